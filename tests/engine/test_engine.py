"""EngineCore end to end on the real SmolLM2: HF parity, tiny pools, prefix hits, seeds, aborts."""

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.protocol import GenerateRequest, SamplingParams

MAX_NEW = 12
CHUNK = 64


def make_prompts(n=20, seed=0):
    rng = random.Random(seed)
    lengths = [5, 17, 64, 65, 150, 31, 8, 100, 129, 47, 16, 33, 90, 12, 70, 140, 23, 55, 80, 3][:n]
    # ids from the common-token range of the BPE vocabulary
    return [[rng.randrange(300, 12000) for _ in range(length)] for length in lengths]


def run(core: EngineCore, requests: list[GenerateRequest], check_each_step=True) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for req in requests:
        core.add_request(req)
    while core.has_work():
        for frame in core.step():
            entry = out.setdefault(frame.request_id, {"tokens": [], "cached": 0, "finish": None})
            entry["tokens"] += frame.token_ids
            entry["cached"] = frame.num_cached_tokens
            entry["finish"] = frame.finish_reason
        if check_each_step:
            core.check_integrity()
    assert core.check_integrity().used == 0
    return out


def greedy(prompts, max_tokens=MAX_NEW, prefix="p"):
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [GenerateRequest(f"{prefix}{i}", p, sampling) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def real_engine_factory(smollm2):
    model, config = smollm2

    def make(**overrides):
        settings = {"max_num_batched_tokens": CHUNK, "num_kv_blocks": 512, **overrides}
        return EngineCore.from_model(EngineConfig(model="smollm2", **settings), model, config)

    return make


@pytest.fixture(scope="module")
def hf_greedy(hf_gguf_model):
    results = []
    with torch.inference_mode():
        for prompt in make_prompts():
            ids = torch.tensor([prompt])
            out = hf_gguf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                min_new_tokens=MAX_NEW, pad_token_id=0,
            )
            results.append(out[0, len(prompt):].tolist())
    return results


@pytest.mark.slow
def test_greedy_matches_hf_in_one_mixed_batch(real_engine_factory, hf_greedy):
    prompts = make_prompts()
    assert any(len(p) > CHUNK for p in prompts)  # some prompts span several prefill chunks
    out = run(real_engine_factory(), greedy(prompts))
    ours = [out[f"p{i}"]["tokens"] for i in range(len(prompts))]
    mismatches = [i for i in range(len(prompts)) if ours[i] != hf_greedy[i]]
    assert mismatches == [], [(i, ours[i], hf_greedy[i]) for i in mismatches]


@pytest.mark.slow
def test_tiny_pool_preempts_and_still_matches_ample_pool(real_engine_factory, hf_greedy):
    prompts = make_prompts()
    core = real_engine_factory(num_kv_blocks=14)  # 224 tokens for ~1,400 tokens of demand
    out = run(core, greedy(prompts))
    assert core.scheduler.num_preemptions > 0
    assert [out[f"p{i}"]["tokens"] for i in range(len(prompts))] == hf_greedy
    assert all(out[f"p{i}"]["finish"] == "length" for i in range(len(prompts)))


@pytest.mark.slow
def test_repeated_prompts_hit_the_cache_with_identical_outputs(real_engine_factory):
    prompts = make_prompts()
    core = real_engine_factory(block_size=16)
    cold = run(core, greedy(prompts, prefix="cold"))
    warm = run(core, greedy(prompts, prefix="warm"))
    for i, p in enumerate(prompts):
        assert cold[f"cold{i}"]["cached"] == 0
        # full blocks, then the cold run's last page (kept as an exact-position entry) if it
        # starts inside the prompt: it serves the prompt up to its last token
        computed = len(p) + MAX_NEW - 1
        last_page_start = computed // 16 * 16
        in_prompt = computed % 16 and last_page_start < len(p) - 1
        assert warm[f"warm{i}"]["cached"] == (len(p) - 1 if in_prompt else ((len(p) - 1) // 16) * 16)
        assert warm[f"warm{i}"]["tokens"] == cold[f"cold{i}"]["tokens"]


# --- fast checks on a tiny random model ------------------------------------------------------

def tiny_core(tiny, **overrides):
    model, config = tiny
    settings = {"max_num_batched_tokens": 32, "num_kv_blocks": 64, **overrides}
    return EngineCore.from_model(EngineConfig(model="tiny", **settings), model, config)


def test_seeded_sampling_is_independent_of_batch_composition(tiny):
    sampling = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    target = GenerateRequest("target", list(range(10, 30)), sampling)
    alone = run(tiny_core(tiny), [target])["target"]["tokens"]
    others = [
        GenerateRequest(f"other{i}", list(range(40 + i, 60 + 3 * i)), SamplingParams(max_tokens=6 + i, temperature=0.7))
        for i in range(4)
    ]
    crowded = run(tiny_core(tiny), others[:2] + [GenerateRequest("target", target.prompt_ids, sampling)] + others[2:])
    assert crowded["target"]["tokens"] == alone
    unseeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, ignore_eos=True)
    draws = run(tiny_core(tiny), [GenerateRequest(f"u{i}", target.prompt_ids, unseeded) for i in range(3)])
    assert len({tuple(d["tokens"]) for d in draws.values()}) > 1


def test_stop_token_ids_min_tokens_and_max_tokens(tiny):
    core = tiny_core(tiny)
    probe = run(core, [
        GenerateRequest("probe", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)),
    ])
    tokens = probe["probe"]["tokens"]
    stop_at = tokens[3]
    first = tokens.index(stop_at)
    out = run(core, [
        GenerateRequest("stop", [5, 6, 7],
                        SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True)),
    ])["stop"]
    assert out["finish"] == "stop" and out["tokens"] == tokens[: first + 1]
    out = run(core, [
        GenerateRequest("len", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)),
    ])["len"]
    assert out["finish"] == "length" and out["tokens"] == tokens[:3]


def test_abort_frees_every_block_mid_prefill_and_mid_decode(tiny):
    core = tiny_core(tiny)
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    core.add_request(GenerateRequest("decoding", list(range(10, 40)), long))
    core.add_request(GenerateRequest("prefilling", list(range(50, 300)), long))
    for _ in range(3):
        core.step()
    assert core.check_integrity().used > 0
    frames = core.abort("decoding") + core.abort("prefilling")
    assert {f.finish_reason for f in frames} == {"abort"}
    assert core.check_integrity().used == 0 and not core.has_work()
    assert core.abort("prefilling") == []  # unknown ids are a no-op


def test_n_siblings_wait_for_the_prompt_then_hit_its_cache(tiny):
    core = tiny_core(tiny, block_size=8)
    sampling = SamplingParams(max_tokens=4, temperature=1.0, n=3, seed=5, ignore_eos=True)
    core.add_request(GenerateRequest("fan", list(range(100, 150)), sampling))
    frames = []
    while core.has_work():
        frames += core.step()
    finals = {f.index: f for f in frames if f.finish_reason}
    assert sorted(finals) == [0, 1, 2]
    assert finals[0].num_cached_tokens == 0
    assert finals[1].num_cached_tokens == finals[2].num_cached_tokens == 48
    assert core.check_integrity().used == 0
