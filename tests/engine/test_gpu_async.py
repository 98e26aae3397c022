"""Overlapped scheduling on CUDA (Triton kernels, captured decode graphs, pinned token copies): the
synchronous loop's tokens, greedy and seeded, with stop tokens, EOS, arrivals, aborts and preemption
under memory pressure. The tiny shape with peaky fp32 weights, so that a batch of another size (a
sequence finished by a stop token rides one step longer) cannot flip a near-tie: any difference is
the mechanism's. Run on the H200 (``pytest -m gpu``); the CPU twin is test_async_scheduling.py."""

from __future__ import annotations

import pytest
import torch
from paged import peaky_tiny
from test_async_scheduling import drive, greedy, mixed_requests, seeded

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.protocol import GenerateRequest
from engine.warmup import warmup

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def tiny_cuda():
    return peaky_tiny(device="cuda", ops="triton", max_position_embeddings=512)


def make_core(tiny_cuda, **settings) -> EngineCore:
    model, config = tiny_cuda
    engine = EngineConfig(model="tiny", device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
                          **settings)
    core = EngineCore.from_model(engine, model, config)
    warmup(core)
    return core


@pytest.fixture(scope="module")
def core(tiny_cuda):
    engine = make_core(tiny_cuda, num_kv_blocks=256)
    assert engine.async_scheduling and engine.runner.decode_graphs is not None  # the CUDA defaults
    return engine


def both(core: EngineCore, requests: dict[int, list]) -> tuple[dict, dict]:
    outs = []
    for mode in (False, True):
        core.async_scheduling = mode
        outs.append(drive(core, requests))
    core.async_scheduling = True
    return outs[0], outs[1]


def test_async_matches_sync_with_graphs_stops_and_arrivals(core):
    core.async_scheduling = False
    probe = drive(core, {0: [GenerateRequest("stop", list(range(60, 66)), greedy(20, ignore_eos=True))]})
    sync, overlapped = both(core, mixed_requests(probe["stop/0"]["tokens"][5]))
    assert overlapped == sync
    assert sync["stop/0"]["finish"] == "stop"


def test_async_aborts_are_masked_on_cuda(core):
    base = {0: [GenerateRequest("keep", list(range(10, 30)), greedy(12, ignore_eos=True)),
                GenerateRequest("gone", list(range(40, 50)), seeded(12, seed=7, ignore_eos=True))]}
    core.async_scheduling = False
    full = drive(core, base)
    sync, overlapped = both(core, {**base, 4: ["gone"]})
    for out in (sync, overlapped):
        assert out["keep/0"] == full["keep/0"] and out["gone/0"]["finish"] == "abort"
        gone = out["gone/0"]["tokens"]
        assert 0 < len(gone) < 12 and gone == full["gone/0"]["tokens"][: len(gone)]


def test_async_preemption_under_memory_pressure_on_cuda(core, tiny_cuda):
    requests = {0: [GenerateRequest(f"p{i}", list(range(20 * i + 5, 20 * i + 60)),
                                    greedy(40, ignore_eos=True) if i % 2 else seeded(40, seed=i, ignore_eos=True))
                    for i in range(6)]}
    core.async_scheduling = False
    ample = drive(core, requests)
    tight = make_core(tiny_cuda, num_kv_blocks=24)  # 384 tokens: six 95-token sequences do not fit
    assert drive(tight, requests) == ample
    assert tight.scheduler.num_preemptions > 0
