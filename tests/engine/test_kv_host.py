"""Host-memory KV tier: exact slots, LRU and events of the pool; loads and offloads through the KV
manager; the real SmolLM2 resuming a conversation from host memory; a soak of both pools."""

import random

import pytest
import torch
from test_kv_groups import gemma_tiny  # noqa: F401 (a fixture)

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_cache import BlockCounts, IntegrityError, KVCacheManager, PositionEntry, PrefixMatch, entry_key
from engine.kv_groups import FREED, ON_HOST, HybridKVCacheManager, KVLayout, group_tables
from engine.kv_host import HostBlockPool, HostKVStore, HostTransfers
from engine.protocol import GenerateRequest, SamplingParams
from engine.request import Sequence
from prefix_index.events import HOST, BlockRemoved, BlockStored
from prefix_index.hashing import block_hashes

BS = 4


def make_seq(tokens, rid="r", salt=None):
    return Sequence(rid, 0, list(tokens), SamplingParams(), salt, [], None)


def prefill(kv: KVCacheManager, seq: Sequence):
    """Admit ``seq`` with its prefix hit, compute the whole prompt, publish its blocks."""
    prefix = kv.match_prefix(seq)
    assert kv.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix) is not None
    kv.record_prefix_lookup(seq, prefix.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_computed_blocks(seq)
    return prefix


def key(h):
    return (0, h)


# --- the host pool alone ---------------------------------------------------------------------

def test_host_pool_offloads_to_lru_slots_touches_held_keys_and_pins_loaded_slots():
    host = HostBlockPool(3, record_events=True)
    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    host.offload(key(a), 10)
    host.offload(key(b), 11)
    host.offload(key(a), 12)  # held already: touched, not copied
    host.offload(key(c), 13)
    assert host.take_transfers() == HostTransfers([(10, 0), (11, 1), (13, 2)], [])
    assert list(host.free_queue) == [1, 0, 2]  # b is now the least recently used
    slot = host.pin(key(a))
    host.load(slot, 20)
    host.offload(key(d), 14)  # evicts b (slot 1), never the pinned slot of a
    assert host.check_integrity() == BlockCounts(free=0, cached=2, used=1, entries=0)
    assert host.take_transfers() == HostTransfers([(14, 1)], [(0, 20)])
    assert host.get(key(b)) is None and host.get(key(d)) == 1
    assert list(host.free_queue) == [2, 1, 0]  # a's slot, loaded, is the most recently used
    assert host.drain_events() == [BlockStored([a, b, c], None, HOST), BlockRemoved([b], HOST),
                                   BlockStored([d], None, HOST)]
    assert host.snapshot() == [a, c, d]
    assert host.check_integrity() == BlockCounts(free=0, cached=3, used=0, entries=0)


def test_host_pool_drops_an_offload_when_every_slot_is_pinned():
    host = HostBlockPool(1)
    a, b = bytes(16), bytes([1]) * 16
    host.offload(key(a), 0)
    host.load(host.pin(key(a)), 5)
    host.offload(key(b), 1)
    assert host.take_transfers() == HostTransfers([(0, 0)], [(0, 5)])
    assert host.get(key(b)) is None


def test_host_integrity_catches_a_stale_slot():
    host = HostBlockPool(2)
    host.offload(key(bytes(16)), 0)
    host.slot_key[0] = key(bytes([9]) * 16)
    with pytest.raises(IntegrityError, match="stale"):
        host.check_integrity()
    with pytest.raises(ValueError, match="positive"):
        HostBlockPool(0)


# --- through the KV manager ------------------------------------------------------------------

def test_evicted_blocks_go_to_host_and_a_later_hit_loads_them_into_new_blocks():
    host = HostBlockPool(8, record_events=True)
    kv = KVCacheManager(num_blocks=4, block_size=BS, record_events=True, max_entries=0, host=host)
    a = make_seq(range(13), "a")  # blocks 0-2 full, block 3 holds one token
    prefill(kv, a)
    kv.free(a)  # free queue, tail first: 3, 2, 1, 0
    hashes = block_hashes(list(range(13)), BS)
    kv.drain_events()
    b = make_seq(range(100, 113), "b")  # takes all four: a's hashed blocks go to host slots 0-2
    prefill(kv, b)
    assert kv.take_host_transfers() == HostTransfers([(2, 0), (1, 1), (0, 2)], [])
    b_hashes = block_hashes(list(range(100, 113)), BS)
    assert kv.drain_events() == [BlockRemoved([hashes[2], hashes[1], hashes[0]]), BlockStored(b_hashes, None),
                                 BlockStored([hashes[2], hashes[1], hashes[0]], None, HOST)]
    kv.free(b)  # b's blocks were 3, 2, 1, 0: free queue 0, 1, 2, 3

    again = make_seq([*range(13), 50, 51], "again")  # a's prompt, then more
    prefix = kv.match_prefix(again)
    assert prefix.blocks == [] and prefix.host_hashes == tuple(hashes) and prefix.num_tokens == 12
    assert kv.allocate(again, 3, prefix) == [0, 1, 2, 3]
    kv.record_prefix_lookup(again, prefix.num_tokens)
    assert again.num_computed_tokens == 12 and again.num_cached_tokens == 12
    # a's slots are pinned, so b's evicted blocks go to other slots; their pages are read first
    assert kv.take_host_transfers() == HostTransfers([(1, 3), (2, 4), (3, 5)], [(2, 0), (1, 1), (0, 2)])
    assert kv.cached[hashes[0]] == 0 and kv.parent_of[hashes[1]] == hashes[0]
    assert kv.drain_events() == [
        BlockRemoved([b_hashes[2], b_hashes[1]]), BlockStored(list(hashes), None), BlockRemoved([b_hashes[0]]),
        BlockStored([b_hashes[2], b_hashes[1], b_hashes[0]], None, HOST),
    ]
    assert kv.check_integrity([again]) == BlockCounts(free=0, cached=0, used=4, entries=0)
    assert host.check_integrity() == BlockCounts(free=2, cached=6, used=0, entries=0)
    # a second sequence with the prefix now hits the pool, not the host tier
    twin = make_seq([*range(13), 60], "twin")
    assert kv.match_prefix(twin).blocks == [0, 1, 2] and kv.match_prefix(twin).host_hashes == ()


def test_pool_blocks_then_host_blocks_then_an_entry_make_one_hit():
    host = HostBlockPool(8)
    kv = KVCacheManager(num_blocks=6, block_size=BS, max_entries=2, host=host)
    a = make_seq(range(12), "a")  # blocks 0-2 full
    prefill(kv, a)
    kv.free(a)  # free queue: 3, 4, 5, 2, 1, 0
    b = make_seq(range(200, 216), "b")
    prefill(kv, b)  # takes 3, 4, 5, 2: a's last block goes to host slot 0
    assert kv.take_host_transfers().offloads == [(2, 0)]
    kv.free(b)
    h = block_hashes(list(range(12)), BS)
    # an entry continuing a's third block, as a turn that ended at token 14 leaves (made directly:
    # entries are evicted before the blocks they extend, so the pool never keeps one past them)
    page = kv._take_free_block()  # block 1, the LRU head: a's second block goes to host slot 1
    kv._add_entry(PositionEntry(entry_key(h[2], None), (12, 13), page))
    c = make_seq([*range(14), 99], "c")
    prefix = kv.match_prefix(c)
    assert prefix == PrefixMatch([0], kv.entries[page], 14, (h[1], h[2]))
    new = kv.allocate(c, 1, prefix)
    # b's blocks (their pages go to host first): the entry's copy takes the first, the loads the others
    assert new == [5, 4, 2] and c.block_ids == [0, 5, 4, 2]
    assert kv.take_host_transfers() == HostTransfers([(1, 1), (2, 2), (5, 3), (4, 4)], [(1, 5), (0, 4)])
    assert kv.take_block_copies() == [(page, 2)]
    assert kv.check_integrity([c]) == BlockCounts(free=0, cached=1, used=4, entries=1)  # b's first block


def test_without_prefix_caching_the_host_tier_is_off():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False, host=HostBlockPool(4))
    assert kv.host is None and kv.take_host_transfers() is None


# --- the bytes ------------------------------------------------------------------------------

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_host_store_round_trips_pages_bytewise(dtype, device):
    """On CUDA through pinned memory and the copy stream, with no synchronization but the test's."""
    pages = [tuple(torch.randn(6, BS, 2, 8, device=device).to(dtype) for _ in "kv") for _ in range(3)]
    before = [tuple(t.clone() for t in pair) for pair in pages]
    store = HostKVStore(pages, 4)
    assert store.host.is_pinned() == (device == "cuda")
    store.run(HostTransfers([(1, 2), (4, 0)], []))
    # block 1 is overwritten by a load of slot 0 (block 4's copy) in the same batch as its offload
    store.run(HostTransfers([(1, 3)], [(0, 1), (2, 5)]))
    if device == "cuda":
        torch.cuda.synchronize()
    for pair, old in zip(pages, before):
        for t, o in zip(pair, old):
            assert torch.equal(t[1].view(torch.uint8), o[4].view(torch.uint8))
            assert torch.equal(t[5].view(torch.uint8), o[1].view(torch.uint8))
            assert torch.equal(t[0].view(torch.uint8), o[0].view(torch.uint8))
    assert torch.equal(store.host[3], store.host[2])  # both hold the old block 1
    assert HostKVStore.slots_for(1.0, 2**20) == 1024


# --- the real SmolLM2 -------------------------------------------------------------------------

CHUNK = 64


def run(core, requests):
    out = {}
    for req in requests:
        core.add_request(req)
    while core.has_work():
        for frame in core.step():
            entry = out.setdefault(frame.request_id, {"tokens": [], "cached": 0})
            entry["tokens"] += frame.token_ids
            entry["cached"] = frame.num_cached_tokens
        core.check_integrity()
    assert core.check_integrity().used == 0
    return out


def greedy(rid, prompt, max_tokens=8):
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


@pytest.fixture(scope="module")
def smollm2_core(smollm2):
    model, config = smollm2

    def make(**overrides):
        settings = {"max_num_batched_tokens": CHUNK, "num_kv_blocks": 24, "block_size": 16, **overrides}
        return EngineCore.from_model(EngineConfig(model="smollm2", **settings), model, config)

    return make


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_next_turn_loads_the_evicted_conversation_from_host_memory(smollm2_core, kv_cache_dtype):
    """Turn one of a conversation, then other conversations that evict it from a 24-block pool,
    then turn two: its blocks come back from the host tier, count as cached, and the answer is the
    one a cold engine gives; the pages come back byte for byte. (fp8: a cold engine computes the
    prefix's keys in other chunks, and on some CPUs' BLAS a last-bit difference there rounds to
    another fp8 value and flips a near-tie, so there the bytes alone are compared.)"""
    rng = random.Random(0)
    words = [rng.randrange(300, 12000) for _ in range(300)]
    turn1 = words[:150]
    others = [[rng.randrange(300, 12000) for _ in range(150)] for _ in range(3)]
    core = smollm2_core(host_kv_cache_gib=0.01, kv_cache_dtype=kv_cache_dtype)
    first = run(core, [greedy("t1", turn1)])["t1"]["tokens"]
    turn2 = turn1 + first + words[150:230]
    hashes = block_hashes(turn2, 16)
    reusable = (len(turn1) + len(first) - 1) // 16  # full blocks turn one computed

    def pages() -> list[torch.Tensor]:
        blocks = [core.kv.cached[h] for h in hashes[:reusable]]
        return [cache[blocks].clone() for layer in core.runner.kv_pages for cache in layer]

    stored = pages()
    assert len(stored) == 2 * core.model_config.num_layers and all(page.any() for page in stored)
    for i, other in enumerate(others):
        run(core, [greedy(f"o{i}", other)])
    assert all(h not in core.kv.cached for h in hashes[:reusable])  # evicted from the pool...
    assert all(core.kv.host.get((0, h)) is not None for h in hashes[:reusable])  # ...to host memory
    loaded_before = core.kv.host.num_loaded
    warm = run(core, [greedy("t2", turn2)])["t2"]
    assert warm["cached"] == reusable * 16 and core.kv.host.num_loaded - loaded_before == reusable
    assert all(torch.equal(a, b) for a, b in zip(pages(), stored, strict=True))
    if kv_cache_dtype == "auto":
        cold = run(smollm2_core(kv_cache_dtype=kv_cache_dtype), [greedy("t2", turn2)])["t2"]
        assert cold["cached"] == 0 and warm["tokens"] == cold["tokens"]
    assert core.stats().host_loaded_blocks == core.kv.host.num_loaded


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_soak_with_aborts_and_preemption_keeps_both_pools_whole(smollm2_core, async_scheduling):
    """Many short conversations over a pool too small for them, with aborts mid-prefill and
    mid-decode and preemptions, in the synchronous and the overlapped loop; both pools are checked
    after every step, and every turn that got a host hit answers as a cold engine does."""
    rng = random.Random(1)
    core = smollm2_core(num_kv_blocks=12, host_kv_cache_gib=0.025, max_num_batched_tokens=32,
                        async_scheduling=async_scheduling)
    assert core.kv.host.num_slots < 40  # the host tier evicts too
    histories = {c: [rng.randrange(300, 12000) for _ in range(rng.randrange(20, 60))] for c in range(6)}
    answers: dict[str, tuple[list[int], list[int], int]] = {}
    for round_ in range(4):
        requests = []
        for c, history in histories.items():
            history += [rng.randrange(300, 12000) for _ in range(rng.randrange(5, 30))]
            requests.append(greedy(f"c{c}r{round_}", list(history), max_tokens=rng.randrange(2, 7)))
        for req in requests:
            core.add_request(req)
        out: dict[str, dict] = {}
        steps = 0
        while core.has_work():
            steps += 1
            if steps % 5 == 0:  # abort whatever runs longest
                victim = max(core.requests, key=lambda r: len(core.requests[r][0].output_ids), default=None)
                if victim is not None:
                    core.abort(victim)
            for frame in core.step():
                entry = out.setdefault(frame.request_id, {"tokens": [], "cached": 0, "finish": None})
                entry["tokens"] += frame.token_ids
                entry["cached"] = frame.num_cached_tokens
                entry["finish"] = frame.finish_reason
            core.check_integrity()
            core.check_host_integrity()
        for req in requests:
            got = out.get(req.request_id)
            if got is not None and got["finish"] == "length":
                answers[req.request_id] = (req.prompt_ids, got["tokens"], got["cached"])
                histories[int(req.request_id[1:].split("r")[0])] += got["tokens"]
    assert core.scheduler.num_preemptions > 0 and core.kv.host.num_loaded > 0
    assert core.check_integrity().used == 0
    assert core.check_host_integrity().used == 0
    cold = smollm2_core(num_kv_blocks=64)
    for rid, (prompt, tokens, cached) in answers.items():
        if cached:
            assert run(cold, [greedy(rid, prompt, len(tokens))])[rid]["tokens"] == tokens, rid


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_on_cuda_a_turn_loaded_from_host_answers_as_one_hit_in_the_pool(kv_cache_dtype):
    """bf16 on the H200: an engine whose small pool sends a conversation to the host tier and loads
    it back gives the next turn the same tokens as an engine whose pool kept it (the same KV bytes;
    a cold prefill would compute them in other chunks, with other bf16 roundings)."""
    from engine.models.loader import load_model
    from kernels import load_ops

    model, config = load_model("smollm2-135m", "dummy", "cuda", torch.bfloat16, load_ops("triton"))
    rng = random.Random(0)
    turn1 = [rng.randrange(300, 12000) for _ in range(600)]
    others = [[rng.randrange(300, 12000) for _ in range(600)] for _ in range(4)]
    answers = {}
    for name, blocks, gib in (("host", 80, 0.2), ("pool", 1024, 0.0)):
        core = EngineCore.from_model(EngineConfig(
            model="smollm2-135m", device="cuda", block_size=16, num_kv_blocks=blocks, host_kv_cache_gib=gib,
            max_num_batched_tokens=256, kv_cache_dtype=kv_cache_dtype,
            max_entries_fraction=0.0), model, config)  # entries stay in the pool: full blocks only
        first = run(core, [greedy("t1", turn1, 16)])["t1"]["tokens"]
        for i, other in enumerate(others):
            run(core, [greedy(f"o{i}", other, 16)])
        turn2 = turn1 + first + [rng.randrange(300, 12000) for _ in range(100)]
        answers[name] = run(core, [greedy("t2", turn2, 32)])["t2"]
        if gib:
            assert core.kv.host.num_loaded >= len(turn1) // 16
            core.check_host_integrity()
    assert answers["host"]["cached"] == answers["pool"]["cached"] == (600 + 15) // 16 * 16
    assert answers["host"]["tokens"] == answers["pool"]["tokens"]


# --- the hybrid pool (sliding-window layer groups) -----------------------------------------------

HYBRID = KVLayout(group_windows=(0, 8), layer_group=(1, 0), layer_slot=(0, 0), group_size=1)


def test_hybrid_pool_offloads_each_groups_blocks_and_loads_the_ones_a_hit_needs():
    """Window 8 (two blocks): a hit at 28 tokens needs group 0's 7 blocks and group 1's last two."""
    host = HostBlockPool(32, record_events=True)
    kv = HybridKVCacheManager(16, BS, HYBRID, max_entries=0, host=host, record_events=True)
    prompt = list(range(200, 230))  # 30 tokens: 7 full blocks
    first = make_seq(prompt, "a")
    prefill(kv, first)
    kv.free(first)
    kv.drain_events()
    hashes = block_hashes(prompt, BS)
    other = make_seq(range(500, 560), "b")  # 15 blocks a group: everything of a's is evicted
    assert kv.allocate(other, 32, kv.match_prefix(other)) is not None
    offloads = kv.take_host_transfers().offloads
    assert {host.slot_key[s] for _, s in offloads} == {(0, h) for h in hashes} | {(1, h) for h in hashes}
    kv.free(other)
    again = make_seq(prompt, "c")
    match = kv.match_prefix(again)
    assert match.num_tokens == 28 and match.tables == [[ON_HOST] * 7, [FREED] * 5 + [ON_HOST] * 2]
    new = kv.allocate(again, 2, match)  # the loaded blocks, then a block for tokens 28-29 in each group
    loads = kv.take_host_transfers().loads
    assert [b for _, b in loads] == new[:9]  # group 0's seven, then group 1's two
    assert [host.slot_key[s] for s, _ in loads] == [(0, h) for h in hashes] + [(1, h) for h in hashes[5:7]]
    assert group_tables(again) == [[*new[:7], new[9]], [FREED] * 5 + [*new[7:9], new[10]]]
    assert kv.cached[1][hashes[6]] == new[8] and kv.parent_of[hashes[1]] == hashes[0]
    assert BlockStored(hashes, None) in kv.drain_events()  # group 0's, in the pool again
    assert kv.check_integrity([again]).used == 11 and host.check_integrity().used == 0


@pytest.mark.slow
def test_hybrid_engine_resumes_a_turn_from_host_memory_as_a_cold_run(gemma_tiny):  # noqa: F811 (the fixture)
    """A Gemma-3-shaped model (one global layer, five on a 64-token window): the first turn is
    evicted to host memory by others on a small pool, the second loads every group's blocks it
    needs back and answers as a cold engine."""
    model, config = gemma_tiny
    rng = random.Random(4)
    turn1 = [rng.randrange(2, 512) for _ in range(300)]
    settings = {"model": "gemma3-test", "max_num_batched_tokens": 64, "max_entries_fraction": 0.0}
    core = EngineCore.from_model(EngineConfig(num_kv_blocks=120, host_kv_cache_gib=0.01, **settings), model, config)
    first = run(core, [greedy("t1", turn1)])["t1"]["tokens"]
    for i in range(3):
        run(core, [greedy(f"o{i}", [rng.randrange(2, 512) for _ in range(300)])])
    turn2 = turn1 + first + [rng.randrange(2, 512) for _ in range(40)]
    assert block_hashes(turn2, 16)[0] not in core.kv.cached[0]
    warm = run(core, [greedy("t2", turn2)])["t2"]
    assert warm["cached"] == (300 + 7) // 16 * 16 and core.kv.host.num_loaded > (300 + 7) // 16
    cold = run(EngineCore.from_model(EngineConfig(num_kv_blocks=400, enable_prefix_caching=False, **settings),
                                     model, config), [greedy("t2", turn2)])["t2"]
    assert warm["tokens"] == cold["tokens"]
    core.check_host_integrity()

