"""Dispatch: route an engine request to a replica and open its stream, with failover.

:meth:`Dispatcher.open` routes an engine request and opens its stream; a replica that cannot take
it, or whose stream breaks before its first frame, is reported to the pool and the request moves to
the next best replica (at most ``MAX_ATTEMPTS`` replicas per request). A stream that broke after its
first frame is not retried: the client has seen tokens.

When a replica's circuit breaker opens (its health checks time out or fail, or its requests do), the
engine calls this gateway still waits on there are interrupted (:meth:`RoutedStream.interrupt`, called
by the pool): a hung engine (stopped, deadlocked, a host gone silent without closing its connections)
would otherwise hold them forever, since a queued request may legitimately wait long for its first
frame (no read timeout). Interrupted requests move on like broken ones: to another replica before
their first frame, an error after it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import structlog

from engine.protocol import GenerateRequest, OutputFrame
from gateway.engine_client import EngineFailed, EngineRejected, EngineStream, EngineUnavailable
from gateway.metrics import GatewayMetrics
from gateway.pool import EnginePool
from gateway.replica import Replica
from gateway.router import FAILOVER, RouteDecision, Router, RouteRequest

log = structlog.get_logger("gateway.dispatch")

MAX_ATTEMPTS = 3  # replicas tried for one engine request
T = TypeVar("T")


class ReplicaDown(EngineFailed):
    """The request's replica was taken out of service (circuit breaker open) while the request waited on it."""


class NoReplicaAvailable(Exception):
    """No replica could take the request (none ready, or every one tried failed)."""


class Dispatcher:
    """Routes engine requests over the pool's ready replicas with ``router`` and opens their streams."""

    def __init__(self, pool: EnginePool, router: Router, metrics: GatewayMetrics):
        self.pool = pool
        self.router = router
        self.metrics = metrics

    async def route(self, request: RouteRequest, exclude: Sequence[Replica] = ()) -> RouteDecision | None:
        candidates = [r for r in self.pool.replicas if r.ready and r not in exclude]
        return await self.router.choose(request, candidates) if candidates else None

    async def open(self, request: GenerateRequest) -> RoutedStream:
        """Route ``request`` and open its engine stream.

        Raises NoReplicaAvailable when no replica could take it, EngineRejected when an engine refused
        it as invalid (no other would take it either)."""
        stream = RoutedStream(self, request)
        await stream.connect()
        return stream


class RoutedStream:
    """One engine request of this gateway: routed, counted in its replica's load while it runs, and moved
    to another replica when its engine fails before sending a frame. Used by one task."""

    def __init__(self, dispatcher: Dispatcher, request: GenerateRequest):
        self._dispatcher = dispatcher
        self._pool = dispatcher.pool
        self._request = request
        self._route = RouteRequest(request.prompt_ids, request.salt)
        self._tried: list[Replica] = []
        self._stream: EngineStream | None = None
        self._pending_tokens = 0  # counted in replica.pending_prefill_tokens
        self._closed = False
        self._interrupted: str | None = None  # why the replica went down under this request
        self._last_failure: str | None = None  # why the last replica tried could not take it
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
                decision = await self._dispatcher.route(self._route, self._tried)
            if decision is None:
                if not self._tried:
                    raise NoReplicaAvailable("no engine replica is ready")
                raise NoReplicaAvailable(f"every engine replica failed ({len(self._tried)} tried; the last: "
                                         f"{self._last_failure})")
            if self._tried:
                decision = decision._replace(reason=FAILOVER)
            replica = decision.replica
            self._tried.append(replica)
            self._count(decision)  # before the await: concurrent routing sees this request's load
            try:
                self._stream = await self._engine_call(replica.client.open, self._request)
            except ReplicaDown as exc:  # already out of service
                self._uncount()
                self._last_failure = str(exc)
                continue
            except EngineUnavailable as exc:
                self._uncount()
                self._last_failure = str(exc)
                self._pool.report_failure(replica, str(exc), refused=exc.refused)
                continue
            except BaseException:
                self._uncount()
                raise
            self._pool.report_success(replica)
            self._dispatcher.metrics.routed.labels(replica.url, decision.reason).inc()
            self._dispatcher.metrics.predicted_cached_tokens.inc(decision.predicted_cached_tokens)
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
                self._last_failure = str(exc)
                if not isinstance(exc, ReplicaDown):  # that one is already out
                    self._pool.report_failure(self.replica, str(exc))
                if got_frame:
                    raise
                error = exc
            else:
                if got_frame or self._closed:
                    return
                error = EngineFailed(f"engine {self.replica.url} ended the stream without a frame")
                self._last_failure = str(error)
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
