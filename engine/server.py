"""The engine sidecar: HTTP in the event loop's thread, the engine loop in its own thread.

The two meet through a command queue (HTTP → engine) and one ``call_soon_threadsafe`` per step
that hands every stream its frames (engine → HTTP), so HTTP work never runs inside a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.protocol import EngineStats, GenerateRequest, OutputFrame, ProtocolError, unpack_generate_request

log = structlog.get_logger("engine.server")

MSGPACK = "application/x-msgpack"
STATS_INTERVAL_S = 0.05  # /stats and /metrics read a snapshot at most this old while busy


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvgate_engine_requests", "Requests by finish reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("kvgate_engine_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter("kvgate_engine_cached_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter("kvgate_engine_generation_tokens", "Tokens generated", registry=r)
        self.steps = Counter("kvgate_engine_steps", "Engine steps", registry=r)
        self.running = Gauge("kvgate_engine_num_running", "Running sequences", registry=r)
        self.waiting = Gauge("kvgate_engine_num_waiting", "Waiting sequences", registry=r)
        self.kv_usage = Gauge("kvgate_engine_kv_usage", "Fraction of KV blocks in use or unavailable", registry=r)
        self.step_seconds = Histogram(
            "kvgate_engine_step_seconds", "Duration of one engine step", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.ttft = Histogram(
            "kvgate_engine_time_to_first_token_seconds", "Arrival to first token", registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )


class _Stream:
    """The event-loop side of one request: frames arrive here from the engine thread."""

    __slots__ = ("frames", "open_sequences", "arrival", "first_token_at", "prompt_len", "cached", "generated")

    def __init__(self, n: int, prompt_len: int):
        self.frames: asyncio.Queue[OutputFrame] = asyncio.Queue()
        self.open_sequences = n
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.prompt_len = prompt_len
        self.cached = 0
        self.generated = 0


class EngineLoop:
    """Owns the EngineCore in a dedicated thread. Thread-safe entry points: submit, abort."""

    def __init__(self, make_core: Callable[[], EngineCore], metrics: Metrics, config: EngineConfig):
        self._make_core = make_core
        self._config = config
        self._publisher = None
        self.metrics = metrics
        self.core: EngineCore | None = None
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.snapshot: EngineStats | None = None
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._deliver: Callable[[list[OutputFrame]], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[list[OutputFrame]], None]) -> None:
        self._loop, self._deliver = loop, deliver
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(("stop",))
        self._thread.join(timeout=10)
        if self._publisher is not None:
            self._publisher.close()

    def _start_publisher(self, core: EngineCore) -> None:
        from prefix_index.publisher import KVEventPublisher

        cfg = self._config
        self._publisher = KVEventPublisher(
            cfg.index_url, cfg.replica_id, core.model_config.name, cfg.block_size, snapshot=core.kv.snapshot
        )
        self._publisher.start()

    def submit(self, request: GenerateRequest) -> None:
        self._inbox.put(("add", request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run ``fn(core)`` between two steps on the engine thread and return its result."""
        future = self._loop.create_future()
        self._inbox.put(("call", fn, future))
        return await future

    def _run(self) -> None:
        try:
            t0 = time.perf_counter()
            self.core = self._make_core()
            self.core.warmup()
            if self._config.index_url is not None:
                self._start_publisher(self.core)
            self.snapshot = self.core.stats()
            log.info("engine_ready", seconds=round(time.perf_counter() - t0, 2), **self.snapshot.to_wire())
            self.ready.set()
        except BaseException as exc:  # noqa: BLE001 — reported through /health, then the thread ends
            log.exception("engine_start_failed")
            self.failed = exc
            return
        core = self.core
        stats_at = time.perf_counter()
        while True:
            frames: list[OutputFrame] = []
            block = not core.has_work()
            while True:
                try:
                    command = self._inbox.get(block=block)
                except queue.Empty:
                    break
                block = False
                if command[0] == "stop":
                    return
                frames.extend(self._handle(core, command))
            if core.has_work():
                t0 = time.perf_counter()
                frames.extend(core.step())
                self.metrics.step_seconds.observe(time.perf_counter() - t0)
                self.metrics.steps.inc()
                if self._publisher is not None and (events := core.kv.drain_events()):
                    self._publisher.publish(events)
            now = time.perf_counter()
            if not core.has_work() or now - stats_at >= STATS_INTERVAL_S:  # fresh before idling
                self.snapshot, stats_at = core.stats(), now
            if frames:
                self._loop.call_soon_threadsafe(self._deliver, frames)

    def _handle(self, core: EngineCore, command: tuple) -> list[OutputFrame]:
        if command[0] == "abort":
            return core.abort(command[1])
        if command[0] == "call":
            _, fn, future = command
            try:
                result = fn(core)
            except Exception as exc:  # noqa: BLE001 — handed to the awaiting coroutine
                self._loop.call_soon_threadsafe(future.set_exception, exc)
            else:
                self._loop.call_soon_threadsafe(future.set_result, result)
            return []
        request: GenerateRequest = command[1]
        try:
            core.add_request(request)
        except ProtocolError as exc:  # raced with a duplicate id; admissibility was checked already
            return [OutputFrame(request.request_id, i, finish_reason="error", error=exc.message)
                    for i in range(request.sampling.n)]
        return []


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "param": param}}, status_code=status)


def build_app(config: EngineConfig, make_core: Callable[[], EngineCore] | None = None) -> Starlette:
    metrics = Metrics()
    engine = EngineLoop(make_core or (lambda: EngineCore.from_config(config)), metrics, config)
    streams: dict[str, _Stream] = {}

    def deliver(frames: list[OutputFrame]) -> None:
        for frame in frames:
            stream = streams.get(frame.request_id)
            if stream is not None:
                stream.frames.put_nowait(frame)

    def not_ready() -> JSONResponse | None:
        if engine.failed is not None:
            return error_response(503, f"engine failed to start: {engine.failed}")
        if not engine.ready.is_set():
            return error_response(503, "engine is loading")
        return None

    async def generate(request: Request) -> Response:
        if (resp := not_ready()) is not None:
            return resp
        core = engine.core
        body = await request.body()
        try:
            gen = unpack_generate_request(body, core.limits)
            core.check_admissible(gen)
        except ProtocolError as exc:
            log.info("generate_rejected", status=400, error=exc.message, param=exc.param)
            return error_response(400, exc.message, exc.param)
        if gen.request_id in streams:
            return error_response(400, f"request_id {gen.request_id!r} is already running", "request_id")
        stream = _Stream(gen.sampling.n, len(gen.prompt_ids))
        streams[gen.request_id] = stream
        engine.submit(gen)
        return StreamingResponse(_frames(gen, stream), media_type=MSGPACK)

    async def _frames(gen: GenerateRequest, stream: _Stream) -> AsyncIterator[bytes]:
        reasons: list[str] = []
        try:
            while stream.open_sequences:
                frame = await stream.frames.get()
                chunks = [frame]
                while not stream.frames.empty():
                    chunks.append(stream.frames.get_nowait())
                for f in chunks:
                    if f.token_ids and stream.first_token_at is None:
                        stream.first_token_at = time.perf_counter()
                        metrics.ttft.observe(stream.first_token_at - stream.arrival)
                    stream.generated += len(f.token_ids)
                    stream.cached = f.num_cached_tokens
                    if f.finish_reason is not None:
                        stream.open_sequences -= 1
                        reasons.append(f.finish_reason)
                yield b"".join(f.pack() for f in chunks)
        finally:
            streams.pop(gen.request_id, None)
            if stream.open_sequences:  # the client went away first
                engine.abort(gen.request_id)
                reasons.append("abort")
            _log_request(gen, stream, reasons)

    def _log_request(gen: GenerateRequest, stream: _Stream, reasons: list[str]) -> None:
        reason = reasons[-1] if reasons else "abort"
        metrics.requests.labels(reason).inc()
        metrics.prompt_tokens.inc(stream.prompt_len)
        metrics.cached_tokens.inc(stream.cached)
        metrics.generation_tokens.inc(stream.generated)
        log.info(
            "request",
            request_id=gen.request_id,
            prompt_tokens=stream.prompt_len,
            cached_tokens=stream.cached,
            generated_tokens=stream.generated,
            n=gen.sampling.n,
            finish_reason=reason,
            ttft_ms=None if stream.first_token_at is None else round((stream.first_token_at - stream.arrival) * 1e3, 2),
            latency_ms=round((time.perf_counter() - stream.arrival) * 1e3, 2),
        )

    async def abort(request: Request) -> Response:
        try:
            payload = await request.json()
            request_id = payload["request_id"]
            if not isinstance(request_id, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return error_response(400, 'body must be JSON {"request_id": "<id>"}', "request_id")
        engine.abort(request_id)
        return JSONResponse({"request_id": request_id, "aborted": request_id in streams})

    async def health(request: Request) -> Response:
        return not_ready() or JSONResponse({"status": "ready"})

    async def stats(request: Request) -> Response:
        return not_ready() or JSONResponse(engine.snapshot.to_wire())

    async def integrity(request: Request) -> Response:
        if (resp := not_ready()) is not None:
            return resp
        try:
            counts = await engine.call(lambda core: core.check_integrity())
        except AssertionError as exc:
            log.error("integrity_check_failed", error=str(exc))
            return JSONResponse({"ok": False, "error": str(exc)}, status_code=500)
        return JSONResponse({"ok": True, **counts._asdict()})

    async def prometheus(request: Request) -> Response:
        snap = engine.snapshot
        if snap is not None:
            metrics.running.set(snap.num_running)
            metrics.waiting.set(snap.num_waiting)
            metrics.kv_usage.set(snap.kv_usage)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start(asyncio.get_running_loop(), deliver)
        yield
        engine.stop()

    app = Starlette(
        routes=[
            Route("/generate", generate, methods=["POST"]),
            Route("/abort", abort, methods=["POST"]),
            Route("/health", health),
            Route("/stats", stats),
            Route("/debug/integrity", integrity),
            Route("/metrics", prometheus),
        ],
        lifespan=lifespan,
    )
    app.state.engine = engine
    return app


def serve(config: EngineConfig, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(build_app(config), host=host, port=port, log_config=None, access_log=False)


def decode_frames(data: bytes) -> list[OutputFrame]:
    """Parse a whole /generate response body (tests and tools)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    return [OutputFrame.from_wire(m) for m in unpacker]
