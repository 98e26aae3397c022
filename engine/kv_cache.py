"""Paged KV block pool with prefix caching and exact-position entries.

Every block is in exactly one state: *used* (ref count > 0), *cached* (ref count 0, holds the hash
of a full block: reusable until evicted), *entry* (ref count 0, a page of an exact-position entry:
a cache-owned copy of a partially filled page) or *free* (ref count 0, holds nothing). Cached, entry
and free blocks sit together in one LRU queue; allocation takes from its head and drops what the
block held. A finished sequence returns its blocks tail first, so a prefix outlives its suffixes.

Exact-position entries. Full blocks are cached under their chained hashes, so a prefix that ends
inside a page (where a chat's system prompt or last message ends) would be recomputed from the page
start: up to a whole block per turn. An entry keeps such a page under a key — the hash of the full
block before it, or the salt for the first page, so salts never share — and its *tail*, the tokens
of the page it holds KV for. A sequence whose tokens after its cached full blocks share a prefix
with a tail resumes right after the shared tokens, on a private copy of the entry's page (copy on
write). Entries come from two places:

- the ``cache_boundaries`` of a request: once a step has computed past one that falls inside a
  page, the page is copied into a block of the entry (taken from the free queue, never from a
  sequence; none left: no entry);
- a sequence that ends (finished, aborted or preempted) hands its last, partially filled page over
  to an entry without a copy, so a client that sends the answer back resumes where it ended.

Entries go into the free queue ahead of the blocks of the sequence they come from, so an entry is
evicted before the blocks it extends; a hit moves its entry to the queue's recent end. Their number
is capped (the least recently used entry makes room); a released entry's block is the next to be
allocated. Under one key no tail is a prefix of another (the longer serves everything the shorter
would). Entries are engine-local: KV events, :meth:`snapshot` and the prefix index cover full blocks
only. In a pool of layer groups (``engine.kv_groups``) an entry holds that page in every group, and
losing any one of its pages to an allocation drops the whole entry.

:class:`BlockPool` holds what this single-group manager and the hybrid one share: ref counts, the
free queue, events, prefix counters and the entries. The manager only plans page copies; the engine
runs them (:meth:`BlockPool.take_block_copies`) in order, before the next forward reads or writes
the pool.

With a host tier (``host``, see :mod:`engine.kv_host`), a full block whose hash leaves the pool is
offloaded to it, and a prefix hit continues past the pool's cached blocks into blocks the host tier
holds: they are loaded into new blocks, cached under their hashes at once (planned like page
copies, :meth:`BlockPool.take_host_transfers`, which the engine runs first) and count as cached
tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple

from engine.request import Sequence
from prefix_index.events import BlockRemoved, BlockStored, KVEvent
from prefix_index.hashing import BlockHash, hash_block

if TYPE_CHECKING:
    from engine.kv_host import HostBlockPool, HostTransfers

FREED = -1  # a window group's table entry whose block went back to the pool (engine.kv_groups)


class BlockCounts(NamedTuple):
    free: int
    cached: int
    used: int
    entries: int  # blocks: an entry has a page in every layer group


class PositionEntry(NamedTuple):
    """An exact-position entry: cache-owned pages holding the KV of ``tail``, the first tokens of
    the page after the full block hashed into ``key`` (see :func:`entry_key`)."""

    key: BlockHash
    tail: tuple[int, ...]  # 1 … block_size - 1 tokens
    block_id: int  # the page of group 0 (the only group of a single-group pool)
    group_block_ids: tuple[int, ...] = ()  # the pages of the other layer groups, in group order

    @property
    def pages(self) -> tuple[int, ...]:
        return (self.block_id, *self.group_block_ids)


class PrefixMatch(NamedTuple):
    """What :meth:`KVCacheManager.match_prefix` found: cached full blocks, then the hashes of full
    blocks the host tier holds (to load), then possibly an entry whose page serves the tokens up to
    ``num_tokens``."""

    blocks: list[int]
    entry: PositionEntry | None
    num_tokens: int  # prompt tokens served from cache
    host_hashes: tuple[BlockHash, ...] = ()


class IntegrityError(AssertionError):
    pass


def entry_key(parent: BlockHash | None, salt: str | None) -> BlockHash:
    """Key of the entries that continue the full block hashed ``parent`` (None: the first page of a
    sequence, which takes the salt, as the first block's hash does)."""
    return hash_block(parent, (), salt, extra_keys=("partial",))


def group_tables(seq: Sequence) -> list[list[int]]:
    """``seq``'s block table of every layer group (group 0's is ``seq.block_ids``; a single-group
    pool has no other)."""
    return [seq.block_ids, *seq.group_block_ids]


def _common_prefix_len(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PositionEntries:
    """The exact-position entries of one pool, by group-0 page in LRU order, by key then tail, and
    by the pages of the other groups, with their cap (in entries). Holds no blocks: the manager
    moves the entries' pages in its free queue."""

    def __init__(self, cap: int):
        self.cap = cap
        self.by_block: OrderedDict[int, PositionEntry] = OrderedDict()  # LRU first
        self._by_key: dict[BlockHash, dict[tuple[int, ...], int]] = {}  # key -> tail -> block
        self._group_page_of: dict[int, int] = {}  # another group's page -> the entry's group-0 page

    def __len__(self) -> int:
        return len(self.by_block)

    def __iter__(self) -> Iterator[int]:
        return iter(self.by_block)

    def __getitem__(self, block_id: int) -> PositionEntry:
        return self.by_block[block_id]

    def get(self, block_id: int) -> PositionEntry | None:
        """The entry one of whose pages (of any group) is ``block_id``, or None."""
        return self.by_block.get(self._group_page_of.get(block_id, block_id))

    def pages(self) -> Iterator[int]:
        """Every page of every entry."""
        for entry in self.by_block.values():
            yield from entry.pages

    @property
    def num_pages(self) -> int:
        return len(self.by_block) + len(self._group_page_of)

    def tails(self, key: BlockHash) -> dict[tuple[int, ...], int]:
        """Tail -> block of the entries under ``key`` (read only)."""
        return self._by_key.get(key, {})

    @property
    def full(self) -> bool:
        return len(self.by_block) >= self.cap

    def oldest(self) -> PositionEntry:
        return next(iter(self.by_block.values()))

    def add(self, entry: PositionEntry) -> None:
        self._by_key.setdefault(entry.key, {})[entry.tail] = entry.block_id
        self.by_block[entry.block_id] = entry
        self._group_page_of.update(dict.fromkeys(entry.group_block_ids, entry.block_id))

    def touch(self, block_id: int) -> None:
        self.by_block.move_to_end(block_id)

    def drop(self, entry: PositionEntry) -> None:
        del self.by_block[entry.block_id]
        tails = self._by_key[entry.key]
        del tails[entry.tail]
        if not tails:
            del self._by_key[entry.key]
        for page in entry.group_block_ids:
            del self._group_page_of[page]

    def check(self, block_size: int, num_groups: int) -> None:
        """Raise IntegrityError unless the maps agree, every entry has a page per group and a tail
        shorter than a page, and the cap holds."""
        indexed = {(key, tail, b) for key, tails in self._by_key.items() for tail, b in tails.items()}
        if indexed != {e[:3] for e in self.by_block.values()} or any(
            b != e.block_id for b, e in self.by_block.items()
        ):
            raise IntegrityError("the entry index differs from the entry list")
        if self._group_page_of != {p: e.block_id for e in self.by_block.values() for p in e.group_block_ids}:
            raise IntegrityError("the entry page map differs from the entry list")
        for entry in self.by_block.values():
            if not 0 < len(entry.tail) < block_size:
                raise IntegrityError(f"entry block {entry.block_id} has a tail of {len(entry.tail)} tokens")
            if len(entry.pages) != num_groups:
                raise IntegrityError(f"entry block {entry.block_id} has {len(entry.pages)} pages, not {num_groups}")
        if len(self.by_block) > self.cap:
            raise IntegrityError(f"{len(self.by_block)} entries exceed the cap of {self.cap}")


class BlockPool(ABC):
    """The block pool both KV managers share (:class:`KVCacheManager`, one group;
    ``engine.kv_groups.HybridKVCacheManager``, layer groups): ref counts, the LRU free queue, KV
    events, the prefix counters and exact-position entries with one page per group. A subclass
    keeps the cache maps of full blocks (:meth:`_forget_hash`, :meth:`_check_cache_maps`), matches
    prefixes and allocates. Not thread-safe except :meth:`snapshot`: the engine loop alone calls it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        record_events: bool,
        max_entries: int | None,
        num_groups: int = 1,
        host: HostBlockPool | None = None,
    ):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        if max_entries is None:
            max_entries = num_blocks // 4 // num_groups
        if not 0 <= max_entries * num_groups <= num_blocks:
            raise ValueError(f"max_entries must be in [0, {num_blocks // num_groups}], got {max_entries}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_groups = num_groups
        self.enable_prefix_caching = enable_prefix_caching
        self.record_events = record_events  # only when a publisher drains them
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.parent_of: dict[BlockHash, BlockHash | None] = {}  # of every group-0 cached hash (index resyncs)
        self.entries = PositionEntries(max_entries if enable_prefix_caching else 0)
        self.host = host if enable_prefix_caching else None
        self._copies: list[tuple[int, int]] = []  # (src, dst) pages, in the order planned
        self._events: list[KVEvent] = []
        self._removed: list[BlockHash] = []
        self._registered: dict[tuple[str, int], int] = {}  # sequence key -> blocks hashed so far
        self._boundaries_seen: dict[tuple[str, int], int] = {}  # sequence key -> boundaries handled
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which served from cache

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take (free plus evictable cached and entry blocks)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # --- commands ------------------------------------------------------------------------
    def record_prefix_lookup(self, seq: Sequence, num_cached_tokens: int) -> None:
        seq.num_cached_tokens = num_cached_tokens
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += num_cached_tokens

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references in every group, tail first (its last blocks are evicted
        before its prefix). A last page that is partially computed becomes an entry (evicted
        before the rest)."""
        kept = self._keep_last_page(seq)
        for table in group_tables(seq):
            for block_id in reversed(table):
                if block_id != FREED and block_id not in kept:
                    self._release(block_id)
        seq.block_ids = []
        seq.group_block_ids = []
        self._registered.pop(seq.key, None)
        self._boundaries_seen.pop(seq.key, None)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) page copies planned since the last call, in order; empties the plan.

        Take them after admission (copies for prefix hits: entry -> new page) and after each step
        (new entries: a sequence's page -> a block of the free queue). Within either batch no dst
        is the src of a later pair, so one gather of every src then one scatter to every dst is the
        same as copying pair by pair.
        """
        copies, self._copies = self._copies, []
        return copies

    def take_host_transfers(self) -> HostTransfers | None:
        """The host tier's planned copies (see :meth:`HostBlockPool.take_transfers`); None without one.
        Run them before the block copies of :meth:`take_block_copies`."""
        return self.host.take_transfers() if self.host is not None else None

    def drain_events(self) -> list[KVEvent]:
        """KV events since the last call, in order within each tier (for the prefix index publisher)."""
        self._flush_removed()
        events, self._events = self._events, []
        if self.host is not None:
            events.extend(self.host.drain_events())
        return events

    def snapshot(self) -> list[tuple[BlockHash, BlockHash | None]]:
        """(hash, parent) of every group-0 block the pool can serve now, for a full index resync.

        Called from the publisher's thread: ``list()`` of a dict is atomic under the GIL.
        """
        return list(self.parent_of.items())

    def _flush_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(self._removed))
            self._removed = []

    def _release(self, block_id: int) -> None:
        self.ref_cnt[block_id] -= 1
        if self.ref_cnt[block_id] == 0:
            self.free_queue[block_id] = None

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        entry = self.entries.get(block_id)
        if entry is not None:  # the entry is gone; its other pages now hold nothing: next to go
            self.entries.drop(entry)
            for page in entry.pages:
                if page != block_id:
                    self.free_queue.move_to_end(page, last=False)
        elif self.block_hash[block_id] is not None:
            if self.host is not None:
                self.host.offload((self._hash_group(block_id), self.block_hash[block_id]), block_id)
            self._forget_hash(block_id)
            self.block_hash[block_id] = None
        self.ref_cnt[block_id] = 1
        return block_id

    @abstractmethod
    def _forget_hash(self, block_id: int) -> None:
        """Drop the hash ``block_id`` holds from the cache maps (it is being reused)."""

    def _hash_group(self, block_id: int) -> int:
        """The layer group whose cache map holds ``block_id``'s hash."""
        return 0

    @abstractmethod
    def _cache_block(self, block_id: int, group: int, block_hash: BlockHash, parent: BlockHash | None) -> None:
        """Record that ``block_id`` holds the KV of ``block_hash`` in ``group`` (``parent``: the
        block before it, for group 0's index resyncs)."""

    def _load_from_host(self, loads: list[tuple[int, int]], hashes: list[BlockHash]) -> list[int]:
        """New blocks for ``loads``, (layer group, index into ``hashes``) of blocks the host tier
        holds, in order: each cached under its hash at once, its load planned. Every slot is pinned
        first: taking a block may offload another to the host tier. Group 0's runs of consecutive
        blocks become stored events."""
        assert self.host is not None
        slots = [self.host.pin((group, hashes[i])) for group, i in loads]
        blocks = []
        for slot, (group, i) in zip(slots, loads):
            block_id = self._take_free_block()
            self.host.load(slot, block_id)
            self._cache_block(block_id, group, hashes[i], hashes[i - 1] if i else None)
            blocks.append(block_id)
        if self.record_events:
            runs: list[list[int]] = []
            for group, i in loads:
                if group == 0:
                    if runs and runs[-1][-1] == i - 1:
                        runs[-1].append(i)
                    else:
                        runs.append([i])
            self._flush_removed()
            self._events.extend(BlockStored([hashes[i] for i in run], hashes[run[0] - 1] if run[0] else None)
                                for run in runs)
        return blocks

    # --- exact-position entries --------------------------------------------------------------
    def _entry_key(self, seq: Sequence, page: int) -> BlockHash:
        hashes = seq.update_block_hashes(self.block_size)
        return entry_key(hashes[page - 1] if page else None, seq.salt)

    def _entry_hit(self, seq: Sequence, page: int) -> tuple[PositionEntry | None, int]:
        """The entry continuing ``seq``'s first ``page`` full blocks that shares the most of the
        tokens after them (leaving one to compute), and how many it shares."""
        if not self.entries:
            return None, 0
        start = page * self.block_size
        rest = seq.all_token_ids[start : min(start + self.block_size, seq.num_tokens) - 1]
        best, num_shared = None, 0
        for tail, block_id in self.entries.tails(self._entry_key(seq, page)).items():
            n = _common_prefix_len(tail, rest)
            if n > num_shared:
                best, num_shared = block_id, n
        return (None, 0) if best is None else (self.entries[best], num_shared)

    def _resume_on(self, entry: PositionEntry, num_spare_blocks: int) -> tuple[int, ...]:
        """Pages (one per group) for a sequence resuming on ``entry``: copies of its pages planned
        into blocks of the free queue, the entry staying as the most recently used; or, when the
        free queue has fewer than a page per group to spare, the entry's own pages taken over."""
        if num_spare_blocks >= len(entry.pages):
            self._touch_entry(entry)
            pages = tuple(self._take_free_block() for _ in entry.pages)
            self._copies.extend(zip(entry.pages, pages))
            return pages
        self.entries.drop(entry)
        for page in entry.pages:
            del self.free_queue[page]
            self.ref_cnt[page] = 1
        return entry.pages

    def _cache_boundaries(self, seq: Sequence) -> None:
        bounds = seq.cache_boundaries
        if not bounds:
            return
        seen = self._boundaries_seen.get(seq.key, 0)
        while seen < len(bounds) and bounds[seen] <= seq.num_computed_tokens:
            end = bounds[seen]
            seen += 1
            if end % self.block_size == 0 or not self.entries.cap:
                continue  # a full block: the cached blocks already end there
            sources = [table[end // self.block_size] for table in group_tables(seq)]
            if FREED in sources:
                continue  # inside a prefix this sequence resumed after, before a group's window
            found = self._new_tail(seq, end)
            if found is None:
                continue
            self._release_extended(*found)
            pages = self._entry_pages()
            if pages is None:
                continue  # every block is in use: no entry
            self._copies.extend(zip(sources, pages))
            self._add_entry(PositionEntry(*found, pages[0], tuple(pages[1:])))
        self._boundaries_seen[seq.key] = seen

    def _keep_last_page(self, seq: Sequence) -> tuple[int, ...]:
        """Hand ``seq``'s partially computed last page of every group over to a new entry;
        returns its pages."""
        end = seq.num_computed_tokens
        if not self.entries.cap or end % self.block_size == 0:
            return ()
        found = self._new_tail(seq, end)
        if found is None:
            return ()
        self._release_extended(*found)
        if self.entries.full:
            self._release_entry(self.entries.oldest())
        pages = tuple(table[end // self.block_size] for table in group_tables(seq))
        self._add_entry(PositionEntry(*found, pages[0], pages[1:]))
        return pages

    def _new_tail(self, seq: Sequence, end: int) -> tuple[BlockHash, tuple[int, ...]] | None:
        """Key and tail of an entry ending at token ``end`` of ``seq``, or None (touching it) if
        an entry whose tail starts with that tail exists."""
        page = end // self.block_size
        key = self._entry_key(seq, page)
        tail = tuple(seq.all_token_ids[page * self.block_size : end])
        for other, block_id in self.entries.tails(key).items():
            if other[: len(tail)] == tail:
                self._touch_entry(self.entries[block_id])
                return None
        return key, tail

    def _entry_pages(self) -> list[int] | None:
        """Pages for a new entry, one per group: the least recently used entry's at the cap, else
        the free queue's head; None when the free queue has fewer (every block is in use)."""
        if self.entries.full:
            entry = self.entries.oldest()
            self.entries.drop(entry)
            return list(entry.pages)
        if len(self.free_queue) < self.num_groups:
            return None
        return [self._take_free_block() for _ in range(self.num_groups)]

    def _release_extended(self, key: BlockHash, tail: tuple[int, ...]) -> None:
        """Release the entries under ``key`` whose tails ``tail`` extends: it serves all they would."""
        tails = self.entries.tails(key)
        for block_id in [b for t, b in tails.items() if tail[: len(t)] == t]:
            self._release_entry(self.entries[block_id])

    def _add_entry(self, entry: PositionEntry) -> None:
        """Register ``entry``, its pages the most recently used blocks of the free queue."""
        self.entries.add(entry)
        for page in entry.pages:
            self.ref_cnt[page] = 0
            self.free_queue[page] = None
            self.free_queue.move_to_end(page)

    def _touch_entry(self, entry: PositionEntry) -> None:
        self.entries.touch(entry.block_id)
        for page in entry.pages:
            self.free_queue.move_to_end(page)

    def _release_entry(self, entry: PositionEntry) -> None:
        """Forget ``entry``; its pages, now holding nothing, are the next ones allocated."""
        self.entries.drop(entry)
        for page in entry.pages:
            self.free_queue.move_to_end(page, last=False)

    # --- proof ---------------------------------------------------------------------------
    def check_integrity(self, live: Iterable[Sequence]) -> BlockCounts:
        """Prove free + cached + used + entry blocks == pool over every group's tables, that ref
        counts match the live sequences, that the cache maps agree with the blocks' hashes and
        that the entry maps agree with each other and hold only unreferenced, unhashed pages."""
        expected = [0] * self.num_blocks
        for seq in live:
            self._check_tables(seq)
            for table in group_tables(seq):
                for block_id in table:
                    if block_id != FREED:
                        expected[block_id] += 1
        if expected != self.ref_cnt:
            bad = [i for i in range(self.num_blocks) if expected[i] != self.ref_cnt[i]]
            raise IntegrityError(f"ref counts differ from live sequences at blocks {bad[:10]}")
        unreferenced = {i for i, r in enumerate(self.ref_cnt) if r == 0}
        if unreferenced != set(self.free_queue):
            raise IntegrityError("free queue differs from the set of unreferenced blocks")
        self._check_cache_maps()
        self.entries.check(self.block_size, self.num_groups)
        for block_id in self.entries.pages():
            if block_id not in unreferenced or self.block_hash[block_id] is not None:
                raise IntegrityError(f"entry block {block_id} is referenced or hashed")
        cached = sum(1 for i in unreferenced if self.block_hash[i] is not None)
        entries = self.entries.num_pages
        counts = BlockCounts(
            len(unreferenced) - cached - entries, cached, self.num_blocks - len(unreferenced), entries
        )
        assert sum(counts) == self.num_blocks
        return counts

    def _check_tables(self, seq: Sequence) -> None:
        """Raise IntegrityError if ``seq``'s tables break a rule of the subclass."""
        return  # one table, no rule beyond the pool's; the hybrid manager adds its groups' rules

    @abstractmethod
    def _check_cache_maps(self) -> None:
        """Raise IntegrityError if the subclass's cache maps disagree with the blocks' hashes."""


class KVCacheManager(BlockPool):
    """Owns block ids, never the KV tensors: one block table per sequence (every layer reads it)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
        max_entries: int | None = None,
        host: HostBlockPool | None = None,
    ):
        super().__init__(num_blocks, block_size, enable_prefix_caching, record_events, max_entries, host=host)
        self.cached: dict[BlockHash, int] = {}

    # --- queries -------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable prefix (in use or evictable)."""
        return len(self.cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Cached full blocks holding the longest prefix of ``seq``, then the entry sharing the
        most of the following tokens; leaves at least one token to compute.

        Pure query: takes no reference (pass the result to :meth:`allocate`). A sequence that still
        needs prompt logprobs gets no hit: it recomputes its prompt (its blocks are cached as usual).
        """
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return PrefixMatch([], None, 0)
        hashes = seq.update_block_hashes(self.block_size)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        host_hashes: list[BlockHash] = []
        if self.host is not None:
            for block_hash in hashes[len(hit) : max_blocks]:
                if self.host.get((0, block_hash)) is None:
                    break
                host_hashes.append(block_hash)
        num_full = len(hit) + len(host_hashes)
        entry, num_shared = self._entry_hit(seq, num_full)
        return PrefixMatch(hit, entry, num_full * self.block_size + num_shared, tuple(host_hashes))

    # --- commands ------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> list[int] | None:
        """Give ``seq`` the blocks to hold ``num_new_tokens`` more tokens, or None if the pool can't.

        ``prefix`` (from :meth:`match_prefix`, only for a sequence with no blocks yet): its full
        blocks are taken first, then new blocks loaded from its host-held ones, and these, with its
        entry's shared tokens, count as computed. The entry's page is copied into the next new
        block (a planned copy, see :meth:`take_block_copies`); when that block would have to be the
        entry's own, the sequence takes the entry's block over instead. Returns the new blocks. On
        None nothing has changed.
        """
        if prefix is None and self.blocks_needed(seq.num_computed_tokens + num_new_tokens) <= len(seq.block_ids):
            return []  # the common decode step: its token fits in the last block
        if prefix is not None and seq.block_ids:
            raise ValueError("a prefix only applies to a sequence that holds no blocks")
        cached_blocks = prefix.blocks if prefix is not None else []
        num_computed = prefix.num_tokens if prefix is not None else seq.num_computed_tokens
        num_required = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = max(num_required - len(seq.block_ids) - len(cached_blocks), 0)
        available = len(self.free_queue) - sum(1 for b in cached_blocks if self.ref_cnt[b] == 0)
        if num_new_blocks > available:
            return None
        for block_id in cached_blocks:
            if self.ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_cnt[block_id] += 1
        # the entry's pages first: the loads then never take them from the free queue
        pages: tuple[int, ...] = ()
        if prefix is not None and prefix.entry is not None:
            pages = self._resume_on(prefix.entry, available - num_new_blocks)
        new_blocks: list[int] = []
        if prefix is not None and prefix.host_hashes:
            loads = [(0, i) for i in range(len(cached_blocks), len(cached_blocks) + len(prefix.host_hashes))]
            new_blocks.extend(self._load_from_host(loads, seq.update_block_hashes(self.block_size)))
        new_blocks.extend(pages)
        new_blocks.extend(self._take_free_block() for _ in range(num_new_blocks - len(new_blocks)))
        seq.block_ids.extend(cached_blocks)
        seq.block_ids.extend(new_blocks)
        if prefix is not None:
            seq.num_computed_tokens = num_computed
            self._registered[seq.key] = len(cached_blocks) + len(prefix.host_hashes)
        return new_blocks

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish every block of ``seq`` whose KV is now fully computed (prompt or output), and
        plan an entry for every cache boundary now computed that falls inside a page.

        Call right after a step; run the planned copies (:meth:`take_block_copies`) before anything
        else allocates or frees blocks, as their source pages belong to ``seq``.
        """
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self._registered.get(seq.key, 0)
        if num_full > start:
            hashes = seq.update_block_hashes(self.block_size)
            for i in range(start, num_full):
                block_id, block_hash = seq.block_ids[i], hashes[i]
                if self.block_hash[block_id] is None and block_hash not in self.cached:
                    self._cache_block(block_id, 0, block_hash, hashes[i - 1] if i else None)
            if self.record_events:
                self._flush_removed()  # keep events in the order they happened
                self._events.append(BlockStored(hashes[start:num_full], hashes[start - 1] if start else None))
            self._registered[seq.key] = num_full
        self._cache_boundaries(seq)

    def rollback(self, seq: Sequence) -> None:
        """Return ``seq``'s blocks past those its tokens need (they held only rejected draft
        tokens: private, never hashed) to the head of the free queue, the next ones allocated."""
        keep = self.blocks_needed(seq.num_tokens)
        if len(seq.block_ids) <= keep:
            return
        for block_id in seq.block_ids[keep:]:
            self.ref_cnt[block_id] -= 1
            self.free_queue[block_id] = None
            self.free_queue.move_to_end(block_id, last=False)
        seq.block_ids = seq.block_ids[:keep]  # a new list: DecodeGraphs rewrites a table row only where its list grew

    def _cache_block(self, block_id: int, group: int, block_hash: BlockHash, parent: BlockHash | None) -> None:
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id
        self.parent_of[block_hash] = parent

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        del self.cached[block_hash]
        del self.parent_of[block_hash]
        if self.record_events:
            self._removed.append(block_hash)

    def _check_cache_maps(self) -> None:
        for block_hash, block_id in self.cached.items():
            if self.block_hash[block_id] != block_hash:
                raise IntegrityError(f"cached entry for block {block_id} has a stale hash")
        if sum(h is not None for h in self.block_hash) != len(self.cached):
            raise IntegrityError("a block holds a hash that the cache map lacks")
