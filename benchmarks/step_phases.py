"""Where an engine step's time goes, on the host and on the device (dummy weights of real shapes).

  b1      one request decoding at batch 1 (overlapped scheduling, the CUDA default): tok/s and the graph
          replay alone (as gpu_bench's decode_b1), then the host's milliseconds per step in each phase (timers
          around the core's, scheduler's and runner's methods), then the device's timeline of a decode step
          from events: its input copies and scatter, the graph replay, the token copy back, and the idle
          time until the next step's first op (the host was late)
  eager   host time (unprofiled, then under cProfile) of the steps with prompt tokens: a lone 128-token prefill, a
          512-token prefill joining 64 decoding sequences; then of graphed decode steps at 64 for comparison; on an
          engine per ``--prefill-graphs`` value (--cuda-graph-prefill-tokens: 0 runs them eagerly, the peer)
  served  the sidecar (the app of ``python -m engine serve``, its engine in its own process) at batch B
          for R runs of B x 128-token prompts x 512 new tokens, each run after a batch-1 run as gpu_bench's
          served section does; the engine process's core is instrumented and writes one record per run:
          milliseconds per step in each phase, the time between steps, garbage collections by generation
          and their time, the sizes of the structures that live across runs, how long the requests took
          to arrive, Triton compilations, and the slowest steps (with their sequences and prompt tokens:
          an eager mixed step stalls every decoding stream). ``--gc``: the engine
          process's garbage collector as is (on), disabled (off) or with the objects that exist at
          start frozen out of it (freeze)

The timers cost a few microseconds per call: read the phases against each other and the untimed tok/s.

    python3 benchmarks/step_phases.py b1 [--model smollm2-135m] [--tokens 256] [--device cpu]
    python3 benchmarks/step_phases.py eager [--model smollm2-135m] [--prefill-graphs 0,2048] [--device cpu]
    python3 benchmarks/step_phases.py served [--batch 64] [--runs 3] [--gc on,off,freeze] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import gc
import json
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_bench import (
    Run,
    Sidecar,
    decode_tok_s,
    greedy,
    make_engine,
    ours_decode_b1,
    random_prompts,
    served_run,
    step_ms,
)
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.logs import configure_logging
from engine.protocol import GenerateRequest
from loadtest.stamp import emit

GC_MODES = ("on", "off", "freeze")
MAX_MODEL_LEN = {"smollm2-135m": 2048, "llama3-8b": 8192, "tiny": 512}


class Phases:
    """Seconds and calls by phase, and the garbage collector's collections while timing."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.seconds[f"gc{info['generation']}"] += time.perf_counter() - self._gc_start
            self.calls[f"gc{info['generation']}"] += 1

    def timed(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return wrapper

    def per_step_ms(self, steps: int) -> dict[str, float]:
        return {k: round(v / max(steps, 1) * 1e3, 4) for k, v in sorted(self.seconds.items())}

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class Timeline:
    """Device events around each decode-graph step while ``on``: inputs (before its copies), replay_start,
    replay_end, done (after the token copy back)."""

    def __init__(self) -> None:
        self.on = False
        self.steps: list[dict[str, torch.cuda.Event]] = []

    def mark(self, name: str) -> None:
        if not self.on:
            return
        if name == "inputs":
            self.steps.append({})
        elif not self.steps or name in self.steps[-1] or (name == "done" and "replay_end" not in self.steps[-1]):
            return  # a step without a graph replay
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.steps[-1][name] = event

    def summary(self) -> dict[str, float]:
        """Microseconds per decode step between the events (median over steps)."""
        torch.cuda.synchronize()
        rows = [e for e in self.steps if len(e) == 4]
        parts = collections.defaultdict(list)
        for this, following in zip(rows, rows[1:]):
            parts["inputs_us"].append(this["inputs"].elapsed_time(this["replay_start"]) * 1e3)
            parts["replay_us"].append(this["replay_start"].elapsed_time(this["replay_end"]) * 1e3)
            parts["token_copy_us"].append(this["replay_end"].elapsed_time(this["done"]) * 1e3)
            parts["until_next_us"].append(this["done"].elapsed_time(following["inputs"]) * 1e3)
            parts["step_us"].append(this["inputs"].elapsed_time(following["inputs"]) * 1e3)
        return {k: round(sorted(v)[len(v) // 2], 2) for k, v in parts.items()} | {"steps": len(rows) - 1}


class _TimedReplay:
    """A captured graph whose replay is timed (host) and bracketed by the timeline's events."""

    def __init__(self, graph: torch.cuda.CUDAGraph, phases: Phases, timeline: Timeline):
        self.graph, self.replay_call, self.timeline = graph, phases.timed("replay_call", graph.replay), timeline

    def replay(self) -> None:
        self.timeline.mark("replay_start")
        self.replay_call()
        self.timeline.mark("replay_end")


class _TimedEvent:
    """DecodeGraphs' staging event, its host wait timed (the previous step's input copies)."""

    def __init__(self, event: torch.cuda.Event, phases: Phases):
        self.record, self.synchronize = event.record, phases.timed("inputs_wait", event.synchronize)


def instrument(core: EngineCore, phases: Phases, timeline: Timeline | None = None) -> None:
    """Time ``core``'s phases into ``phases`` (instance attributes shadow the methods) and mark its decode
    graph steps on ``timeline``."""
    timeline = timeline or Timeline()
    scheduler, runner = core.scheduler, core.runner
    core.step = phases.timed("step", core.step)
    record = phases.timed("record_total", core._record)

    def record_with_device_time(scheduled, launched):
        frames = record(scheduled, launched)
        seconds = launched.seconds()  # the StepClock's events: the step's time on the device
        if seconds is not None:
            phases.seconds["device"] += seconds
        return frames

    core._record = record_with_device_time
    core._copy_blocks = phases.timed("copy_blocks", core._copy_blocks)
    core._frame = phases.timed("frames", core._frame)
    schedule = phases.timed("schedule", scheduler.schedule)

    def counted_schedule():
        out = schedule()
        phases.calls["scheduled_seqs"] += len(out.scheduled)
        phases.calls["scheduled_tokens"] += sum(n for _, n in out.scheduled)
        phases.calls["mixed_steps"] += any(n > 1 for _, n in out.scheduled)
        return out

    scheduler.schedule = counted_schedule
    scheduler.advance = phases.timed("advance", scheduler.advance)
    scheduler.record = phases.timed("scheduler_record", scheduler.record)
    runner.sampler.sample = phases.timed("sample", runner.sampler.sample)
    launch = phases.timed("launch", runner.launch)
    graphs = runner.decode_graphs
    if graphs is not None:
        graphs._graphs = {key: _TimedReplay(g, phases, timeline) for key, g in graphs._graphs.items()}
        run = phases.timed("graph_run", graphs.run)
        if graphs._copied is not None:
            graphs._copied = _TimedEvent(graphs._copied, phases)

        def graph_run(seqs, carried=None):
            timeline.mark("inputs")
            return run(seqs, carried)

        graphs.run = graph_run

    def timed_launch(scheduled, previous=None):
        step = launch(scheduled, previous)
        timeline.mark("done")
        step.resolve = phases.timed("wait", step.resolve)
        return step

    runner.launch = timed_launch


def bench_b1(model: str, tokens: int, device: str) -> None:
    """On the CPU (a dry run of the timers) without the graph replay and the device timeline."""
    settings = dict(max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=MAX_MODEL_LEN[model])
    core = make_engine(model, device, **settings, **({"gpu_memory_utilization": 0.5} if device == "cuda" else {}))
    if device == "cuda":
        rate, replay_ms = ours_decode_b1(core, 128, tokens)
        emit(bench="step_phases_b1", model=model, part="untimed", tok_s=round(rate, 1),
             ms_per_token=round(1e3 / rate, 4), graph_replay_ms=round(replay_ms, 4))
    phases, timeline = Phases(), Timeline()
    instrument(core, phases, timeline)
    Run(core, random_prompts(1, 128, 21), [greedy(8)], "b1warm-")
    phases.reset()
    run = Run(core, random_prompts(1, 128, 22), [greedy(tokens)], "b1phases-")
    steps = phases.calls["step"]
    emit(bench="step_phases_b1", model=model, part="host_ms_per_step", steps=steps,
         tok_s=round((tokens - 1) / (run.last[run.ids[0]] - run.first[run.ids[0]]), 1), **phases.per_step_ms(steps))
    if device != "cuda":
        return
    timeline.on = True
    run = Run(core, random_prompts(1, 128, 23), [greedy(tokens)], "b1events-")
    emit(bench="step_phases_b1", model=model, part="device_timeline",
         tok_s=round((tokens - 1) / (run.last[run.ids[0]] - run.first[run.ids[0]]), 1), **timeline.summary())


# --- eager steps: where their host time goes ----------------------------------------------------------


def profile_steps(core: EngineCore, name: str, setup: Callable[[int], None], repeats: int, **labels) -> None:
    """``repeats`` steps timed on the host without a profiler, then cProfile over ``repeats`` more, each
    the first step after ``setup(i)`` (which queues its work); the device is idle at each step's start."""
    import cProfile
    import pstats

    def one_step(i: int, run: Callable) -> float:
        setup(i)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(core.step)
        return time.perf_counter() - t0

    unprofiled = [one_step(i, lambda step: step()) for i in range(repeats)]
    profiler = cProfile.Profile()
    seconds = [one_step(repeats + i, profiler.runcall) for i in range(repeats)]
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]  # by own time
    emit(bench="step_phases_eager", scenario=name, steps=repeats, **labels,
         unprofiled_ms_per_step=[round(t * 1e3, 2) for t in unprofiled],
         ms_per_step=[round(t * 1e3, 2) for t in seconds],
         top_own_time=["function,calls per step,own ms per step,cumulative ms per step", *[
             (f"{os.path.basename(f)}:{line}:{fn}", round(calls / repeats, 1), round(own / repeats * 1e3, 3),
              round(cum / repeats * 1e3, 3)) for (f, line, fn), (_, calls, own, cum, _) in rows]])


def bench_eager(model: str, device: str, prefill_graph_tokens: list[int]) -> None:
    """A lone 128-token prefill on an idle engine, a 512-token prefill joining 64 decoding sequences, and
    their graphed decode steps (the tiny model on the CPU: prompts and outputs of a quarter of its context),
    on an engine per ``--cuda-graph-prefill-tokens`` value (0: steps with prompt tokens run eagerly, the peer)."""
    max_len = MAX_MODEL_LEN[model]
    join, new = min(512, max_len // 4), min(400, max_len // 4)
    for tokens in prefill_graph_tokens:
        settings = dict(max_num_seqs=80, max_num_batched_tokens=8192, max_model_len=max_len,
                        cuda_graph_prefill_tokens=tokens)
        core = make_engine(model, device, **settings, **({"gpu_memory_utilization": 0.4} if device == "cuda" else {}))
        prompts = iter(random_prompts(200, join, 77))
        label = {"cuda_graph_prefill_tokens": tokens}

        def lone(i: int) -> None:
            while core.has_work():
                core.step()
            core.add_request(GenerateRequest(f"lone{i}", next(prompts)[:join // 4], greedy(2), salt="eager"))

        profile_steps(core, "prefill_128_alone", lone, 5, **label)
        while core.has_work():
            core.step()
        for i in range(64):
            core.add_request(GenerateRequest(f"dec{i}", next(prompts)[:join // 4], greedy(new), salt="eager"))
        for _ in range(4):
            core.step()

        def joining(i: int) -> None:
            core.add_request(GenerateRequest(f"join{i}", next(prompts), greedy(new), salt="eager"))

        profile_steps(core, "prefill_512_with_64_decodes", joining, 5, **label)
        profile_steps(core, "decode_64_graphed", lambda i: None, 5, **label)
        del core
        if device == "cuda":
            torch.cuda.empty_cache()


# --- served: the engine process's core, instrumented ----------------------------------------------------


def profiled_core(config: EngineConfig, out_path: str, gc_mode: str) -> EngineCore:
    """Runs in the engine process (EngineProcess's make_core): the core, instrumented, appending a JSON line to
    ``out_path`` each time it runs out of work (the end of a benchmark run)."""
    core = EngineCore.from_config(config)
    phases = Phases()
    instrument(core, phases)
    step, add_request, schedule = core.step, core.add_request, core.scheduler.schedule
    state = {"last_end": None, "label": None, "scheduled": []}
    step_rows: list[tuple] = []  # per step: ms, launch ms, seqs, tokens, prefill tokens, Triton compiles
    arrivals: list[float] = []
    compiled: list[str] = []

    def on_compile(*, fn, **_):  # Triton's hook on a kernel variant not in its in-memory cache
        compiled.append(fn.name)
        return False

    from triton import knobs
    knobs.runtime.jit_cache_hook = on_compile

    def add(request):
        arrivals.append(time.perf_counter())
        return add_request(request)

    def scheduled_step():
        out = schedule()
        state["scheduled"] = out.scheduled
        return out

    core.add_request, core.scheduler.schedule = add, scheduled_step

    def step_and_report():
        t0 = time.perf_counter()
        if state["last_end"] is not None:
            phases.seconds["between_steps"] += t0 - state["last_end"]
        if state["label"] is None and core.requests:  # a run is named by its requests' ids, less the index
            state["label"] = next(iter(core.requests)).rsplit("-", 1)[0]
        launch_s, num_compiled = phases.seconds["launch"], len(compiled)
        frames = step()
        state["last_end"] = time.perf_counter()
        scheduled = state["scheduled"]
        launch_ms = (phases.seconds["launch"] - launch_s) * 1e3
        step_rows.append((round((state["last_end"] - t0) * 1e3, 3), round(launch_ms, 3), len(scheduled),
                          sum(n for _, n in scheduled), sum(n for _, n in scheduled if n > 1),
                          len(compiled) - num_compiled))
        if not core.has_work():
            steps = phases.calls["step"]
            if state["label"] is not None:
                record = dict(run=state["label"], gc_mode=gc_mode, steps=steps,
                              ms_per_step=phases.per_step_ms(steps),
                              gc_collections={k: v for k, v in phases.calls.items() if k.startswith("gc")},
                              seqs_per_step=round(phases.calls["scheduled_seqs"] / max(steps, 1), 2),
                              tokens_per_step=round(phases.calls["scheduled_tokens"] / max(steps, 1), 2),
                              mixed_steps=phases.calls["mixed_steps"],
                              gc_counts=list(gc.get_count()), gc_tracked_objects=len(gc.get_objects()),
                              requests=len(core.requests), cached_blocks=core.kv.num_cached_blocks,
                              free_blocks=core.kv.num_free_blocks,
                              arrival_spread_ms=round((max(arrivals) - min(arrivals)) * 1e3, 2) if arrivals else None,
                              steps_over_5ms=sum(row[0] > 5 for row in step_rows),
                              ms_in_steps_over_5ms=round(sum(row[0] for row in step_rows if row[0] > 5), 1),
                              triton_compiles=collections.Counter(compiled),
                              slowest_steps=["ms,launch_ms,seqs,tokens,prefill_tokens,compiles",
                                             *sorted(step_rows, reverse=True)[:10]])
                with open(out_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            state["label"] = state["last_end"] = None
            step_rows.clear()
            arrivals.clear()
            compiled.clear()
            phases.reset()
        return frames

    core.step = step_and_report
    if gc_mode == "off":
        gc.disable()
    elif gc_mode == "freeze":
        gc.freeze()
    return core


class ProfiledSidecar(Sidecar):
    """gpu_bench's Sidecar, serving :func:`serve_profiled`'s app (the engine process's core instrumented)."""

    def __init__(self, model: str, device: str, settings: dict, out_path: str, gc_mode: str):
        import subprocess

        from gateway.spawn import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "_serve", f"--port={port}", f"--model={model}",
             f"--device={device}", f"--out={out_path}", f"--gc={gc_mode}", f"--settings={json.dumps(settings)}"],
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )


def serve_profiled(port: int, model: str, device: str, out_path: str, gc_mode: str, settings: dict) -> None:
    import uvicorn

    from engine.server import build_app

    config = EngineConfig(model=model, load_format="dummy", device=device, **settings)
    app = build_app(config, make_core=functools.partial(profiled_core, config, out_path, gc_mode))
    uvicorn.run(app, host="127.0.0.1", port=port, log_config=None, access_log=False)


async def drive_served(model: str, device: str, settings: dict, batch: int, runs: int, new: int, out_path: str,
                       gc_mode: str) -> list[dict]:
    from gateway.engine_client import EngineClient, engine_transport

    sidecar = ProfiledSidecar(model, device, settings, out_path, gc_mode)
    results = []
    try:
        await sidecar.wait_ready()
        transport = engine_transport(256)  # the gateway's pool
        client = EngineClient(sidecar.url, transport)
        await served_run(client, random_prompts(1, 128, 500), new, "srv-warm-")
        prompts = random_prompts(batch, 128, 500 + batch)
        for r in range(runs):
            await served_run(client, prompts[:1], new, f"srv-b1-{r}-")
            before = await sidecar.counters()
            first, last = await served_run(client, prompts, new, f"srv-on{r}-")
            busy, steps, *_ = (a - b for a, b in zip(await sidecar.counters(), before))
            results.append(dict(tok_s=round(decode_tok_s(first, last, new), 1), engine_step_ms=step_ms(busy, steps)))
        await transport.aclose()
    finally:
        sidecar.close()
    return results


def bench_served(model: str, device: str, batch: int, runs: int, new: int, gc_modes: list[str], out_dir: str) -> None:
    settings = dict(max_num_seqs=max(batch, 8), max_num_batched_tokens=8192 if device == "cuda" else 1024,
                    max_model_len=MAX_MODEL_LEN[model])
    if device == "cuda":
        settings["gpu_memory_utilization"] = 0.9
    os.makedirs(out_dir, exist_ok=True)
    for gc_mode in gc_modes:
        out_path = os.path.join(out_dir, f"step_phases_served_{gc_mode}.jsonl")
        if os.path.exists(out_path):
            os.remove(out_path)
        results = asyncio.run(drive_served(model, device, settings, batch, runs, new, out_path, gc_mode))
        with open(out_path) as f:
            records = [json.loads(line) for line in f]
        batch_runs = [r for r in records if r["run"].startswith("srv-on")]
        for r, (client, engine) in enumerate(zip(results, batch_runs, strict=True)):
            emit(bench="step_phases_served", model=model, batch=batch, gc_mode=gc_mode, run=r + 1, **client,
                 **{k: v for k, v in engine.items() if k not in ("run", "gc_mode")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("b1", "eager", "served", "_serve"))
    parser.add_argument("--model", default="smollm2-135m", choices=tuple(MAX_MODEL_LEN))
    parser.add_argument("--tokens", type=int, default=256, help="b1: new tokens per run")
    parser.add_argument("--batch", type=int, default=64, help="served: requests per run")
    parser.add_argument("--runs", type=int, default=3, help="served: batch runs per sidecar")
    parser.add_argument("--new", type=int, default=512, help="served: new tokens per request")
    parser.add_argument("--gc", default="on", help=f"served: comma-separated of {','.join(GC_MODES)}")
    parser.add_argument("--prefill-graphs", default="0,2048",
                        help="eager: comma-separated --cuda-graph-prefill-tokens values, an engine each "
                             "(default: 0,2048)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "."), help="served: where the engine writes")
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    configure_logging("WARNING")
    if args.device == "cuda" and args.what != "_serve":
        emit(bench="device", device=torch.cuda.get_device_name(), torch=torch.__version__)
    if args.what == "_serve":
        serve_profiled(args.port, args.model, args.device, args.out, args.gc, json.loads(args.settings))
    elif args.what == "b1":
        bench_b1(args.model, args.tokens, args.device)
    elif args.what == "eager":
        bench_eager(args.model, args.device, [int(t) for t in args.prefill_graphs.split(",")])
    else:
        gc_modes = args.gc.split(",")
        if set(gc_modes) - set(GC_MODES):
            sys.exit(f"unknown --gc modes {sorted(set(gc_modes) - set(GC_MODES))}; choose from {GC_MODES}")
        bench_served(args.model, args.device, args.batch, args.runs, args.new, gc_modes, args.out_dir)


if __name__ == "__main__":
    main()
