"""The engine replicas of this gateway: health, the model they serve, routing with failover.

A replica takes requests (``Replica.ready``) while its last /stats poll answered 200 with the pool's
model shape and its circuit breaker (:mod:`gateway.health`) is closed. Polls are the active health
checks and refresh the load figures routing reads; requests report their failures to the breaker
too. Every state change is logged once (``replica_ready`` / ``replica_down``).

:meth:`EnginePool.open` routes an engine request and opens its stream; a replica that cannot take
it, or whose stream breaks before its first frame, is reported and the request moves to the next
best replica (at most ``MAX_ATTEMPTS`` replicas per request). A stream that broke after its first
frame is not retried: the client has seen tokens.

When a replica's circuit breaker opens (its health checks time out or fail, or its requests do), the
engine calls this gateway still waits on there are interrupted: a hung engine (stopped, deadlocked, a
host gone silent without closing its connections) would otherwise hold them forever, since a queued
request may legitimately wait long for its first frame (no read timeout). Interrupted requests move
on like broken ones: to another replica before their first frame, an error after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import httpx
import structlog

from engine.protocol import GenerateRequest, ModelLimits, OutputFrame
from gateway.engine_client import EngineClient, EngineFailed, EngineRejected, EngineStream, EngineUnavailable
from gateway.health import BreakerState, CircuitBreaker
from gateway.metrics import GatewayMetrics
from gateway.router import FAILOVER, Replica, RouteDecision, Router, RouteRequest

log = structlog.get_logger("gateway.pool")

MAX_ATTEMPTS = 3  # replicas tried for one engine request
T = TypeVar("T")
_BREAKER_GAUGE = {BreakerState.CLOSED: 0.0, BreakerState.HALF_OPEN: 0.5, BreakerState.OPEN: 1.0}


class ReplicaDown(EngineFailed):
    """The request's replica was taken out of service (circuit breaker open) while the request waited on it."""


class NoReplicaAvailable(Exception):
    """No replica could take the request (none ready, or every one tried failed)."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the engines report about the model they serve (GET /stats)."""

    name: str
    limits: ModelLimits
    block_size: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_stats(cls, stats: dict) -> ModelInfo:
        return cls(
            name=str(stats["model"]),
            limits=ModelLimits(vocab_size=int(stats["vocab_size"]), max_model_len=int(stats["max_model_len"])),
            block_size=int(stats["block_size"]),
            eos_token_ids=tuple(stats.get("eos_token_ids", ())),
        )


def _refused(exc: EngineUnavailable) -> bool:
    return isinstance(exc.__cause__, httpx.ConnectError)


class EnginePool:
    def __init__(self, urls: Sequence[str], transport: httpx.AsyncBaseTransport, router: Router,
                 metrics: GatewayMetrics | None = None, stats_timeout: float = 2.0,
                 breaker: Callable[[], CircuitBreaker] = CircuitBreaker):
        self.replicas = [Replica(url, EngineClient(url, transport), breaker=breaker()) for url in urls]
        self.router = router
        self.metrics = metrics or GatewayMetrics()
        self.model: ModelInfo | None = None
        self._stats_timeout = stats_timeout
        self._router_started = False

    def ready_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.ready]

    async def route(self, request: RouteRequest, exclude: Sequence[Replica] = ()) -> RouteDecision | None:
        candidates = [r for r in self.replicas if r.ready and r not in exclude]
        return await self.router.choose(request, candidates) if candidates else None

    async def open(self, request: GenerateRequest) -> RoutedStream:
        """Route ``request`` and open its engine stream.

        Raises NoReplicaAvailable when no replica could take it, EngineRejected when an engine refused
        it as invalid (no other would take it either)."""
        stream = RoutedStream(self, request)
        await stream.connect()
        return stream

    # --- health ---

    def report_failure(self, replica: Replica, reason: str, refused: bool = False) -> None:
        """A request or probe failed on ``replica`` (``refused``: the connection was refused). When that
        opens its breaker, the requests still waiting on it are interrupted."""
        was_closed = replica.breaker.closed
        replica.breaker.record_failure(refused)
        self._refresh(replica, reason)
        if was_closed and not replica.breaker.closed and replica.streams:
            log.warning("replica_requests_interrupted", replica=replica.url, requests=len(replica.streams))
            for stream in list(replica.streams):
                stream.interrupt(f"engine {replica.url} was taken out of service: {reason}")

    def report_success(self, replica: Replica) -> None:
        replica.breaker.record_success()
        self._refresh(replica)

    def _refresh(self, replica: Replica, reason: str | None = None) -> None:
        """Recompute ``ready`` after an event (``reason``: what went wrong, if anything); log a change."""
        first_error = replica.error is None
        if reason is not None:
            replica.error = reason
        ready = replica.engine_ready and replica.breaker.closed
        if ready:
            replica.error = None
            if not replica.ready:
                log.info("replica_ready", replica=replica.url, replica_id=replica.stats.get("replica_id"),
                         model=replica.stats.get("model"), max_model_len=replica.stats.get("max_model_len"),
                         block_size=replica.stats.get("block_size"),
                         num_total_blocks=replica.stats.get("num_total_blocks"))
        elif replica.ready or (first_error and reason is not None):
            log.warning("replica_down", replica=replica.url, reason=replica.error,
                        breaker=replica.breaker.state.value)
        replica.ready = ready

    async def poll(self) -> None:
        await asyncio.gather(*(self._poll(r) for r in self.replicas))

    async def _poll(self, replica: Replica) -> None:
        if not replica.breaker.probe_due():
            return  # open: cooling down
        try:
            stats = await replica.client.stats(self._stats_timeout)
            info = ModelInfo.from_stats(stats)
        except EngineUnavailable as exc:
            if isinstance(exc.__cause__, httpx.TransportError):
                self.report_failure(replica, str(exc), refused=_refused(exc))
                return
            reason = str(exc)  # it answered: reachable, just not ready (loading, failed)
        except (ValueError, KeyError, TypeError) as exc:
            reason = f"malformed /stats: {exc!r}"
        else:
            if self.model is None:
                self.model = info
            replica_id = stats.get("replica_id")
            # Two engines under one id would mix their caches in the index: the second one is refused.
            owner = next((r for r in self.replicas if r is not replica and r.ready and r.replica_id == replica_id
                          and replica_id), None)
            if (info.limits, info.block_size) != (self.model.limits, self.model.block_size):
                reason = f"serves a different model shape ({info}) than the pool ({self.model})"
            elif owner is not None:
                reason = f"its replica_id {replica_id!r} is already used by {owner.url}; give each engine its own"
            else:
                replica.stats = stats
                replica.in_flight_at_poll = replica.in_flight
                if "total_busy_seconds" in stats:
                    replica.observe_busy(stats["total_busy_seconds"], time.monotonic())
                replica.replica_id = replica_id
                replica.engine_ready = True
                self.report_success(replica)
                return
        replica.engine_ready = False
        replica.breaker.record_success()
        self._refresh(replica, reason)

    async def wait_ready(self, timeout: float, require_all: bool,
                         check_alive: Callable[[], None] = lambda: None) -> ModelInfo:
        """Poll until one replica (or all) is ready, then start the router; raises RuntimeError on timeout.

        ``check_alive`` raises when a spawned engine process has died, so start-up fails fast."""
        deadline = time.monotonic() + timeout
        while True:
            await self.poll()
            ready = self.ready_replicas()
            if self.model is not None and (len(ready) == len(self.replicas) if require_all else ready):
                if not self._router_started:
                    await self.router.start(self.model.name, self.model.block_size)
                    self._router_started = True
                return self.model
            check_alive()
            if time.monotonic() > deadline:
                errors = "; ".join(f"{r.url}: {r.error}" for r in self.replicas if not r.ready)
                raise RuntimeError(f"engines not ready after {timeout:.0f}s: {errors}")
            await asyncio.sleep(0.25)

    async def run_health_checks(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.poll()

    async def close(self) -> None:
        await self.router.close()

    def export_metrics(self) -> None:
        """Per-replica gauges, set when /metrics is scraped."""
        m = self.metrics
        for r in self.replicas:
            m.replica_ready.labels(r.url).set(1 if r.ready else 0)
            m.replica_in_flight.labels(r.url).set(r.in_flight)
            m.replica_pending_prefill.labels(r.url).set(r.pending_prefill_tokens)
            m.replica_utilization.labels(r.url).set(r.utilization)
            m.replica_breaker.labels(r.url).set(_BREAKER_GAUGE[r.breaker.state])


class RoutedStream:
    """One engine request of this gateway: routed, counted in its replica's load while it runs, and moved
    to another replica when its engine fails before sending a frame. Used by one task."""

    def __init__(self, pool: EnginePool, request: GenerateRequest):
        self._pool = pool
        self._request = request
        self._route = RouteRequest(request.prompt_ids, request.salt)
        self._tried: list[Replica] = []
        self._stream: EngineStream | None = None
        self._pending_tokens = 0  # counted in replica.pending_prefill_tokens
        self._closed = False
        self._interrupted: str | None = None  # why the replica went down under this request
        self._waiting: asyncio.Task | None = None  # the task awaiting an engine call, during the call
        self.replica: Replica | None = None
        self.decision: RouteDecision | None = None

    @property
    def predicted_cached_tokens(self) -> int:
        return self.decision.predicted_cached_tokens if self.decision else 0

    async def connect(self) -> None:
        """Open the stream on the best replica not tried yet; raises NoReplicaAvailable or EngineRejected."""
        while True:
            decision = None
            if len(self._tried) < MAX_ATTEMPTS:
                decision = await self._pool.route(self._route, self._tried)
            if decision is None:
                raise NoReplicaAvailable("every engine replica failed" if self._tried
                                         else "no engine replica is ready")
            if self._tried:
                decision = decision._replace(reason=FAILOVER)
            replica = decision.replica
            self._tried.append(replica)
            self._count(decision)  # before the await: concurrent routing sees this request's load
            try:
                self._stream = await self._engine_call(replica.client.open, self._request)
            except ReplicaDown:
                self._uncount()
                continue
            except EngineUnavailable as exc:
                self._uncount()
                self._pool.report_failure(replica, str(exc), refused=_refused(exc))
                continue
            except BaseException:
                self._uncount()
                raise
            self._pool.report_success(replica)
            self._pool.metrics.routed.labels(replica.url, decision.reason).inc()
            self._pool.metrics.predicted_cached_tokens.inc(decision.predicted_cached_tokens)
            return

    async def frames(self) -> AsyncIterator[OutputFrame]:
        """The engine's frames; fails over transparently until the first one arrives."""
        while not self._closed:
            got_frame = False
            try:
                async with contextlib.aclosing(self._stream.frames()) as frames:
                    while True:
                        try:
                            frame = await self._engine_call(anext, frames)
                        except StopAsyncIteration:
                            break
                        if not got_frame:
                            got_frame = True
                            self._prefilled()
                        yield frame
            except EngineFailed as exc:
                if self._closed:  # closed by its reader (stop string): not the engine's fault
                    return
                if not isinstance(exc, ReplicaDown):  # that one is already out
                    self._pool.report_failure(self.replica, str(exc))
                if got_frame:
                    raise
                error = exc
            else:
                if got_frame or self._closed:
                    return
                error = EngineFailed(f"engine {self.replica.url} ended the stream without a frame")
                self._pool.report_failure(self.replica, str(error))
            await self._close_stream()
            try:
                await self.connect()
            except (NoReplicaAvailable, EngineRejected) as exc:
                raise EngineFailed(f"{error}; no other replica took the request: {exc}") from None
            log.info("request_failover", error=str(error), replica=self.replica.url)

    def interrupt(self, reason: str) -> None:
        """The replica was taken out of service: end the engine call this request waits on (now, or when
        it next makes one), with ReplicaDown. Called by the pool, on the event loop."""
        if self._interrupted is None:
            self._interrupted = reason
            if self._waiting is not None:
                self._waiting.cancel()

    async def _engine_call(self, fn: Callable[..., Awaitable[T]], *args: object) -> T:
        """``await fn(*args)``, unless :meth:`interrupt` comes first: then ReplicaDown. A flag, not a
        timeout scope per frame, keeps this cheap; the cancellation can only land inside the call."""
        if self._interrupted is not None:
            raise ReplicaDown(self._interrupted)
        task = self._waiting = asyncio.current_task()
        try:
            return await fn(*args)
        except asyncio.CancelledError:
            if self._interrupted is None or task.uncancel() > 0:
                raise  # a real cancellation (the client went away)
            raise ReplicaDown(self._interrupted) from None
        finally:
            self._waiting = None

    async def aclose(self) -> None:
        """Idempotent: closes the stream (which aborts what the engine still runs) and releases the load."""
        self._closed = True
        await self._close_stream()

    async def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            self._uncount()
            await stream.aclose()

    def _count(self, decision: RouteDecision) -> None:
        self.decision = decision
        self.replica = decision.replica
        self.replica.streams.add(self)
        self._interrupted = None
        self._pending_tokens = len(self._request.prompt_ids) - decision.predicted_cached_tokens
        self.replica.pending_prefill_tokens += self._pending_tokens

    def _prefilled(self) -> None:
        self.replica.pending_prefill_tokens -= self._pending_tokens
        self._pending_tokens = 0

    def _uncount(self) -> None:
        self._prefilled()
        self.replica.streams.discard(self)
