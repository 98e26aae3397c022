"""Where the CPU engine's time goes, in-process (SmolLM2-135M's shapes; the box's load recorded).

``matmul``: one decode step's 121 weight matmuls (30 layers x qkv, o, gate/up, down, and the LM
head) at M rows, through each weight layout / matmul path side by side, interleaved round by
round so that machine noise hits all of them; one JSON line per path and M with the median time,
the weight bytes streamed per second, and the ratio to F.linear (fp32 paths must stay HF-exact;
the bf16 and int8 ones change the numbers and are the --dtype / --quantization candidates).

``threads``: those matmuls (fp32 F.linear) with 1 thread, and with 2 whose idle OpenMP workers
spin (libgomp's default) or sleep (``OMP_WAIT_POLICY=PASSIVE``; ``python -m engine`` spins, with a governor).

``steps``: the engine itself (the GGUF, fp32 unless --dtype/--quantization) under torch.profiler:
a decode step at batch 1, 8 and 32 (contexts of --context tokens) and a prefill chunk of
--prefill tokens; one JSON line per step with its wall time, the host's part of a decode step (all
but the model's forward and LM head: scheduler, block tables, inputs, sampler, frames) and the top
ops by self CPU time.

    python benchmarks/cpu_profile.py matmul [--rows 1,8,32] [--rounds 15] [--kernels-from REV]
    python benchmarks/cpu_profile.py threads [--rows 1,8,32] [--rounds 5]
    python benchmarks/cpu_profile.py steps [--batches 1,8,32] [--prefill 512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import DUMMY_CONFIGS
from engine.models import cpu_kernels
from engine.models.cpu import INT4_GROUP, PACK_ROWS, Int4
from loadtest.stamp import emit


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def env() -> dict:
    return {"threads": torch.get_num_threads(), "torch": torch.__version__, "load_avg_1m": load_average()}


def model_weights() -> list[torch.Tensor]:
    """SmolLM2-135M's projection weights ``[out, in]`` (random, fp32) and its tied LM head."""
    c = DUMMY_CONFIGS["smollm2-135m"]
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    shapes = [(qkv, c.hidden_size), (c.num_heads * c.head_dim, c.hidden_size),
              (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) * 0.02 for _ in range(c.num_layers) for shape in shapes]
    return weights + [torch.randn(c.vocab_size, c.hidden_size, generator=gen) * 0.02]


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    return (w / scale[:, None]).round().to(torch.int8), scale


def kernels_at(revision: str) -> cpu_kernels.CpuKernels:
    """kvgate's CPU kernels as ``cpu_kernels.c`` was at a git revision, built beside this tree's."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "cpu_kernels.c"
        source.write_text(subprocess.run(["git", "show", f"{revision}:engine/models/cpu_kernels.c"],
                                         capture_output=True, text=True, check=True).stdout)
        kernels = cpu_kernels.load(source)
    if kernels is None:
        raise SystemExit(f"the CPU kernels of {revision} did not build (see the warning)")
    return kernels


def matmul_paths(weights: list[torch.Tensor], rows: int,
                 base: tuple[str, cpu_kernels.CpuKernels] | None = None) -> dict[str, tuple[Callable, int]]:
    """Path name -> (run all matmuls once, bytes of weights it streams); with ``base`` (a revision and
    its kernels), also kvgate's int8 GEMV as it was there."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    xs_bf16 = {k: v.bfloat16() for k, v in xs.items()}
    fp32_bytes = sum(w.numel() * 4 for w in weights)
    transposed = [w.t().contiguous() for w in weights]
    mkl = [(torch.ops.mkl._mkl_reorder_linear_weight(w, rows), w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, batch_size=PACK_ROWS) for w in weights]
    bf16 = [w.bfloat16() for w in weights]
    int8 = [int8_rows(w) for w in weights]
    int8_bf16 = [(q, s.bfloat16()) for q, s in int8]
    int4 = [Int4(w) for w in weights]
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("kvgate's CPU kernels did not build (see the warning): no C compiler?")
    paths = {
        "fp32 F.linear": (lambda: [F.linear(xs[w.shape[1]], w) for w in weights], fp32_bytes),
        "fp32 x @ Wt": (lambda: [xs[w.shape[0]] @ w for w in transposed], fp32_bytes),
        "fp32 mkl packed": (lambda: [torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, rows) for p, w in mkl],
                            fp32_bytes),
        "fp32 oneDNN packed": (lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                        for w, p in zip(weights, onednn)], fp32_bytes),
        "bf16 F.linear": (lambda: [F.linear(xs_bf16[w.shape[1]], w) for w in bf16], fp32_bytes // 2),
        "int8 _weight_int8pack_mm (bf16 x)": (
            lambda: [torch.ops.aten._weight_int8pack_mm(xs_bf16[q.shape[1]], q, s) for q, s in int8_bf16],
            fp32_bytes // 4),
        "int8 _weight_int8pack_mm (fp32 x)": (
            lambda: [torch.ops.aten._weight_int8pack_mm(xs[q.shape[1]], q, s) for q, s in int8], fp32_bytes // 4),
        "int8 kvgate int8_gemv (fp32 x)": (
            lambda: [kernels.int8_gemv(xs[q.shape[1]], q, s) for q, s in int8], fp32_bytes // 4),
        "int8 widened to fp32 (fp32 x)": (
            lambda: [F.linear(xs[q.shape[1]], q.float()) * s for q, s in int8], fp32_bytes // 4),
        "int8 widened to bf16 (bf16 x)": (
            lambda: [F.linear(xs_bf16[q.shape[1]], q.to(torch.bfloat16)) * s for q, s in int8_bf16], fp32_bytes // 4),
        "int4 _weight_int4pack_mm_for_cpu (bf16 x)": (
            lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs_bf16[m.weight.shape[1] * 2], m.weight, INT4_GROUP,
                                                                 m.scales_and_zeros) for m in int4], fp32_bytes // 8),
        "int4 widened to bf16 (bf16 x)": (
            lambda: [F.linear(xs_bf16[m.weight.shape[1] * 2], m.widened()) for m in int4], fp32_bytes // 8),
    }
    if base is not None:
        revision, base_kernels = base
        paths[f"int8 kvgate int8_gemv at {revision} (fp32 x)"] = (
            lambda: [base_kernels.int8_gemv(xs[q.shape[1]], q, s) for q, s in int8], fp32_bytes // 4)
    return paths


def bench_matmul(args) -> None:
    weights = model_weights()
    base = (args.kernels_from, kernels_at(args.kernels_from)) if args.kernels_from else None
    for rows in args.rows:
        paths = matmul_paths(weights, rows, base)
        if args.paths:
            paths = {name: paths[name] for name in args.paths}
        times: dict[str, list[float]] = {name: [] for name in paths}
        loads = []
        for run, _ in paths.values():
            run()  # first-call costs (packing, allocations)
        for _ in range(args.rounds):
            loads.append(load_average())
            for name, (run, _) in paths.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["fp32 F.linear"])
        for name, (_, nbytes) in paths.items():
            t = statistics.median(times[name])
            emit(bench="cpu_profile", part="matmul", path=name, rows=rows, matmuls=len(weights),
                 median_ms=round(t * 1e3, 2), weight_gb_s=round(nbytes / t / 1e9, 2),
                 speedup_vs_f_linear=round(base / t, 2), rounds=args.rounds,
                 load_avg_1m_min=min(loads), load_avg_1m_max=max(loads), **env())


THREAD_SETTINGS = {
    "1 thread": {"OMP_NUM_THREADS": "1"},
    "2 threads, spinning workers": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"},
    "2 threads, sleeping workers": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
}


def bench_threads(args) -> None:
    """The fp32 F.linear matmuls under each thread setting (OpenMP reads them at start: one child
    process per run), the settings interleaved round by round."""
    times: dict[tuple[str, int], list[float]] = {}
    loads = []
    for _ in range(args.rounds):
        loads.append(load_average())
        for name, settings in THREAD_SETTINGS.items():
            out = subprocess.run(
                [sys.executable, __file__, "matmul", "--rounds", "3", "--paths", "fp32 F.linear",
                 "--rows", ",".join(map(str, args.rows))],
                env={**os.environ, **settings}, capture_output=True, text=True, check=True).stdout
            for line in out.splitlines():
                record = json.loads(line)
                times.setdefault((name, record["rows"]), []).append(record["median_ms"])
    for (name, rows), ms in times.items():
        emit(bench="cpu_profile", part="threads", setting=name, rows=rows, path="fp32 F.linear",
             median_ms=round(statistics.median(ms), 2), runs_ms=ms, load_avg_1m_min=min(loads),
             load_avg_1m_max=max(loads), torch=torch.__version__)


def top_ops(prof, n: int) -> list[dict]:
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return [{"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2),
             "share": round(e.self_cpu_time_total / total, 3)} for e in events[:n]]


def bench_steps(args) -> None:
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.logs import configure_logging
    from engine.protocol import GenerateRequest, SamplingParams, default_model_path

    configure_logging("WARNING")
    config = EngineConfig(model=str(default_model_path()), dtype=args.dtype, quantization=args.quantization,
                          max_num_seqs=max(args.batches), enable_prefix_caching=False)
    core = EngineCore.from_config(config)
    gen = torch.Generator().manual_seed(1)
    counter = iter(range(10**9))

    def submit(batch: int, prompt_len: int, max_tokens: int) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(batch):
            ids = torch.randint(300, 12000, (prompt_len,), generator=gen).tolist()
            core.add_request(GenerateRequest(f"p{next(counter)}", ids, sampling))

    def drain() -> None:
        while core.has_work():
            core.step()

    # the model's own time (forward and LM head): the rest of a step is the host's (scheduler, block
    # tables, inputs, sampler, frames)
    model, in_model = core.runner.model, [0.0]

    def timed(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                in_model[0] += time.perf_counter() - t0
        return run

    model.forward, model.compute_logits = timed(model.forward), timed(model.compute_logits)
    for batch in args.batches:
        submit(batch, args.context, 2 * args.steps + 2)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in core.live_sequences()):
            core.step()  # prefill, unprofiled
        core.step()
        in_model[0], t0 = 0.0, time.perf_counter()
        for _ in range(args.steps):
            core.step()
        wall = (time.perf_counter() - t0) / args.steps
        host = wall - in_model[0] / args.steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                core.step()
        drain()
        emit(bench="cpu_profile", part="decode_step", batch=batch, context=args.context, dtype=args.dtype,
             quantization=args.quantization, step_ms=round(wall * 1e3, 2), host_ms=round(host * 1e3, 2),
             host_share=round(host / wall, 3), profiled_steps=args.steps,
             top_ops=top_ops(prof, args.top), **env())
    submit(1, 16, 1)
    drain()
    submit(1, args.prefill, 1)
    t0 = time.perf_counter()
    drain()
    wall = time.perf_counter() - t0
    submit(1, args.prefill, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        drain()
    emit(bench="cpu_profile", part="prefill", tokens=args.prefill, dtype=args.dtype, quantization=args.quantization,
         step_ms=round(wall * 1e3, 2), tok_s=round(args.prefill / wall, 1), top_ops=top_ops(prof, args.top), **env())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="part", required=True)
    matmul = sub.add_parser("matmul", help="weight layouts and matmul paths side by side")
    matmul.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    matmul.add_argument("--rounds", type=int, default=15)
    steps = sub.add_parser("steps", help="the engine's decode and prefill steps under torch.profiler")
    steps.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    steps.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding sequence")
    steps.add_argument("--steps", type=int, default=10, help="decode steps profiled per batch")
    steps.add_argument("--prefill", type=int, default=512, help="tokens of the profiled prefill chunk")
    steps.add_argument("--top", type=int, default=12)
    steps.add_argument("--dtype", default="auto")
    steps.add_argument("--quantization", default="none")
    matmul.add_argument("--paths", type=lambda s: s.split(";"), default=None, help="only these (';'-separated)")
    matmul.add_argument("--kernels-from", metavar="REV", default=None,
                        help="also time kvgate's int8 GEMV built from cpu_kernels.c at this git revision")
    threads = sub.add_parser("threads", help="thread count and OpenMP wait policy, F.linear matmuls")
    threads.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    threads.add_argument("--rounds", type=int, default=5)
    for p in (matmul, steps):
        p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    {"matmul": bench_matmul, "steps": bench_steps, "threads": bench_threads}[args.part](args)


if __name__ == "__main__":
    main()
