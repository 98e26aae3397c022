"""Hybrid KV cache: layer groups by attention kind over one block pool (sliding-window models).

Layers are grouped by attention kind into groups of equal size (Gemma 3 270M: 3 global and 15
sliding layers make one full-attention group and five window groups of 3 layers), so that one page
of the pool holds a block of tokens for the layers of one group: the pool has ``group_size`` K/V
tensors and layer ``i`` uses tensor ``layer_slot[i]`` through its group's block table. Every group
has its own block table per sequence (group 0 is ``Sequence.block_ids``, the others
``Sequence.group_block_ids``); all draw from one free queue.

A window group of window W needs, for new tokens from position P on, the blocks covering
``[P - W, P)`` and the new ones: once a sequence has computed ``n`` tokens its blocks wholly before
``n - W`` go back to the free queue, keeping their hash (a later prompt can still hit them), and
their table entries become ``FREED`` (-1; the attention ops never read a page before a window).
So a sequence holds at most ``ceil(W / block_size) + 1`` blocks of a window group between steps.

Prefix caching: every group caches its full blocks under the sequence's chained block hashes, each
group in its own map. A prefix hit at ``P`` needs the full-attention blocks ``[0, P)`` and, in every
window group, the blocks covering ``[P - W, P)``: the longest such ``P`` is taken. KV events (and
:meth:`snapshot`) cover group 0's blocks, per block as for a single group. Exact-position entries
are not kept for a hybrid pool (every prefix resumes at a block boundary).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

from engine.config import ModelConfig
from engine.kv_cache import BlockCounts, IntegrityError, PositionEntries
from engine.request import Sequence
from prefix_index.events import BlockRemoved, BlockStored, KVEvent
from prefix_index.hashing import BlockHash

FREED = -1  # a window group's table entry whose block went back to the pool


class KVLayout(NamedTuple):
    """How a model's layers share the pool's pages."""

    group_windows: tuple[int, ...]  # per group: its window, 0 for full attention
    layer_group: tuple[int, ...]  # per layer
    layer_slot: tuple[int, ...]  # per layer: its K/V tensor among the group_size of the pool
    group_size: int  # layers per group: a page holds a block of tokens for this many layers

    @property
    def hybrid(self) -> bool:
        return any(self.group_windows)


@functools.cache
def kv_layout(config: ModelConfig) -> KVLayout:
    """One group of every layer for a full-attention model; else groups of ``gcd`` of the two
    kinds' layer counts, the full-attention ones first (group 0, when there are any)."""
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    if not any(windows):
        return KVLayout((0,), (0,) * config.num_layers, tuple(range(config.num_layers)), config.num_layers)
    by_window: dict[int, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    size = math.gcd(*map(len, by_window.values()))
    group_windows, layer_group, layer_slot = [], [0] * config.num_layers, [0] * config.num_layers
    for window in sorted(by_window):  # 0 (full attention) first
        layers = by_window[window]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(window)
    return KVLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)


def group_tables(seq: Sequence) -> list[list[int]]:
    """``seq``'s block table of every group (group 0's is ``seq.block_ids``)."""
    return [seq.block_ids, *seq.group_block_ids]


class HybridPrefixMatch(NamedTuple):
    """Cached blocks of every group serving ``num_tokens`` prompt tokens (FREED before a window)."""

    tables: list[list[int]]
    num_tokens: int


class HybridKVCacheManager:
    """The KVCacheManager contract (see ``engine.kv_cache``) over layer groups; no exact-position
    entries (``entries`` stays empty, ``take_block_copies`` has none). Not thread-safe except
    :meth:`snapshot`."""

    def __init__(
        self, num_blocks: int, block_size: int, layout: KVLayout, enable_prefix_caching: bool = True,
        record_events: bool = False,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows = layout.group_windows
        self.enable_prefix_caching = enable_prefix_caching
        self.record_events = record_events
        self.ref_cnt = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.block_group: list[int] = [0] * num_blocks  # the group whose map holds the block's hash
        self.cached: list[dict[BlockHash, int]] = [{} for _ in self.windows]
        self.parent_of: dict[BlockHash, BlockHash | None] = {}  # group 0's cached blocks
        self.entries = PositionEntries(0)
        self.host = None
        self._events: list[KVEvent] = []
        self._removed: list[BlockHash] = []
        self._registered: dict[tuple[str, int], int] = {}  # sequence key -> blocks hashed so far
        self.prefix_queries = 0
        self.prefix_hits = 0

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable prefix (in use or evictable), in every group."""
        return sum(len(cached) for cached in self.cached)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _first_needed(self, group: int, position: int) -> int:
        """A window group's first block that tokens from ``position`` on still read."""
        window = self.windows[group]
        return max(position - window, 0) // self.block_size if window else 0

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks of every group one sequence of ``num_tokens`` tokens holds at its end."""
        full = self._blocks(num_tokens)
        return sum(full if not w else min(full, self._blocks(w) + 1) for w in self.windows)

    def group_block_counts(self, seq: Sequence) -> list[int]:
        """Blocks ``seq`` holds in each group."""
        return [sum(b != FREED for b in table) for table in group_tables(seq)]

    def match_prefix(self, seq: Sequence) -> HybridPrefixMatch:
        """The longest prefix of whole blocks that every group serves; leaves at least one token
        to compute. Pure query. A sequence that still needs prompt logprobs gets no hit (as in
        KVCacheManager.match_prefix)."""
        empty = HybridPrefixMatch([[] for _ in self.windows], 0)
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return empty
        hashes = seq.update_block_hashes(self.block_size)[: (seq.num_tokens - 1) // self.block_size]
        found = [[self.cached[g].get(h) for h in hashes] for g in range(len(self.windows))]
        for num_hit in range(len(hashes), 0, -1):
            position = num_hit * self.block_size
            firsts = [self._first_needed(g, position) for g in range(len(self.windows))]
            if all(None not in found[g][first:num_hit] for g, first in enumerate(firsts)):
                tables = [[FREED] * first + found[g][first:num_hit] for g, first in enumerate(firsts)]
                return HybridPrefixMatch(tables, position)
        return empty

    # --- commands ------------------------------------------------------------------------
    def allocate(
        self, seq: Sequence, num_new_tokens: int, prefix: HybridPrefixMatch | None = None
    ) -> list[int] | None:
        """Give every group of ``seq`` the blocks to hold ``num_new_tokens`` more tokens, or None
        (nothing changed) if the pool can't. ``prefix`` (only for a sequence without blocks): its
        blocks are taken first and count as computed. Returns the new blocks."""
        if prefix is not None and seq.block_ids:
            raise ValueError("a prefix only applies to a sequence that holds no blocks")
        if prefix is not None and not seq.group_block_ids:
            seq.group_block_ids = [[] for _ in self.windows[1:]]
        tables = group_tables(seq)
        hits = prefix.tables if prefix is not None else [[] for _ in tables]
        num_computed = prefix.num_tokens if prefix is not None else seq.num_computed_tokens
        required = self._blocks(num_computed + num_new_tokens)
        wanted = [max(required - len(table) - len(hit), 0) for table, hit in zip(tables, hits)]
        reused = {b for hit in hits for b in hit if b != FREED and self.ref_cnt[b] == 0}
        if sum(wanted) > len(self.free_queue) - len(reused):
            return None
        for hit in hits:
            for block_id in hit:
                if block_id == FREED:
                    continue
                if self.ref_cnt[block_id] == 0:
                    del self.free_queue[block_id]
                self.ref_cnt[block_id] += 1
        new_blocks: list[int] = []
        for table, hit, count in zip(tables, hits, wanted):
            table.extend(hit)
            added = [self._take_free_block() for _ in range(count)]
            table.extend(added)
            new_blocks.extend(added)
        if prefix is not None:
            seq.num_computed_tokens = num_computed
            self._registered[seq.key] = len(prefix.tables[0])
        return new_blocks

    def record_prefix_lookup(self, seq: Sequence, num_cached_tokens: int) -> None:
        seq.num_cached_tokens = num_cached_tokens
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += num_cached_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Hash every block of ``seq`` now fully computed, in every group, then return each
        window group's blocks that fell wholly out of its window (hashes kept). Call after a step."""
        if self.enable_prefix_caching:
            self._register(seq)
        for group, table in enumerate(group_tables(seq)):
            for i in range(self._first_needed(group, seq.num_computed_tokens)):
                if table[i] != FREED:
                    self._release(table[i])
                    table[i] = FREED

    def _register(self, seq: Sequence) -> None:
        num_full = seq.num_computed_tokens // self.block_size
        start = self._registered.get(seq.key, 0)
        if num_full <= start:
            return
        hashes = seq.update_block_hashes(self.block_size)
        for group, table in enumerate(group_tables(seq)):
            for i in range(start, num_full):
                block_id, block_hash = table[i], hashes[i]
                if block_id == FREED or self.block_hash[block_id] is not None or block_hash in self.cached[group]:
                    continue
                self.block_hash[block_id] = block_hash
                self.block_group[block_id] = group
                self.cached[group][block_hash] = block_id
                if group == 0:
                    self.parent_of[block_hash] = hashes[i - 1] if i else None
        if self.record_events:
            self._flush_removed()
            self._events.append(BlockStored(hashes[start:num_full], hashes[start - 1] if start else None))
        self._registered[seq.key] = num_full

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references in every group, tail first."""
        for table in group_tables(seq):
            for block_id in reversed(table):
                if block_id != FREED:
                    self._release(block_id)
        seq.block_ids = []
        seq.group_block_ids = []
        self._registered.pop(seq.key, None)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Always empty: a hybrid pool plans no page copies (no exact-position entries)."""
        return []

    def take_host_transfers(self) -> None:
        return None

    def drain_events(self) -> list[KVEvent]:
        self._flush_removed()
        events, self._events = self._events, []
        return events

    def snapshot(self) -> list[tuple[BlockHash, BlockHash | None]]:
        """(hash, parent) of every group-0 block the pool can serve now (thread-safe: see KVCacheManager)."""
        return list(self.parent_of.items())

    def _release(self, block_id: int) -> None:
        self.ref_cnt[block_id] -= 1
        if self.ref_cnt[block_id] == 0:
            self.free_queue[block_id] = None

    def _flush_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(self._removed))
            self._removed = []

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            group = self.block_group[block_id]
            del self.cached[group][block_hash]
            self.block_hash[block_id] = None
            if group == 0:
                del self.parent_of[block_hash]
                if self.record_events:
                    self._removed.append(block_hash)
        self.ref_cnt[block_id] = 1
        return block_id

    # --- proof ---------------------------------------------------------------------------
    def check_integrity(self, live: Iterable[Sequence]) -> BlockCounts:
        """Prove free + cached + used == pool over every group's tables, that ref counts match the
        live sequences, that each group's cache map agrees with the blocks' hashes, and that no
        sequence holds a window group's block wholly before its window."""
        expected = [0] * self.num_blocks
        for seq in live:
            tables = group_tables(seq)
            if len(tables) != len(self.windows) and any(tables):
                raise IntegrityError(f"sequence {seq.key} has {len(tables)} tables for {len(self.windows)} groups")
            for group, table in enumerate(tables):
                first = self._first_needed(group, seq.num_computed_tokens)
                if any(b != FREED for b in table[:first]):
                    raise IntegrityError(f"sequence {seq.key} holds blocks of group {group} before its window")
                for block_id in table:
                    if block_id != FREED:
                        expected[block_id] += 1
        if expected != self.ref_cnt:
            bad = [i for i in range(self.num_blocks) if expected[i] != self.ref_cnt[i]]
            raise IntegrityError(f"ref counts differ from live sequences at blocks {bad[:10]}")
        unreferenced = {i for i, r in enumerate(self.ref_cnt) if r == 0}
        if unreferenced != set(self.free_queue):
            raise IntegrityError("free queue differs from the set of unreferenced blocks")
        for group, cached in enumerate(self.cached):
            for block_hash, block_id in cached.items():
                if self.block_hash[block_id] != block_hash or self.block_group[block_id] != group:
                    raise IntegrityError(f"group {group}'s cache entry for block {block_id} is stale")
        if sum(h is not None for h in self.block_hash) != sum(map(len, self.cached)):
            raise IntegrityError("a block holds a hash that no cache map has")
        if self.parent_of.keys() != self.cached[0].keys():
            raise IntegrityError("group 0's parent map differs from its cache map")
        cached = sum(1 for i in unreferenced if self.block_hash[i] is not None)
        counts = BlockCounts(len(unreferenced) - cached, cached, self.num_blocks - len(unreferenced), 0)
        assert sum(counts) == self.num_blocks
        return counts
