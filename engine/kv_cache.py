"""Paged KV block pool with prefix caching and exact-position entries.

Every block is in exactly one state: *used* (ref count > 0), *cached* (ref count 0, holds the hash
of a full block: reusable until evicted), *entry* (ref count 0, an exact-position entry: a
cache-owned copy of a partially filled page) or *free* (ref count 0, holds nothing). Cached, entry
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
only.

The manager only plans page copies; the engine runs them (:meth:`take_block_copies`) in order,
before the next forward reads or writes the pool.

With a host tier (``host``, see :mod:`engine.kv_host`), a full block whose hash leaves the pool is
offloaded to it, and a prefix hit continues past the pool's cached blocks into blocks the host tier
holds: they are loaded into new blocks (planned like page copies, :meth:`take_host_transfers`,
which the engine runs first) and count as cached tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple

from engine.request import Sequence
from prefix_index.events import BlockRemoved, BlockStored, KVEvent
from prefix_index.hashing import BlockHash, hash_block

if TYPE_CHECKING:
    from engine.kv_host import HostBlockPool, HostTransfers


class BlockCounts(NamedTuple):
    free: int
    cached: int
    used: int
    entries: int


class PositionEntry(NamedTuple):
    """An exact-position entry: a cache-owned page holding the KV of ``tail``, the first tokens of
    the page after the full block hashed into ``key`` (see :func:`entry_key`)."""

    key: BlockHash
    tail: tuple[int, ...]  # 1 … block_size - 1 tokens
    block_id: int


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


def _common_prefix_len(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PositionEntries:
    """The exact-position entries of one pool, by block id in LRU order and by key then tail, with
    their cap. Holds no blocks: the manager moves the entries' blocks in its free queue."""

    def __init__(self, cap: int):
        self.cap = cap
        self.by_block: OrderedDict[int, PositionEntry] = OrderedDict()  # LRU first
        self._by_key: dict[BlockHash, dict[tuple[int, ...], int]] = {}  # key -> tail -> block

    def __len__(self) -> int:
        return len(self.by_block)

    def __iter__(self) -> Iterator[int]:
        return iter(self.by_block)

    def __getitem__(self, block_id: int) -> PositionEntry:
        return self.by_block[block_id]

    def get(self, block_id: int) -> PositionEntry | None:
        return self.by_block.get(block_id)

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

    def touch(self, block_id: int) -> None:
        self.by_block.move_to_end(block_id)

    def drop(self, entry: PositionEntry) -> None:
        del self.by_block[entry.block_id]
        tails = self._by_key[entry.key]
        del tails[entry.tail]
        if not tails:
            del self._by_key[entry.key]

    def check(self, block_size: int) -> None:
        """Raise IntegrityError unless both maps agree, every tail is shorter than a page and the
        cap holds."""
        indexed = {(key, tail, b) for key, tails in self._by_key.items() for tail, b in tails.items()}
        if indexed != set(self.by_block.values()) or any(b != e.block_id for b, e in self.by_block.items()):
            raise IntegrityError("the entry index differs from the entry list")
        for entry in self.by_block.values():
            if not 0 < len(entry.tail) < block_size:
                raise IntegrityError(f"entry block {entry.block_id} has a tail of {len(entry.tail)} tokens")
        if len(self.by_block) > self.cap:
            raise IntegrityError(f"{len(self.by_block)} entries exceed the cap of {self.cap}")


class KVCacheManager:
    """Owns block ids, never the KV tensors. Not thread-safe: the engine loop alone calls it."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
        max_entries: int | None = None,
        host: HostBlockPool | None = None,
    ):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        if max_entries is None:
            max_entries = num_blocks // 4
        if not 0 <= max_entries <= num_blocks:
            raise ValueError(f"max_entries must be in [0, {num_blocks}], got {max_entries}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.record_events = record_events  # only when a publisher drains them
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.parent_of: dict[BlockHash, BlockHash | None] = {}  # of every cached hash (index resyncs)
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
    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable prefix (in use or evictable)."""
        return len(self.cached)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

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
        num_tokens = num_full * self.block_size
        tails = self.entries.tails(self._entry_key(seq, num_full))
        if not tails:
            return PrefixMatch(hit, None, num_tokens, tuple(host_hashes))
        rest = seq.all_token_ids[num_tokens : min(num_tokens + self.block_size, seq.num_tokens) - 1]
        best, num_shared = None, 0
        for tail, block_id in tails.items():
            n = _common_prefix_len(tail, rest)
            if n > num_shared:
                best, num_shared = block_id, n
        if best is None:
            return PrefixMatch(hit, None, num_tokens, tuple(host_hashes))
        return PrefixMatch(hit, self.entries[best], num_tokens + num_shared, tuple(host_hashes))

    # --- commands ------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> list[int] | None:
        """Give ``seq`` the blocks to hold ``num_new_tokens`` more tokens, or None if the pool can't.

        ``prefix`` (from :meth:`match_prefix`, only for a sequence with no blocks yet): its full
        blocks are taken first, then new blocks loaded from its host-held ones (cached under their
        hashes at once), and these, with its entry's shared tokens, count as computed. The entry's
        page is copied into the first new block (a planned copy, see :meth:`take_block_copies`);
        when that block would have to be the entry's own, the sequence takes the entry's block over
        instead. Returns the new blocks. On None nothing has changed.
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
        entry = prefix.entry if prefix is not None else None
        if entry is not None:  # the most recently used block: loads below never take it
            self._touch_entry(entry.block_id)
        new_blocks = self._load_from_host(seq, prefix) if prefix is not None and prefix.host_hashes else []
        if entry is not None:
            if num_new_blocks < available:  # the entry stays
                page = self._take_free_block()
                self._copies.append((entry.block_id, page))
            else:
                self.entries.drop(entry)
                del self.free_queue[entry.block_id]
                self.ref_cnt[entry.block_id] = 1
                page = entry.block_id
            new_blocks.append(page)
        new_blocks.extend(self._take_free_block() for _ in range(num_new_blocks - len(new_blocks)))
        seq.block_ids.extend(cached_blocks)
        seq.block_ids.extend(new_blocks)
        if prefix is not None:
            seq.num_computed_tokens = num_computed
            self._registered[seq.key] = len(cached_blocks) + len(prefix.host_hashes)
        return new_blocks

    def _load_from_host(self, seq: Sequence, prefix: PrefixMatch) -> list[int]:
        """New blocks for ``prefix``'s host-held hashes, each cached under its hash, their loads
        planned. The slots are pinned first: taking a block may offload another to the host tier."""
        assert self.host is not None
        slots = [self.host.pin((0, h)) for h in prefix.host_hashes]
        hashes = seq.update_block_hashes(self.block_size)
        start = len(prefix.blocks)
        blocks = []
        for i, (slot, block_hash) in enumerate(zip(slots, prefix.host_hashes), start):
            block_id = self._take_free_block()
            self.host.load(slot, block_id)
            self.block_hash[block_id] = block_hash
            self.cached[block_hash] = block_id
            self.parent_of[block_hash] = hashes[i - 1] if i else None
            blocks.append(block_id)
        if self.record_events:
            self._flush_removed()
            self._events.append(BlockStored(list(prefix.host_hashes), hashes[start - 1] if start else None))
        return blocks

    def record_prefix_lookup(self, seq: Sequence, num_cached_tokens: int) -> None:
        seq.num_cached_tokens = num_cached_tokens
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += num_cached_tokens

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
                    self.block_hash[block_id] = block_hash
                    self.cached[block_hash] = block_id
                    self.parent_of[block_hash] = hashes[i - 1] if i else None
            if self.record_events:
                self._flush_removed()  # keep events in the order they happened
                self._events.append(BlockStored(hashes[start:num_full], hashes[start - 1] if start else None))
            self._registered[seq.key] = num_full
        self._cache_boundaries(seq)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, tail first (its last blocks are evicted before its prefix).

        A last page that is partially computed becomes an entry (evicted before the rest).
        """
        kept = self._keep_last_page(seq)
        for block_id in reversed(seq.block_ids):
            if block_id == kept:
                continue
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None
        seq.block_ids = []
        self._registered.pop(seq.key, None)
        self._boundaries_seen.pop(seq.key, None)

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
        entry = self.entries.get(block_id)
        if entry is not None:
            self.entries.drop(entry)
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            del self.parent_of[block_hash]
            self.block_hash[block_id] = None
            if self.record_events:
                self._removed.append(block_hash)
            if self.host is not None:
                self.host.offload((0, block_hash), block_id)
        self.ref_cnt[block_id] = 1
        return block_id

    # --- exact-position entries --------------------------------------------------------------
    def _entry_key(self, seq: Sequence, page: int) -> BlockHash:
        hashes = seq.update_block_hashes(self.block_size)
        return entry_key(hashes[page - 1] if page else None, seq.salt)

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
            found = self._new_tail(seq, end)
            if found is None:
                continue
            self._release_extended(*found)
            block_id = self._entry_block()
            if block_id is None:
                continue  # every block is in use: no entry
            self._copies.append((seq.block_ids[end // self.block_size], block_id))
            self._add_entry(PositionEntry(*found, block_id))
        self._boundaries_seen[seq.key] = seen

    def _keep_last_page(self, seq: Sequence) -> int | None:
        """Hand ``seq``'s partially computed last page over to a new entry; returns its block."""
        end = seq.num_computed_tokens
        if not self.entries.cap or end % self.block_size == 0:
            return None
        found = self._new_tail(seq, end)
        if found is None:
            return None
        self._release_extended(*found)
        if self.entries.full:
            self._release_entry(self.entries.oldest())
        block_id = seq.block_ids[end // self.block_size]
        self._add_entry(PositionEntry(*found, block_id))
        return block_id

    def _new_tail(self, seq: Sequence, end: int) -> tuple[BlockHash, tuple[int, ...]] | None:
        """Key and tail of an entry ending at token ``end`` of ``seq``, or None (touching it) if
        an entry whose tail starts with that tail exists."""
        page = end // self.block_size
        key = self._entry_key(seq, page)
        tail = tuple(seq.all_token_ids[page * self.block_size : end])
        for other, block_id in self.entries.tails(key).items():
            if other[: len(tail)] == tail:
                self._touch_entry(block_id)
                return None
        return key, tail

    def _entry_block(self) -> int | None:
        """A block for a new entry: the least recently used entry's at the cap, else the free
        queue's head; None when every block is in use."""
        if self.entries.full:
            entry = self.entries.oldest()
            self.entries.drop(entry)
            return entry.block_id
        if not self.free_queue:
            return None
        return self._take_free_block()

    def _release_extended(self, key: BlockHash, tail: tuple[int, ...]) -> None:
        """Release the entries under ``key`` whose tails ``tail`` extends: it serves all they would."""
        tails = self.entries.tails(key)
        for block_id in [b for t, b in tails.items() if tail[: len(t)] == t]:
            self._release_entry(self.entries[block_id])

    def _add_entry(self, entry: PositionEntry) -> None:
        """Register ``entry`` as the most recently used block of the free queue."""
        self.entries.add(entry)
        self.ref_cnt[entry.block_id] = 0
        self.free_queue[entry.block_id] = None
        self.free_queue.move_to_end(entry.block_id)

    def _touch_entry(self, block_id: int) -> None:
        self.entries.touch(block_id)
        self.free_queue.move_to_end(block_id)

    def _release_entry(self, entry: PositionEntry) -> None:
        """Forget ``entry``; its block, now holding nothing, is the next one allocated."""
        self.entries.drop(entry)
        self.free_queue.move_to_end(entry.block_id, last=False)

    # --- proof ---------------------------------------------------------------------------
    def check_integrity(self, live: Iterable[Sequence]) -> BlockCounts:
        """Prove free + cached + used + entry blocks == pool, that ref counts match the live sequences
        and that the entry maps agree."""
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
        self.entries.check(self.block_size)
        for block_id in self.entries:
            if block_id not in unreferenced or self.block_hash[block_id] is not None:
                raise IntegrityError(f"entry block {block_id} is referenced or hashed")
        cached = sum(1 for i in unreferenced if self.block_hash[i] is not None)
        entries = len(self.entries)
        counts = BlockCounts(
            len(unreferenced) - cached - entries, cached, self.num_blocks - len(unreferenced), entries
        )
        assert sum(counts) == self.num_blocks
        return counts
