"""Malformed KV event batches are refused by name before they reach an index."""

from __future__ import annotations

import pytest

from prefix_index.events import AllCleared, BlockRemoved, BlockStored, KVEventBatch, check_batch
from prefix_index.hashing import block_hashes

H = block_hashes(list(range(64)), 16)


def test_a_well_formed_batch_passes():
    check_batch(KVEventBatch("engine-0", 1_733_000_000_123_456_789,
                             [BlockStored(H[:2]), BlockStored(H[2:], H[1]), BlockRemoved([H[0]]), AllCleared()]))


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (KVEventBatch("", 1), "replica_id"),
        (KVEventBatch(None, 1), "replica_id"),
        (KVEventBatch("r", -1), "epoch"),
        (KVEventBatch("r", True), "epoch"),
        (KVEventBatch("r", 1, [("stored", H[:1])]), "events\\[0\\] is not a KV event"),
        (KVEventBatch("r", 1, [AllCleared(), BlockRemoved([b"x"])]), "events\\[1\\].block_hashes"),
        (KVEventBatch("r", 1, [BlockStored(H[:1], b"x")]), "events\\[0\\].parent_hash"),
        (KVEventBatch("r", 1, [BlockStored(tuple(H[:1]) + (3,))]), "events\\[0\\].block_hashes"),
    ],
)
def test_malformed_batches_are_refused(batch, message):
    with pytest.raises(ValueError, match=message):
        check_batch(batch)
