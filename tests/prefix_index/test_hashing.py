"""The one block-hash function: its exact digest, the chain, the salt on the first block only."""

from __future__ import annotations

import hashlib
import random

import msgpack
import numpy as np
import pytest

from prefix_index.hashing import HASH_BYTES, block_hashes, hash_block


def blake2b(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


def test_hash_block_is_the_documented_blake2b():
    tokens = [1, 70000, 3]
    first = hash_block(None, tokens, "tenant")
    assert first == blake2b(b"\x00" * 16, (6).to_bytes(4, "little"), b"tenant",
                            np.asarray(tokens, dtype="<u4").tobytes())
    second = hash_block(first, [4, 5], "tenant", extra_keys=("partial",))
    assert second == blake2b(first, np.asarray([4, 5], dtype="<u4").tobytes(), msgpack.packb(["partial"]))


def test_the_salt_only_enters_through_the_first_block():
    a, b = block_hashes(list(range(8)), 4, "a"), block_hashes(list(range(8)), 4, "b")
    assert a[0] != b[0] and a[1] != b[1]  # the chain carries the first block's salt on
    assert hash_block(a[0], range(4, 8), "other") == a[1]  # a later block ignores its salt argument
    assert block_hashes(list(range(8)), 4, None) == block_hashes(list(range(8)), 4, "")


def test_block_hashes_chain_full_blocks_and_resume_from_a_prefix():
    tokens = list(range(100, 111))
    hashes = block_hashes(tokens, 4)
    assert len(hashes) == 2  # the 3 tokens of the last, partial block are not hashed
    assert hashes == [hash_block(None, tokens[:4]), hash_block(hashes[0], tokens[4:8])]
    assert block_hashes(tokens + [7], 4, prefix=hashes) == block_hashes(tokens + [7], 4)
    assert block_hashes(tokens, 4, prefix=[b"x" * 16, b"y" * 16]) == [b"x" * 16, b"y" * 16]  # trusted as given
    assert block_hashes(tokens, 4, extra_keys=("lora", 1)) != hashes
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(tokens, 0)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("salt, extra_keys", [(None, ()), ("tenant", ()), (None, (5, "lora-a"))])
def test_block_hashes_equal_hash_block_chained(block_size, salt, extra_keys):
    """The batched path feeds blake2b the same bytes as hash_block, block by block."""
    rng = random.Random(block_size)
    tokens = [rng.randrange(200_000) for _ in range(203)]
    reference, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size], salt, extra_keys)
        reference.append(parent)
    assert block_hashes(tokens, block_size, salt, extra_keys) == reference
    assert block_hashes(tokens, block_size, salt, extra_keys, prefix=reference[:7]) == reference
    assert block_hashes(tokens, block_size, salt, extra_keys, prefix=reference) == reference
