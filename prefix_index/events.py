"""KV cache events: what an engine reports to the prefix index.

The engine emits, once per step, the blocks it made reusable (:class:`BlockStored`), the blocks it
evicted (:class:`BlockRemoved`) and a full reset (:class:`AllCleared`). Stores and removals name
the tier they happened in: ``DEVICE`` (the engine's KV pool: a hit costs nothing) or ``HOST`` (the
host-memory tier: a hit costs a copy back, less than recomputing). The tiers are independent sets:
a block may be held by both, and a lookup counts a block held by either. A :class:`KVEventBatch`
carries them with the engine's replica id and its epoch, a number fixed per engine start: the index
drops a replica's old entries when it sees a new epoch. Batches stay in the engine's process (the
publisher applies them to the index); everything here is plain data that imports nothing, so the
engine core may use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prefix_index.hashing import HASH_BYTES, BlockHash

DEVICE, HOST = "device", "host"
TIERS = (DEVICE, HOST)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became reusable, in chain order: each one's parent is the block before it,
    and the first one's is ``parent_hash`` (None only for the first block of a sequence). The
    Redis index relies on these parents to answer lookups by binary search. ``HOST`` stores are
    single blocks in no particular order: they carry no parent (None)."""

    block_hashes: Sequence[BlockHash]
    parent_hash: BlockHash | None = None
    tier: str = DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from one tier of the replica's cache (order does not matter)."""

    block_hashes: Sequence[BlockHash]
    tier: str = DEVICE


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The replica dropped its whole prefix cache."""


KVEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """Events of one replica in the order they happened."""

    replica_id: str
    epoch: int
    events: Sequence[KVEvent] = field(default_factory=list)


def check_batch(batch: KVEventBatch) -> None:
    """Raise ValueError naming the first bad field of ``batch``."""
    check_replica_id(batch.replica_id)
    check_epoch(batch.epoch)
    for i, event in enumerate(batch.events):
        if isinstance(event, (BlockStored, BlockRemoved)):
            pack_block_hashes(event.block_hashes, f"events[{i}].block_hashes")
            if event.tier not in TIERS:
                raise ValueError(f"events[{i}].tier must be one of {', '.join(TIERS)}, got {event.tier!r}")
            if isinstance(event, BlockStored) and event.parent_hash is not None:
                pack_block_hashes([event.parent_hash], f"events[{i}].parent_hash")
        elif not isinstance(event, AllCleared):
            raise ValueError(f"events[{i}] is not a KV event: {type(event).__name__}")


def check_replica_id(replica_id: Any) -> None:
    if not isinstance(replica_id, str) or not replica_id:
        raise ValueError(f"replica_id must be a non-empty string, got {replica_id!r}")


def check_epoch(epoch: Any) -> None:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")


def pack_block_hashes(hashes: Any, name: str = "block_hashes") -> bytes:
    """Concatenate a list or tuple of block hashes; raise ValueError if it is anything else.

    This runs on every lookup of up to thousands of hashes, so it checks the total length only:
    any wrong-sized hash shows there unless another one exactly makes up for it.
    """
    if isinstance(hashes, (list, tuple)):
        try:
            blob = b"".join(hashes)
        except TypeError:
            pass
        else:
            if len(blob) == HASH_BYTES * len(hashes):
                return blob
    raise ValueError(f"{name} must be a list of {HASH_BYTES}-byte block hashes")
