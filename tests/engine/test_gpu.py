"""The engine on CUDA — bf16, Triton kernels, decode CUDA graphs, KV sized by a profiling run —
against HF transformers bf16 running on the same dummy weights; and a warmup that leaves nothing
for the first requests to compile. Run on the H200 (``pytest -m gpu``)."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.hf_twin import hf_twin
from engine.config import FULL_ATTENTION, SLIDING_ATTENTION, EngineConfig, ModelConfig
from engine.core import EngineCore
from engine.models import build_model
from engine.protocol import SamplingParams
from engine.warmup import warmup
from kernels import load_ops
from tests.engine.paged import generate, mixed_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODEL = "smollm2-135m"
NUM_PROMPTS, NEW_TOKENS = 20, 64
UTILIZATION = 0.3


def make_core(**settings) -> EngineCore:
    config = EngineConfig(
        model=MODEL, load_format="dummy", device="cuda", max_num_seqs=32, max_num_batched_tokens=1024,
        max_model_len=2048, **settings,
    )
    core = EngineCore.from_config(config)
    warmup(core)
    return core


@pytest.fixture(scope="module")
def graphed():
    torch.cuda.empty_cache()
    core = make_core(gpu_memory_utilization=UTILIZATION, cuda_graph_prefill_tokens=1024)
    yield core
    del core
    torch.cuda.empty_cache()


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, 40000) for _ in range(rng.randint(5, 300))] for _ in range(NUM_PROMPTS)]


@torch.inference_mode()
def agreement_with_hf(core: EngineCore, ps: list[list[int]] | None = None) -> float:
    """Teacher-forced greedy agreement: at each of our tokens, HF's greedy choice given the same
    history (so one near-tie does not derail the rest of a sequence); ``ps`` default: ``prompts()``."""
    ps = ps or prompts()
    outs = generate(core, ps, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    twin = hf_twin(core.runner.model)
    agree = total = 0
    for prompt, out in zip(ps, outs):
        assert len(out) == NEW_TOKENS
        ids = torch.tensor([prompt + out[:-1]], device="cuda")
        predicted = twin(ids).logits[0, len(prompt) - 1 :].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(predicted, out))
        total += len(out)
    return agree / total


def test_kv_cache_sized_by_gpu_memory_utilization(graphed):
    free, total = torch.cuda.mem_get_info()
    kv_bytes = sum(c.numel() * c.element_size() for layer in graphed.runner.kv_caches for c in layer)
    assert graphed.runner.decode_graphs is not None
    # Weights, KV, graphs and the cached activations stay inside the budget (plus graph memory).
    assert total - free <= UTILIZATION * total + 2**30
    assert kv_bytes >= 0.5 * UTILIZATION * total


def test_greedy_tokens_agree_with_hf_with_cuda_graphs(graphed):
    assert agreement_with_hf(graphed) >= 0.95


def test_greedy_tokens_agree_with_hf_eager():
    core = make_core(enforce_eager=True, kv_cache_memory_gb=2.0)
    assert core.runner.decode_graphs is None
    assert agreement_with_hf(core) >= 0.95


def test_prefill_steps_replay_their_pieces(graphed, monkeypatch):
    """Steps with prompt tokens replay the piecewise graphs (max_num_batched_tokens: 1024) and agree with HF."""
    graphs = graphed.runner.prefill_graphs
    assert graphs is not None and graphs.buckets[-1] == 1024 and len(graphs._pieces) == len(graphs.buckets)
    assert all(len(pieces) == graphed.model_config.num_layers + 1 for pieces in graphs._pieces.values())
    sizes = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda ids, *rest: sizes.append(ids.shape[0]) or run(ids, *rest))
    assert agreement_with_hf(graphed, prompts(7)) >= 0.95
    assert sizes and max(sizes) > 16


@torch.inference_mode()
def test_a_mixed_step_in_pieces_matches_the_eager_step():
    """Two decoding sequences and a 300-token prompt in one step: the replayed pieces give the eager
    forward's hidden states (bf16: the padded bucket's GEMMs may tile differently)."""
    core = make_core(kv_cache_memory_gb=1.0, cuda_graph_prefill_tokens=1024)
    scheduled = mixed_step(core, [40, 90], 300, range(300, 40000), seed=9, warm_steps=3)
    assert [n for _, n in scheduled] == [1, 1, 300]
    runner = core.runner
    pieces = runner._run_eager(scheduled)[0].float()
    graphs, runner.prefill_graphs = runner.prefill_graphs, None
    try:
        eager = runner._run_eager(scheduled)[0].float()
    finally:
        runner.prefill_graphs = graphs
    assert graphs.bucket(302) == 320
    torch.testing.assert_close(pieces, eager, rtol=2e-2, atol=2e-2)
    del core


def test_no_triton_compilation_after_warmup(graphed, monkeypatch):
    import triton

    compiled: list[str] = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: compiled.append(kw["repr"]))
    rng = random.Random(3)
    lengths = [1, 2, 15, 16, 17, 100, 333, 1023, 1024, 1500, 2000]
    ps = [[rng.randrange(300, 40000) for _ in range(n)] for n in lengths]
    generate(graphed, ps, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), prefix="len")
    sampled = SamplingParams(max_tokens=8, temperature=0.7, top_k=20, logprobs=3, repetition_penalty=1.2)
    generate(graphed, prompts(4)[:31], sampled, prefix="many")
    assert compiled == []


# A Gemma 3 shape small enough to build twice: 5 sliding layers (48 keys) to a global one.
GEMMA3_TINY = ModelConfig(
    name="gemma3-tiny", vocab_size=2048, hidden_size=128, intermediate_size=256, num_layers=6, num_heads=4,
    num_kv_heads=2, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
    architecture="gemma3", layer_types=(SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,), sliding_window=48,
    local_rope_theta=1e4, query_pre_attn_scalar=64, bos_token_id=2, eos_token_ids=(1,),
    tie_word_embeddings=False,  # tied, random weights only echo the last token
)


def test_sliding_window_model_matches_the_reference_ops_with_cuda_graphs():
    """fp32 Gemma 3 shape on CUDA — the Triton prefill, split-K and fused decode kernels with
    windows, inside CUDA graphs (prefill steps in pieces, six layer groups: five windowed) — picks the torch
    reference ops' greedy tokens on the CPU."""
    torch.manual_seed(0)
    reference_model = build_model(GEMMA3_TINY, load_ops("torch"))
    with torch.no_grad():
        for param in reference_model.parameters():  # peaky: greedy near-ties are unlikely
            param.copy_(1 + 0.1 * torch.randn_like(param) if param.dim() == 1 else 0.3 * torch.randn_like(param))
    cuda_model = build_model(GEMMA3_TINY, load_ops("triton"), "cuda", torch.float32)
    cuda_model.load_state_dict(reference_model.state_dict())
    settings = dict(model="gemma3-tiny", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
                    max_model_len=1024, num_kv_blocks=512)
    rng = random.Random(5)
    ps = [[rng.randrange(3, 2048) for _ in range(n)] for n in (5, 47, 48, 49, 130, 300, 20, 700)]
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = generate(EngineCore.from_model(EngineConfig(**settings), reference_model, GEMMA3_TINY), ps, sampling)
    core = EngineCore.from_model(EngineConfig(device="cuda", cuda_graph_prefill_tokens=64, **settings), cuda_model,
                                 GEMMA3_TINY)
    warmup(core)
    assert core.runner.decode_graphs is not None and core.runner.prefill_graphs.num_groups == 6
    ours = generate(core, ps, sampling)
    assert sum(a == b for a, b in zip(ours, expected)) >= len(ps) - 1, (ours, expected)


def test_speculative_greedy_tokens_agree_with_hf_with_verification_graphs(monkeypatch):
    """Drafts from periodic prompts, verified by the captured 1 + K-query graphs (bf16: compared
    with HF teacher-forced, as the plain engine is)."""
    torch.cuda.empty_cache()
    # A fixed pool: the module's graphed core may still hold its utilization share of the GPU.
    core = make_core(kv_cache_memory_gb=2, speculative="ngram", num_speculative_tokens=4, ngram_min=1)
    graphs = core.runner.verify_graphs
    assert graphs is not None and graphs.query_len == 5
    replays = []
    run_graphs = graphs.run
    monkeypatch.setattr(graphs, "run", lambda seqs: replays.append(len(seqs)) or run_graphs(seqs))
    assert agreement_with_hf(core, periodic_prompts(0)) >= 0.95
    assert len(replays) > 10 and core.stats().spec_num_draft_tokens > 0
    del core
    torch.cuda.empty_cache()


def periodic_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, 40000) for _ in range(rng.randint(2, 12))] * rng.randint(3, 20)
            for _ in range(NUM_PROMPTS)]
