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
(see ``engine.kv_cache``) hold the partial page of every group, so a hit at ``P`` inside a page
takes an entry's pages plus the same full blocks ``P`` needs; their cap counts entries, each
``num_groups`` blocks. With a host tier (``engine.kv_host``) a group's block may also come from
host memory, by (group, hash): a hit takes it as if cached, and allocation loads it into a new block.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

from engine.config import ModelConfig
from engine.kv_cache import FREED, BlockPool, IntegrityError, PositionEntry, group_tables
from engine.request import Sequence
from prefix_index.events import BlockStored
from prefix_index.hashing import BlockHash

if TYPE_CHECKING:
    from engine.kv_host import HostBlockPool


class KVLayout(NamedTuple):
    """How a model's layers share the pool's pages."""

    group_windows: tuple[int, ...]  # per group: its window, 0 for full attention
    layer_group: tuple[int, ...]  # per layer
    layer_slot: tuple[int, ...]  # per layer: its K/V tensor among the group_size of the pool
    group_size: int  # layers per group: a page holds a block of tokens for this many layers

    @property
    def hybrid(self) -> bool:
        return any(self.group_windows)

    def group_blocks(self, num_tokens: int, block_size: int) -> list[int]:
        """Pages of each group one sequence of ``num_tokens`` tokens holds at its end: a window
        group's cover its window and the block being filled."""
        full = -(-num_tokens // block_size)
        return [full if not w else min(full, -(-w // block_size) + 1) for w in self.group_windows]


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


ON_HOST = -2  # a hit table's entry whose block the host tier holds: allocation loads it


class HybridPrefixMatch(NamedTuple):
    """Cached blocks of every group (FREED before a window, ON_HOST where the host tier holds
    them), then possibly an entry whose pages serve the tokens from ``len(tables[0]) * block_size``
    to ``num_tokens``."""

    tables: list[list[int]]
    entry: PositionEntry | None
    num_tokens: int


class HybridKVCacheManager(BlockPool):
    """The KVCacheManager contract (see ``engine.kv_cache``) over layer groups. Not thread-safe
    except :meth:`snapshot`."""

    def __init__(
        self, num_blocks: int, block_size: int, layout: KVLayout, enable_prefix_caching: bool = True,
        record_events: bool = False, max_entries: int | None = None, host: HostBlockPool | None = None,
    ):
        super().__init__(num_blocks, block_size, enable_prefix_caching, record_events, max_entries,
                         num_groups=len(layout.group_windows), host=host)
        self.layout = layout
        self.windows = layout.group_windows
        self.block_group: list[int] = [0] * num_blocks  # the group whose map holds the block's hash
        self.cached: list[dict[BlockHash, int]] = [{} for _ in self.windows]

    # --- queries -------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable prefix (in use or evictable), in every group."""
        return sum(len(cached) for cached in self.cached)

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _first_needed(self, group: int, position: int) -> int:
        """A window group's first block that tokens from ``position`` on still read."""
        window = self.windows[group]
        return max(position - window, 0) // self.block_size if window else 0

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks of every group one sequence of ``num_tokens`` tokens holds at its end."""
        return sum(self.layout.group_blocks(num_tokens, self.block_size))

    def group_block_counts(self, seq: Sequence) -> list[int]:
        """Blocks ``seq`` holds in each group."""
        return [sum(b != FREED for b in table) for table in group_tables(seq)]

    def match_prefix(self, seq: Sequence) -> HybridPrefixMatch:
        """The longest prefix every group serves — whole blocks, then possibly an entry's page;
        leaves at least one token to compute. Pure query. A sequence that still needs prompt
        logprobs gets no hit (as in KVCacheManager.match_prefix)."""
        empty = HybridPrefixMatch([[] for _ in self.windows], None, 0)
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return empty
        hashes = seq.update_block_hashes(self.block_size)[: (seq.num_tokens - 1) // self.block_size]
        found = [[self._find(g, h) for h in hashes] for g in range(len(self.windows))]
        # a full-attention group 0 bounds the hit by its leading run of cached blocks
        longest = found[0].index(None) if not self.windows[0] and None in found[0] else len(hashes)
        for num_hit in range(longest, -1, -1):
            entry, num_shared = self._entry_hit(seq, num_hit)
            position = num_hit * self.block_size
            for resume, with_entry in ((position + num_shared, entry), (position, None)):
                tables = self._hit_tables(found, num_hit, resume)
                if tables is not None and (num_hit or with_entry is not None):
                    return HybridPrefixMatch(tables, with_entry, resume)
                if entry is None:
                    break  # the second candidate is the same position
        return empty

    def _find(self, group: int, block_hash: BlockHash) -> int | None:
        """``group``'s cached block of ``block_hash``, else ON_HOST if the host tier holds it, else None."""
        block_id = self.cached[group].get(block_hash)
        if block_id is None and self.host is not None and self.host.get((group, block_hash)) is not None:
            return ON_HOST
        return block_id

    def _hit_tables(self, found: list[list[int | None]], num_hit: int, position: int) -> list[list[int]] | None:
        """Every group's cached blocks among its first ``num_hit`` that tokens from ``position``
        on read (FREED before a window), or None if a group lacks one."""
        firsts = [self._first_needed(g, position) for g in range(len(self.windows))]
        if any(None in found[g][first:num_hit] for g, first in enumerate(firsts)):
            return None
        return [[FREED] * first + found[g][first:num_hit] for g, first in enumerate(firsts)]

    # --- commands ------------------------------------------------------------------------
    def allocate(
        self, seq: Sequence, num_new_tokens: int, prefix: HybridPrefixMatch | None = None
    ) -> list[int] | None:
        """Give every group of ``seq`` the blocks to hold ``num_new_tokens`` more tokens, or None
        (nothing changed) if the pool can't. ``prefix`` (only for a sequence without blocks): its
        blocks are taken first (those ON_HOST loaded into new blocks) and, with its entry's shared
        tokens, count as computed; the entry's pages are copied into each group's first new block,
        or taken over when the pool has no blocks to spare for copies (as in
        KVCacheManager.allocate). Returns the new blocks."""
        if prefix is not None and seq.block_ids:
            raise ValueError("a prefix only applies to a sequence that holds no blocks")
        if prefix is not None and not seq.group_block_ids:
            seq.group_block_ids = [[] for _ in self.windows[1:]]
        tables = group_tables(seq)
        hits = prefix.tables if prefix is not None else [[] for _ in tables]
        num_computed = prefix.num_tokens if prefix is not None else seq.num_computed_tokens
        required = self._blocks(num_computed + num_new_tokens)
        wanted = [max(required - len(table) - len(hit), 0) for table, hit in zip(tables, hits)]
        loads = [(g, i) for g, hit in enumerate(hits) for i, b in enumerate(hit) if b == ON_HOST]
        reused = {b for hit in hits for b in hit if b >= 0 and self.ref_cnt[b] == 0}
        available = len(self.free_queue) - len(reused)
        if sum(wanted) + len(loads) > available:
            return None
        for hit in hits:
            for block_id in hit:
                if block_id < 0:  # FREED or ON_HOST
                    continue
                if self.ref_cnt[block_id] == 0:
                    del self.free_queue[block_id]
                self.ref_cnt[block_id] += 1
        pages: tuple[int, ...] = ()
        if prefix is not None and prefix.entry is not None:  # first: the loads never take its pages
            pages = self._resume_on(prefix.entry, available - sum(wanted) - len(loads))
        new_blocks: list[int] = []
        if loads:
            hits = [list(hit) for hit in hits]
            new_blocks = self._load_from_host(loads, seq.update_block_hashes(self.block_size))
            for (group, i), block_id in zip(loads, new_blocks):
                hits[group][i] = block_id
        for group, (table, hit, count) in enumerate(zip(tables, hits, wanted)):
            table.extend(hit)
            added = [pages[group]] if pages else []
            added.extend(self._take_free_block() for _ in range(count - len(added)))
            table.extend(added)
            new_blocks.extend(added)
        if prefix is not None:
            seq.num_computed_tokens = num_computed
            self._registered[seq.key] = len(prefix.tables[0])
        return new_blocks

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Hash every block of ``seq`` now fully computed, in every group, plan an entry for every
        cache boundary now computed inside a page, then return each window group's blocks that
        fell wholly out of its window (hashes kept). Call after a step; run the planned copies
        (:meth:`take_block_copies`) before anything else allocates or frees blocks."""
        if self.enable_prefix_caching:
            self._register(seq)
            self._cache_boundaries(seq)  # first: a boundary's page may be leaving a window now
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
                self._cache_block(block_id, group, block_hash, hashes[i - 1] if i else None)
        if self.record_events:
            self._flush_removed()
            self._events.append(BlockStored(hashes[start:num_full], hashes[start - 1] if start else None))
        self._registered[seq.key] = num_full

    def _cache_block(self, block_id: int, group: int, block_hash: BlockHash, parent: BlockHash | None) -> None:
        self.block_hash[block_id] = block_hash
        self.block_group[block_id] = group
        self.cached[group][block_hash] = block_id
        if group == 0:
            self.parent_of[block_hash] = parent

    def _hash_group(self, block_id: int) -> int:
        return self.block_group[block_id]

    def _forget_hash(self, block_id: int) -> None:
        block_hash, group = self.block_hash[block_id], self.block_group[block_id]
        del self.cached[group][block_hash]
        if group == 0:
            del self.parent_of[block_hash]
            if self.record_events:
                self._removed.append(block_hash)

    # --- proof ---------------------------------------------------------------------------
    def _check_tables(self, seq: Sequence) -> None:
        """A table per group, and no block of a window group wholly before its window."""
        tables = group_tables(seq)
        if len(tables) != len(self.windows) and any(tables):
            raise IntegrityError(f"sequence {seq.key} has {len(tables)} tables for {len(self.windows)} groups")
        for group, table in enumerate(tables):
            first = self._first_needed(group, seq.num_computed_tokens)
            if any(b != FREED for b in table[:first]):
                raise IntegrityError(f"sequence {seq.key} holds blocks of group {group} before its window")

    def _check_cache_maps(self) -> None:
        for group, cached in enumerate(self.cached):
            for block_hash, block_id in cached.items():
                if self.block_hash[block_id] != block_hash or self.block_group[block_id] != group:
                    raise IntegrityError(f"group {group}'s cache entry for block {block_id} is stale")
        if sum(h is not None for h in self.block_hash) != sum(map(len, self.cached)):
            raise IntegrityError("a block holds a hash that no cache map has")
        if self.parent_of.keys() != self.cached[0].keys():
            raise IntegrityError("group 0's parent map differs from its cache map")
