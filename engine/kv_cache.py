"""Paged KV block pool with prefix caching.

Every block is in exactly one state: *used* (ref count > 0), *cached* (ref count 0, holds a hash:
reusable until evicted) or *free* (ref count 0, no hash). Cached and free blocks sit together in
one LRU queue; allocation takes from its head and evicts the hash of a cached block it takes.
A finished sequence returns its blocks tail first, so a prefix outlives its suffixes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

from engine.request import Sequence
from prefix_index.events import BlockRemoved, BlockStored, KVEvent
from prefix_index.hashing import BlockHash


class BlockCounts(NamedTuple):
    free: int
    cached: int
    used: int


class IntegrityError(AssertionError):
    pass


class KVCacheManager:
    """Owns block ids, never the KV tensors. Not thread-safe: the engine loop alone calls it."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, record_events: bool = False
    ):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.record_events = record_events  # only when a publisher drains them
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.parent_of: dict[BlockHash, BlockHash | None] = {}  # of every cached hash (index resyncs)
        self._events: list[KVEvent] = []
        self._removed: list[BlockHash] = []
        self._registered: dict[tuple[str, int], int] = {}  # sequence key -> blocks hashed so far
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which served from cache

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take (free plus evictable cached)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of ``seq``; leaves at least one token to compute.

        Pure query: takes no reference (pass the result to :meth:`allocate`).
        """
        if not self.enable_prefix_caching:
            return []
        hashes = seq.update_block_hashes(self.block_size)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    # --- commands ------------------------------------------------------------------------
    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Give ``seq`` the blocks to hold ``num_new_tokens`` more tokens, or None if the pool can't.

        ``cached_blocks`` (from :meth:`match_prefix`, only for a sequence with no blocks yet) are
        taken first and count as computed. On None nothing has changed.
        """
        cached_blocks = cached_blocks or []
        if cached_blocks and seq.block_ids:
            raise ValueError("cached_blocks only apply to a sequence that holds no blocks")
        num_computed = len(cached_blocks) * self.block_size if cached_blocks else seq.num_computed_tokens
        num_required = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = num_required - len(seq.block_ids) - len(cached_blocks)
        num_revived = sum(1 for b in cached_blocks if self.ref_cnt[b] == 0)
        if num_new_blocks > len(self.free_queue) - num_revived:
            return None
        for block_id in cached_blocks:
            if self.ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_cnt[block_id] += 1
        new_blocks = [self._take_free_block() for _ in range(max(num_new_blocks, 0))]
        seq.block_ids.extend(cached_blocks)
        seq.block_ids.extend(new_blocks)
        if cached_blocks:
            seq.num_computed_tokens = num_computed
            self._registered[seq.key] = len(cached_blocks)
        return new_blocks

    def record_prefix_lookup(self, seq: Sequence, num_cached_tokens: int) -> None:
        seq.num_cached_tokens = num_cached_tokens
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += num_cached_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish every block of ``seq`` whose KV is now fully computed (prompt or output)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self._registered.get(seq.key, 0)
        if num_full <= start:
            return
        hashes = seq.update_block_hashes(self.block_size)
        for i in range(start, num_full):
            block_id, block_hash = seq.block_ids[i], hashes[i]
            if self.block_hash[block_id] is None and block_hash not in self.cached:
                self.block_hash[block_id] = block_hash
                self.cached[block_hash] = block_id
                self.parent_of[block_hash] = hashes[i - 1] if i else None
        if self.record_events:
            self._flush_removed()  # keep events in the order they happened
            self._events.append(BlockStored(hashes[start:num_full], hashes[start - 1] if start else None))
        self._registered[seq.key] = num_full

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, tail first (its last blocks are evicted before its prefix)."""
        for block_id in reversed(seq.block_ids):
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None
        seq.block_ids = []
        self._registered.pop(seq.key, None)

    def drain_events(self) -> list[KVEvent]:
        """KV events since the last call, in order (for the prefix index publisher)."""
        self._flush_removed()
        events, self._events = self._events, []
        return events

    def snapshot(self) -> list[tuple[BlockHash, BlockHash | None]]:
        """(hash, parent) of every block the pool can serve now, for a full index resync.

        Called from the publisher's thread: ``list()`` of a dict is atomic under the GIL.
        """
        return list(self.parent_of.items())

    def _flush_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(self._removed))
            self._removed = []

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            del self.parent_of[block_hash]
            self.block_hash[block_id] = None
            if self.record_events:
                self._removed.append(block_hash)
        self.ref_cnt[block_id] = 1
        return block_id

    # --- proof ---------------------------------------------------------------------------
    def check_integrity(self, live: Iterable[Sequence]) -> BlockCounts:
        """Prove free + cached + used == pool and that ref counts match the live sequences."""
        expected = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_ids:
                expected[block_id] += 1
        if expected != self.ref_cnt:
            bad = [i for i in range(self.num_blocks) if expected[i] != self.ref_cnt[i]]
            raise IntegrityError(f"ref counts differ from live sequences at blocks {bad[:10]}")
        unreferenced = {i for i, r in enumerate(self.ref_cnt) if r == 0}
        if unreferenced != set(self.free_queue):
            raise IntegrityError("free queue differs from the set of unreferenced blocks")
        for block_hash, block_id in self.cached.items():
            if self.block_hash[block_id] != block_hash:
                raise IntegrityError(f"cached entry for block {block_id} has a stale hash")
        if sum(h is not None for h in self.block_hash) != len(self.cached):
            raise IntegrityError("a block holds a hash that the cache map lacks")
        cached = sum(1 for i in unreferenced if self.block_hash[i] is not None)
        counts = BlockCounts(len(unreferenced) - cached, cached, self.num_blocks - len(unreferenced))
        assert sum(counts) == self.num_blocks
        return counts
