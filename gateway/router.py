"""Replica choice: a :class:`Router` picks one ready replica per engine request.

Policies (``--routing``):

- ``prefix`` (default): the replica that predicts the least work for the request (:func:`pick`):
  the work queued there, its uncached prompt tokens (one prefix index lookup of the prompt's
  block hashes) and the cached tokens it would recompute, among the replicas where the request's
  first token comes within ``--prefix-load-bound`` tokens of the soonest one (known queue plus its
  own uncached tokens). Cached tokens in an engine's host-memory tier (``--host-kv-cache-gib``)
  count as reused, at ``HOST_HIT_COST`` of a computed token each: cheaper than recompute, dearer
  than a hit in the engine's KV pool. Without an answer from the index it routes on the queues alone. The queue
  known to wait there (this gateway's requests before their first token, other gateways' requests
  from the engine's /stats) sets the bound; the score takes the larger of it and what the
  replica's utilization predicts (:func:`expected_queue`): between the turns of its conversations a
  busy replica's queue is empty, yet their next turns will come back. Ties (a new conversation
  on idle replicas, above all) go to the replica whose KV holds least (:attr:`Replica.kv_footprint`,
  from /stats), then to one at random: never by list order, which put every new conversation on
  the same replica while its conversations ran one after another.
- ``least-load``: fewest requests (this gateway's in flight plus the engine's queue).
- ``round-robin``: in turn.

The two baselines exist for A/B runs (``python -m loadtest.ab``).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple
from urllib.parse import urlsplit

import structlog

from gateway.replica import Replica
from prefix_index.hashing import BlockHash, block_hashes
from prefix_index.index import IndexUnavailableError, PrefixIndex, TierMatch, open_index, redact_url

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.metrics import GatewayMetrics

log = structlog.get_logger("gateway.router")

# Routing reasons: the ``reason`` label of kvgate_gateway_routed.
PREFIX_HIT = "prefix_hit"  # the best-cached replica
LOAD_OVERRIDE = "load_override"  # another replica had more of the prompt cached, but too much queued
PREFIX_MISS = "prefix_miss"  # no replica holds any block of the prompt: by load
NO_INDEX = "no_index"  # the index did not answer (down, slow, backing off): by load
LEAST_LOAD = "least_load"
ROUND_ROBIN = "round_robin"
FAILOVER = "failover"  # a retry after the replica chosen first failed

# After the index failed, route without it this long before asking again, so a dead Redis costs
# requests nothing. A lone timeout only routes its request by load (a loaded host may just be slow);
# repeated ones count as the index being down.
INDEX_RETRY_S = 1.0
TIMEOUTS_BEFORE_BACKOFF = 3
# A cold client connects and loads its Lua scripts on first use: slower than a request may wait.
CONNECT_TIMEOUT_S = 5.0
NO_MATCH = TierMatch(0, 0)
LOAD_EWMA_WEIGHT = 0.1  # of the latest request in the running mean of uncached prompt tokens
MAX_UTILIZATION = 0.95  # caps the expected queue at 19 requests
# What a prompt token served from an engine's host tier costs, in computed tokens: the copy back
# over PCIe (an 8B model's 128 KiB of KV per token at ~50 GB/s) takes about a tenth of its
# recompute (~40K tokens/s of prefill on an H200), rounded up for the step that waits on it.
HOST_HIT_COST = 0.2


class RouteRequest(NamedTuple):
    prompt_ids: list[int]
    salt: str | None


class RouteDecision(NamedTuple):
    replica: Replica
    reason: str  # metric label: why this replica
    predicted_cached_tokens: int = 0


class Router(ABC):
    """Chooses a replica for one engine request.

    ``choose`` runs on the event loop and must not block; it may await (an index lookup). It gets a
    non-empty list of ready candidates and must return one of them. It must not mutate replicas:
    the dispatcher counts in-flight requests itself, right after ``choose`` returns. The app's
    lifespan calls ``start`` once the engines' model is known, ``close`` at shutdown.
    """

    policy: ClassVar[str]

    @abstractmethod
    async def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> RouteDecision: ...

    async def start(self, model: str, block_size: int) -> None:  # noqa: B027 — optional hook
        """Called once with the engines' model name and block size (from their /stats)."""

    async def close(self) -> None:  # noqa: B027 — optional hook
        """Release what ``start`` opened."""


class RoundRobinRouter(Router):
    policy = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    async def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> RouteDecision:
        return RouteDecision(candidates[next(self._turn) % len(candidates)], ROUND_ROBIN)


def _rotated(candidates: Sequence[Replica], turn: int) -> list[Replica]:
    """Candidates starting at ``turn``: min() then gives ties to each replica in turn."""
    start = turn % len(candidates)
    return [*candidates[start:], *candidates[:start]]


class LeastLoadRouter(Router):
    """Fewest requests on the replica: this gateway's in-flight ones plus the engine's queue.
    Ties rotate, so equal replicas share the work."""

    policy = "least-load"

    def __init__(self) -> None:
        self._turn = itertools.count()

    async def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> RouteDecision:
        rotated = _rotated(candidates, next(self._turn))
        return RouteDecision(min(rotated, key=lambda r: r.in_flight + r.queued), LEAST_LOAD)


class Candidate(NamedTuple):
    """A replica as the prefix policy scores it; all work in prompt tokens to compute."""

    cached_tokens: int  # predicted reusable prompt tokens there
    uncached_tokens: int  # the prompt tokens it would compute
    load_tokens: int  # prefill work known to be queued there
    requests: int  # requests on it (the tie-breaker: decoding requests queue no prefill)
    expected_load_tokens: int = 0  # the queue its utilization predicts (see expected_queue)
    kv_footprint: float = 0.0  # share of its KV holding something (the next tie-breaker)
    host_tokens: int = 0  # of cached_tokens, those its host tier holds (loaded back, not recomputed)


def pick(candidates: Sequence[Candidate], load_bound: int, rng: random.Random) -> tuple[int, str]:
    """Index of the replica to use and the reason.

    The predicted work of a replica is what the request waits for there (its queue: the larger of
    the known and the expected one, then its own uncached tokens and ``HOST_HIT_COST`` of each
    token it loads back from its host tier) plus what choosing it wastes: the tokens it recomputes
    that the best-cached replica holds. Least work wins (then fewest
    requests, then the smallest KV footprint, then ``rng``'s draw) among the replicas where the
    request would reach its first
    token (known queue, then its own uncached tokens) at most ``load_bound`` tokens after the
    soonest one: the bound caps what affinity may cost the request. Leaving costs the request its
    own recompute, so a late turn stays until its queue outgrows that recompute (a bound on the
    queues alone moved late turns off evenly saturated replicas at every fluctuation, each move a
    whole recompute more). Counting the waste keeps requests that share a prefix together: a
    second identical request waits for the first's prefill rather than computing it again
    elsewhere, and a late turn of a conversation stays on its busy replica, while a new
    conversation, which would waste only its system prompt, goes to an idler one. The footprint
    spreads new prefixes, as SGLang's router does with its smallest cache tree: the replica whose
    cache holds least loses least to the new prefix's blocks.
    """
    most_cached = max(c.cached_tokens for c in candidates)
    first_token = [c.load_tokens + c.uncached_tokens for c in candidates]
    soonest = min(first_token)
    draws = [rng.random() for _ in candidates]

    def work(i: int) -> tuple[int, int, float, float]:
        c = candidates[i]
        queue = max(c.load_tokens, c.expected_load_tokens)
        own = c.uncached_tokens + HOST_HIT_COST * c.host_tokens
        return queue + own + (most_cached - c.cached_tokens), c.requests, c.kv_footprint, draws[i]

    best = min((i for i in range(len(candidates)) if first_token[i] <= soonest + load_bound), key=work)
    if most_cached == 0:
        return best, PREFIX_MISS
    return best, PREFIX_HIT if candidates[best].cached_tokens == most_cached else LOAD_OVERRIDE


def expected_queue(utilization: float) -> float:
    """Requests an arrival finds at a replica this busy, as in an M/M/1 queue: ρ / (1 − ρ)."""
    rho = min(utilization, MAX_UTILIZATION)
    return rho / (1.0 - rho)


@dataclass(frozen=True, slots=True)
class PrefixSettings:
    """The prefix policy's settings; their defaults are the gateway config's."""

    load_bound_tokens: int
    lookup_timeout_s: float
    speculative_ttl_s: float

    @classmethod
    def from_config(cls, config: GatewayConfig) -> PrefixSettings:
        return cls(config.prefix_load_bound, config.index_lookup_timeout, config.speculative_ttl)


class GuardedIndex:
    """The prefix index as a hint: a call that fails or is too slow answers None, never an error.

    Each call is bounded by ``timeout_s``. An unavailable index (an error, or
    ``TIMEOUTS_BEFORE_BACKOFF`` timeouts in a row) is logged once per change of state and not asked
    again for ``INDEX_RETRY_S``. Speculative inserts run in the background. Event loop only.
    """

    def __init__(self, index: PrefixIndex, url: str, timeout_s: float, metrics: GatewayMetrics):
        self._index = index
        self._url = url
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._ok: bool | None = None  # None until the first answer
        self._retry_at = 0.0
        self._timeouts = 0
        self._background: set[asyncio.Task] = set()

    async def connect(self) -> None:
        """Connect now, and log whether the index answers."""
        try:
            await asyncio.wait_for(self._index.lookup([]), CONNECT_TIMEOUT_S)
        except TimeoutError:
            self._down(f"no answer within {CONNECT_TIMEOUT_S:.0f} s")
        except IndexUnavailableError as exc:
            self._down(str(exc))
        else:
            self._up()

    async def lookup(self, hashes: list[BlockHash]) -> dict[str, TierMatch] | None:
        """Matched blocks per live replica id, by tier, or None without an answer in time."""
        if time.monotonic() < self._retry_at:
            return None
        start = time.perf_counter()
        matched = await self._guarded(self._index.lookup_tiers(hashes))
        if matched is not None:
            self._metrics.index_lookup.observe(time.perf_counter() - start)
        return matched

    def insert_speculative(self, replica_id: str, hashes: list[BlockHash], ttl_s: float) -> None:
        """Start the insert in the background."""
        task = asyncio.ensure_future(self._guarded(self._index.insert_speculative(replica_id, hashes, ttl_s)))
        self._background.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._background)  # each bounded by the timeout
        await self._index.close()

    async def _guarded(self, call: Awaitable[Any]) -> Any | None:
        """The call's result, or None when the index failed or was too slow (its state updated)."""
        try:
            result = await asyncio.wait_for(call, self._timeout_s)
        except TimeoutError:
            self._timeouts += 1
            if self._timeouts >= TIMEOUTS_BEFORE_BACKOFF:
                self._down(f"no answer within {self._timeout_s * 1e3:.0f} ms, {self._timeouts} times in a row")
            return None
        except IndexUnavailableError as exc:
            self._down(str(exc))
            return None
        self._up()
        return result

    def _up(self) -> None:
        self._timeouts = 0
        if not self._ok:
            log.info("prefix_index_available", index_url=self._url)
            self._ok = True
            self._metrics.index_available.set(1)

    def _down(self, error: str) -> None:
        self._retry_at = time.monotonic() + INDEX_RETRY_S
        if self._ok is not False:
            log.warning("prefix_index_unavailable", index_url=self._url, error=error,
                        routing="by load until it answers again")
            self._ok = False
            self._metrics.index_available.set(0)


class PrefixRouter(Router):
    """Prefix-cache-aware routing over the shared index (see the module docstring).

    Cache information comes from one :meth:`PrefixIndex.lookup_tiers` per request through a
    :class:`GuardedIndex` (``lookup_timeout_s``); without an answer the request is routed by load.
    After each choice the prompt's blocks are inserted as speculative entries of the chosen replica
    (``speculative_ttl_s``, in the background), so that concurrent requests with the same prefix,
    from any gateway, follow before the engine's own events arrive. Index replica ids map to
    replicas through each engine's /stats ``replica_id``.
    """

    policy = "prefix"

    def __init__(self, index_url: str, settings: PrefixSettings, metrics: GatewayMetrics):
        self._index_url = index_url
        self._settings = settings
        self._metrics = metrics
        self._index: GuardedIndex | None = None
        self._block_size = 0
        self._rng = random.Random()
        self._mean_uncached = 0.0  # running mean of the uncached prompt tokens of routed requests
        self._seen_requests = False

    async def start(self, model: str, block_size: int) -> None:
        index = open_index(self._index_url, model, block_size)
        self._index = GuardedIndex(index, redact_url(self._index_url), self._settings.lookup_timeout_s, self._metrics)
        self._block_size = block_size
        if urlsplit(self._index_url).scheme == "memory":
            log.warning("prefix_index_local", index_url=self._index_url,
                        reason="engines in other processes cannot publish to a memory:// index, so prefix "
                               "routing routes by load; give gateway and engines a shared --index-url redis://")
        await self._index.connect()

    async def close(self) -> None:
        if self._index is not None:
            await self._index.close()

    async def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> RouteDecision:
        assert self._index is not None, "start() first"
        num_tokens = len(request.prompt_ids)
        hashes = block_hashes(request.prompt_ids, self._block_size, request.salt)  # as the engine does
        matched = await self._index.lookup(hashes) if hashes else {}
        scored = []
        for r in candidates:
            match = matched.get(r.replica_id, NO_MATCH) if matched and r.replica_id else NO_MATCH
            cached = min(match.total * self._block_size, num_tokens - 1)  # one token is always computed
            host = max(cached - match.device * self._block_size, 0)
            load = r.pending_prefill_tokens + round(r.other_requests * self._mean_uncached)
            expected = round(expected_queue(r.utilization) * self._mean_uncached)
            scored.append(Candidate(cached, num_tokens - cached, load, r.in_flight + r.other_requests, expected,
                                    r.kv_footprint, host))
        best, reason = pick(scored, self._settings.load_bound_tokens, self._rng)
        chosen, score = candidates[best], scored[best]
        weight = LOAD_EWMA_WEIGHT if self._seen_requests else 1.0
        self._mean_uncached += weight * (score.uncached_tokens - self._mean_uncached)
        self._seen_requests = True
        if matched is None:
            return RouteDecision(chosen, NO_INDEX)
        self._metrics.matched_blocks.observe(score.cached_tokens // self._block_size)
        if hashes and chosen.replica_id is not None:
            self._index.insert_speculative(chosen.replica_id, hashes, self._settings.speculative_ttl_s)
        return RouteDecision(chosen, reason, score.cached_tokens)


ROUTERS: dict[str, type[Router]] = {cls.policy: cls for cls in (PrefixRouter, LeastLoadRouter, RoundRobinRouter)}


def make_router(config: GatewayConfig, metrics: GatewayMetrics) -> Router:
    """The router of ``config.routing``; raises ValueError for an unknown policy."""
    if config.routing not in ROUTERS:
        raise ValueError(f"unknown routing policy {config.routing!r}; choose one of {', '.join(ROUTERS)}")
    if config.routing == PrefixRouter.policy:
        return PrefixRouter(config.index_url, PrefixSettings.from_config(config), metrics)
    return ROUTERS[config.routing]()
