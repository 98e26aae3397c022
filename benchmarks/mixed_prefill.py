"""The mixed-prefill budget in the seed system's scenario: 2 requests decoding, then 2 prompts of 4K
tokens arriving together; the 4K prompts' TTFT against the decoders' progress while they prefill.

For each target (``--mixed-prefill-step-latency-ms``; 0 = off, the whole 8192-token step budget) on
one engine (Llama-3-8B shape, dummy bf16 weights, overlapped scheduling), the scenario runs twice:
``run`` 0 starts the budget from scratch, ``run`` 1 with the fit the first one left. Each prints one
JSON line: the prompts' TTFT (from their arrival), and over the interval from their arrival to the
last one's first token the decoders' tokens ("decode rounds"), their longest gap between tokens and
the steps the engine ran; then the budget, its fit and the eager steps' (tokens, ms) it was fed.
The peer of each target is target 0, in the same run.

    python3 benchmarks/mixed_prefill.py [--targets 0,50,100,250] [--model llama3-8b]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.logs import configure_logging
from engine.mixed_budget import MixedPrefillBudget
from engine.protocol import GenerateRequest, SamplingParams
from engine.warmup import warmup
from loadtest.stamp import emit

STEP_BUDGET = 8192
PROMPT_LEN = 4096


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 12000) for _ in range(n)]


def scenario(core: EngineCore, tag: str, rng: random.Random) -> dict:
    decode = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    decoders = [f"{tag}-dec{i}" for i in range(2)]
    for rid in decoders:
        core.add_request(GenerateRequest(rid, prompt(rng, 64), decode))
    tokens = {rid: 0 for rid in decoders}
    while min(tokens.values()) < 4:
        for frame in core.step():
            tokens[frame.request_id] += len(frame.token_ids)
    longs = [f"{tag}-long{i}" for i in range(2)]
    arrived = time.perf_counter()
    for rid in longs:
        core.add_request(GenerateRequest(rid, prompt(rng, PROMPT_LEN), SamplingParams(max_tokens=4, temperature=0.0,
                                                                                      ignore_eos=True)))
    first: dict[str, float] = {}
    last_token = {rid: arrived for rid in decoders}
    gaps = {rid: 0.0 for rid in decoders}
    rounds = {rid: 0 for rid in decoders}
    steps = 0
    while len(first) < len(longs):
        frames = core.step()
        steps += 1
        now = time.perf_counter()
        for frame in frames:
            if frame.request_id in last_token and frame.token_ids:
                gaps[frame.request_id] = max(gaps[frame.request_id], now - last_token[frame.request_id])
                last_token[frame.request_id] = now
                rounds[frame.request_id] += len(frame.token_ids)
            elif frame.request_id in longs and frame.token_ids:
                first.setdefault(frame.request_id, now - arrived)
    for rid in decoders + longs:
        core.abort(rid)
    while core.has_work():
        core.step()
    return dict(
        ttft_ms=[round(first[r] * 1e3, 1) for r in longs],
        decode_rounds=[rounds[r] for r in decoders],
        decoder_max_gap_ms=round(max(gaps.values()) * 1e3, 1),
        steps=steps,
        interval_ms=round(max(first.values()) * 1e3, 1),
    )


def record_eager_samples(budget: MixedPrefillBudget) -> list[tuple[int, float]]:
    """From now on, the (tokens, ms) of each eager step ``budget`` observes."""
    samples: list[tuple[int, float]] = []
    observe = MixedPrefillBudget.observe.__get__(budget)

    def recorded(tokens: int, elapsed_s: float, graphed: bool) -> None:
        if not graphed:
            samples.append((tokens, round(elapsed_s * 1e3, 2)))
        observe(tokens, elapsed_s, graphed)

    budget.observe = recorded
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="0,50,100,250", help="comma-separated step latency targets, ms (0: off)")
    parser.add_argument("--model", default="llama3-8b", help="dummy shape (default: llama3-8b)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("mixed_prefill needs a CUDA device")
    configure_logging("WARNING")
    config = EngineConfig(model=args.model, load_format="dummy", device="cuda", max_num_seqs=64,
                          max_num_batched_tokens=STEP_BUDGET, max_model_len=8192, gpu_memory_utilization=0.9)
    core = EngineCore.from_config(config)
    warmup(core)
    rng = random.Random(0)
    for target in (float(t) for t in args.targets.split(",")):
        budget = MixedPrefillBudget(target / 1e3, STEP_BUDGET) if target else None
        core.scheduler.mixed_budget = budget
        for run in range(2):
            samples = record_eager_samples(budget) if budget is not None else []
            result = scenario(core, f"t{target:g}r{run}", rng)
            line = budget.eager.line() if budget else None
            emit(bench="mixed_prefill", model=args.model, target_ms=target, run=run, prompts=f"2 x {PROMPT_LEN}",
                 decoders=2, async_scheduling=core.async_scheduling, **result,
                 budget=budget.budget if budget else STEP_BUDGET,
                 fit_fixed_ms=round(line.fixed_s * 1e3, 3) if line else None,
                 fit_per_token_us=round(line.per_token_s * 1e6, 3) if line else None,
                 eager_samples_tokens_ms=samples)


if __name__ == "__main__":
    main()
