"""EngineLoop: the EngineCore in a dedicated thread, fed by typed commands.

HTTP handlers put commands in the inbox (thread-safe); between two steps the thread drains it, runs
one step and adds the step's frames to the outbox, so HTTP work never runs inside a step. The event
loop takes the whole outbox at once, paced: the two threads share the GIL, so the HTTP work of a
delivery (a write per stream) is time the engine waits; a delivery waits until the loop's CPU time
since the last one is a small share of the time since then, and then carries the frames of every
step in between. A request's first tokens and its end go at once: time to first token and a
request's latency are not paced, the tokens in between are.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.cpu import GOVERNOR_WINDOW_S, resident_bytes
from engine.metrics import Metrics
from engine.protocol import EngineStats, GenerateRequest, OutputFrame, ProtocolError
from engine.warmup import warmup

log = structlog.get_logger("engine.loop")

STATS_INTERVAL_S = 0.05  # /stats and /metrics read a snapshot at most this old while busy
# The event loop's share of the time while frames flow, and the longest a delivery waits for it. At 64
# streams of SmolLM2 on the H200, one delivery a step took 1.0-1.4 ms of the loop against a 1.3 ms step:
# the sidecar decoded at 0.46-0.56 of the offline rate; paced, 0.3 ms a step and 0.71 (gpu_bench served,
# benchmarks/results/served_h200.jsonl): at the bound the loop's per-token work (merge, metrics, pack)
# still takes ~15 % of the time, and the engine thread waits for the GIL.
DELIVERY_LOOP_SHARE = 0.03
DELIVERY_MAX_WAIT_S = 0.05


@dataclass(frozen=True, slots=True)
class Add:
    request: GenerateRequest


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn(core)`` between two steps; its result or exception goes to ``future``."""

    fn: Callable[[EngineCore], Any]
    future: asyncio.Future


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Command = Add | Abort | Call | Stop


class EngineLoop:
    """Owns the EngineCore in a dedicated thread. Thread-safe entry points: submit, abort, call."""

    def __init__(self, make_core: Callable[[], EngineCore], metrics: Metrics, config: EngineConfig):
        self._make_core = make_core
        self._config = config
        self._publisher = None
        self.metrics = metrics
        self.core: EngineCore | None = None
        self.ready = threading.Event()
        self.failed: BaseException | None = None  # set once: at start, in a step, or by fail()
        self._failed_lock = threading.Lock()
        self._on_failure: Callable[[BaseException], None] | None = None
        self.snapshot: EngineStats | None = None
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._deliver: Callable[[list[OutputFrame]], None] | None = None
        self._outbox: list[OutputFrame] = []  # frames not yet taken by the event loop
        self._outbox_lock = threading.Lock()
        self._delivered_at = 0.0  # perf_counter and the loop thread's thread_time at the last delivery
        self._delivered_cpu = 0.0
        self._streaming: set[str] = set()  # requests whose first tokens are out (engine thread only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(
        self, loop: asyncio.AbstractEventLoop, deliver: Callable[[list[OutputFrame]], None],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        """Start the engine thread: ``deliver(frames)`` after each step and ``on_failure(exc)`` once
        if the engine fails, both on ``loop``."""
        self._loop, self._deliver, self._on_failure = loop, deliver, on_failure
        self._delivered_at, self._delivered_cpu = time.perf_counter(), time.thread_time()
        self._thread.start()

    def fail(self, exc: BaseException) -> None:
        """Mark the engine failed (health goes red) and have every open request ended with an
        error. Thread-safe; the first failure wins. The engine thread stops stepping after a
        failing step; a failure reported from elsewhere (a dead tensor-parallel rank) does not
        wait for it, since it may be blocked in a collective."""
        with self._failed_lock:
            if self.failed is not None:
                return
            self.failed = exc
        log.error("engine_failed", error=str(exc))
        self._loop.call_soon_threadsafe(self._fail_streams, exc)

    def stop(self) -> None:
        self._inbox.put(Stop())
        self._thread.join(timeout=10)
        if self._publisher is not None:
            self._publisher.close()

    def submit(self, request: GenerateRequest) -> None:
        self._inbox.put(Add(request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    async def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run ``fn(core)`` between two steps on the engine thread and return its result."""
        future = self._loop.create_future()
        self._inbox.put(Call(fn, future))
        return await future

    def _run(self) -> None:
        try:
            core = self._start()
        except BaseException as exc:
            log.exception("engine_start_failed")
            self.fail(exc)
            return
        try:
            self._serve(core)
        except Exception as exc:  # a step that raised: its sequences' state is unknown, so stop serving
            log.exception("engine_step_failed")
            self.fail(exc)

    def _start(self) -> EngineCore:
        t0 = time.perf_counter()
        core = self.core = self._make_core()
        warmup(core)
        if self._config.index_url is not None:
            from prefix_index.publisher import KVEventPublisher

            cfg = self._config
            self._publisher = KVEventPublisher(
                cfg.index_url, cfg.replica_id, cfg.served_name, cfg.block_size, snapshot=core.kv_snapshot,
                host_snapshot=core.host_kv_snapshot,
            )
            self._publisher.start()
        self.snapshot = core.stats()
        log.info("engine_ready", seconds=round(time.perf_counter() - t0, 2), rss_mib=resident_bytes() >> 20,
                 **self.snapshot.to_wire())
        self.ready.set()
        return core

    def _serve(self, core: EngineCore) -> None:
        stats_at = time.perf_counter()
        # idle, a CPU engine's thread governor still measures the box, a window at a time
        idle_wait = GOVERNOR_WINDOW_S if core.thread_governor is not None else None
        while True:
            frames: list[OutputFrame] = []
            block = not core.has_work()
            while True:
                try:
                    command = self._inbox.get(block=block, timeout=idle_wait if block else None)
                except queue.Empty:
                    if block:
                        core.thread_governor.tick()
                    break
                block = False
                if isinstance(command, Stop) or self.failed is not None:
                    return
                frames.extend(self._handle(core, command))
            if core.has_work():
                frames.extend(self._step(core))
            now = time.perf_counter()
            if not core.has_work() or now - stats_at >= STATS_INTERVAL_S:  # fresh before idling
                self.snapshot, stats_at = core.stats(), now
            if frames:
                self._post(frames)

    def _post(self, frames: list[OutputFrame]) -> None:
        """Add frames to the outbox; the first frames of an empty outbox schedule its delivery, a
        request's first tokens or its end one at once."""
        urgent = False
        for frame in frames:
            if frame.token_ids and frame.request_id not in self._streaming:
                self._streaming.add(frame.request_id)
                urgent = True
            if frame.finish_reason is not None:
                self._streaming.discard(frame.request_id)
                urgent = True
        with self._outbox_lock:
            scheduled = bool(self._outbox)
            self._outbox.extend(frames)
        if urgent or not scheduled:
            self._loop.call_soon_threadsafe(self._flush, not urgent)

    def _flush(self, paced: bool = True) -> None:
        """On the event loop: deliver every frame the outbox holds, once the loop's share allows."""
        now, cpu = time.perf_counter(), time.thread_time()
        wait = min(self._delivered_at + (cpu - self._delivered_cpu) / DELIVERY_LOOP_SHARE - now, DELIVERY_MAX_WAIT_S)
        if paced and wait > 0:
            self._loop.call_later(wait, self._flush, False)
            return
        self._delivered_at, self._delivered_cpu = now, cpu
        with self._outbox_lock:
            frames, self._outbox = self._outbox, []
        if frames:
            self._deliver(frames)

    def _fail_streams(self, exc: BaseException) -> None:
        """On the event loop: the frames of the steps before the failure, then the failure's."""
        self._flush(paced=False)
        self._on_failure(exc)

    def _step(self, core: EngineCore) -> list[OutputFrame]:
        steps, busy = core.counters.steps, core.counters.busy_seconds
        frames = core.step()
        for seconds in core.take_queue_times():
            self.metrics.queue_time.observe(seconds)
        if core.counters.steps > steps:
            self.metrics.step_seconds.observe(core.counters.busy_seconds - busy)
            self.metrics.steps.inc()
        if self._publisher is not None and (events := core.drain_kv_events()):
            self._publisher.publish(events)
        return frames

    def _handle(self, core: EngineCore, command: Add | Abort | Call) -> list[OutputFrame]:
        match command:
            case Abort(request_id):
                return core.abort(request_id)
            case Call(fn, future):
                try:
                    result = fn(core)
                except Exception as exc:
                    self._loop.call_soon_threadsafe(future.set_exception, exc)
                else:
                    self._loop.call_soon_threadsafe(future.set_result, result)
                return []
            case Add(request):
                try:
                    core.add_request(request)
                except ProtocolError as exc:  # raced with a duplicate id; admissibility was checked already
                    return [OutputFrame(request.request_id, i, finish_reason="error", error=exc.message)
                            for i in range(request.sampling.n)]
                return []
