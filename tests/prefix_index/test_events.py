"""KV event batches survive msgpack exactly, and malformed ones are refused by name."""

from __future__ import annotations

import msgpack
import pytest

from prefix_index.events import AllCleared, BlockRemoved, BlockStored, KVEventBatch
from prefix_index.hashing import block_hashes

H = block_hashes(list(range(64)), 16)


def test_batch_round_trips_through_msgpack():
    batch = KVEventBatch(
        "engine-0",
        1_733_000_000_123_456_789,
        [BlockStored(H[:2]), BlockStored(H[2:], H[1]), BlockRemoved([H[0]]), AllCleared()],
    )
    decoded = KVEventBatch.unpack(batch.pack())
    assert decoded == batch
    assert decoded.events[1].parent_hash == H[1]


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        ([], "must be a map"),
        ({"replica_id": "r", "epoch": 1}, "events list"),
        ({"replica_id": "", "epoch": 1, "events": []}, "replica_id"),
        ({"replica_id": "r", "epoch": -1, "events": []}, "epoch"),
        ({"replica_id": "r", "epoch": True, "events": []}, "epoch"),
        ({"replica_id": "r", "epoch": 1, "events": [["evicted", []]]}, "events\\[0\\] is not"),
        ({"replica_id": "r", "epoch": 1, "events": [["cleared", 1]]}, "events\\[0\\] is not"),
        ({"replica_id": "r", "epoch": 1, "events": [["removed", [b"x"]]]}, "events\\[0\\].block"),
        ({"replica_id": "r", "epoch": 1, "events": [["stored", H[:1], b"x"]]}, "parent_hash"),
    ],
)
def test_malformed_batches_are_refused(wire, message):
    with pytest.raises(ValueError, match=message):
        KVEventBatch.unpack(msgpack.packb(wire))
