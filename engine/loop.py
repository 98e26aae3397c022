"""The engine side of a sidecar: the EngineCore stepped by one thread, fed typed commands between two
steps, each step's output handed to a host.

:class:`EngineLoop` owns the core (with a tensor-parallel engine's other ranks, and the KV event
publisher): between two steps it takes every queued command, then runs one step and posts its frames, with
the step's timings for /metrics, to its host. Two hosts run it (``python -m engine serve`` picks one):

- :class:`engine.proc.EngineProcess` (``--engine-process``, the default): the loop is the main thread of a
  process of its own; commands and outputs cross a pipe as msgpack frames, a message per step, and the
  HTTP process reads whatever has arrived in one go (under load, several steps a delivery).
- :class:`EngineThread` (``--no-engine-process``): the loop in a thread of the HTTP process. The two
  threads share the GIL, so the HTTP work of a delivery (a write per stream) is time the engine waits:
  a delivery waits until the event loop's CPU time since the last one is a small share of the time since
  then, and then carries the frames of every step in between. A request's first tokens and its end go at
  once: time to first token and a request's latency are not paced, the tokens in between are.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.cpu import GOVERNOR_WINDOW_S, resident_bytes
from engine.protocol import EngineStats, GenerateRequest, ModelLimits, OutputFrame, ProtocolError, StructuredOutput
from engine.warmup import warmup

log = structlog.get_logger("engine.loop")

STATS_INTERVAL_S = 0.05  # /stats and /metrics read a snapshot at most this old while busy
# EngineThread: the event loop's share of the time while frames flow, and the longest a delivery waits for
# it. At 64 streams of SmolLM2 on the H200, one delivery a step took 1.0-1.4 ms of the loop against a 1.3 ms
# step: the sidecar decoded at 0.46-0.56 of the offline rate; paced, 0.3 ms a step and 0.71 (gpu_bench
# served, benchmarks/results/served_h200.jsonl): at the bound the loop's per-token work (merge, metrics,
# pack) still takes ~15 % of the time, and the engine thread waits for the GIL. EngineProcess needs no pacing.
DELIVERY_LOOP_SHARE = 0.03
DELIVERY_MAX_WAIT_S = 0.05
_STOP_JOIN_S = 10.0


@dataclass(frozen=True, slots=True)
class Add:
    request: GenerateRequest


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Call:
    """A named request (:data:`CALLS`) with wire-form ``args``; answered by ``reply(error, result)``, on the
    loop's thread or, for "compile", on a worker thread. The result is wire-form too (msgpack)."""

    name: str
    args: tuple
    reply: Callable[[BaseException | None, Any], None]


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Command = Add | Abort | Call | Stop


def _integrity(core: EngineCore) -> dict[str, Any]:
    """GET /debug/integrity's body; raises IntegrityError (an AssertionError) for an inconsistent pool."""
    counts, host = core.check_integrity(), core.check_host_integrity()
    return {"ok": True, **counts._asdict(), "host": host._asdict() if host is not None else None}


def _compile(core: EngineCore, spec: dict[str, str]) -> None:
    """Compile a structured output spec before its request is submitted (the core then finds it in the
    compiler's cache); raises ProtocolError for a spec it cannot compile."""
    core.compile_structured(StructuredOutput(**spec))


CALLS: dict[str, Callable[..., Any]] = {"integrity": _integrity, "compile": _compile}
_OFF_LOOP = frozenset({"compile"})  # slow and thread-safe: on a worker thread, so that steps go on


@dataclass(slots=True)
class StepOutput:
    """What the loop hands its host: frames (of a step, of the commands before it, or of several steps
    merged), each step's busy seconds and the queue times of the requests that started (for /metrics)."""

    frames: list[OutputFrame] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    queue_seconds: list[float] = field(default_factory=list)

    def extend(self, other: StepOutput) -> None:
        self.frames += other.frames
        self.step_seconds += other.step_seconds
        self.queue_seconds += other.queue_seconds


class Inbox(Protocol):
    def get(self, block: bool = True, timeout: float | None = None) -> Command:
        """The next command; raises queue.Empty when none came (at once unless ``block``, else within ``timeout``)."""


class Host(Protocol):
    """Where an EngineLoop's results go. ``report_failure`` may be called from any thread (once); the others
    from the loop's."""

    def started(self, core: EngineCore, stats: EngineStats) -> None: ...
    def post(self, output: StepOutput) -> None: ...
    def publish_stats(self, stats: EngineStats) -> None: ...
    def report_failure(self, exc: BaseException) -> None: ...


class EngineLoop:
    """Owns the EngineCore (built by ``make_core``, else from ``config``: with tensor_parallel_size > 1 rank 0
    of a tensor-parallel engine, whose ranks it starts and stops) and steps it in the thread that calls
    :meth:`run`. Thread-safe: :meth:`fail`."""

    def __init__(self, config: EngineConfig, make_core: Callable[[], EngineCore] | None, host: Host):
        self._config = config
        self._make_core = make_core
        self._host = host
        self._publisher = None
        self._ranks = None
        self._workers: ThreadPoolExecutor | None = None
        self.failed: BaseException | None = None  # set once: at start, in a step, or by fail()
        self._failed_lock = threading.Lock()

    def run(self, inbox: Inbox) -> None:
        """Start the core, then serve ``inbox`` until Stop or a failure (reported to the host)."""
        try:
            core = self._start()
        except BaseException as exc:
            log.exception("engine_start_failed")
            self.fail(exc)
            return
        try:
            self._serve(core, inbox)
        except Exception as exc:  # a step that raised: its sequences' state is unknown, so stop serving
            log.exception("engine_step_failed")
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Mark the engine failed and tell the host (once; the first failure wins). The loop stops
        stepping after a failing step; a failure reported from elsewhere (a dead tensor-parallel rank)
        does not wait for it, since it may be blocked in a collective."""
        with self._failed_lock:
            if self.failed is not None:
                return
            self.failed = exc
        log.error("engine_failed", error=str(exc))
        self._host.report_failure(exc)

    def close(self) -> None:
        """Stop the publisher, the worker thread and a tensor-parallel engine's ranks (after run)."""
        if self._publisher is not None:
            self._publisher.close()
        if self._workers is not None:
            self._workers.shutdown(wait=False, cancel_futures=True)
        if self._ranks is not None:
            self._ranks.close()

    def _start(self) -> EngineCore:
        t0 = time.perf_counter()
        config = self._config
        if self._make_core is not None:
            core = self._make_core()
        elif config.tensor_parallel_size > 1:
            from engine.parallel import TensorParallelRanks

            self._ranks = TensorParallelRanks(config, on_failure=self.fail)
            core = self._ranks.build_core()
        else:
            core = EngineCore.from_config(config)
        warmup(core)
        if config.index_url is not None:
            from prefix_index.publisher import KVEventPublisher

            self._publisher = KVEventPublisher(
                config.index_url, config.replica_id, config.served_name, config.block_size,
                snapshot=core.kv_snapshot, host_snapshot=core.host_kv_snapshot,
            )
            self._publisher.start()
        self._workers = ThreadPoolExecutor(1, thread_name_prefix="engine-compile")
        stats = core.stats()
        log.info("engine_ready", seconds=round(time.perf_counter() - t0, 2), rss_mib=resident_bytes() >> 20,
                 **stats.to_wire())
        self._host.started(core, stats)
        return core

    def _serve(self, core: EngineCore, inbox: Inbox) -> None:
        stats_at = time.perf_counter()
        # idle, a CPU engine's thread governor still measures the box, a window at a time
        idle_wait = GOVERNOR_WINDOW_S if core.thread_governor is not None else None
        while True:
            output = StepOutput()
            block = not core.has_work()
            while True:
                try:
                    command = inbox.get(block=block, timeout=idle_wait if block else None)
                except queue.Empty:
                    if block:
                        core.thread_governor.tick()
                    break
                block = False
                if isinstance(command, Stop) or self.failed is not None:
                    return
                output.frames += self._handle(core, command)
            if core.has_work():
                self._step(core, output)
            now = time.perf_counter()
            if not core.has_work() or now - stats_at >= STATS_INTERVAL_S:  # fresh before idling
                self._host.publish_stats(core.stats())
                stats_at = now
            if output.frames or output.step_seconds:
                self._host.post(output)

    def _step(self, core: EngineCore, output: StepOutput) -> None:
        steps, busy = core.counters.steps, core.counters.busy_seconds
        output.frames += core.step()
        output.queue_seconds += core.take_queue_times()
        if core.counters.steps > steps:
            output.step_seconds.append(core.counters.busy_seconds - busy)
        if self._publisher is not None and (events := core.drain_kv_events()):
            self._publisher.publish(events)

    def _handle(self, core: EngineCore, command: Add | Abort | Call) -> list[OutputFrame]:
        match command:
            case Abort(request_id):
                return core.abort(request_id)
            case Call(name, args, reply):
                if name in _OFF_LOOP:
                    self._workers.submit(_answer, CALLS[name], core, args, reply)
                else:
                    _answer(CALLS[name], core, args, reply)
                return []
            case Add(request):
                try:
                    core.add_request(request)
                except ProtocolError as exc:  # raced with a duplicate id; admissibility was checked already
                    return [OutputFrame(request.request_id, i, finish_reason="error", error=exc.message)
                            for i in range(request.sampling.n)]
                return []


def _answer(fn: Callable[..., Any], core: EngineCore, args: tuple, reply: Callable) -> None:
    try:
        result = fn(core, *args)
    except Exception as exc:
        reply(exc, None)
    else:
        reply(None, result)


class EngineThread:
    """The engine loop in a thread of the HTTP process (``--no-engine-process``), with paced deliveries.

    Called on the event loop: :meth:`start`, :meth:`stop`, :meth:`submit`, :meth:`abort`, :meth:`request`;
    ``ready``, ``failed``, ``limits`` and ``snapshot`` may be read anywhere."""

    def __init__(self, config: EngineConfig, make_core: Callable[[], EngineCore] | None = None):
        self.engine = EngineLoop(config, make_core, self)
        self.ready = threading.Event()
        self.limits: ModelLimits | None = None
        self.snapshot: EngineStats | None = None
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._deliver: Callable[[StepOutput], None] | None = None
        self._on_failure: Callable[[BaseException], None] | None = None
        self._pending: set[asyncio.Future] = set()  # requests not answered yet
        self._outbox = StepOutput()  # not yet taken by the event loop
        self._outbox_lock = threading.Lock()
        self._delivered_at = 0.0  # perf_counter and the loop thread's thread_time at the last delivery
        self._delivered_cpu = 0.0
        self._streaming: set[str] = set()  # requests whose first tokens are out (engine thread only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    @property
    def failed(self) -> BaseException | None:
        return self.engine.failed

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[StepOutput], None],
              on_failure: Callable[[BaseException], None]) -> None:
        """Start the engine thread: ``deliver(output)`` after steps and ``on_failure(exc)`` once if the
        engine fails, both on ``loop``."""
        self._loop, self._deliver, self._on_failure = loop, deliver, on_failure
        self._delivered_at, self._delivered_cpu = time.perf_counter(), time.thread_time()
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(Stop())
        self._thread.join(timeout=_STOP_JOIN_S)
        if self._thread.is_alive():  # blocked in a collective of a dead rank: stopping the ranks ends it
            self.engine.close()

    def submit(self, request: GenerateRequest) -> None:
        self._inbox.put(Add(request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    async def request(self, name: str, *args: Any) -> Any:
        """The named request's (:data:`CALLS`) result; raises its error (or the engine's failure)."""
        if self.failed is not None:
            raise self.failed
        future = self._loop.create_future()
        self._pending.add(future)

        def reply(error: BaseException | None, result: Any) -> None:
            self._loop.call_soon_threadsafe(_settle, future, error, result)

        self._inbox.put(Call(name, args, reply))
        try:
            return await future
        finally:
            self._pending.discard(future)

    def _run(self) -> None:
        try:
            self.engine.run(self._inbox)
        finally:
            self.engine.close()

    # --- Host: called on the engine thread (report_failure: on any) ---------------------------------------
    def started(self, core: EngineCore, stats: EngineStats) -> None:
        self.limits, self.snapshot = core.limits, stats
        self.ready.set()

    def publish_stats(self, stats: EngineStats) -> None:
        self.snapshot = stats

    def report_failure(self, exc: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._fail_streams, exc)

    def post(self, output: StepOutput) -> None:
        """Add the output to the outbox; the first frames of an empty outbox schedule its delivery, a
        request's first tokens or its end one at once."""
        urgent = False
        for frame in output.frames:
            if frame.token_ids and frame.request_id not in self._streaming:
                self._streaming.add(frame.request_id)
                urgent = True
            if frame.finish_reason is not None:
                self._streaming.discard(frame.request_id)
                urgent = True
        with self._outbox_lock:
            scheduled = bool(self._outbox.frames or self._outbox.step_seconds)
            self._outbox.extend(output)
        if urgent or not scheduled:
            self._loop.call_soon_threadsafe(self._flush, not urgent)

    # --- on the event loop ------------------------------------------------------------------------
    def _flush(self, paced: bool = True) -> None:
        """Deliver everything the outbox holds, once the loop's share allows."""
        now, cpu = time.perf_counter(), time.thread_time()
        wait = min(self._delivered_at + (cpu - self._delivered_cpu) / DELIVERY_LOOP_SHARE - now, DELIVERY_MAX_WAIT_S)
        if paced and wait > 0:
            self._loop.call_later(wait, self._flush, False)
            return
        self._delivered_at, self._delivered_cpu = now, cpu
        with self._outbox_lock:
            output, self._outbox = self._outbox, StepOutput()
        if output.frames or output.step_seconds:
            self._deliver(output)

    def _fail_streams(self, exc: BaseException) -> None:
        """The frames of the steps before the failure, then the failure's; unanswered requests fail."""
        self._flush(paced=False)
        for future in self._pending:
            _settle(future, exc, None)
        self._on_failure(exc)


def _settle(future: asyncio.Future, error: BaseException | None, result: Any) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
