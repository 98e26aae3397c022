"""Overlapped (asynchronous) scheduling gives the synchronous loop's tokens: greedy and seeded, with
stop tokens, EOS, max_tokens, requests arriving mid-run, aborts, preemption under memory pressure,
and the steps that must wait for their tokens (grammar, penalties, min_tokens, speculation).

On the CPU the same mechanism runs (device tokens carried into the next step's inputs, the next
step planned before the previous one is recorded), through the eager varlen path and through the
padded decode-graph buffers; test_gpu.py runs it with captured graphs on the H200."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.cuda_graphs import DecodeGraphs, decode_buckets
from engine.protocol import GenerateRequest, SamplingParams, StructuredOutput

BLOCK = 4


def make_core(tiny, async_scheduling: bool, graphs: bool = False, **overrides) -> EngineCore:
    model, config = tiny
    settings = {"max_num_batched_tokens": 32, "num_kv_blocks": 128, "block_size": BLOCK, "max_num_seqs": 6,
                "async_scheduling": async_scheduling, **overrides}
    core = EngineCore.from_model(EngineConfig(model="tiny", **settings), model, config)
    if graphs:  # the decode graphs' padded static buffers, run eagerly (no capture on the CPU)
        runner = core.runner
        runner.decode_graphs = DecodeGraphs(
            runner.model, runner.kv_caches, runner.device, runner.block_size, runner.max_blocks_per_seq,
            decode_buckets(core.config.max_num_seqs), capture=False,
        )
    return core


def drive(core: EngineCore, schedule: dict[int, list]) -> dict[str, dict]:
    """Step ``core`` until idle; before step ``k`` submit the requests (or abort the ids) of
    ``schedule[k]``. Returns each request's streamed tokens and finish reason, and checks that no
    frame follows a request's last one and that every block comes back."""
    out: dict[str, dict] = {}
    k = 0
    while core.has_work() or any(j >= k for j in schedule):
        for item in schedule.get(k, []):
            frames = core.abort(item) if isinstance(item, str) else core.add_request(item) or []
            collect(out, frames)
        collect(out, core.step())
        k += 1
    assert core.check_integrity().used == 0
    return out


def collect(out: dict[str, dict], frames) -> None:
    for f in frames:
        entry = out.setdefault(f"{f.request_id}/{f.index}", {"tokens": [], "finish": None})
        assert entry["finish"] is None, f"a frame after {f.request_id}'s last one"
        entry["tokens"] += f.token_ids
        entry["finish"] = f.finish_reason


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


def seeded(max_tokens: int, seed: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, top_k=40, seed=seed, **extra)


def mixed_requests(stop_token: int) -> dict[int, list]:
    """Greedy and seeded requests of different lengths, one stopping on ``stop_token``, one on EOS
    (the tiny model's EOS comes up in its greedy output), others arriving while the first decode."""
    return {
        0: [GenerateRequest("g1", list(range(10, 30)), greedy(12, ignore_eos=True)),
            GenerateRequest("s1", list(range(40, 47)), seeded(9, seed=3, ignore_eos=True)),
            GenerateRequest("stop", list(range(60, 66)), greedy(20, stop_token_ids=[stop_token], ignore_eos=True))],
        3: [GenerateRequest("late", list(range(100, 170)), greedy(6, ignore_eos=True)),  # a chunked prefill
            GenerateRequest("eos", list(range(200, 205)), greedy(30))],
        5: [GenerateRequest("n2", list(range(300, 309)), seeded(5, seed=11, n=2, ignore_eos=True))],
    }


def stop_token_of(tiny) -> int:
    probe = drive(make_core(tiny, False), {0: [GenerateRequest("stop", list(range(60, 66)),
                                                               greedy(20, ignore_eos=True))]})
    return probe["stop/0"]["tokens"][5]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode_graph_buffers"])
def test_async_matches_sync_greedy_and_seeded_with_stops_and_arrivals(tiny, graphs):
    requests = mixed_requests(stop_token_of(tiny))
    sync = drive(make_core(tiny, False, graphs), requests)
    core = make_core(tiny, True, graphs)
    overlapped = drive(core, requests)
    assert overlapped == sync
    assert sync["stop/0"]["finish"] == "stop" and len(sync["stop/0"]["tokens"]) < 20
    assert {v["finish"] for v in sync.values()} >= {"length", "stop"}
    assert sorted(sync) == ["eos/0", "g1/0", "late/0", "n2/0", "n2/1", "s1/0", "stop/0"]


def test_a_decode_step_stays_in_flight_while_the_next_is_planned(tiny):
    core = make_core(tiny, True)
    core.add_request(GenerateRequest("a", list(range(10, 20)), greedy(5, ignore_eos=True)))
    assert core.step() == []  # the prefill: its token is still on its way
    assert core._in_flight is not None
    frames = core.step()  # plans and queues the first decode, then records the prefill's token
    assert [len(f.token_ids) for f in frames] == [1] and core._in_flight is not None
    tokens = frames[0].token_ids
    while core.has_work():
        tokens += [t for f in core.step() for t in f.token_ids]
    assert len(tokens) == 5 and core._in_flight is None


def test_the_last_token_by_length_is_not_planned_again(tiny):
    """A sequence whose pending token reaches max_tokens is not scheduled once more: the async
    steps are the sync steps."""
    requests = {0: [GenerateRequest(f"r{i}", list(range(10 + i, 20 + 2 * i)), greedy(3 + i, ignore_eos=True))
                    for i in range(4)]}
    steps = {mode: traced_steps(make_core(tiny, mode), requests) for mode in (False, True)}
    assert steps[True] == steps[False]


def traced_steps(core: EngineCore, requests: dict[int, list]) -> list[list[tuple[str, int]]]:
    """Each launched step's (request id, new tokens), running ``requests`` through ``core``."""
    launched = []
    launch = core.runner.launch

    def traced(scheduled, previous=None):
        launched.append(sorted((s.request_id, n) for s, n in scheduled))
        return launch(scheduled, previous)

    core.runner.launch = traced
    drive(core, requests)
    return launched


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode_graph_buffers"])
def test_aborts_while_a_step_is_in_flight_are_masked(tiny, graphs):
    base = {0: [GenerateRequest("keep", list(range(10, 30)), greedy(12, ignore_eos=True)),
                GenerateRequest("gone", list(range(40, 50)), greedy(12, ignore_eos=True)),
                GenerateRequest("prefilling", list(range(60, 160)), greedy(12, ignore_eos=True))]}
    full = drive(make_core(tiny, False, graphs), base)
    for mode in (False, True):
        out = drive(make_core(tiny, mode, graphs), {**base, 4: ["gone"], 1: ["prefilling"]})
        assert out["keep/0"] == full["keep/0"]
        assert out["gone/0"]["finish"] == out["prefilling/0"]["finish"] == "abort"
        gone = out["gone/0"]["tokens"]
        assert 0 < len(gone) < 12 and gone == full["gone/0"]["tokens"][: len(gone)]


def test_preemption_under_memory_pressure_gives_the_ample_pool_tokens(tiny):
    requests = {0: [GenerateRequest(f"p{i}", list(range(20 * i + 5, 20 * i + 25)),
                                    (greedy(24, ignore_eos=True) if i % 2 else seeded(24, seed=i, ignore_eos=True)))
                    for i in range(4)]}
    ample = drive(make_core(tiny, False), requests)
    tight = make_core(tiny, True, num_kv_blocks=30)  # 120 tokens: four 44-token sequences do not fit
    assert drive(tight, requests) == ample
    assert tight.scheduler.num_preemptions > 0


def test_steps_that_need_their_tokens_on_the_host_wait_and_match(tiny):
    """Penalties and min_tokens read the output; such a step is recorded before the next is planned."""
    requests = {0: [
        GenerateRequest("pen", list(range(10, 20)), seeded(10, seed=1, repetition_penalty=1.3, frequency_penalty=0.5)),
        GenerateRequest("min", list(range(30, 40)), greedy(10, min_tokens=8)),
        GenerateRequest("plain", list(range(50, 60)), greedy(10, ignore_eos=True)),
        GenerateRequest("lp", list(range(70, 80)), seeded(6, seed=2, logprobs=2, ignore_eos=True)),
    ]}
    sync = drive(make_core(tiny, False), requests)
    core = make_core(tiny, True)
    core.add_request(requests[0][0])
    core.step()
    assert core._in_flight is None  # the penalized sequence's step was recorded at once
    assert drive(make_core(tiny, True), requests) == sync


def test_structured_output_waits_for_each_token_and_matches(tiny):
    from test_structured import synthetic_tokenizer_info

    model, config = tiny
    info = synthetic_tokenizer_info(config.vocab_size, config.eos_token_ids[0])
    spec = StructuredOutput("regex", "[a-z]{3,8}")
    requests = {0: [GenerateRequest("re", list(range(10, 20)), greedy(10, structured=spec)),
                    GenerateRequest("plain", list(range(30, 40)), greedy(10, ignore_eos=True))]}
    outs = []
    for mode in (False, True):
        settings = EngineConfig(model="tiny", max_num_batched_tokens=32, num_kv_blocks=128, block_size=BLOCK,
                                async_scheduling=mode)
        outs.append(drive(EngineCore.from_model(settings, model, config, info), requests))
    assert outs[0] == outs[1] and outs[0]["re/0"]["finish"] == "stop"


def test_speculative_decoding_falls_back_to_the_synchronous_loop(tiny):
    repetitive = [5, 6, 7, 8] * 6
    requests = {0: [GenerateRequest("spec", repetitive, greedy(16, ignore_eos=True)),
                    GenerateRequest("other", list(range(40, 50)), seeded(8, seed=4, ignore_eos=True))]}
    outs = [drive(make_core(tiny, mode, speculative="ngram", num_speculative_tokens=3), requests)
            for mode in (False, True)]
    assert outs[0] == outs[1]
