"""EngineCore's bookkeeping with a stand-in model runner: requests in, frames out, n > 1, aborts,
finishes and freed blocks, checked after every step. No model runs."""

from __future__ import annotations

import pytest
import torch

from engine.config import DUMMY_CONFIGS, EngineConfig
from engine.core import EngineCore
from engine.model_runner import LaunchedStep
from engine.protocol import GenerateRequest, ProtocolError, SamplingParams
from engine.scheduler import SampledToken, ScheduledSeq

EOS = 2


class CountingRunner:
    """Samples, for every fully computed sequence, its token count plus 1000 (never EOS)."""

    def __init__(self, max_model_len: int = 256):
        self.config = DUMMY_CONFIGS["tiny"]
        self.device, self.dtype, self.max_model_len = torch.device("cpu"), torch.float32, max_model_len
        self.steps: list[list[tuple[str, int, int]]] = []

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pass

    def launch(self, scheduled: list[ScheduledSeq], previous: LaunchedStep | None = None) -> LaunchedStep:
        return LaunchedStep.on_host(self.execute(scheduled), graphed=False)

    def execute(self, scheduled: list[ScheduledSeq]) -> list[SampledToken]:
        self.steps.append([(seq.request_id, seq.index, n) for seq, n in scheduled])
        return [SampledToken(seq, 1000 + seq.num_tokens, None) for seq, n in scheduled
                if seq.num_computed_tokens + n == seq.num_tokens]


def make_core(**settings) -> EngineCore:
    config = EngineConfig(model="tiny", block_size=4, num_kv_blocks=32, max_num_batched_tokens=8, **settings)
    return EngineCore(config, CountingRunner())


def request(rid: str, prompt_len: int, **sampling) -> GenerateRequest:
    return GenerateRequest(rid, list(range(10, 10 + prompt_len)), SamplingParams(**sampling))


def run(core: EngineCore) -> list:
    frames = []
    while core.has_work():
        frames.extend(core.step())
        core.check_integrity()
    return frames


def test_n_siblings_start_from_the_first_ones_prefix_and_the_request_retires_at_the_end():
    core = make_core()
    core.add_request(request("r", 10, n=3, max_tokens=2))
    assert core.stats().num_waiting == 3
    frames = run(core)
    runner = core.runner
    assert runner.steps[:2] == [[("r", 0, 8)], [("r", 0, 2)]]  # chunked prefill of the first sequence
    assert runner.steps[2] == [("r", 0, 1), ("r", 1, 2), ("r", 2, 2)]  # siblings after its 2 full blocks
    by_index = {i: [t for f in frames if f.index == i for t in f.token_ids] for i in range(3)}
    assert by_index == {0: [1010, 1011], 1: [1010, 1011], 2: [1010, 1011]}
    assert [f.finish_reason for f in frames if f.finish_reason] == ["length"] * 3
    assert [f.num_cached_tokens for f in frames if f.finish_reason] == [0, 8, 8]
    assert not core.requests and core.check_integrity().used == 0


def test_abort_ends_running_waiting_and_held_sequences_and_frees_their_blocks():
    core = make_core()
    core.add_request(request("a", 6, max_tokens=50))
    core.add_request(request("b", 12, n=2, max_tokens=50))
    core.step()  # a prefills whole, b's first sequence 2 of 12 tokens
    frames = core.abort("b")
    assert [(f.request_id, f.index, f.finish_reason) for f in frames] == [("b", 0, "abort"), ("b", 1, "abort")]
    assert core.abort("b") == []  # already gone
    assert core.check_integrity().used == 2  # a's two blocks
    frames = core.abort("a")
    assert [(f.index, f.finish_reason, f.token_ids) for f in frames] == [(0, "abort", [])]  # sent in step 1
    assert not core.has_work() and not core.requests and core.check_integrity().used == 0


def test_finish_rules_reach_the_frames():
    core = make_core()
    core.add_request(request("stop", 4, stop_token_ids=[1005], max_tokens=9))
    core.add_request(request("len", 4, max_tokens=3))
    frames = run(core)
    ends = {f.request_id: (f.finish_reason, len(f.token_ids)) for f in frames if f.finish_reason}
    assert ends == {"stop": ("stop", 1), "len": ("length", 1)}
    assert [t for f in frames if f.request_id == "len" for t in f.token_ids] == [1004, 1005, 1006]


def test_a_request_that_cannot_fit_or_repeats_an_id_is_refused():
    core = make_core()
    core.add_request(request("r", 4))
    with pytest.raises(ProtocolError, match="already running"):
        core.add_request(request("r", 4))
    with pytest.raises(ProtocolError, match="context length"):
        core.add_request(request("long", 250, max_tokens=16))
    with pytest.raises(ProtocolError, match="more KV cache"):
        core.add_request(request("big", 100, max_tokens=40))
