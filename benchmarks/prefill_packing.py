"""Prefill packing on the CPU: first tokens of agent turns that reach one engine at the same moment.

``--turns`` conversations are cached (``--cached-tokens`` each); then each sends its next turn
(``--new-tokens``) at once, and the engine runs until every turn has its first token. Measured with
the CPU default (``--prefill-pack-tokens 256``: a long prompt gets a step of its own) and, as the
peer in the same run, packing up to the whole step budget (the CUDA default; the CPU's before).
Then an offline batch of short prompts both ways, which packing is for. One JSON line per
measurement. Run: .venv/bin/python benchmarks/prefill_packing.py   (mini dummy model, 1 thread:
one engine of the routing A/B)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import CPU_PREFILL_PACK_TOKENS, EngineConfig
from engine.core import EngineCore
from engine.logs import configure_logging
from engine.protocol import GenerateRequest, SamplingParams
from engine.warmup import warmup
from loadtest.stamp import emit

BUDGET = 2048


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 12000) for _ in range(n)]


class Engine:
    def __init__(self, args: argparse.Namespace, pack: int):
        config = EngineConfig(model=args.model, load_format=args.load_format, max_num_batched_tokens=BUDGET,
                              prefill_pack_tokens=pack, kv_cache_memory_gb=2.0)
        self.core = EngineCore.from_config(config)
        warmup(self.core)
        self.runs = 0

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], float]:
        """Seconds to each prompt's first token (in submission order) and to the end of all of them."""
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = []
        for prompt in prompts:
            self.runs += 1
            ids.append(f"r{self.runs}")
            self.core.add_request(GenerateRequest(ids[-1], prompt, sampling))
        first: dict[str, float] = {}
        t0 = time.perf_counter()
        while self.core.has_work():
            for frame in self.core.step():
                if frame.token_ids and frame.request_id not in first:
                    first[frame.request_id] = time.perf_counter() - t0
        return [first[i] for i in ids], time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mini", help="engine --model (default: %(default)s)")
    parser.add_argument("--load-format", default="dummy", help="engine --load-format (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=3, help="turns arriving together (default: %(default)s)")
    parser.add_argument("--cached-tokens", type=int, default=4096, help="(default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=768, help="(default: %(default)s)")
    parser.add_argument("--short-prompts", type=int, default=32, help="offline batch size (default: %(default)s)")
    parser.add_argument("--short-len", type=int, default=48, help="tokens per short prompt (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="(default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configure_logging("WARNING")
    rng = random.Random(0)
    for pack, label in ((CPU_PREFILL_PACK_TOKENS, "ours"), (BUDGET, "peer_pack_whole_budget")):
        engine = Engine(args, pack)
        ttfts, spans = [], []
        for _ in range(args.repeats):
            histories = [tokens(rng, args.cached_tokens) for _ in range(args.turns)]
            engine.run(histories, 1)  # cached, untimed
            firsts, _ = engine.run([h + tokens(rng, args.new_tokens) for h in histories], 1)
            ttfts.append(firsts)
            spans.append(max(firsts))
        mean_ttft = statistics.median(statistics.mean(f) for f in ttfts)
        emit(metric="co_arriving_turns_ttft_s", engine=label, prefill_pack_tokens=pack, turns=args.turns,
             cached_tokens=args.cached_tokens, new_tokens=args.new_tokens, threads=args.threads,
             mean=round(mean_ttft, 4), first=round(statistics.median(f[0] for f in ttfts), 4),
             last=round(statistics.median(spans), 4))
        short = [[tokens(rng, args.short_len) for _ in range(args.short_prompts)] for _ in range(args.repeats)]
        totals = [engine.run(batch, 16)[1] for batch in short]
        emit(metric="short_batch_s", engine=label, prefill_pack_tokens=pack, prompts=args.short_prompts,
             prompt_len=args.short_len, max_tokens=16, threads=args.threads,
             seconds=round(statistics.median(totals), 4))


if __name__ == "__main__":
    main()
