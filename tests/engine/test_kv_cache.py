"""Block pool and prefix caching: exact block ids, eviction order, salts, integrity."""

import pytest

from engine.kv_cache import BlockCounts, IntegrityError, KVCacheManager, PositionEntry, PrefixMatch, entry_key
from engine.protocol import SamplingParams
from engine.request import Sequence
from prefix_index.events import BlockRemoved, BlockStored
from prefix_index.hashing import block_hashes

BS = 4


def make_seq(tokens, rid="r", salt=None, index=0, boundaries=()):
    return Sequence(rid, index, list(tokens), SamplingParams(), salt, list(boundaries), None)


def run_prefill(kv: KVCacheManager, seq: Sequence) -> list[int]:
    """Admit ``seq`` with its prefix hit, compute the whole prompt, publish its blocks."""
    prefix = kv.match_prefix(seq)
    assert kv.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix) is not None
    kv.record_prefix_lookup(seq, prefix.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_computed_blocks(seq)
    return prefix.blocks


def test_allocate_takes_blocks_in_order_and_free_returns_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10), "a")
    assert kv.allocate(a, 10) == [0, 1, 2]
    b = make_seq(range(100, 105), "b")
    assert kv.allocate(b, 5) == [3, 4]
    kv.free(a)
    assert list(kv.free_queue) == [5, 6, 7, 2, 1, 0]
    assert kv.check_integrity([b]) == BlockCounts(free=6, cached=0, used=2, entries=0)


def test_allocate_returns_none_and_changes_nothing_when_pool_is_short():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_seq(range(8), "a")
    assert kv.allocate(a, 8) == [0, 1]
    b = make_seq(range(9), "b")
    assert kv.allocate(b, 9) is None
    assert b.block_ids == [] and kv.num_free_blocks == 1
    kv.check_integrity([a])


def test_growth_allocates_only_when_a_block_fills():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    s = make_seq(range(3))
    assert kv.allocate(s, 3) == [0]
    s.num_computed_tokens = 3
    assert kv.allocate(s, 1) == []  # position 3 still fits block 0
    s.num_computed_tokens = 4
    assert kv.allocate(s, 1) == [1]


def test_repeated_prompt_hits_all_but_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(50, 63))  # 13 tokens: 3 full blocks
    first = make_seq(prompt, "first")
    assert run_prefill(kv, first) == []
    assert first.block_ids == [0, 1, 2, 3]
    kv.free(first)
    second = make_seq(prompt, "second")
    assert run_prefill(kv, second) == [0, 1, 2]
    assert second.num_cached_tokens == ((len(prompt) - 1) // BS) * BS == 12
    # The uncached tail got a new block: the freed partial block 3 sits behind untouched ones.
    assert second.block_ids == [0, 1, 2, 4]
    kv.check_integrity([second])


def test_prompt_of_exact_blocks_recomputes_last_block():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(8))
    first = make_seq(prompt, "first")
    run_prefill(kv, first)
    kv.free(first)
    second = make_seq(prompt, "second")
    assert run_prefill(kv, second) == [0]
    assert second.num_cached_tokens == 4  # (8 - 1) // 4 * 4: one token must be computed


def test_eviction_order_is_lru_and_tail_blocks_go_first():
    kv = KVCacheManager(num_blocks=6, block_size=BS, record_events=True)
    a = make_seq(range(0, 12), "a")  # 3 full blocks
    run_prefill(kv, a)
    assert a.block_ids == [0, 1, 2]
    kv.free(a)
    hashes = block_hashes(list(range(12)), BS)
    assert kv.drain_events() == [BlockStored(hashes, None)]
    assert kv.snapshot() == [(hashes[0], None), (hashes[1], hashes[0]), (hashes[2], hashes[1])]
    # free queue: untouched 3,4,5 then a's blocks tail first: 2,1,0
    assert list(kv.free_queue) == [3, 4, 5, 2, 1, 0]
    b = make_seq(range(100, 116), "b")  # 4 blocks: takes 3,4,5 then evicts a's tail block 2
    assert kv.allocate(b, 16) == [3, 4, 5, 2]
    assert kv.drain_events() == [BlockRemoved([hashes[2]])]
    assert len(kv.snapshot()) == 2
    # a's first two blocks still serve a prefix
    c = make_seq(list(range(12)) + [7], "c")
    assert kv.match_prefix(c).blocks == [0, 1]
    kv.check_integrity([b])


def test_shared_prefix_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    system = list(range(8))
    a = make_seq(system + [20, 21, 22], "a")
    run_prefill(kv, a)
    b = make_seq(system + [30, 31], "b")
    assert run_prefill(kv, b) == [0, 1]
    assert kv.ref_cnt[0] == kv.ref_cnt[1] == 2
    kv.free(a)
    assert kv.ref_cnt[0] == 1 and 0 not in kv.free_queue
    # a's last page (3 of its 4 slots computed) became an exact-position entry
    assert kv.entries[2].tail == (20, 21, 22)
    assert kv.check_integrity([b]) == BlockCounts(free=6, cached=0, used=3, entries=1)


def test_salt_isolates_caches():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(9))
    run_prefill(kv, make_seq(prompt, "a", salt="tenant-a"))
    assert kv.match_prefix(make_seq(prompt, "b", salt="tenant-b")).blocks == []
    assert kv.match_prefix(make_seq(prompt, "c", salt=None)).blocks == []
    assert kv.match_prefix(make_seq(prompt, "d", salt="tenant-a")).blocks == [0, 1]


def test_output_blocks_are_cached_once_computed():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    seq = make_seq(range(6), "a")
    run_prefill(kv, seq)  # 1 full block cached
    for tok in (90, 91, 92):
        seq.append_token(tok)
        assert kv.allocate(seq, 1) is not None
        seq.num_computed_tokens += 1
        kv.cache_computed_blocks(seq)
    # tokens 0..8 known, 0..8 computed: blocks 0 and 1 full
    assert len(kv.cached) == 2
    follow_up = make_seq(list(range(6)) + [90, 91, 92, 5], "b")
    assert kv.match_prefix(follow_up).blocks == seq.block_ids[:2]


def test_duplicate_blocks_computed_concurrently_keep_one_entry():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a, b = make_seq(range(9), "a"), make_seq(range(9), "b")
    for s in (a, b):  # both admitted before either computed
        assert kv.allocate(s, 9, kv.match_prefix(s)) is not None
    for s in (a, b):
        s.num_computed_tokens = 9
        kv.cache_computed_blocks(s)
    assert len(kv.cached) == 2 and set(kv.cached.values()) == {0, 1}
    kv.free(a)
    kv.free(b)  # its last page equals a's, which is already an entry: not kept twice
    assert list(kv.entries) == [2]
    assert kv.check_integrity([]) == BlockCounts(free=7, cached=2, used=0, entries=1)


def test_integrity_check_catches_leaks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    s = make_seq(range(5))
    kv.allocate(s, 5)
    with pytest.raises(IntegrityError):
        kv.check_integrity([])  # blocks held by a sequence nobody knows about


# --- exact-position entries ----------------------------------------------------------------

def grow(kv: KVCacheManager, seq: Sequence, num_tokens: int) -> None:
    """One engine step of ``num_tokens`` for a running sequence: allocate, compute, publish."""
    assert kv.allocate(seq, num_tokens) is not None
    seq.num_computed_tokens += num_tokens
    kv.cache_computed_blocks(seq)


def test_boundary_inside_a_page_is_copied_and_resumed_on_a_private_page():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    system = [10, 11, 12, 13, 14, 15]  # ends inside page 1
    a = make_seq(system + [20, 21, 22], "a", boundaries=[6])
    run_prefill(kv, a)
    assert a.block_ids == [0, 1, 2]
    assert kv.take_block_copies() == [(1, 3)]  # page 1 into the free queue's head, after the step
    assert kv.take_block_copies() == []
    key = entry_key(block_hashes(system, BS)[0], None)
    assert kv.entries.by_block == {3: PositionEntry(key, (14, 15), 3)}
    assert list(kv.free_queue)[-1] == 3  # the most recently used block

    b = make_seq(system + [30, 31, 32, 33], "b")
    prefix = kv.match_prefix(b)
    assert prefix == PrefixMatch([0], kv.entries[3], 6)
    assert kv.allocate(b, 4, prefix) == [4, 5]
    assert kv.take_block_copies() == [(3, 4)]  # b's own copy of the entry's page
    assert b.block_ids == [0, 4, 5] and b.num_computed_tokens == 6

    kv.free(a)
    # a's last page (token 22) becomes an entry ahead of a's other blocks; block 0 is still b's
    assert kv.entries[2].tail == (22,)
    assert list(kv.free_queue) == [*range(6, 16), 3, 2, 1]
    assert kv.check_integrity([b]) == BlockCounts(free=10, cached=1, used=3, entries=2)


def test_a_hit_leaves_a_token_to_compute_and_may_use_part_of_a_tail():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    run_prefill(kv, make_seq([10, 11, 12, 13, 14, 15, 16, 17, 40], "a", boundaries=[7]))
    assert [e.tail for e in kv.entries.by_block.values()] == [(14, 15, 16)]
    whole = make_seq([10, 11, 12, 13, 14, 15, 16], "whole")  # the prompt is the boundary itself
    assert kv.match_prefix(whole).num_tokens == 6
    diverging = make_seq([10, 11, 12, 13, 14, 15, 99, 98], "div")  # KV of 14, 15 is still right
    prefix = kv.match_prefix(diverging)
    assert prefix.entry.tail == (14, 15, 16) and prefix.num_tokens == 6
    assert kv.match_prefix(make_seq([10, 11, 12, 13, 99, 15], "miss")) == PrefixMatch([0], None, 4)


def test_entries_are_keyed_by_salt():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = [10, 11, 12, 13, 14, 15, 16]
    run_prefill(kv, make_seq(tokens + [50, 51], "a", salt="t1", boundaries=[2, 6]))
    assert sorted(e.tail for e in kv.entries.by_block.values()) == [(10, 11), (14, 15)]
    for salt in ("t2", None):  # the same tokens under another salt miss, on the first page too
        assert kv.match_prefix(make_seq(tokens, "b", salt=salt)) == PrefixMatch([], None, 0)
        assert kv.match_prefix(make_seq([10, 11, 99], "c", salt=salt)) == PrefixMatch([], None, 0)
    assert kv.match_prefix(make_seq([10, 11, 99], "c", salt="t1")).num_tokens == 2
    assert kv.match_prefix(make_seq(tokens, "b", salt="t1")).num_tokens == 6


def test_an_answer_sent_back_resumes_after_its_last_computed_token():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = [10, 11, 12, 13, 14]
    seq = make_seq(prompt, "turn1")
    run_prefill(kv, seq)
    for token in (60, 61, 62, 63, 2):  # sampled, then computed by the next step; 2 (<|im_end|>) stops
        seq.append_token(token)
        if token != 2:
            grow(kv, seq, 1)
    assert seq.num_computed_tokens == 9 and seq.block_ids == [0, 1, 2]
    kv.free(seq)
    assert kv.take_block_copies() == []  # the last page is handed over, not copied
    assert kv.entries[2].tail == (63,)
    # the client sends the answer back, then <|im_end|>, "\n" and a new message
    turn2 = make_seq(prompt + [60, 61, 62, 63, 2, 198, 1, 70, 71], "turn2")
    # block 1 holds output tokens (14, 60, 61, 62): full output blocks are cached too
    assert kv.match_prefix(turn2) == PrefixMatch([0, 1], kv.entries[2], 9)


def test_entries_are_evicted_before_the_blocks_they_extend():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10, 20), "a", boundaries=[6])
    run_prefill(kv, a)
    assert a.block_ids == [0, 1, 2] and kv.take_block_copies() == [(1, 3)]
    kv.free(a)
    assert list(kv.entries) == [3, 2]
    assert list(kv.free_queue) == [4, 5, 6, 7, 3, 2, 1, 0]
    b = make_seq(range(100, 124), "b")
    assert kv.allocate(b, 24) == [4, 5, 6, 7, 3, 2]  # the free blocks, then both entries
    assert kv.entries.by_block == {}
    assert kv.match_prefix(make_seq(range(10, 20), "again")) == PrefixMatch([0, 1], None, 8)
    assert kv.check_integrity([b]) == BlockCounts(free=0, cached=2, used=6, entries=0)


def test_the_cap_releases_the_least_recently_used_entry():
    kv = KVCacheManager(num_blocks=16, block_size=BS, max_entries=2)
    a = make_seq(range(10, 16), "a", boundaries=[2])
    run_prefill(kv, a)
    b = make_seq(range(20, 26), "b", boundaries=[2])
    run_prefill(kv, b)
    assert kv.take_block_copies() == [(0, 2), (3, 5)]
    d = make_seq([10, 11, 99], "d")  # hits a's entry: now b's is the least recently used
    assert kv.allocate(d, 1, kv.match_prefix(d)) == [6]
    assert kv.take_block_copies() == [(2, 6)]
    c = make_seq(range(30, 36), "c", boundaries=[2])
    run_prefill(kv, c)
    assert c.block_ids == [7, 8]
    assert kv.take_block_copies() == [(7, 5)]  # b's entry gives its block to c's
    assert [(b, e.tail) for b, e in kv.entries.by_block.items()] == [(2, (10, 11)), (5, (30, 31))]
    assert kv.match_prefix(make_seq([20, 21, 99], "e")).entry is None
    kv.free(c)  # its last page (34, 35) makes room by releasing a's entry, whose block goes next
    assert [(b, e.tail) for b, e in kv.entries.by_block.items()] == [(5, (30, 31)), (8, (34, 35))]
    f = make_seq([1, 2, 3], "f")
    assert kv.allocate(f, 3) == [2]
    kv.check_integrity([a, b, d, f])


def test_a_longer_tail_replaces_the_entry_it_extends():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    run_prefill(kv, make_seq([10, 11, 12, 13, 14, 40, 41], "a", boundaries=[5]))
    kv.take_block_copies()
    assert [e.tail for e in kv.entries.by_block.values()] == [(14,)]
    b = make_seq([10, 11, 12, 13, 14, 15, 16, 50], "b", boundaries=[7])
    prefix = kv.match_prefix(b)
    assert prefix.num_tokens == 5
    assert kv.allocate(b, 3, prefix) == [3]
    assert kv.take_block_copies() == [(2, 3)]  # b resumes on a copy of (14,)
    b.num_computed_tokens = 8
    kv.cache_computed_blocks(b)
    assert kv.take_block_copies() == [(3, 2)]  # (14, 15, 16) replaces (14,) and takes its block
    assert [e.tail for e in kv.entries.by_block.values()] == [(14, 15, 16)]
    c = make_seq([10, 11, 12, 13, 14, 15, 60], "c", boundaries=[6])
    run_prefill(kv, c)
    assert c.num_cached_tokens == 6
    assert kv.take_block_copies() == [(2, 4)]  # (14, 15) is served by (14, 15, 16): no new entry
    assert [e.tail for e in kv.entries.by_block.values()] == [(14, 15, 16)]


def test_a_hit_on_the_last_free_block_takes_the_entry_over():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_seq([10, 11, 12, 13, 14, 15], "a", boundaries=[6])
    run_prefill(kv, a)
    assert kv.take_block_copies() == [(1, 2)]
    b = make_seq([10, 11, 12, 13, 14, 15, 70, 71, 72], "b")
    prefix = kv.match_prefix(b)
    assert prefix.num_tokens == 6
    assert kv.allocate(b, 3, prefix) == [2, 3]  # no block is left for a copy: the page itself
    assert kv.take_block_copies() == [] and kv.entries.by_block == {}
    assert b.block_ids == [0, 2, 3] and b.num_computed_tokens == 6
    assert kv.check_integrity([a, b]) == BlockCounts(free=0, cached=0, used=4, entries=0)


def test_no_entry_without_a_free_block_or_with_entries_off():
    kv = KVCacheManager(num_blocks=2, block_size=BS, max_entries=1)
    a = make_seq(range(10, 18), "a", boundaries=[6])
    run_prefill(kv, a)  # both blocks are a's: the boundary is skipped, never evicting a used block
    assert kv.take_block_copies() == [] and kv.entries.by_block == {}
    off = KVCacheManager(num_blocks=8, block_size=BS, max_entries=0)
    b = make_seq(range(10, 17), "b", boundaries=[6])
    run_prefill(off, b)
    off.free(b)
    assert off.take_block_copies() == [] and off.entries.by_block == {}
    assert off.check_integrity([]) == BlockCounts(free=7, cached=1, used=0, entries=0)


def test_integrity_check_catches_a_lost_entry():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    s = make_seq(range(10, 17), "s")
    run_prefill(kv, s)
    kv.free(s)
    assert kv.check_integrity([]).entries == 1
    kv.entries._by_key.clear()
    with pytest.raises(IntegrityError, match="entry index"):
        kv.check_integrity([])
