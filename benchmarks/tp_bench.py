"""Tensor parallelism: the engine at TP=N against TP=1 in the same run (dummy weights of real shapes).

Prints one JSON line per measurement (``bench`` names it; ``goal``/``met`` where issue 24 sets one):
  device      copy bandwidth of one GPU (bytes read + written): the ceiling of batch-1 decode
  decode_b1   Llama-3-8B shape, batch-1 decode tok/s, TP=1 and TP=N (both with CUDA graphs)
  cont_batch  Llama-3-8B shape, 64 requests x 512 in x 256 out, greedy: output tok/s, TP=1 and TP=N
  big         Llama-3-70B shape (141 GB of bf16 weights: no single H200 holds it) at TP=N: batch-1
              decode tok/s and its fraction of the N GPUs' copy bandwidth (each rank reads its share
              of the weights and KV per token)

    python3 benchmarks/tp_bench.py                      # on a host with >= 2 GPUs (nvidia-h200-x2)
    python3 benchmarks/tp_bench.py --device cpu --model tiny --big-model mini --prompt-len 32 \\
        --new-tokens 16 --batch 4                       # the same code on the CPU (gloo), in seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_bench import Run, Shape, free_cuda, greedy, measure_device, random_prompts
from engine.config import EngineConfig, dummy_config
from engine.core import EngineCore
from engine.logs import configure_logging
from engine.parallel import TensorParallelRanks
from engine.warmup import warmup
from loadtest.stamp import emit

SECTIONS = ("decode_b1", "cont_batch", "big")
DECODE_B1_GOAL = 1.6  # TP=2 over TP=1, issue 24


class Engine:
    """An engine at some tensor-parallel size, warmed up; ``close`` frees it (and its other ranks)."""

    def __init__(self, model: str, device: str, tp: int, **settings):
        config = EngineConfig(model=model, load_format="dummy", device=device, tensor_parallel_size=tp, **settings)
        t0 = time.perf_counter()
        self.ranks = TensorParallelRanks(config) if tp > 1 else None
        self.core = self.ranks.build_core() if self.ranks else EngineCore.from_config(config)
        warmup(self.core)
        self.label = f"tp{tp}"
        emit(bench="engine_start", model=model, engine=self.label, seconds=round(time.perf_counter() - t0, 1),
             kv_blocks=self.core.kv.num_blocks, **settings)

    def close(self) -> None:
        del self.core
        if self.ranks is not None:
            self.ranks.close()
        if torch.cuda.is_available():
            free_cuda()


def decode_b1(engine: Engine, prompt_len: int, new_tokens: int) -> float:
    """Batch-1 decode tok/s: the tokens after the first over the time between first and last."""
    run = Run(engine.core, random_prompts(1, prompt_len, 7, engine.core.model_config.vocab_size),
              [greedy(new_tokens)], "b1-")
    rid = run.ids[0]
    return (new_tokens - 1) / (run.last[rid] - run.first[rid])


def cont_batch(engine: Engine, batch: int, prompt_len: int, new_tokens: int) -> float:
    prompts = random_prompts(batch, prompt_len, 64, engine.core.model_config.vocab_size)
    run = Run(engine.core, prompts, [greedy(new_tokens)] * batch, "cb-")
    return run.output_tokens / run.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--tp", type=int, default=2, help="the tensor-parallel size measured against TP=1 (default: 2)")
    parser.add_argument("--device", default="cuda", help="cuda (rank r on GPU r) or cpu (gloo) (default: cuda)")
    parser.add_argument("--model", default="llama3-8b",
                        help="dummy shape of decode_b1 and cont_batch (default: llama3-8b)")
    parser.add_argument("--big-model", default="llama3-70b", help="dummy shape of big (default: llama3-70b)")
    parser.add_argument("--prompt-len", type=int, default=512, help="cont_batch prompt tokens (default: 512)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per request (default: 256)")
    parser.add_argument("--batch", type=int, default=64, help="cont_batch requests (default: 64)")
    args = parser.parse_args()
    sections = set(args.only.split(","))
    if sections - set(SECTIONS):
        sys.exit(f"unknown sections {sorted(sections - set(SECTIONS))}; choose from {SECTIONS}")
    cuda = args.device != "cpu"
    if cuda and torch.cuda.device_count() < args.tp:
        sys.exit(f"tp_bench needs {args.tp} GPUs, found {torch.cuda.device_count()}")
    configure_logging("INFO")  # the engine's JSON logs go to stderr; stdout holds the measurements
    bandwidth = measure_device()[0] if cuda else None
    settings = dict(max_num_seqs=args.batch, max_num_batched_tokens=8192, max_model_len=2048,
                    **({"gpu_memory_utilization": 0.9} if cuda else {"num_kv_blocks": 1024}))
    prompt_b1 = 128
    if sections & {"decode_b1", "cont_batch"}:
        rates: dict[str, float] = {}
        for tp in (1, args.tp):
            engine = Engine(args.model, args.device, tp, **settings)
            if "decode_b1" in sections:
                rates[engine.label] = rate = decode_b1(engine, prompt_b1, args.new_tokens)
                emit(bench="decode_b1", model=args.model, engine=engine.label, tok_s=round(rate, 1))
            if "cont_batch" in sections:
                rate = cont_batch(engine, args.batch, args.prompt_len, args.new_tokens)
                emit(bench="cont_batch", model=args.model, engine=engine.label, batch=args.batch,
                     prompt_len=args.prompt_len, new_tokens=args.new_tokens, tok_s=round(rate, 1))
            engine.close()
        if "decode_b1" in sections:
            speedup = rates[f"tp{args.tp}"] / rates["tp1"]
            emit(bench="decode_b1_speedup", model=args.model, tp=args.tp, over_tp1=round(speedup, 2),
                 **({"goal": f"TP={args.tp} >= {DECODE_B1_GOAL}x TP=1", "met": speedup >= DECODE_B1_GOAL}
                    if cuda else {}))  # the goal is the GPUs'; the CPU run checks the code path
    if "big" in sections:
        engine = Engine(args.big_model, args.device, args.tp, **settings)
        rate = decode_b1(engine, prompt_b1, args.new_tokens)
        shape = Shape(dummy_config(args.big_model))  # the whole model: the ranks together read all of it
        record = dict(bench="big", model=args.big_model, tp=args.tp, tok_s=round(rate, 1))
        if bandwidth is not None:
            per_token = shape.weight_bytes + (prompt_b1 + args.new_tokens // 2) * shape.kv_bytes_per_token
            record["copy_bandwidth_fraction"] = round(per_token * rate / (args.tp * bandwidth), 3)
        emit(**record)
        engine.close()
    emit(bench="done")


if __name__ == "__main__":
    main()
