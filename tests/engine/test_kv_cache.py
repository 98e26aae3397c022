"""Block pool and prefix caching: exact block ids, eviction order, salts, integrity."""

import pytest

from engine.kv_cache import BlockCounts, IntegrityError, KVCacheManager
from engine.protocol import SamplingParams
from engine.request import Sequence
from prefix_index.events import BlockRemoved, BlockStored
from prefix_index.hashing import block_hashes

BS = 4


def make_seq(tokens, rid="r", salt=None, index=0):
    return Sequence(rid, index, list(tokens), SamplingParams(), salt, [], None)


def run_prefill(kv: KVCacheManager, seq: Sequence) -> list[int]:
    """Admit ``seq`` with its prefix hit, compute the whole prompt, publish its blocks."""
    cached = kv.match_prefix(seq)
    num_cached = len(cached) * BS
    assert kv.allocate(seq, seq.num_tokens - num_cached, cached) is not None
    kv.record_prefix_lookup(seq, num_cached)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_computed_blocks(seq)
    return cached


def test_allocate_takes_blocks_in_order_and_free_returns_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10), "a")
    assert kv.allocate(a, 10) == [0, 1, 2]
    b = make_seq(range(100, 105), "b")
    assert kv.allocate(b, 5) == [3, 4]
    kv.free(a)
    assert list(kv.free_queue) == [5, 6, 7, 2, 1, 0]
    assert kv.check_integrity([b]) == BlockCounts(free=6, cached=0, used=2)


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
    assert kv.match_prefix(c) == [0, 1]
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
    assert kv.check_integrity([b]) == BlockCounts(free=7, cached=0, used=3)


def test_salt_isolates_caches():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(9))
    run_prefill(kv, make_seq(prompt, "a", salt="tenant-a"))
    assert kv.match_prefix(make_seq(prompt, "b", salt="tenant-b")) == []
    assert kv.match_prefix(make_seq(prompt, "c", salt=None)) == []
    assert kv.match_prefix(make_seq(prompt, "d", salt="tenant-a")) == [0, 1]


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
    assert kv.match_prefix(follow_up) == seq.block_ids[:2]


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
    kv.free(b)
    assert kv.check_integrity([]) == BlockCounts(free=8, cached=2, used=0)


def test_integrity_check_catches_leaks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    s = make_seq(range(5))
    kv.allocate(s, 5)
    with pytest.raises(IntegrityError):
        kv.check_integrity([])  # blocks held by a sequence nobody knows about
