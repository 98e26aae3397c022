"""Piecewise prefill graphs' padded static-buffer path on the CPU (the capture itself is in test_gpu.py):
buckets, a mixed step's hidden states and K/V against the eager step, a sliding-window model's two
layer groups, and the engine's tokens with the pieces."""

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.models import build_model
from engine.prefill_graphs import PrefillGraphs, prefill_buckets
from engine.protocol import SamplingParams
from kernels import load_ops
from tests.engine.paged import clone, generate, mixed_step
from tests.engine.test_kv_groups import gemma3_shape

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_prefill_buckets():
    assert prefill_buckets(16) == [16]
    assert prefill_buckets(40) == [16, 32, 40]
    buckets = prefill_buckets(2048)
    assert buckets[:3] == [16, 32, 48] and buckets[-1] == 2048 and len(buckets) == 40
    assert {256, 288, 512, 576, 1024, 1152} <= set(buckets)
    assert all(b - a <= max(16, a // 8) for a, b in zip(buckets, buckets[1:]))  # at most 1/8 padding past 128


def core_of(model, config, **overrides) -> EngineCore:
    settings = {"max_num_batched_tokens": 40, "num_kv_blocks": 128, "block_size": 4, "max_num_seqs": 6, **overrides}
    return EngineCore.from_model(EngineConfig(model=config.name, **settings), model, config)


def padded(core: EngineCore) -> PrefillGraphs:
    runner = core.runner
    return PrefillGraphs(runner.model, runner.kv_caches, runner.device, prefill_buckets(40),
                         len(runner.layout.group_windows), capture=False)


def gemma3_tiny() -> tuple[torch.nn.Module, object]:
    config = gemma3_shape(6, 8)
    torch.manual_seed(0)
    model = build_model(config, load_ops("torch"))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if param.dim() == 1 else 0.3 * torch.randn_like(param))
    return model, config


@pytest.fixture(params=["llama", "gemma3"])
def model_and_config(request, tiny):
    return tiny if request.param == "llama" else gemma3_tiny()


@torch.inference_mode()
@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8-weights-and-kv"])
def test_a_mixed_step_in_pieces_matches_the_eager_step(model_and_config, fp8):
    """Two decoding sequences and a prompt's chunk (27 tokens in bucket 32: five padding rows): the
    pieces give the eager step's hidden states and K/V, and the padding rows store nothing; with fp8
    weights and an fp8 KV pool too (the scales reach each layer's attention between the pieces)."""
    model, config = model_and_config
    settings = dict(quantization="fp8", kv_cache_dtype="fp8_e4m3") if fp8 else {}
    core = core_of(clone(model) if fp8 else model, config, **settings)
    assert (core.runner.kv_pages[0][0].dtype == torch.float8_e4m3fn) == fp8
    scheduled = mixed_step(core, [5, 13], 25, range(3, 500), seed=0, warm_steps=4)
    assert [n for _, n in scheduled] == [1, 1, 25]
    runner = core.runner
    eager, rows, seqs = runner._run_eager(scheduled)
    caches = [tuple(c.clone() for c in layer) for layer in runner.kv_caches]
    runner.prefill_graphs = graphs = padded(core)
    assert graphs.bucket(27) == 32
    hidden, rows_in_pieces, seqs_in_pieces = runner._run_eager(scheduled)
    assert (rows_in_pieces, seqs_in_pieces) == (rows, seqs)
    torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)
    for layer, before in zip(runner.kv_caches, caches):  # the step's K/V stored again, and nothing else
        for cache, expected in zip(layer, before):
            torch.testing.assert_close(cache.float(), expected.float(), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_the_run_before_each_capture_stores_nothing(model_and_config):
    """The eager run that compiles a bucket's kernels before its capture: one sequence of the bucket's
    tokens, every slot -1."""
    core = core_of(*model_and_config)
    graphs = padded(core)
    graphs._step = (graphs._warmup_metadata(40), 40)
    hidden = graphs._forward(40)
    assert hidden.shape == (40, model_and_config[1].hidden_size) and bool(torch.isfinite(hidden).all())
    assert all(not cache.any() for layer in core.runner.kv_caches for cache in layer)


@torch.inference_mode()
def test_engine_tokens_with_prefill_pieces(model_and_config):
    """Prompts longer than the budget (chunked), joining decodes: the same greedy tokens with the pieces."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 30, 57, 9, 41)]

    def tokens(pieces: bool) -> list[list[int]]:
        core = core_of(*model_and_config)
        if pieces:
            core.runner.prefill_graphs = padded(core)
        return generate(core, prompts, GREEDY)

    assert tokens(pieces=True) == tokens(pieces=False)


def test_cuda_graph_prefill_tokens_setting():
    assert EngineConfig(model="tiny").cuda_graph_prefill_tokens == 2048
    assert EngineConfig(model="tiny", cuda_graph_prefill_tokens=16).cuda_graph_prefill_tokens == 16
    with pytest.raises(ValueError, match="0 \\(off\\) or at least 16"):
        EngineConfig(model="tiny", cuda_graph_prefill_tokens=8)
