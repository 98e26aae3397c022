"""The engine replicas of this gateway: health polls, breaker reports, the model they serve, metrics.

A replica takes requests (``Replica.ready``) while its last /stats poll answered 200 with the pool's
model shape and its circuit breaker (:mod:`gateway.health`) is closed. Polls are the active health
checks and refresh the load figures routing reads; requests report their failures to the breaker
too (:mod:`gateway.dispatch`). Every state change is logged once (``replica_ready`` /
``replica_down``). When a replica's breaker opens, the requests still waiting on it are interrupted
(see :mod:`gateway.dispatch` for why).

Replicas are the ``--engine`` URLs and, with ``--engine-dns NAME:PORT``, one per address the name
resolves to (a Kubernetes headless Service lists its ready pods), re-resolved before each poll: a
new address is added, a vanished one dropped (its requests finish on their own connections). A name
without records means no engine; a resolver failure keeps the replicas as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import httpx2
import structlog

from gateway.engine_client import EngineClient, EngineUnavailable
from gateway.health import BreakerState, CircuitBreaker
from gateway.metrics import GatewayMetrics
from gateway.replica import ModelInfo, Replica

log = structlog.get_logger("gateway.pool")

_BREAKER_GAUGE = {BreakerState.CLOSED: 0.0, BreakerState.HALF_OPEN: 0.5, BreakerState.OPEN: 1.0}
# getaddrinfo's answers for a name that exists nowhere or has no address: no engine, not a failure.
_NO_RECORDS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}

Resolver = Callable[[str, int], Awaitable[set[str]]]


async def resolve_addresses(name: str, port: int) -> set[str]:
    """The IP addresses ``name`` resolves to (empty when it has none); raises OSError when the resolver fails."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_RECORDS:
            return set()
        raise
    return {info[4][0] for info in infos}


def engine_url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ipaddress.ip_address(address).version == 6 else f"http://{address}:{port}"


class EnginePool:
    """This gateway's replicas: polls their /stats, keeps their readiness and breakers, exports their gauges.
    Event loop only."""

    def __init__(self, urls: Sequence[str], transport: httpx2.AsyncBaseTransport,
                 metrics: GatewayMetrics | None = None, stats_timeout: float = 2.0,
                 breaker: Callable[[], CircuitBreaker] = CircuitBreaker, engine_token: str | None = None,
                 dns: tuple[str, int] | None = None, resolver: Resolver = resolve_addresses):
        self._transport = transport
        self._breaker = breaker
        self._engine_token = engine_token
        self.replicas = [self._replica(url) for url in urls]
        self.metrics = metrics or GatewayMetrics()
        self.model: ModelInfo | None = None
        self._stats_timeout = stats_timeout
        self._dns = dns
        self._resolver = resolver
        self._dns_urls: set[str] = set()  # the replicas that came from the name
        self._dns_error: str | None = None  # the resolver's last failure, logged once

    def _replica(self, url: str) -> Replica:
        return Replica(url, EngineClient(url, self._transport, self._engine_token), breaker=self._breaker())

    def ready_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.ready]

    def unready_summary(self) -> str:
        """Why no replica takes requests, in a client's 503 (GET /health/ready names each replica and its
        error): how many are unreachable (breaker open), not polled yet, or answer without being ready
        (loading, failed, another model shape or replica id)."""
        if not self.replicas:
            return "no engine replica is known" + (f" ({self._dns[0]} has no addresses)" if self._dns else "")
        counts = Counter("unreachable" if not r.breaker.closed else "not polled yet" if r.error is None else "not ready"
                         for r in self.replicas if not r.ready)
        return f"{len(self.replicas)} engine replicas, none ready: " + ", ".join(
            f"{n} {state}" for state, n in sorted(counts.items()))

    async def discover(self) -> None:
        """With ``dns``: resolve the name again, add a replica per new address, drop those whose address is gone."""
        if self._dns is None:
            return
        name, port = self._dns
        try:
            addresses = await self._resolver(name, port)
        except OSError as exc:
            if self._dns_error is None:
                log.warning("engine_dns_failed", name=name, error=str(exc), replicas="kept until it answers")
            self._dns_error = str(exc)
            return
        if self._dns_error is not None:
            log.info("engine_dns_answers", name=name)
            self._dns_error = None
        urls = {engine_url(address, port) for address in addresses}
        for url in sorted(urls - self._dns_urls):
            self.replicas.append(self._replica(url))
            log.info("replica_added", replica=url, name=name)
        for url in sorted(self._dns_urls - urls):
            self.replicas = [r for r in self.replicas if r.url != url]
            self._forget_metrics(url)
            log.info("replica_removed", replica=url, name=name)
        self._dns_urls = urls

    def _forget_metrics(self, url: str) -> None:
        m = self.metrics
        for gauge in (m.replica_ready, m.replica_in_flight, m.replica_pending_prefill, m.replica_utilization,
                      m.replica_breaker):
            with contextlib.suppress(KeyError):  # never exported: it was not scraped while it lived
                gauge.remove(url)

    # --- health ---

    def report_failure(self, replica: Replica, reason: str, refused: bool = False) -> None:
        """A request or probe failed on ``replica`` (``refused``: the connection was refused). When that
        opens its breaker, the requests still waiting on it are interrupted."""
        was_closed = replica.breaker.closed
        replica.failed_at = time.monotonic()
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
                stats = replica.stats  # set: the engine answered ready
                log.info("replica_ready", replica=replica.url, replica_id=stats.replica_id, model=stats.model,
                         max_model_len=stats.max_model_len, block_size=stats.block_size,
                         num_total_blocks=stats.num_total_blocks)
        elif replica.ready or (first_error and reason is not None):
            log.warning("replica_down", replica=replica.url, reason=replica.error,
                        breaker=replica.breaker.state.value)
        replica.ready = ready

    async def poll(self) -> None:
        """Re-resolve ``dns``, then poll every replica's /stats."""
        await self.discover()
        await asyncio.gather(*(self._poll(r) for r in self.replicas))

    async def _poll(self, replica: Replica) -> None:
        if not replica.breaker.probe_due():
            return  # open: cooling down
        asked_at = time.monotonic()
        stats = None
        try:
            stats = await replica.client.stats(self._stats_timeout)
        except EngineUnavailable as exc:
            if isinstance(exc.__cause__, httpx2.TransportError):
                self.report_failure(replica, str(exc), refused=exc.refused)
                return
            reason = str(exc)  # it answered: reachable, just not ready (loading, failed)
        except ValueError as exc:
            reason = f"malformed /stats: {exc}"
        if replica.failed_at > asked_at:
            return  # a request saw it fail while this answer was on its way: the answer is older
        if stats is not None:
            info = ModelInfo.from_stats(stats)
            if self.model is None:
                self.model = info
            # Two engines under one id would mix their caches in the index: the second one is refused.
            owner = next((r for r in self.replicas if r is not replica and r.ready
                          and r.replica_id == stats.replica_id), None)
            if (info.limits, info.block_size) != (self.model.limits, self.model.block_size):
                reason = f"serves a different model shape ({info}) than the pool ({self.model})"
            elif owner is not None:
                reason = (f"its replica_id {stats.replica_id!r} is already used by {owner.url}; "
                          "give each engine its own")
            else:
                replica.observe(stats, time.monotonic())
                replica.engine_ready = True
                self.report_success(replica)
                return
        replica.engine_ready = False
        replica.breaker.record_success()
        self._refresh(replica, reason)

    async def wait_ready(self, timeout: float, require_all: bool,
                         check_alive: Callable[[], None] = lambda: None) -> ModelInfo:
        """Poll until one replica (or all) is ready; raises RuntimeError on timeout.

        ``check_alive`` raises when a spawned engine process has died, so start-up fails fast."""
        deadline = time.monotonic() + timeout
        while True:
            await self.poll()
            ready = self.ready_replicas()
            if self.model is not None and (len(ready) == len(self.replicas) if require_all else ready):
                return self.model
            check_alive()
            if time.monotonic() > deadline:
                errors = [f"{r.url}: {r.error}" for r in self.replicas if not r.ready]
                if self._dns is not None:
                    failure = f" (resolver: {self._dns_error})" if self._dns_error else ""
                    errors.append(f"{self._dns[0]} resolves to {len(self._dns_urls)} address(es){failure}")
                raise RuntimeError(f"engines not ready after {timeout:.0f}s: {'; '.join(errors)}")
            await asyncio.sleep(0.25)

    async def run_health_checks(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.poll()

    def export_metrics(self) -> None:
        """Per-replica gauges, set when /metrics is scraped."""
        m = self.metrics
        for r in self.replicas:
            m.replica_ready.labels(r.url).set(1 if r.ready else 0)
            m.replica_in_flight.labels(r.url).set(r.in_flight)
            m.replica_pending_prefill.labels(r.url).set(r.pending_prefill_tokens)
            m.replica_utilization.labels(r.url).set(r.utilization)
            m.replica_kv_footprint.labels(r.url).set(r.kv_footprint)
            m.replica_breaker.labels(r.url).set(_BREAKER_GAUGE[r.breaker.state])
