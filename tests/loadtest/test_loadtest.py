"""loadtest/: the seeded workload, the single-cache ideal, the report, and one real A/B smoke run.

Locust is never imported here (it monkey-patches the process with gevent): the smoke test runs the
A/B runner, which runs Locust in its own process.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from engine.protocol import default_model_path
from gateway.tokenizer import Tokenizer, load_hf_tokenizer
from loadtest import report
from loadtest.records import RecordWriter, RequestRecord, read_records
from loadtest.workload import (
    AGENT,
    CHAT,
    TEMPLATE_TOKENS_PER_MESSAGE,
    WORDS,
    TokenRange,
    Workload,
    WorkloadConfig,
)

ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("KVGATE_CACHE_DIR", "~/.cache/kvgate")).expanduser()
SMALL = WorkloadConfig(seed=7, system_prompts=3, system_tokens=TokenRange(50, 120), turns=4,
                       user_tokens=TokenRange(10, 40), answer_tokens=TokenRange(3, 9), chat_tokens=TokenRange(5, 15))


def n_words(text: str) -> int:
    return len(text.split())


# --- workload ---


def test_same_seed_same_workload_other_seed_other_workload():
    a, b = Workload(SMALL), Workload(SMALL)
    for i in range(5):
        assert a.agent(i) == b.agent(i)
        assert a.chat(i) == b.chat(i)
    other = Workload(WorkloadConfig(seed=8, system_prompts=3))
    assert other.agent(0).turns != a.agent(0).turns
    assert Workload(SMALL).agent(0) != Workload(SMALL).agent(1)


def test_workload_is_identical_in_another_process():
    """Locust, the runner and the report rebuild requests in different processes (other hash seeds)."""
    code = ("import json; from loadtest.workload import Workload, WorkloadConfig; "
            "w = Workload(WorkloadConfig(seed=7)); print(json.dumps(w.agent(3).messages(5)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert json.loads(out.stdout) == Workload(WorkloadConfig(seed=7)).agent(3).messages(5)


def test_sizes_stay_in_their_ranges_and_system_prompts_are_shared():
    w = Workload(SMALL)
    systems: dict[int, str] = {}
    for i in range(40):
        conv = w.agent(i)
        assert conv.kind == AGENT and conv.index == i
        assert len(conv.turns) == SMALL.turns
        assert 0 <= conv.system_index < SMALL.system_prompts
        assert SMALL.system_tokens.lo <= n_words(conv.system) <= SMALL.system_tokens.hi
        assert systems.setdefault(conv.system_index, conv.system) == conv.system
        for turn in conv.turns:
            assert SMALL.user_tokens.lo <= n_words(turn.user) <= SMALL.user_tokens.hi
            assert SMALL.answer_tokens.lo <= turn.max_tokens <= SMALL.answer_tokens.hi
            assert n_words(turn.answer) == turn.max_tokens
        chat = w.chat(i)
        assert chat.kind == CHAT and len(chat.turns) == 1
        assert SMALL.chat_tokens.lo <= n_words(chat.turns[0].user) <= SMALL.chat_tokens.hi
        assert systems.setdefault(chat.system_index, chat.system) == chat.system
    assert len(systems) == SMALL.system_prompts  # 80 draws reach every one of the 3
    assert len(set(systems.values())) == SMALL.system_prompts


def test_each_turn_resends_the_history_with_the_previous_answer():
    conv = Workload(SMALL).agent(2)
    first = conv.messages(0)
    assert first == [{"role": "system", "content": conv.system}, {"role": "user", "content": conv.turns[0].user}]
    for t in range(1, SMALL.turns):
        before, now = conv.messages(t - 1), conv.messages(t)
        assert len(now) == 2 * t + 2
        assert now[: len(before)] == before
        assert now[len(before)] == {"role": "assistant", "content": conv.turns[t - 1].answer}
        assert now[-1] == {"role": "user", "content": conv.turns[t].user}
    with pytest.raises(IndexError, match="has 4 turns"):
        conv.messages(SMALL.turns)


def test_pauses_are_exponential_seeded_per_user_and_kind():
    w = Workload(SMALL)
    think = list(itertools.islice(w.pauses("think", 3, 2.0), 4000))
    assert think[:20] == list(itertools.islice(Workload(SMALL).pauses("think", 3, 2.0), 20))  # seeded
    assert think[:20] != list(itertools.islice(w.pauses("think", 4, 2.0), 20))  # per user
    assert think[:20] != list(itertools.islice(w.pauses("conversation", 3, 2.0), 20))  # per kind
    assert min(think) >= 0 and np.mean(think) == pytest.approx(2.0, rel=0.1)
    assert np.median(think) == pytest.approx(2.0 * np.log(2), rel=0.1)  # exponential, not constant
    assert list(itertools.islice(w.pauses("think", 3, 0.0), 3)) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="at least 0"):
        w.pauses("think", 3, -1.0)


def test_arrivals_are_one_seeded_poisson_stream():
    w = Workload(SMALL)
    times = list(itertools.islice(w.arrivals(0.5), 4000))
    assert times[:20] == list(itertools.islice(Workload(SMALL).arrivals(0.5), 20))  # seeded
    assert times[:20] != list(itertools.islice(Workload(WorkloadConfig(seed=8)).arrivals(0.5), 20))
    gaps = np.diff([0.0, *times])
    assert min(gaps) >= 0 and np.mean(gaps) == pytest.approx(2.0, rel=0.1)  # 0.5 per second
    assert np.median(gaps) == pytest.approx(2.0 * np.log(2), rel=0.1)  # exponential gaps: Poisson arrivals
    assert times[:20] != list(itertools.islice(w.arrivals(1.0), 20))
    with pytest.raises(ValueError, match="must be positive"):
        w.arrivals(0.0)


def test_config_round_trips_through_flags_and_json():
    import argparse

    from loadtest.workload import add_workload_arguments

    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    assert WorkloadConfig.from_options(parser.parse_args(SMALL.to_argv())) == SMALL
    assert WorkloadConfig.from_json(json.loads(json.dumps(SMALL.to_json()))) == SMALL
    assert WorkloadConfig.from_options(parser.parse_args([])) == WorkloadConfig()
    for bad in ("0-5", "9-3", "x", "3-"):
        with pytest.raises(ValueError):
            TokenRange.parse(bad)
    with pytest.raises(SystemExit):
        parser.parse_args(["--user-tokens", "9-3"])


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(load_hf_tokenizer(str(default_model_path()), CACHE_DIR))


def test_words_are_tokens_of_the_default_tokenizer(tokenizer: Tokenizer):
    """So N words of the workload are N tokens, and the context bound holds for real prompts."""
    assert len(set(WORDS)) == len(WORDS) == 256
    assert len(tokenizer.encode(" ".join(WORDS), add_special_tokens=False)) == len(WORDS)
    assert all(len(tokenizer.encode(w, add_special_tokens=False)) == 1 for w in WORDS)
    w = Workload(SMALL)
    for i in range(5):
        conv = w.agent(i)
        messages = conv.messages(SMALL.turns - 1)
        tokens = len(tokenizer.chat_prompt(messages).token_ids)
        words = sum(n_words(m["content"]) for m in messages)
        assert words < tokens <= words + TEMPLATE_TOKENS_PER_MESSAGE * (len(messages) + 1)
        assert tokens <= SMALL.max_prompt_tokens()


# --- the single-cache ideal ---


def test_single_cache_ideal_on_a_hand_made_example():
    bs = 4
    a = list(range(1, 11))  # 10 tokens: blocks [1-4] [5-8], 2 tokens left over
    prompts = [
        a,  # cold: 0
        [*range(1, 9), 99, 100, 101],  # shares a's two full blocks: 8
        a,  # itself again: both full blocks, and 2 tokens still computed: 8
        list(range(1, 9)),  # exactly two known blocks: the last one is recomputed (one token at least): 4
        [5, 6, 7, 8, 1, 2, 3, 4],  # a's block contents at other positions: the chain differs: 0
        [*range(1, 9), 99, 100, 101, 102, 7],  # [99..102] became a full block only now: 8
        [*range(1, 9), 99, 100, 101, 102, 8],  # ... and is known from the request before: 12
    ]
    assert report.single_cache_hits(prompts, bs) == [0, 8, 8, 4, 0, 8, 12]
    totals = report.single_cache_ideal(prompts, bs)
    assert totals == (sum(map(len, prompts)), 40)
    assert totals.hit_rate == pytest.approx(40 / 73)
    assert report.single_cache_hits([[1], [1]], bs) == [0, 0]  # no full block, nothing to reuse


# --- records and the summary ---


def record(start: float, turn: int, ttft: float | None, cached: int, prompt: int, ok: bool = True,
           conversation: int = 0, error: str = "", lag: float | None = None) -> RequestRecord:
    return RequestRecord(start=start, kind=AGENT, user=0, conversation=conversation, turn=turn, ok=ok,
                         status=200 if ok else 503, error=error, ttft_ms=ttft, itl_ms=10.0 * (turn + 1) if ok else None,
                         e2e_ms=1000.0, prompt_tokens=prompt if ok else 0, cached_tokens=cached,
                         completion_tokens=5 if ok else 0, token_chunks=5 if ok else 0, start_lag_ms=lag)


def synthetic_records() -> list[RequestRecord]:
    return [
        record(100.0, 0, 400.0, 0, 200, lag=0.0),
        record(101.0, 1, 100.0, 192, 300),
        record(102.0, 2, 200.0, 288, 400),
        record(103.0, 3, 300.0, 0, 500),
        record(104.0, 0, None, 0, 0, ok=False, conversation=1, error="HTTP 503: no engine replica is ready",
               lag=1500.0),
    ]


def test_records_round_trip_through_csv(tmp_path: Path):
    rows = synthetic_records()
    writer = RecordWriter(tmp_path / "r.csv")
    for row in rows:
        writer.write(row)
    writer.close()
    assert read_records(tmp_path / "r.csv") == rows
    (tmp_path / "bad.csv").write_text("start,kind\n1,agent\n")
    with pytest.raises(ValueError, match="missing columns"):
        read_records(tmp_path / "bad.csv")


def test_summary_numbers():
    s = report.summarize(synthetic_records(), report.CacheTotals(1400, 700))
    assert (s["requests"], s["failures"]) == (5, 1)
    assert s["failure_examples"] == ["HTTP 503: no engine replica is ready"]
    ttfts = [400.0, 100.0, 200.0, 300.0]
    assert s["ttft_ms"] == {f"p{p}": pytest.approx(np.percentile(ttfts, p), abs=0.01) for p in (50, 90, 99)}
    assert s["ttft_ms"]["p50"] == 250.0
    assert s["itl_ms"]["p50"] == 25.0
    assert (s["prompt_tokens"], s["cached_tokens"], s["completion_tokens"]) == (1400, 480, 20)
    assert s["hit_rate"] == pytest.approx(480 / 1400, abs=1e-4)
    assert s["ideal_hit_rate"] == 0.5
    assert s["hit_rate_of_ideal"] == pytest.approx(480 / 1400 / 0.5, abs=1e-3)
    assert s["window_s"] == 4.0  # from the first start (100) to the last end (103 + 1 s)
    assert s["requests_per_s"] == 1.0
    assert s["output_tokens_per_s"] == 5.0
    # conversation starts on the arrival clock, failed ones included: 1 of 2 more than a second late
    assert (s["scheduled_starts"], s["late_starts"]) == (2, 1)
    assert s["start_lag_ms"]["p50"] == 750.0


def test_compare_against_round_robin():
    def policy(p50: float, p90: float) -> dict:
        return {"ttft_ms": {"p50": p50, "p90": p90}}

    out = report.compare({"round-robin": policy(1000, 5000), "prefix": policy(250, 500),
                          "least-load": policy(500, None)})
    assert out["vs_round-robin"]["prefix"] == {"ttft_p50_speedup": 4.0, "ttft_p90_speedup": 10.0}
    assert out["vs_round-robin"]["least-load"] == {"ttft_p50_speedup": 2.0, "ttft_p90_speedup": None}
    assert "round-robin" not in out["vs_round-robin"]
    assert report.compare({"prefix": policy(1, 1)}) == {}


class FakePrompt(NamedTuple):
    token_ids: list[int]


class WordTokenizer:
    """One token per word plus one per message (its role): prefix-stable like a chat template."""

    ROLES = {"system": 1000, "user": 1001, "assistant": 1002}

    def chat_prompt(self, messages: list[dict[str, str]]) -> FakePrompt:
        ids = []
        for m in messages:
            ids += [self.ROLES[m["role"]], *(WORDS.index(w) for w in m["content"].split())]
        return FakePrompt(ids)


def test_report_of_a_run_directory(tmp_path: Path):
    """summary.json, the combined CSV and three PNGs from per-policy CSVs; the ideal from the workload."""
    run = {"policies": ["round-robin", "least-load", "prefix"], "engines": 2, "gateways": 1, "users": 2,
           "duration_s": 10, "model": "tiny", "block_size": 4, "tokenizer": "unused", "workload": SMALL.to_json()}
    (tmp_path / "run.json").write_text(json.dumps(run))
    tok = WordTokenizer()
    w = Workload(SMALL)
    sent = {"round-robin": [(0, 0), (1, 0), (0, 1), (1, 1)], "least-load": [(0, 0), (0, 1), (0, 2)]}
    for policy, order in sent.items():
        (tmp_path / policy).mkdir()
        writer = RecordWriter(tmp_path / policy / "requests.csv")
        for i, (conv, turn) in enumerate(order):
            prompt = len(tok.chat_prompt(w.agent(conv).messages(turn)).token_ids)
            writer.write(record(50.0 + i, turn, 100.0 * (i + 1), cached=4 * turn, prompt=prompt, conversation=conv))
        writer.close()
    (tmp_path / "least-load" / "replicas.json").write_text(json.dumps([{"replica": "engine-0", "requests": 3}]))
    cpu = {"cores": 2, "wall_s": 10.0, "engines_s": 6.0, "gateways_s": 1.5, "locust_s": 0.5}
    (tmp_path / "least-load" / "cpu.json").write_text(json.dumps(cpu))

    summary = report.write_report(tmp_path, tokenizer=tok)

    assert list(summary["policies"]) == ["round-robin", "least-load"]  # prefix never ran
    for policy, order in sent.items():
        prompts = [tok.chat_prompt(w.agent(c).messages(t)).token_ids for c, t in order]
        ideal = report.single_cache_ideal(prompts, 4)
        s = summary["policies"][policy]
        assert (s["ideal_prompt_tokens"], s["ideal_cached_tokens"]) == ideal
        assert s["prompt_tokens"] == ideal.prompt_tokens
        assert ideal.cached_tokens > 0  # later turns reuse earlier ones
    assert summary["policies"]["least-load"]["replicas"] == [{"replica": "engine-0", "requests": 3}]
    assert summary["policies"]["least-load"]["cpu"] == {**cpu, "engine_s_per_request": 2.0, "busy_fraction": 0.4}
    assert "cpu" not in summary["policies"]["round-robin"]
    table = report.format_table(summary).splitlines()
    assert table[0].endswith("engine s/req") and table[1].endswith(" -") and table[2].endswith(" 2.00")
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    rows = (tmp_path / "requests.csv").read_text().splitlines()
    assert rows[0].startswith("policy,start,kind") and len(rows) == 1 + 4 + 3
    for name in ("ttft.png", "hit_rate.png", "throughput.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# --- the runner ---


def run_ab(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``python -m loadtest.ab``; on timeout it gets SIGTERM, so it stops every process it started."""
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.ab", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"loadtest.ab ran past {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_runner_refuses_a_policy_the_gateway_lacks(tmp_path: Path):
    result = run_ab(["--out", str(tmp_path / "out"), "--policies", "round-robin,no-such-policy"], timeout=60)
    assert result.returncode == 2
    assert "the gateway does not accept --routing no-such-policy" in result.stderr
    assert not (tmp_path / "out").exists()  # refused before starting anything


def test_runner_refuses_a_negative_pause(tmp_path: Path):
    result = run_ab(["--out", str(tmp_path / "out"), "--conversation-gap", "-5"], timeout=60)
    assert result.returncode == 2 and "--conversation-gap are mean seconds" in result.stderr


def test_runner_refuses_a_rate_with_a_gap(tmp_path: Path):
    result = run_ab(["--out", str(tmp_path / "out"), "--conversation-gap", "5", "--conversation-rate", "1"],
                    timeout=60)
    assert result.returncode == 2 and "not both" in result.stderr
    assert not (tmp_path / "out").exists()


def test_ab_smoke_one_engine_one_user(tmp_path: Path):
    """Locust for 10 s through a gateway to one tiny engine. One user sends one request at a time to
    one engine, so the engine's cache is the single cache: what it reports cached must equal the
    ideal computed from the workload (up to a block per request, for boundary entries the engine may add).
    Conversations arrive at 5 per second, faster than one user serves them: each starts late, by a lag
    its record gives."""
    out = tmp_path / "ab"
    result = run_ab(["--out", str(out), "--engines", "1", "--policies", "least-load", "--users", "1",
                     "--duration", "10", "--stop-timeout", "30", "--system-prompts", "1", "--system-tokens", "150-250",
                     "--turns", "3", "--user-tokens", "40-80", "--answer-tokens", "4-8", "--conversation-rate", "5",
                     "--engine-args", "--num-kv-blocks 512"], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    s = summary["policies"]["least-load"]
    assert s["requests"] >= 3 and s["failures"] == 0, s
    assert s["ttft_ms"]["p50"] > 0 and s["itl_ms"]["p50"] > 0
    assert s["prompt_tokens"] == s["ideal_prompt_tokens"]  # the report tokenizes exactly as the gateway did
    assert s["ideal_cached_tokens"] > 0
    block = summary["run"]["block_size"]
    assert s["ideal_cached_tokens"] <= s["cached_tokens"] <= s["ideal_cached_tokens"] + (block - 1) * s["requests"]
    assert [r["requests"] for r in s["replicas"]] == [s["requests"]]
    cpu = s["cpu"]  # measured over Locust's run, at least the 10 s of load
    assert cpu["wall_s"] >= 10 and cpu["engines_s"] > 0 and cpu["gateways_s"] > 0 and cpu["locust_s"] > 0
    assert cpu["engine_s_per_request"] == round(cpu["engines_s"] / s["requests"], 3)
    records = read_records(out / "least-load" / "requests.csv")
    assert [(r.conversation, r.turn) for r in records][:4] == [(0, 0), (0, 1), (0, 2), (1, 0)][: len(records)]
    firsts = [r for r in records if r.turn == 0]
    assert all(r.start_lag_ms is None for r in records if r.turn > 0)
    assert s["scheduled_starts"] == len(firsts) >= 2
    # Conversations 1, 2, ... arrive 0.08, 0.17, ... s after conversation 0 (the seeded stream), sooner than
    # a 3-turn conversation ends: each is sent late, and sent time minus lag is its arrival on one clock.
    arrivals = list(itertools.islice(Workload(WorkloadConfig()).arrivals(5.0), len(firsts)))
    assert all(r.start_lag_ms > 0 for r in firsts[1:])
    origins = [r.start - r.start_lag_ms / 1e3 - arrivals[r.conversation] for r in firsts]
    assert max(origins[1:]) - min(origins[1:]) < 1e-3
    # The gateway's own request lines, in the same order: the client saw the same usage, and its TTFT
    # clock (started before the gateway's, read after the gateway saw the token) can only be longer.
    lines = [json.loads(x) for x in (out / "least-load" / "gateway-0.log").read_text().splitlines()
             if x.startswith("{")]
    served = [x for x in lines if x.get("event") == "request"]
    assert len(served) == len(records)
    for r, g in zip(records, served):
        assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (
            g["prompt_tokens"], g["cached_tokens"], g["completion_tokens"])
        assert r.ttft_ms >= g["ttft_ms"] - 0.01  # the log rounds to 0.01 ms
    stats = (out / "least-load" / "locust_stats.csv").read_text()
    for metric in ("TTFT,agent", "ITL,agent", "CACHED,agent", "POST,chat/completions [agent]"):
        assert metric in stats
    for name in ("ttft.png", "hit_rate.png", "throughput.png", "requests.csv"):
        assert (out / name).stat().st_size > 0
