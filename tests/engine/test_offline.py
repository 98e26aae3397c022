"""``python -m engine generate`` as users run it: a process, JSONL on stdin, JSONL on stdout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.protocol import GenerateRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--model", "tiny", "--load-format", "dummy", "--device", "cpu", "--num-kv-blocks", "64", "--cpu-threads", "1"]


def generate(lines: list[str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "generate", *flags], input="\n".join(lines) + "\n",
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_generate_answers_each_line_in_order_and_bad_lines_alone():
    prompt = list(range(300, 340))
    lines = [
        json.dumps({"prompt_ids": prompt, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}),
        "not json",
        json.dumps({"prompt_ids": prompt, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True, "n": 2}),
        json.dumps({"prompt_ids": prompt, "max_tokens": 5000}),
    ]
    done = generate(lines, *FLAGS)
    assert done.returncode == 0, done.stderr
    first, bad, pair, too_long = map(json.loads, done.stdout.splitlines())
    # the same greedy tokens as the engine in process, on the same seeded dummy weights
    core = EngineCore.from_config(EngineConfig(model="tiny", load_format="dummy", device="cpu", num_kv_blocks=64))
    core.add_request(GenerateRequest("r", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
    expected = [t for _ in iter(core.has_work, False) for f in core.step() for t in f.token_ids]
    assert first == {"token_ids": expected, "finish_reason": "length", "num_cached_tokens": 0}
    assert "line 2 is not valid JSON" in bad["error"]["message"]
    assert [o["token_ids"] for o in pair["outputs"]] == [expected[:3]] * 2
    assert "context length" in too_long["error"]["message"]
    (start,) = [json.loads(line) for line in done.stderr.splitlines() if "model_load_start" in line]
    assert start["cpu_threads"] == 1


def test_generate_lines_carry_salt_and_cache_boundaries():
    """A line's salt and cache boundaries reach the engine as the sidecar's request fields do;
    bad ones are that line's error."""
    import io

    from engine.offline import run_offline

    core = EngineCore.from_config(EngineConfig(model="tiny", load_format="dummy", device="cpu", num_kv_blocks=64))
    prompt = list(range(300, 340))
    base = {"prompt_ids": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    lines = [json.dumps(base | extra) for extra in (
        {}, {"salt": "tenant-a", "cache_boundaries": [7, 21]}, {"salt": 3}, {"cache_boundaries": [500]},
    )]
    out = io.StringIO()
    run_offline(core, lines, out)
    plain, hinted, bad_salt, bad_bounds = map(json.loads, out.getvalue().splitlines())
    assert hinted == plain and len(plain["token_ids"]) == 4
    assert bad_salt["error"]["param"] == "salt"
    assert bad_bounds["error"]["param"] == "cache_boundaries"


def test_bad_cpu_threads_exits_2_naming_the_flag():
    done = generate([], *FLAGS[:-1], "0")
    assert done.returncode == 2 and "--cpu-threads must be at least 1" in done.stderr


def test_generate_line_with_prompt_logprobs():
    """Prompt logprobs come with sequence 0, one per prompt token after the first, each with its top k."""
    import io

    from engine.offline import run_offline

    core = EngineCore.from_config(EngineConfig(model="tiny", load_format="dummy", device="cpu", num_kv_blocks=64))
    prompt = list(range(300, 340))
    line = {"prompt_ids": prompt, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True, "prompt_logprobs": 2}
    out = io.StringIO()
    run_offline(core, [json.dumps(line), json.dumps({**line, "n": 2}), json.dumps({**line, "prompt_logprobs": 21})],
                out)
    single, pair, too_many = map(json.loads, out.getvalue().splitlines())
    lps = single["prompt_logprobs"]
    assert len(lps) == len(prompt) - 1 and all(len(lp["top"]) == 2 and lp["rank"] >= 1 for lp in lps)
    assert all(lp["top"][0][1] >= lp["logprob"] for lp in lps)
    assert all((lp["rank"] == 1) == (lp["logprob"] == lp["top"][0][1]) for lp in lps)
    assert pair["outputs"][0]["prompt_logprobs"] == lps and "prompt_logprobs" not in pair["outputs"][1]
    assert too_many["error"]["param"] == "prompt_logprobs"
