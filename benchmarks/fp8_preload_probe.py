"""Batch-1 fp8 decode with fp8_gemv's preload settings varied, on CUDA (issue 23).

``kernels``: each variant's one-row projections (the engine's ops, the rows' quantization
included), a layer's chain of four and the fp8 LM head, as ``kernels_bench.py --only fp8`` times
them (CUDA graphs over 4 rotated Llama-3-8B layers), every variant timed in each of ``--rounds``
rounds so that the spread between rounds shows. ``engine VARIANT``: ``gpu_bench.py --only fp8``
with fp8_gemv set to VARIANT (stamped ``<commit>+VARIANT`` where $KVGATE_COMMIT is set); further
arguments go to gpu_bench.

    python3 benchmarks/fp8_preload_probe.py kernels [--rounds 2]
    python3 benchmarks/fp8_preload_probe.py engine pre32k
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.triton_ops import fp8 as fp8_ops

# name -> (FP8_GEMV_PRELOAD_BYTES, FP8_GEMV_TRIGGER_EARLY, one-row stages of qkv, o and down or None)
VARIANTS = {
    "pre0": (0, False, None),  # main's kernel
    "pre16k": (16384, False, None),
    "pre32k": (32768, False, None),
    "pre64k": (65536, False, None),
    "pre32k_early": (32768, True, None),
    "pre32k_stages6": (32768, False, 6),
}
# The one-row weight shapes of qkv, o and down (gate_up keeps its own tiles).
ONE_ROW_PLAIN_SHAPES = ((1, 6144, 4096), (1, 4096, 4096), (1, 4096, 14336))


def apply(variant: str) -> None:
    """Set fp8_gemv's module settings to ``variant`` for every launch after this."""
    preload_bytes, early, stages = VARIANTS[variant]
    fp8_ops.FP8_GEMV_PRELOAD_BYTES = preload_bytes
    fp8_ops.FP8_GEMV_TRIGGER_EARLY = early
    if stages is not None:
        tiles = fp8_ops.FP8_GEMV_DEFAULT_TILES._replace(num_stages=stages)
        fp8_ops.FP8_GEMV_TILES = {**fp8_ops.FP8_GEMV_TILES, **{shape: tiles for shape in ONE_ROW_PLAIN_SHAPES}}


def probe_kernels(variants: list[str], rounds: int) -> None:
    import kernels_bench as kb
    import torch

    from engine.models.fp8 import quantize_weight
    from kernels import triton_ops
    from loadtest.stamp import emit

    torch.manual_seed(0)
    bandwidth = kb.bench_copy_bandwidth()
    hidden, qkv_width, q_width, inter = kb.GEMV_SHAPES["llama3-8b"]
    bf16 = [kb.LayerWeights.random(hidden, qkv_width, q_width, inter) for _ in range(kb.FP8_LAYERS)]
    fp8 = [{name: quantize_weight(getattr(w, name)) for name in ("qkv", "o", "gate_up", "down")} for w in bf16]
    cases = kb._fp8_projection_cases(bf16, fp8, 1)
    head = quantize_weight(torch.randn(kb.LM_HEAD_ROWS, hidden, dtype=kb.DTYPE, device="cuda") / hidden**0.5)
    x = torch.randn(1, hidden, dtype=kb.DTYPE, device="cuda")
    layer_bytes = sum(fp8[0][name][0].numel() for name in cases)
    saved = (fp8_ops.FP8_GEMV_PRELOAD_BYTES, fp8_ops.FP8_GEMV_TRIGGER_EARLY, fp8_ops.FP8_GEMV_TILES)
    for round_ in range(rounds):
        for variant in variants:
            apply(variant)
            us = {name: kb.graph_us_per_call(fns[1], kb.FP8_LAYERS, kb.FP8_REPLAYS) for name, fns in cases.items()}

            def chain(i: int):
                for fns in cases.values():
                    fns[1](i)

            chain_us = kb.graph_us_per_call(chain, kb.FP8_LAYERS, kb.FP8_REPLAYS)
            head_us = kb.graph_us_per_call(lambda: triton_ops.linear(x, *head), replays=kb.FP8_REPLAYS)
            err = max(kb.max_abs_err(fns[1](0), fns[0](0)) for fns in cases.values())
            emit(bench="fp8_preload_probe", variant=variant, round=round_, rows=1,
                 **{f"{name}_us": round(t, 2) for name, t in us.items()}, layer_chain_us=round(chain_us, 2),
                 layer_chain_of_fp8_roofline=round(layer_bytes / bandwidth * 1e6 / chain_us, 3),
                 lm_head_fp8_us=round(head_us, 2), max_abs_err_vs_bf16=err)
            fp8_ops.FP8_GEMV_PRELOAD_BYTES, fp8_ops.FP8_GEMV_TRIGGER_EARLY, fp8_ops.FP8_GEMV_TILES = saved


def probe_engine(variant: str, gpu_bench_args: list[str]) -> None:
    apply(variant)
    if sha := os.environ.get("KVGATE_COMMIT"):
        os.environ["KVGATE_COMMIT"] = f"{sha}+{variant}"
    sys.argv = ["gpu_bench.py", "--only", "fp8", *gpu_bench_args]
    runpy.run_path(str(Path(__file__).with_name("gpu_bench.py")), run_name="__main__")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--variants", default=",".join(VARIANTS))
    k.add_argument("--rounds", type=int, default=2)
    e = sub.add_parser("engine")
    e.add_argument("variant", choices=tuple(VARIANTS))
    args, rest = parser.parse_known_args()
    if args.mode == "kernels":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        probe_kernels(args.variants.split(","), args.rounds)
    else:
        probe_engine(args.variant, rest)


if __name__ == "__main__":
    main()
