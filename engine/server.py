"""The engine sidecar's HTTP side: the routes, the open streams and the metrics.

With a token, every endpoint but /health wants ``Authorization: Bearer <token>`` (:class:`TokenAuth`):
a request's salt is a tenant's cache, so whoever may call /generate may read it.

The engine runs elsewhere: in a process of its own (:class:`engine.proc.EngineProcess`, the default) or
in a thread of this one (:class:`engine.loop.EngineThread`, ``--no-engine-process``). Either takes
commands (submit, abort, named requests) and delivers :class:`engine.loop.StepOutput` on the event loop:
each stream gets its frames of a delivery as one list, merged into one frame per sequence, so a stream
writes once per delivery. :class:`Sidecar` holds the handlers and the open streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import time
from collections.abc import AsyncIterator, Callable

import structlog
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loop import EngineThread, StepOutput
from engine.metrics import Metrics
from engine.proc import EngineProcess
from engine.protocol import MSGPACK, GenerateRequest, OutputFrame, ProtocolError, unpack_generate_request

log = structlog.get_logger("engine.server")


class _Stream:
    """The event-loop side of one request: frames arrive here from the engine."""

    __slots__ = ("frames", "open_indices", "arrival", "first_token_at", "prompt_len", "cached", "generated",
                 "last_token_at")

    def __init__(self, n: int, prompt_len: int):
        self.frames: asyncio.Queue[list[OutputFrame]] = asyncio.Queue()
        self.open_indices = set(range(n))  # sequences not finished yet
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.prompt_len = prompt_len
        self.cached = 0
        self.generated = 0
        self.last_token_at: dict[int, float] = {}  # per sequence, for the inter-token latency


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "param": param}}, status_code=status)


class Sidecar:
    """The HTTP side of one engine: its routes, the open streams and the metrics."""

    def __init__(self, engine: EngineProcess | EngineThread, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        self.streams: dict[str, _Stream] = {}

    def routes(self) -> list[Route]:
        return [
            Route("/generate", self.generate, methods=["POST"]),
            Route("/abort", self.abort, methods=["POST"]),
            Route("/health", self.health),
            Route("/stats", self.stats),
            Route("/debug/integrity", self.integrity),
            Route("/metrics", self.prometheus),
        ]

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.engine.start(asyncio.get_running_loop(), self._deliver, self._fail_streams)
        yield
        self.engine.stop()

    def _deliver(self, output: StepOutput) -> None:
        metrics = self.metrics
        for seconds in output.step_seconds:
            metrics.step_seconds.observe(seconds)
        metrics.steps.inc(len(output.step_seconds))
        for seconds in output.queue_seconds:
            metrics.queue_time.observe(seconds)
        by_request: dict[str, list[OutputFrame]] = {}
        for frame in output.frames:
            by_request.setdefault(frame.request_id, []).append(frame)
        for request_id, chunk in by_request.items():
            stream = self.streams.get(request_id)
            if stream is not None:
                stream.frames.put_nowait(chunk)

    def _fail_streams(self, exc: BaseException) -> None:
        """The engine failed: end every open sequence of every stream with an error frame."""
        for request_id, stream in self.streams.items():
            stream.frames.put_nowait([
                OutputFrame(request_id, index, finish_reason="error", error=f"engine failed: {exc}")
                for index in sorted(stream.open_indices)
            ])

    def _not_ready(self) -> JSONResponse | None:
        if self.engine.failed is not None:
            when = "" if self.engine.ready.is_set() else " to start"
            return error_response(503, f"engine failed{when}: {self.engine.failed}")
        if not self.engine.ready.is_set():
            return error_response(503, "engine is loading")
        return None

    async def generate(self, request: Request) -> Response:
        if (resp := self._not_ready()) is not None:
            return resp
        body = await request.body()
        try:
            gen = unpack_generate_request(body, self.engine.limits)
            if gen.sampling.structured is not None:
                # Compiled off the step loop; the engine then finds it in the compiler's cache.
                await self.engine.request("compile", gen.sampling.structured.to_wire())
        except ProtocolError as exc:
            log.info("generate_rejected", status=400, error=exc.message, param=exc.param)
            return error_response(400, exc.message, exc.param)
        except Exception:
            if self.engine.failed is None:
                raise
            return self._not_ready()  # the engine's failure ended the request
        if gen.request_id in self.streams:
            return error_response(400, f"request_id {gen.request_id!r} is already running", "request_id")
        if (resp := self._not_ready()) is not None:  # failed while this request was read: nothing would end it
            return resp
        stream = _Stream(gen.sampling.n, len(gen.prompt_ids))
        self.streams[gen.request_id] = stream
        self.engine.submit(gen)
        return StreamingResponse(self._frames(gen, stream), media_type=MSGPACK)

    async def _frames(self, gen: GenerateRequest, stream: _Stream) -> AsyncIterator[bytes]:
        reasons: list[str] = []
        try:
            while stream.open_indices:
                chunks = await stream.frames.get()
                while not stream.frames.empty():
                    chunks += stream.frames.get_nowait()
                chunks = OutputFrame.merge(chunks)  # one frame per sequence: a delivery may carry several steps
                for f in chunks:
                    self._account(stream, f, reasons)
                yield b"".join(f.pack() for f in chunks)
        finally:
            self.streams.pop(gen.request_id, None)
            if stream.open_indices:  # the client went away first
                self.engine.abort(gen.request_id)
                reasons.append("abort")
            self._log_request(gen, stream, reasons)

    def _account(self, stream: _Stream, frame: OutputFrame, reasons: list[str]) -> None:
        if frame.token_ids:
            now = time.perf_counter()
            if stream.first_token_at is None:
                stream.first_token_at = now
                self.metrics.ttft.observe(now - stream.arrival)
            last = stream.last_token_at.get(frame.index)
            if last is not None:
                for _ in frame.token_ids:  # a frame of k tokens: k gaps of a k-th of its wait
                    self.metrics.inter_token_latency.observe((now - last) / len(frame.token_ids))
            stream.last_token_at[frame.index] = now
        stream.generated += len(frame.token_ids)
        stream.cached = frame.num_cached_tokens
        if frame.finish_reason is not None:
            stream.open_indices.discard(frame.index)
            reasons.append(frame.finish_reason)

    def _log_request(self, gen: GenerateRequest, stream: _Stream, reasons: list[str]) -> None:
        reason = reasons[-1] if reasons else "abort"
        metrics = self.metrics
        metrics.requests.labels(reason).inc()
        metrics.prompt_tokens.inc(stream.prompt_len)
        metrics.cached_tokens.inc(stream.cached)
        metrics.generation_tokens.inc(stream.generated)
        metrics.e2e_latency.observe(time.perf_counter() - stream.arrival)
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

    async def abort(self, request: Request) -> Response:
        try:
            payload = await request.json()
            request_id = payload["request_id"]
            if not isinstance(request_id, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return error_response(400, 'body must be JSON {"request_id": "<id>"}', "request_id")
        self.engine.abort(request_id)
        return JSONResponse({"request_id": request_id, "aborted": request_id in self.streams})

    async def health(self, request: Request) -> Response:
        return self._not_ready() or JSONResponse({"status": "ready"})

    async def stats(self, request: Request) -> Response:
        return self._not_ready() or JSONResponse(self.engine.snapshot.to_wire())

    async def integrity(self, request: Request) -> Response:
        if (resp := self._not_ready()) is not None:
            return resp
        try:
            return JSONResponse(await self.engine.request("integrity"))
        except AssertionError as exc:
            log.error("integrity_check_failed", error=str(exc))
            return JSONResponse({"ok": False, "error": str(exc)}, status_code=500)
        except Exception:
            if self.engine.failed is None:
                raise
            return self._not_ready()  # the engine's failure ended the request

    async def prometheus(self, request: Request) -> Response:
        snap = self.engine.snapshot
        if snap is not None:
            self.metrics.running.set(snap.num_running)
            self.metrics.waiting.set(snap.num_waiting)
            self.metrics.kv_usage.set(snap.kv_usage)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


class TokenAuth:
    """Pure-ASGI check of the engines' token, in constant time; /health stays open for probes."""

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app: ASGIApp, token: str):
        self.app = app
        self._digest = hashlib.sha256(f"Bearer {token}".encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(hashlib.sha256(given).digest(), self._digest):
                response = error_response(401, "missing or wrong engine token (Authorization: Bearer <token>)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def build_app(config: EngineConfig, make_core: Callable[[], EngineCore] | None = None,
              token: str | None = None, engine_process: bool = True) -> ASGIApp:
    """The sidecar's app, behind ``token`` when given. The engine runs in a process of its own, or with
    ``engine_process=False`` in a thread of this one; its core comes from ``make_core`` (in an engine
    process a module-level function, run there), else from ``config`` (with ``tensor_parallel_size`` > 1
    rank 0 of a tensor-parallel engine, whose ranks it starts)."""
    metrics = Metrics(config.served_name)
    engine = (EngineProcess if engine_process else EngineThread)(config, make_core)
    if config.speculative is not None:
        metrics.add_spec_decode(lambda: engine.snapshot)
    sidecar = Sidecar(engine, metrics)
    app = Starlette(routes=sidecar.routes(), lifespan=sidecar.lifespan)
    return TokenAuth(app, token) if token is not None else app


def serve(config: EngineConfig, host: str, port: int, token: str | None, engine_process: bool = True) -> None:
    import uvicorn

    uvicorn.run(build_app(config, token=token, engine_process=engine_process), host=host, port=port,
                log_config=None, access_log=False)
