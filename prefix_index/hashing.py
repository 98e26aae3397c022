"""The one block-hash function of kvgate.

``h_i = H(h_{i-1}, salt if i == 0, tokens of block i, extra keys)`` with H = blake2b (16-byte
digests). Gateway and engine both call :func:`block_hashes`, so identical token ids, salt, block
size and extra keys always give identical hashes. Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgpack
import numpy as np

BlockHash = bytes
HASH_BYTES = 16
_ROOT = b"\x00" * HASH_BYTES


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    salt: str | None = None,
    extra_keys: tuple = (),
) -> BlockHash:
    """Hash one block chained onto ``parent`` (None for the first block, which takes the salt)."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent if parent is not None else _ROOT)
    if parent is None:
        salt_bytes = (salt or "").encode()
        h.update(len(salt_bytes).to_bytes(4, "little"))
        h.update(salt_bytes)
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    if extra_keys:
        h.update(msgpack.packb(list(extra_keys)))
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    extra_keys: tuple = (),
    prefix: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids``.

    ``prefix`` holds hashes already computed for the leading blocks (they are returned as they
    are and hashing resumes after them), so a growing sequence only hashes its new blocks.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes = list(prefix)
    num_full = len(token_ids) // block_size
    start = len(hashes)
    if start >= num_full:
        return hashes
    if start == 0:  # the first block takes the salt
        hashes.append(hash_block(None, token_ids[:block_size], salt, extra_keys))
        start = 1
    # One conversion for all blocks, then byte slices: the bytes hash_block would feed, at a tenth
    # of its per-block cost (the gateway hashes every prompt).
    data = np.asarray(token_ids[start * block_size : num_full * block_size], dtype="<u4").tobytes()
    extra = msgpack.packb(list(extra_keys)) if extra_keys else b""
    step = 4 * block_size
    parent = hashes[-1]
    for offset in range(0, len(data), step):
        h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
        h.update(data[offset : offset + step])
        if extra:
            h.update(extra)
        parent = h.digest()
        hashes.append(parent)
    return hashes
