"""The hybrid KV cache (engine.kv_groups): layer groups, exact block ids of window groups, prefix
hits every group can serve, and the engine on a sliding-window model end to end."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.config import FULL_ATTENTION, SLIDING_ATTENTION, EngineConfig, ModelConfig
from engine.core import EngineCore
from engine.kv_cache import BlockCounts, PositionEntry, entry_key
from engine.kv_groups import FREED, HybridKVCacheManager, KVLayout, group_tables, kv_layout
from engine.models import build_model
from engine.protocol import EngineStats, GenerateRequest, ProtocolError, SamplingParams
from engine.request import Sequence
from kernels import load_ops

BLOCK = 4
WINDOW = 8  # two blocks
LAYOUT = KVLayout(group_windows=(0, WINDOW), layer_group=(1, 0), layer_slot=(0, 0), group_size=1)


def gemma3_shape(num_layers: int, window: int, **extra) -> ModelConfig:
    layer_types = tuple(FULL_ATTENTION if (i + 1) % 6 == 0 else SLIDING_ATTENTION for i in range(num_layers))
    return ModelConfig(
        name="gemma3-test", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=num_layers,
        num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=8192, architecture="gemma3",
        layer_types=layer_types, sliding_window=window, local_rope_theta=1e4, query_pre_attn_scalar=32,
        eos_token_ids=(1,), tie_word_embeddings=False, **extra,
    )


def test_layout_groups_layers_by_kind():
    gemma = kv_layout(gemma3_shape(18, 512))
    assert gemma.group_windows == (0,) + (512,) * 5 and gemma.group_size == 3
    assert [gemma.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert [gemma.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    assert gemma.layer_group[:5] == (1, 1, 1, 2, 2) and gemma.layer_slot[:5] == (0, 1, 2, 0, 1)
    assert gemma.layer_group[6:11] == (2, 3, 3, 3, 4)
    mistral = ModelConfig(name="m", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=4, num_heads=1,
                          num_kv_heads=1, head_dim=8, max_position_embeddings=64,
                          layer_types=(SLIDING_ATTENTION,) * 4, sliding_window=16)
    assert kv_layout(mistral) == KVLayout((16,), (0,) * 4, (0, 1, 2, 3), 4)
    llama = kv_layout(ModelConfig(name="l", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=3,
                                  num_heads=1, num_kv_heads=1, head_dim=8, max_position_embeddings=64))
    assert llama == KVLayout((0,), (0,) * 3, (0, 1, 2), 3) and not llama.hybrid


def new_seq(tokens: list[int], rid: str = "a", boundaries: tuple[int, ...] = ()) -> Sequence:
    return Sequence(rid, 0, list(tokens), SamplingParams(max_tokens=100), None, list(boundaries), None)


def step(kv: HybridKVCacheManager, seq: Sequence, num_new: int) -> None:
    """What scheduler and runner do for one step of ``seq``: allocate, compute, record."""
    if not seq.block_ids and not seq.num_computed_tokens:
        assert kv.allocate(seq, num_new, kv.match_prefix(seq)) is not None
    else:
        assert kv.allocate(seq, num_new) is not None
    seq.num_computed_tokens += num_new
    kv.cache_computed_blocks(seq)
    kv.check_integrity([seq])


def test_window_group_frees_blocks_that_leave_the_window_with_exact_ids():
    kv = HybridKVCacheManager(16, BLOCK, LAYOUT)
    seq = new_seq(list(range(100, 110)))
    step(kv, seq, 10)  # 10 tokens: 3 blocks per group, nothing out of the window [2, 10) yet
    assert group_tables(seq) == [[0, 1, 2], [3, 4, 5]]
    for token in range(110, 114):  # decode to 14 tokens
        seq.append_token(token)
        step(kv, seq, 1)
    # 11th and 12th tokens fit block 2; the 13th opens block 3 of each group (6 and 7); from 12
    # computed tokens on, block 0 of the window group ([0, 4)) lies before 12 - 8: freed, hashed.
    assert group_tables(seq) == [[0, 1, 2, 6], [FREED, 4, 5, 7]]
    assert list(kv.free_queue)[-1] == 3 and kv.block_hash[3] is not None and kv.cached[1][kv.block_hash[3]] == 3
    for token in range(114, 140):
        seq.append_token(token)
        step(kv, seq, 1)
        held = kv.group_block_counts(seq)
        assert held[1] <= math.ceil(WINDOW / BLOCK) + 1 and held[0] == math.ceil(seq.num_tokens / BLOCK) - (
            seq.num_tokens % BLOCK == 0 and seq.num_computed_tokens < seq.num_tokens)
    assert group_tables(seq)[1][:-3] == [FREED] * (len(group_tables(seq)[1]) - 3)
    kv.free(seq)
    assert kv.check_integrity([]).used == 0


def evict(kv: HybridKVCacheManager, block_id: int) -> None:
    """Evict one free block as an allocation would (least recently used first)."""
    kv.free_queue.move_to_end(block_id, last=False)
    kv._take_free_block()
    kv.ref_cnt[block_id] = 0
    kv.free_queue[block_id] = None


def test_prefix_hit_is_the_longest_every_group_serves():
    kv = HybridKVCacheManager(32, BLOCK, LAYOUT, max_entries=0)  # whole blocks only
    prompt = list(range(200, 230))  # 30 tokens: 7 full blocks
    first = new_seq(prompt)
    step(kv, first, 30)
    full = list(first.block_ids)
    kv.free(first)
    window = [kv.cached[1][h] for h in first.block_hashes]  # blocks before the window went back hashed
    # Every group still holds its blocks' hashes: the hit is the 28 tokens of 7 blocks
    again = new_seq(prompt, "b")
    match = kv.match_prefix(again)
    assert match.num_tokens == 28
    assert match.tables == [full[:7], [FREED] * 5 + window[5:7]]
    # An edit at token 17 (block 4): the full group serves 16 tokens, the window group blocks
    # [2, 4) covering [8, 16)
    edited = prompt[:17] + [999] + prompt[18:]
    assert kv.match_prefix(new_seq(edited, "c")).num_tokens == 16
    # Without the window group's block 3 ([12, 16)), 16 is out; 12 needs window blocks 1 and 2
    evict(kv, window[3])
    assert kv.match_prefix(new_seq(edited, "c")).num_tokens == 12
    evict(kv, window[1])  # and 8 needs block 0 and 1: only 4 (block 0) is left
    assert kv.match_prefix(new_seq(edited, "c")).num_tokens == 4
    kv.check_integrity([])


def test_allocation_of_a_hit_takes_the_cached_blocks_and_fails_cleanly():
    kv = HybridKVCacheManager(12, BLOCK, LAYOUT)
    first = new_seq(list(range(50, 70)))  # 20 tokens: 5 blocks per group
    step(kv, first, 20)
    kv.free(first)
    again = new_seq(list(range(50, 70)) + [7, 8, 9, 10, 11], "b")  # 25 tokens
    match = kv.match_prefix(again)
    assert match.num_tokens == 20
    before = (list(kv.free_queue), list(kv.ref_cnt))
    assert kv.allocate(again, 5 + 40, match) is None  # 12 more blocks a group: more than the pool
    assert (list(kv.free_queue), list(kv.ref_cnt)) == before and again.block_ids == []
    assert kv.allocate(again, 5, match) is not None
    assert again.num_computed_tokens == 20
    # the free queue: never used 10, 11; window blocks 5, 6, 7 (left the window); then the
    # sequence's, tail first: 4 … 0 and 9, 8. The hit takes 0-4 and 8, 9; two new blocks a group.
    assert match.tables == [[0, 1, 2, 3, 4], [FREED] * 3 + [8, 9]]
    assert group_tables(again) == [[0, 1, 2, 3, 4, 10, 11], [FREED] * 3 + [8, 9, 5, 6]]
    kv.check_integrity([again])


def test_boundary_entry_copies_every_groups_page_and_resumes_on_the_window_blocks():
    kv = HybridKVCacheManager(32, BLOCK, LAYOUT)
    a = new_seq(range(100, 122), "a", boundaries=(18,))  # 22 tokens; the boundary is inside page 4
    step(kv, a, 22)
    assert group_tables(a) == [[0, 1, 2, 3, 4, 5], [FREED] * 3 + [9, 10, 11]]
    # page 4 of both groups into the free queue's head (12, 13); then the window group's blocks
    # before 22 - 8 went back, after the entry: it is evicted before them
    assert kv.take_block_copies() == [(4, 12), (10, 13)]
    key = entry_key(a.block_hashes[3], None)
    assert kv.entries.by_block == {12: PositionEntry(key, (116, 117), 12, (13,))}
    assert list(kv.free_queue)[-5:] == [12, 13, 6, 7, 8]
    assert kv.check_integrity([a]) == BlockCounts(free=18, cached=3, used=9, entries=2)

    # b shares 18 tokens: the full group's blocks [0, 16), the window group's [8, 16) (8 is free
    # but hashed) and a copy of the entry's page in each group
    b = new_seq([*range(100, 118), 300, 301, 302, 303], "b")
    match = kv.match_prefix(b)
    assert match == ([[0, 1, 2, 3], [FREED, FREED, 8, 9]], kv.entries[12], 18)
    assert kv.allocate(b, 4, match) == [14, 16, 15, 17]
    assert kv.take_block_copies() == [(12, 14), (13, 15)]
    assert group_tables(b) == [[0, 1, 2, 3, 14, 16], [FREED, FREED, 8, 9, 15, 17]]
    assert b.num_computed_tokens == 18 and list(kv.free_queue)[-2:] == [12, 13]  # the entry, touched
    assert kv.check_integrity([a, b]) == BlockCounts(free=14, cached=2, used=14, entries=2)

    # a ends: its last page (tokens 120, 121) of both groups becomes a second entry, no copy
    kv.free(a)
    assert kv.take_block_copies() == []
    assert kv.entries[5] == PositionEntry(entry_key(a.block_hashes[4], None), (120, 121), 5, (11,))
    assert kv.check_integrity([b]).entries == 4


def freed_with_an_entry_at_18() -> HybridKVCacheManager:
    """A pool where a 22-token sequence with a boundary at 18 ran and was freed (its pages cached)."""
    kv = HybridKVCacheManager(32, BLOCK, LAYOUT)
    a = new_seq(range(100, 122), "a", boundaries=(18,))
    step(kv, a, 22)
    kv.take_block_copies()
    kv.free(a)
    return kv


def test_losing_one_page_drops_the_whole_entry():
    kv = freed_with_an_entry_at_18()
    assert list(kv.entries) == [12, 5]
    evict(kv, 13)  # the window group's page of the first entry: the entry goes, 12 is next
    assert list(kv.entries) == [5] and next(iter(kv.free_queue)) == 12
    again = new_seq([*range(100, 118), 300, 301], "b")
    assert kv.match_prefix(again) == ([[0, 1, 2, 3], [FREED, FREED, 8, 9]], None, 16)
    assert kv.check_integrity([]) == BlockCounts(free=20, cached=10, used=0, entries=2)


def test_an_entry_needs_the_window_blocks_before_it():
    kv = freed_with_an_entry_at_18()
    b = new_seq([*range(100, 118), 300, 301], "b")
    assert kv.match_prefix(b).num_tokens == 18
    evict(kv, 8)  # the window group's [8, 12): 18 needs [10, 18), 16 [8, 16) and 12 [4, 12)
    assert kv.match_prefix(b) == ([[0, 1], [6, 7]], None, 8)
    kv.check_integrity([])


def test_a_hit_with_no_spare_blocks_takes_the_entry_over():
    kv = HybridKVCacheManager(10, BLOCK, LAYOUT)
    a = new_seq(range(100, 110), "a", boundaries=(6,))  # 10 tokens: 3 blocks a group
    step(kv, a, 10)
    assert kv.take_block_copies() == [(1, 6), (4, 7)]
    b = new_seq([*range(100, 106), 200, 201, 202, 203, 204, 205], "b")  # 12 tokens
    match = kv.match_prefix(b)
    assert match.num_tokens == 6 and match.entry == kv.entries[6]
    # 2 blocks a group from a free queue of 4, the entry's 2 pages among them: no room for copies
    assert kv.allocate(b, 6, match) == [6, 8, 7, 9]
    assert kv.take_block_copies() == [] and len(kv.entries) == 0
    assert group_tables(b) == [[0, 6, 8], [3, 7, 9]]
    assert kv.check_integrity([a, b]) == BlockCounts(free=0, cached=0, used=10, entries=0)


# --- the engine on a sliding-window model --------------------------------------------------------

MODEL_WINDOW = 64


@pytest.fixture(scope="module")
def gemma_tiny():
    config = gemma3_shape(6, MODEL_WINDOW)
    torch.manual_seed(0)
    model = build_model(config, load_ops("torch"))
    with torch.no_grad():
        for p in model.parameters():  # peaky: greedy near-ties are unlikely
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.3 * torch.randn_like(p))
    return model, config


def engine(gemma_tiny, **settings) -> EngineCore:
    model, config = gemma_tiny
    settings = {"model": "gemma3-test", "max_num_batched_tokens": 256, "num_kv_blocks": 2048, **settings}
    return EngineCore.from_model(EngineConfig(**settings), model, config)


def run(
    core: EngineCore, prompts: dict[str, list[int]], max_tokens: int = 8,
    boundaries: dict[str, list[int]] | None = None,
) -> dict[str, tuple[list[int], int]]:
    """Greedy tokens and cached prompt tokens of each request; integrity and the window bound
    checked after every step."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, prompt in prompts.items():
        core.add_request(GenerateRequest(rid, prompt, sampling, cache_boundaries=(boundaries or {}).get(rid, [])))
    out: dict[str, list] = {rid: [[], 0] for rid in prompts}
    bound = math.ceil(MODEL_WINDOW / core.kv.block_size) + 1
    while core.has_work():
        for frame in core.step():
            out[frame.request_id][0] += frame.token_ids
            out[frame.request_id][1] = frame.num_cached_tokens
        core.check_integrity()
        for seq in core.scheduler.running:
            assert max(core.kv.group_block_counts(seq)[1:]) <= bound
    return {rid: (tokens, cached) for rid, (tokens, cached) in out.items()}


def test_engine_uses_the_hybrid_pool(gemma_tiny):
    core = engine(gemma_tiny)
    assert isinstance(core.kv, HybridKVCacheManager) and core.kv.windows == (0,) + (MODEL_WINDOW,) * 5
    assert core.kv.entries.cap == 2048 // 4 // 6  # a quarter of the pool, 6 pages an entry
    assert len(core.runner.kv_pages) == 1 and len(core.runner.kv_caches) == 6


def test_stats_count_kv_bytes_per_token_by_group(gemma_tiny):
    core = engine(gemma_tiny)
    stats = EngineStats.from_wire(core.stats().to_wire())
    context, page = core.max_model_len, 2 * 16 * 32 * 4  # a page: 16 tokens of one layer's fp32 K and V
    assert stats.kv_group_windows == [0] + [MODEL_WINDOW] * 5
    full, window = context // 16, MODEL_WINDOW // 16 + 1  # blocks a max_model_len-long sequence holds
    assert stats.kv_bytes_per_token_by_group == [page // 16] + [round(window * page / context)] * 5
    assert stats.kv_tokens_per_gib == 2**30 * context // ((full + 5 * window) * page)
    all_global = 2**30 // (6 * page // 16)  # every layer holding every token
    assert stats.kv_tokens_per_gib > 5 * all_global


def test_repeated_3k_prompt_hits_its_cache_with_the_same_output(gemma_tiny):
    core = engine(gemma_tiny)
    prompt = [random.Random(1).randrange(2, 512) for _ in range(3000)]
    cold = run(core, {"cold": prompt})["cold"]
    warm = run(core, {"warm": prompt})["warm"]
    # every whole block but the one the last token needs, then 7 tokens of the entry the cold
    # run's last page became (it ended at 3007 computed tokens)
    assert cold[1] == 0 and warm[1] == 2999
    assert warm[0] == cold[0]
    assert core.check_integrity().used == 0
    stats = EngineStats.from_wire(core.stats().to_wire())  # /stats of a hybrid pool, as the gateway reads it
    assert stats.num_cached_blocks >= 2992 // core.kv.block_size


def test_resumed_prefill_at_mid_page_boundaries_matches_a_cold_one(gemma_tiny):
    """Exact-position entries in every group, past the window and with prefill chunks smaller than
    it: a prompt sharing a system prompt resumes at its boundary, a second turn right after the
    first turn's last computed token, each with the tokens of a cold prefill."""
    rng = random.Random(5)
    system = [rng.randrange(2, 512) for _ in range(201)]  # 12 blocks and 9 tokens; window 64
    first = system + [rng.randrange(2, 512) for _ in range(150)]
    core = engine(gemma_tiny, max_num_batched_tokens=48)
    out = run(core, {"t1": first}, boundaries={"t1": [201, 351]})["t1"][0]
    assert len(core.kv.entries) == 3  # the two boundaries' pages and t1's last one (358 tokens)
    turn2 = first + out + [rng.randrange(2, 512) for _ in range(30)]
    other = system + [rng.randrange(2, 512) for _ in range(100)]
    warm = run(core, {"turn2": turn2, "other": other})
    assert warm["turn2"][1] == 351 + 7 and warm["other"][1] == 201  # 358 = 22 blocks and 6 tokens
    cold = engine(gemma_tiny, max_num_batched_tokens=48, enable_prefix_caching=False)
    assert warm == {rid: (run(cold, {rid: p})[rid][0], warm[rid][1]) for rid, p in (("turn2", turn2), ("other", other))}
    counts = core.check_integrity()
    assert counts.used == 0 and counts.entries == len(core.kv.entries) * 6


def test_mid_prompt_edit_resumes_where_every_group_can(gemma_tiny):
    core = engine(gemma_tiny)
    prompt = [random.Random(2).randrange(2, 512) for _ in range(2000)]
    run(core, {"a": prompt})
    edited = prompt[:1000] + [3] + prompt[1001:]
    resumed = run(core, {"b": edited})["b"]
    assert resumed[1] == 992  # block 62 (tokens 992-1007) holds the edit
    fresh = run(engine(gemma_tiny), {"b": edited})["b"]
    assert resumed[0] == fresh[0]


def test_soak_integrity_after_every_step_with_preemption(gemma_tiny):
    """Shared prefixes, edits, n > 1, cache boundaries at the shared prefixes' ends and a pool
    small enough to preempt: integrity holds after every step and every run matches its own
    output alone on an ample pool."""
    rng = random.Random(3)
    base = [rng.randrange(2, 512) for _ in range(400)]
    prompts, boundaries = {}, {}
    for i in range(12):
        cut = rng.randrange(50, 400)
        prompts[f"s{i}"] = base[:cut] + [rng.randrange(2, 512) for _ in range(rng.randrange(1, 200))]
        boundaries[f"s{i}"] = [cut]
    small = engine(gemma_tiny, num_kv_blocks=140, max_num_batched_tokens=128)
    together = run(small, prompts, max_tokens=20, boundaries=boundaries)
    assert small.scheduler.num_preemptions > 0
    assert small.check_integrity().used == 0 and len(small.kv.entries) > 0
    alone = engine(gemma_tiny, enable_prefix_caching=False)
    for rid in list(prompts)[:4]:
        assert together[rid][0] == run(alone, {rid: prompts[rid]}, max_tokens=20)[rid][0]


def test_padded_decode_graphs_read_every_groups_tables(gemma_tiny):
    """The decode graphs' static buffers (here run eagerly on the CPU) hold each group's block
    tables and slots: tokens are the eager engine's, past the window too."""
    from engine.cuda_graphs import DecodeGraphs, decode_buckets

    rng = random.Random(4)
    prompts = {f"r{i}": [rng.randrange(2, 512) for _ in range(n)] for i, n in enumerate((5, 60, 130, 300))}
    eager = run(engine(gemma_tiny), prompts, max_tokens=90)
    core = engine(gemma_tiny)
    runner = core.runner
    runner.decode_graphs = DecodeGraphs(
        runner.model, runner.kv_caches, runner.device, runner.block_size, runner.max_blocks_per_seq,
        decode_buckets(core.config.max_num_seqs), capture=False, num_groups=len(runner.layout.group_windows),
    )
    assert run(core, prompts, max_tokens=90) == eager


def test_a_lone_prompt_whose_chunk_outgrows_the_pool_runs_in_smaller_chunks(gemma_tiny):
    """60 blocks of 16 tokens, 128-token chunks: the chunk at 128 needs the window blocks from 64
    to 256 in each of five window groups (60) plus the full group's 16. With nothing else running
    to free blocks, the scheduler halves the chunk instead of waiting forever."""
    prompt = [random.Random(6).randrange(2, 512) for _ in range(300)]
    small = engine(gemma_tiny, num_kv_blocks=60, max_num_batched_tokens=128)
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    small.add_request(GenerateRequest("a", prompt, sampling))
    tokens = []
    for _ in range(100):  # the fixed prompt takes a few dozen steps; a stalled one never ends
        tokens += [t for frame in small.step() for t in frame.token_ids]
        small.check_integrity()
        if not small.has_work():
            break
    assert not small.has_work() and small.scheduler.num_preemptions == 0
    assert tokens == run(engine(gemma_tiny), {"a": prompt})["a"][0]


def test_a_request_longer_than_the_pool_holds_names_the_hybrid_capacity(gemma_tiny):
    """60 blocks: five window groups hold 5 blocks each at any length, the full group the rest,
    35 blocks of 16 tokens (not the 960 tokens of 60 blocks)."""
    small = engine(gemma_tiny, num_kv_blocks=60)
    request = GenerateRequest("a", [5] * 500, SamplingParams(max_tokens=100))
    with pytest.raises(ProtocolError, match=r"\(560 tokens\)"):
        small.check_admissible(request)
    small.check_admissible(GenerateRequest("b", [5] * 500, SamplingParams(max_tokens=60)))
