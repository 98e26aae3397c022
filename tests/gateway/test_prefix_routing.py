"""Prefix routing, replica health and failover, in process: the scoring rule, the router over a real
memory:// index (and a failing one), the circuit breaker on a fake clock, and the pool against engines
mocked at the HTTP transport."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import uuid
from collections.abc import Sequence

import httpx2
import pytest
from stats_testing import engine_stats
from structlog.testing import capture_logs

from engine.protocol import GenerateRequest, OutputFrame, SamplingParams
from gateway import replica as replica_module
from gateway import router as router_module
from gateway.config import GatewayConfig
from gateway.dispatch import MAX_ATTEMPTS, Dispatcher, NoReplicaAvailable
from gateway.engine_client import EngineFailed
from gateway.health import BreakerState, CircuitBreaker
from gateway.metrics import GatewayMetrics
from gateway.pool import EnginePool
from gateway.replica import Replica
from gateway.router import Candidate, PrefixRouter, PrefixSettings, RoundRobinRouter, RouteRequest, pick
from prefix_index.events import HOST, BlockStored, KVEventBatch
from prefix_index.hashing import block_hashes
from prefix_index.index import IndexUnavailableError, PrefixIndex, TierMatch, open_index

MODEL, BLOCK = "tiny", 16
PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks
STATS = engine_stats(model=MODEL, block_size=BLOCK).to_wire()


# --- the scoring rule ---


@pytest.mark.parametrize("candidates, bound, expected", [
    # equal queues: the best-cached replica
    ([Candidate(0, 100, 0, 0), Candidate(64, 36, 0, 0), Candidate(32, 68, 0, 0)], 4096, (1, "prefix_hit")),
    # a second request with the same prompt waits behind the first rather than recomputing it elsewhere
    ([Candidate(99, 1, 100, 1), Candidate(0, 100, 0, 0)], 4096, (0, "prefix_hit")),
    # ... but never beyond the bound: there its first token comes 101 tokens on, here after 100
    ([Candidate(99, 1, 100, 1), Candidate(0, 100, 0, 0)], 0, (1, "load_override")),
    # a late turn on an evenly busy replica stays: leaving would recompute its 7000 cached tokens
    ([Candidate(7000, 500, 6000, 4), Candidate(0, 7500, 1500, 1)], 4096, (0, "prefix_hit")),
    # ... until its queue outgrows that recompute by the bound
    ([Candidate(7000, 500, 14000, 8), Candidate(0, 7500, 1500, 1)], 4096, (1, "load_override")),
    # a one-block match does not buy a long queue: waiting costs more than the 16 tokens it saves
    ([Candidate(16, 984, 200, 1), Candidate(0, 1000, 0, 0)], 4096, (1, "load_override")),
    # nothing cached anywhere: the shortest queue, then the fewest requests, then the smallest KV footprint
    ([Candidate(0, 100, 50, 0), Candidate(0, 100, 10, 3), Candidate(0, 100, 10, 1)], 4096, (2, "prefix_miss")),
    ([Candidate(0, 100, 0, 2, 0, 0.5), Candidate(0, 100, 0, 2, 0, 0.25)], 4096, (1, "prefix_miss")),
    ([Candidate(0, 100, 0, 1, 0, 0.5), Candidate(0, 100, 0, 2, 0, 0.25)], 4096, (0, "prefix_miss")),
    # a busy replica (expected queue 9000) keeps a late turn, whose 7000 cached tokens would be
    # recomputed elsewhere, but a new conversation, which would recompute only its system prompt, moves
    ([Candidate(7000, 500, 0, 1, 9000), Candidate(0, 7500, 0, 0)], 4096, (0, "prefix_hit")),
    ([Candidate(2000, 800, 0, 1, 9000), Candidate(0, 2800, 0, 0)], 4096, (1, "load_override")),
    # the best-cached replica's queue puts the first token past the bound; among the others, cache
    # still counts
    ([Candidate(90, 10, 200, 2), Candidate(48, 52, 0, 0), Candidate(0, 100, 0, 0)], 50, (1, "load_override")),
    # a prefix in a host tier (loaded back) beats recomputing it, and loses to the same prefix in a KV pool
    ([Candidate(0, 1000, 0, 0), Candidate(800, 200, 0, 0, 0, 0.0, 800)], 4096, (1, "prefix_hit")),
    ([Candidate(800, 200, 0, 0, 0, 0.0, 800), Candidate(800, 200, 0, 0)], 4096, (1, "prefix_hit")),
    ([Candidate(800, 200, 0, 0, 0, 0.0, 500), Candidate(800, 200, 0, 0, 0, 0.0, 600)], 4096, (0, "prefix_hit")),
    # ... and a longer prefix there beats a shorter one in a pool when it saves more than it costs
    ([Candidate(800, 200, 0, 0, 0, 0.0, 400), Candidate(400, 600, 0, 0)], 4096, (0, "prefix_hit")),
])
def test_pick(candidates: list[Candidate], bound: int, expected: tuple[int, str]):
    assert pick(candidates, bound, random.Random(0)) == expected


def test_ties_are_drawn_at_random_never_by_list_order():
    rng = random.Random(1)
    counts = collections.Counter(pick([Candidate(0, 100, 0, 0, 0, 0.1)] * 4, 4096, rng)[0] for _ in range(400))
    assert sorted(counts) == [0, 1, 2, 3] and min(counts.values()) >= 70, counts
    # a tie in work and requests with a footprint apart is no tie
    assert {pick([Candidate(0, 100, 0, 0, 0, 0.1), Candidate(0, 100, 0, 0, 0, 0.0)], 4096, rng)[0]
            for _ in range(50)} == {1}


def test_the_kv_footprint_is_the_larger_of_blocks_in_use_and_blocks_cached():
    r = replica("a", "e0")
    assert r.kv_footprint == 0.0
    r.stats = engine_stats(num_free_blocks=48, num_cached_blocks=8)  # 16 of 64 in use
    assert r.kv_footprint == 0.25
    r.stats = engine_stats(num_free_blocks=60, num_cached_blocks=32)  # idle, half of it cached
    assert r.kv_footprint == 0.5
    assert replica("b").kv_footprint == 0.0  # no /stats yet


# --- the router over an index ---


def sample(metric, suffix: str = "") -> float:
    (value,) = [s.value for s in metric.collect()[0].samples if s.name.endswith(suffix)]
    return value


def replica(name: str, replica_id: str | None = None, **fields) -> Replica:
    """A ready replica; one with an index id has an idle engine's /stats."""
    stats = engine_stats(replica_id=replica_id) if replica_id is not None else None
    return Replica(f"http://{name}", client=None, ready=True, stats=stats, **fields)


async def live_index(url: str, held: dict[str, Sequence[bytes]]) -> PrefixIndex:
    """A memory:// index where replica id -> the listed blocks (stored durably) and every one is live."""
    index = open_index(url, MODEL, BLOCK)
    for replica_id, hashes in held.items():
        await index.apply(KVEventBatch(replica_id, 1, [BlockStored(list(hashes))] if hashes else []))
        assert await index.heartbeat(replica_id, 1, ttl_s=60)
    return index


async def started_router(url: str, metrics: GatewayMetrics | None = None, **settings) -> PrefixRouter:
    defaults = PrefixSettings.from_config(GatewayConfig())
    router = PrefixRouter(url, dataclasses.replace(defaults, **settings), metrics or GatewayMetrics())
    await router.start(MODEL, BLOCK)
    return router


@pytest.fixture
def index_url() -> str:
    return f"memory://routing-{uuid.uuid4().hex}"


async def test_router_follows_the_index_with_the_tenant_salt(index_url):
    hashes = block_hashes(PROMPT, BLOCK, "tenant-a")
    index = await live_index(index_url, {"e0": [], "e1": hashes[:4], "e2": hashes[:2]})
    metrics = GatewayMetrics()
    router = await started_router(index_url, metrics)
    replicas = [replica("a", "e0"), replica("b", "e1"), replica("c", "e2")]
    decision = await router.choose(RouteRequest(PROMPT, "tenant-a"), replicas)
    assert (decision.replica.url, decision.reason, decision.predicted_cached_tokens) == ("http://b", "prefix_hit", 64)
    assert sample(metrics.matched_blocks, "_sum") == 4
    # another tenant's salt hashes differently: nothing is cached for it
    other = await router.choose(RouteRequest(PROMPT, "tenant-b"), replicas)
    assert (other.reason, other.predicted_cached_tokens) == ("prefix_miss", 0)
    # a replica whose id the index does not know, or that has none, predicts nothing
    unknown = await router.choose(RouteRequest(PROMPT, "tenant-a"), [replica("a", "e0"), replica("x")])
    assert unknown.reason == "prefix_miss"
    await router.close()
    await index.close()


async def test_a_host_tier_hit_routes_between_a_pool_hit_and_a_miss(index_url):
    """e0 holds 2 blocks in its KV pool and the next 3 in its host tier; e1 holds all 5 in its pool."""
    hashes = block_hashes(PROMPT, BLOCK)
    index = await live_index(index_url, {"e0": hashes[:2], "e1": hashes[:5], "e2": []})
    await index.apply(KVEventBatch("e0", 1, [BlockStored(hashes[2:5], None, HOST)]))
    router = await started_router(index_url)
    missing = await router.choose(RouteRequest(PROMPT, None), [replica("a", "e0"), replica("c", "e2")])
    assert (missing.replica.url, missing.reason, missing.predicted_cached_tokens) == ("http://a", "prefix_hit", 80)
    pooled = await router.choose(RouteRequest(PROMPT, None), [replica("a", "e0"), replica("b", "e1")])
    assert (pooled.replica.url, pooled.reason, pooled.predicted_cached_tokens) == ("http://b", "prefix_hit", 80)
    await router.close()
    await index.close()


async def test_a_fully_cached_prompt_still_computes_one_token(index_url):
    prompt = PROMPT[:64]
    index = await live_index(index_url, {"e0": block_hashes(prompt, BLOCK), "e1": []})
    router = await started_router(index_url)
    decision = await router.choose(RouteRequest(prompt, None), [replica("a", "e0"), replica("b", "e1")])
    assert (decision.replica.url, decision.predicted_cached_tokens) == ("http://a", 63)
    await router.close()
    await index.close()


async def test_speculative_entries_bring_a_prefix_together_across_gateways(index_url):
    """Gateway A routes a fresh prompt; gateway B, asked for the same prefix before the engine computed
    anything, sends it to the same replica."""
    index = await live_index(index_url, {"e0": [], "e1": [], "e2": []})
    gateway_a, gateway_b = await started_router(index_url), await started_router(index_url)
    replicas_a = [replica(n, f"e{i}") for i, n in enumerate("abc")]
    replicas_b = [replica(n, f"e{i}") for i, n in enumerate("abc")]
    first = await gateway_a.choose(RouteRequest(PROMPT, None), replicas_a)
    assert first.reason == "prefix_miss"
    chosen_id = first.replica.replica_id
    hashes = block_hashes(PROMPT, BLOCK)
    for _ in range(100):  # the insert runs in the background
        if (await index.lookup(hashes)).get(chosen_id) == len(hashes):
            break
        await asyncio.sleep(0.01)
    longer = PROMPT + [7] * 40  # the next turn of the conversation
    second = await gateway_b.choose(RouteRequest(longer, None), replicas_b)
    assert (second.replica.replica_id, second.reason, second.predicted_cached_tokens) == (chosen_id, "prefix_hit", 96)
    for router in (gateway_a, gateway_b):
        await router.close()
    await index.close()


async def test_queued_prefill_and_other_gateways_requests_count_as_load(index_url):
    index = await live_index(index_url, {"e0": block_hashes(PROMPT, BLOCK)[:3], "e1": []})
    router = await started_router(index_url, load_bound_tokens=100)
    busy, idle = replica("a", "e0"), replica("b")  # no index id: it never gets speculative entries
    assert (await router.choose(RouteRequest(PROMPT, None), [busy, idle])).replica is busy
    # this gateway's queued prefill there: the first token would come over 200 tokens on, against
    # 100 on the idle replica (the bound: 100)
    busy.pending_prefill_tokens = 201
    assert (await router.choose(RouteRequest(PROMPT, None), [busy, idle])).reason == "load_override"
    busy.pending_prefill_tokens = 0
    # another gateway's requests, seen in the engine's /stats, weigh the mean uncached prompt each
    busy.stats = dataclasses.replace(busy.stats, num_running=2, num_waiting=2)
    assert busy.other_requests == 4
    decision = await router.choose(RouteRequest(PROMPT, None), [busy, idle])
    assert (decision.replica, decision.reason) == (idle, "load_override")
    busy.in_flight_at_poll = 4  # they were this gateway's own
    assert (await router.choose(RouteRequest(PROMPT, None), [busy, idle])).replica is busy
    await router.close()
    await index.close()


def test_utilization_follows_the_engines_busy_seconds():
    r = replica("a")
    r.observe_busy(100.0, now=10.0)
    assert r.utilization == 0.0  # one sample is no rate
    r.observe_busy(101.0, now=11.0)  # busy the whole second
    assert r.utilization == pytest.approx(replica_module.UTILIZATION_EWMA_WEIGHT)
    for t in range(12, 40):
        r.observe_busy(101.0 + (t - 11) * 0.5, now=float(t))  # half busy from now on
    assert r.utilization == pytest.approx(0.5, abs=1e-3)
    r.observe_busy(3.0, now=41.0)  # the engine restarted: its counter went back, no sample
    assert r.utilization == pytest.approx(0.5, abs=1e-3) and r.busy_sample == (3.0, 41.0)
    assert router_module.expected_queue(0.5) == 1.0 and router_module.expected_queue(1.0) == pytest.approx(19.0)


async def test_a_busy_replica_sheds_new_work_though_its_queue_is_empty(index_url):
    """Between the turns of its conversations a busy replica has nothing queued; its utilization
    still says that work will come back there."""
    index = await live_index(index_url, {"e0": block_hashes(PROMPT, BLOCK)[:3], "e1": []})
    router = await started_router(index_url, load_bound_tokens=100)
    busy, idle = replica("a", "e0"), replica("b")
    assert (await router.choose(RouteRequest(PROMPT, None), [busy, idle])).replica is busy  # mean uncached: 52
    busy.utilization = 0.5  # one request ahead, expected: within the bound
    assert (await router.choose(RouteRequest(PROMPT, None), [busy, idle])).replica is busy
    busy.utilization = 0.8  # four: 208 tokens, past it
    decision = await router.choose(RouteRequest(PROMPT, None), [busy, idle])
    assert (decision.replica, decision.reason) == (idle, "load_override")
    await router.close()
    await index.close()


@pytest.mark.parametrize("num_replicas, turns", [(2, 2), (3, 3), (4, 4)])
async def test_sequential_new_conversations_spread_evenly_over_idle_replicas(index_url, num_replicas, turns):
    """Conversations with distinct system prompts, one after another, each of ``turns`` turns: every
    replica gets as many. The engines are played here: each request's blocks become durable entries
    of its replica and count in the replica's /stats, as the next poll would report them."""
    ids = [f"e{i}" for i in range(num_replicas)]
    index = await live_index(index_url, {replica_id: [] for replica_id in ids})
    router = await started_router(index_url)
    replicas = [replica(f"r{i}", replica_id) for i, replica_id in enumerate(ids)]
    held: dict[str, set[bytes]] = {replica_id: set() for replica_id in ids}
    placed = collections.Counter()
    for conversation in range(num_replicas * 3):
        prompt = [1000 + conversation] * 48  # its own system prompt
        for turn in range(turns):
            prompt = prompt + [5000 + turn] * 40
            decision = await router.choose(RouteRequest(prompt, None), replicas)
            if turn == 0:
                assert decision.reason == "prefix_miss"
                placed[decision.replica.url] += 1
            else:
                assert decision.reason == "prefix_hit"  # later turns follow their first
            chosen = decision.replica
            hashes = block_hashes(prompt, BLOCK)
            await index.apply(KVEventBatch(chosen.replica_id, 1, [BlockStored(hashes)]))
            held[chosen.replica_id].update(hashes)
            chosen.stats = dataclasses.replace(chosen.stats, num_cached_blocks=len(held[chosen.replica_id]))
    assert sorted(placed.values()) == [3] * num_replicas, placed
    await router.close()
    await index.close()


class FlakyIndex(PrefixIndex):
    """Lookups fail (``down``), hang (``slow``) or answer that nothing is cached."""

    def __init__(self) -> None:
        super().__init__(MODEL, BLOCK, "test")
        self.down = self.slow = False
        self.lookups = self.inserts = 0

    async def lookup_tiers(self, block_hashes):
        self.lookups += 1
        if self.down:
            raise IndexUnavailableError("redis: connection refused")
        if self.slow:
            await asyncio.sleep(10)
        return {"e0": TierMatch(0, 0), "e1": TierMatch(0, 0)}

    async def insert_speculative(self, replica_id, block_hashes, ttl_s):
        self.inserts += 1

    async def apply(self, batch): ...
    async def clear(self, replica_id): ...
    async def heartbeat(self, replica_id, epoch, ttl_s): ...
    async def live_replicas(self): ...
    async def close(self): ...


@pytest.fixture
def flaky(monkeypatch) -> FlakyIndex:
    index = FlakyIndex()
    monkeypatch.setattr(router_module, "open_index", lambda *args, **kwargs: index)
    return index


async def test_index_down_routes_by_load_logs_once_and_backs_off(flaky):
    metrics = GatewayMetrics()
    with capture_logs() as logs:
        router = await started_router("redis://127.0.0.1:1/0", metrics)
    assert [x["event"] for x in logs] == ["prefix_index_available"] and flaky.lookups == 1  # connected at start
    replicas = [replica("a", "e0", pending_prefill_tokens=500), replica("b", "e1")]
    flaky.down = True
    with capture_logs() as logs:
        reasons = [(await router.choose(RouteRequest(PROMPT, None), replicas)) for _ in range(5)]
    assert {(d.replica.url, d.reason) for d in reasons} == {("http://b", "no_index")}
    assert flaky.lookups == 2 and flaky.inserts == 0  # backing off: the next four did not ask
    assert [x["event"] for x in logs] == ["prefix_index_unavailable"]
    assert sample(metrics.index_available) == 0
    flaky.down = False
    router._index._retry_at = 0.0  # as if INDEX_RETRY_S had passed
    with capture_logs() as logs:
        decisions = [(await router.choose(RouteRequest(PROMPT, None), replicas)) for _ in range(3)]
    assert {d.reason for d in decisions} == {"prefix_miss"} and flaky.lookups == 5
    assert [x["event"] for x in logs] == ["prefix_index_available"]
    await router.close()


async def test_a_slow_index_times_out_and_repeated_timeouts_back_off(flaky):
    router = await started_router("redis://127.0.0.1:1/0", lookup_timeout_s=0.01)
    replicas = [replica("a", "e0"), replica("b", "e1")]
    flaky.slow = True
    with capture_logs() as logs:
        assert (await router.choose(RouteRequest(PROMPT, None), replicas)).reason == "no_index"
        assert logs == []  # one slow answer is no outage
        for _ in range(router_module.TIMEOUTS_BEFORE_BACKOFF + 1):
            assert (await router.choose(RouteRequest(PROMPT, None), replicas)).reason == "no_index"
    assert flaky.lookups == 1 + router_module.TIMEOUTS_BEFORE_BACKOFF
    assert [x["event"] for x in logs] == ["prefix_index_unavailable"]
    await router.close()


async def test_an_index_down_at_start_is_logged_and_routing_works(flaky):
    flaky.down = True
    with capture_logs() as logs:
        router = await started_router("redis://127.0.0.1:1/0")
    assert [x["event"] for x in logs] == ["prefix_index_unavailable"]
    decision = await router.choose(RouteRequest(PROMPT, None), [replica("a", "e0"), replica("b", "e1")])
    assert decision.reason == "no_index" and flaky.lookups == 1  # backing off since the start
    await router.close()


# --- the circuit breaker ---


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_probes_with_backoff():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=3, base_cooldown_s=1.0, max_cooldown_s=3.0, clock=clock)
    b.record_failure()
    b.record_failure()
    b.record_success()  # resets the count
    b.record_failure()
    b.record_failure()
    assert b.state is BreakerState.CLOSED
    b.record_failure()
    assert b.state is BreakerState.OPEN and not b.probe_due()
    clock.now = 1.0
    assert b.probe_due() and b.state is BreakerState.HALF_OPEN and not b.closed
    b.record_failure()  # the probe failed: open again, for twice as long
    assert b.state is BreakerState.OPEN and b.cooldown_s == 2.0
    clock.now = 2.9
    assert not b.probe_due()
    clock.now = 3.0
    assert b.probe_due()
    b.record_failure()
    assert b.cooldown_s == 3.0  # capped
    clock.now = 6.0
    assert b.probe_due()
    b.record_success()
    assert b.closed and b.cooldown_s == 1.0 and b.failures == 0


def test_a_refused_connection_opens_the_breaker_at_once():
    b = CircuitBreaker(clock=Clock())
    b.record_failure(refused=True)
    assert b.state is BreakerState.OPEN


# --- the pool: health from polls, failover, load accounting ---


class Engines:
    """Engines mocked at the transport: per host, /stats answers and a /generate behaviour."""

    def __init__(self, hosts: str):
        self.stats: dict[str, object] = {h: {**STATS, "replica_id": f"id-{h}"} for h in hosts}
        # ok | refuse | reset_first | reset_later | hang_head | hang_first | hang_later (hang: never answer more)
        self.generate: dict[str, str] = dict.fromkeys(hosts, "ok")
        self.stats_held: dict[str, asyncio.Event] = {}  # /stats answers only once the event is set
        self.calls: list[str] = []

    async def handler(self, request: httpx2.Request) -> httpx2.Response:
        host = request.url.host
        if request.url.path == "/stats":
            if host in self.stats_held:
                await self.stats_held[host].wait()
            answer = self.stats[host]
            if isinstance(answer, Exception):
                raise answer
            if isinstance(answer, int):
                return httpx2.Response(answer, json={"error": {"message": "engine is loading"}})
            return httpx2.Response(200, json=answer)
        self.calls.append(host)
        mode = self.generate[host]
        if mode == "refuse":
            raise httpx2.ConnectError("connection refused")
        if mode == "hang_head":
            await asyncio.Event().wait()
        frames = [OutputFrame("r", 0, [5]).pack(), OutputFrame("r", 0, [6], finish_reason="length").pack()]

        class Body(httpx2.AsyncByteStream):
            async def __aiter__(self):
                if mode == "reset_first":
                    raise httpx2.ReadError("connection reset")
                if mode == "hang_first":
                    await asyncio.Event().wait()
                yield frames[0]
                if mode == "reset_later":
                    raise httpx2.ReadError("connection reset")
                if mode == "hang_later":
                    await asyncio.Event().wait()
                yield frames[1]

        return httpx2.Response(200, stream=Body())


REQUEST = GenerateRequest("r", list(range(40)), SamplingParams(max_tokens=2))


async def ready_pool(engines: Engines, breaker=CircuitBreaker) -> tuple[EnginePool, Dispatcher, httpx2.MockTransport]:
    transport = httpx2.MockTransport(engines.handler)
    metrics = GatewayMetrics()
    pool = EnginePool([f"http://{h}:1" for h in engines.stats], transport, metrics, breaker=breaker)
    await pool.wait_ready(timeout=5, require_all=True)
    return pool, Dispatcher(pool, RoundRobinRouter(), metrics), transport


def routed(pool: EnginePool) -> dict[tuple[str, str], float]:
    return {(s.labels["replica"], s.labels["reason"]): s.value
            for s in pool.metrics.routed.collect()[0].samples if s.name.endswith("_total")}


async def test_refused_replica_fails_over_and_is_taken_out():
    engines = Engines("ab")
    engines.generate["a"] = "refuse"
    pool, dispatcher, transport = await ready_pool(engines)
    stream = await dispatcher.open(REQUEST)
    assert stream.replica.url == "http://b:1" and stream.decision.reason == "failover"
    assert [f.token_ids async for f in stream.frames()] == [[5], [6]]
    await stream.aclose()
    a = pool.replicas[0]
    assert not a.ready and a.breaker.state is BreakerState.OPEN and "unreachable" in a.error
    assert routed(pool) == {("http://b:1", "failover"): 1.0}
    assert [r.url for r in pool.ready_replicas()] == ["http://b:1"]
    await transport.aclose()


async def test_a_stream_broken_before_its_first_frame_moves_to_another_replica():
    engines = Engines("ab")
    engines.generate["a"] = "reset_first"
    pool, dispatcher, transport = await ready_pool(engines)
    stream = await dispatcher.open(REQUEST)
    assert stream.replica.url == "http://a:1"
    assert [f.token_ids async for f in stream.frames()] == [[5], [6]]
    assert stream.replica.url == "http://b:1" and engines.calls == ["a", "b"]
    a, b = pool.replicas
    assert a.breaker.failures == 1 and a.ready  # one reset does not take a replica out
    assert (a.in_flight, b.in_flight) == (0, 1)
    await stream.aclose()
    assert b.in_flight == 0
    await transport.aclose()


async def test_a_stream_broken_after_its_first_frame_fails():
    engines = Engines("ab")
    engines.generate["a"] = "reset_later"
    pool, dispatcher, transport = await ready_pool(engines)
    stream = await dispatcher.open(REQUEST)
    got = []
    with pytest.raises(EngineFailed, match="lost the connection to engine http://a:1"):
        async for frame in stream.frames():
            got.append(frame.token_ids)
    assert got == [[5]] and engines.calls == ["a"]  # the client saw a token: no retry
    await stream.aclose()
    await transport.aclose()


async def test_failover_is_bounded():
    engines = Engines("abcd")
    engines.generate = dict.fromkeys("abcd", "reset_first")
    pool, dispatcher, transport = await ready_pool(engines)
    stream = await dispatcher.open(REQUEST)
    with pytest.raises(EngineFailed, match="no other replica took the request: every engine replica failed"):
        async for _ in stream.frames():
            pass
    assert len(engines.calls) == MAX_ATTEMPTS
    assert all(r.in_flight == 0 and r.pending_prefill_tokens == 0 for r in pool.replicas)
    await stream.aclose()
    await transport.aclose()


async def test_no_replica_takes_the_request():
    engines = Engines("ab")
    engines.generate = {"a": "refuse", "b": "refuse"}
    pool, dispatcher, transport = await ready_pool(engines)
    with pytest.raises(NoReplicaAvailable) as info:
        await dispatcher.open(REQUEST)
    assert str(info.value).startswith("every engine replica failed (2 tried; the last: engine http://")
    assert "unreachable: ConnectError('connection refused')" in str(info.value)
    with pytest.raises(NoReplicaAvailable, match="no engine replica is ready"):
        await dispatcher.open(REQUEST)
    await transport.aclose()


async def test_load_is_counted_until_the_first_frame_and_released_on_close():
    engines = Engines("a")
    pool, dispatcher, transport = await ready_pool(engines)
    (a,) = pool.replicas
    stream = await dispatcher.open(REQUEST)
    assert (a.in_flight, a.pending_prefill_tokens) == (1, 40)
    frames = stream.frames()
    await anext(frames)
    assert (a.in_flight, a.pending_prefill_tokens) == (1, 0)
    await frames.aclose()
    await stream.aclose()
    await stream.aclose()  # idempotent
    assert (a.in_flight, a.pending_prefill_tokens) == (0, 0)
    await transport.aclose()


async def test_polls_measure_utilization_and_kv_footprint():
    engines = Engines("a")
    engines.stats["a"] = {**STATS, "replica_id": "id-a", "total_busy_seconds": 0.0}
    pool, _, transport = await ready_pool(engines)
    (a,) = pool.replicas
    assert a.utilization == 0.0
    pool.export_metrics()
    assert sample(pool.metrics.replica_kv_footprint) == 0.0
    # busy since: at most 1; a quarter of the blocks in use, more of them holding cached prefixes
    engines.stats["a"] = {**STATS, "replica_id": "id-a", "total_busy_seconds": 100.0, "num_total_blocks": 64,
                          "num_free_blocks": 48, "num_cached_blocks": 24}
    await pool.poll()
    assert a.utilization == pytest.approx(replica_module.UTILIZATION_EWMA_WEIGHT)
    pool.export_metrics()
    assert sample(pool.metrics.replica_utilization) == a.utilization
    assert sample(pool.metrics.replica_kv_footprint) == a.kv_footprint == 24 / 64
    await transport.aclose()


async def test_polls_open_the_breaker_then_probe_it_closed():
    clock = Clock()
    engines = Engines("ab")
    pool, _, transport = await ready_pool(engines, breaker=lambda: CircuitBreaker(clock=clock))
    a = pool.replicas[0]
    engines.stats["a"] = 503  # reachable but not ready (restarting): out, without tripping the breaker
    with capture_logs() as logs:
        await pool.poll()
        await pool.poll()
    assert not a.ready and a.breaker.closed and "loading" in a.error
    assert [x["event"] for x in logs] == ["replica_down"]  # once per change, not per poll
    engines.stats["a"] = httpx2.ConnectError("connection refused")
    await pool.poll()
    assert a.breaker.state is BreakerState.OPEN
    engines.stats["a"] = {**STATS, "replica_id": "id-a"}
    await pool.poll()  # cooling down: not even probed
    assert not a.ready
    clock.now = a.breaker.cooldown_s
    with capture_logs() as logs:
        await pool.poll()  # the probe
    assert a.ready and a.breaker.closed and a.error is None
    assert [x["event"] for x in logs] == ["replica_ready"]
    await transport.aclose()


async def test_a_health_answer_older_than_a_failure_does_not_bring_the_replica_back():
    """A request finds the engine gone while a /stats answer sent before its death is still on its way."""
    engines = Engines("a")
    pool, dispatcher, transport = await ready_pool(engines)
    (a,) = pool.replicas
    engines.stats_held["a"] = asyncio.Event()
    poll = asyncio.create_task(pool.poll())
    await asyncio.sleep(0.01)  # the probe is out
    engines.generate["a"] = "refuse"
    with pytest.raises(NoReplicaAvailable, match="every engine replica failed"):
        await dispatcher.open(REQUEST)
    engines.stats_held["a"].set()
    await finished(poll)
    assert not a.ready and a.breaker.state is BreakerState.OPEN
    await transport.aclose()


async def finished(task: asyncio.Future, timeout: float = 5.0) -> asyncio.Future:
    """``task`` once done; fails after ``timeout`` without cancelling it (a cancellation would end it)."""
    done, _ = await asyncio.wait({task}, timeout=timeout)
    assert task in done, f"still running after {timeout} s"
    return task


async def hang_up(pool: EnginePool, engines: Engines, host: str) -> None:
    """``host`` stops answering its health checks until its breaker opens."""
    engines.stats[host] = httpx2.ReadTimeout("timed out")
    for _ in range(CircuitBreaker().failure_threshold):
        await pool.poll()


@pytest.mark.parametrize("mode", ["hang_head", "hang_first"])
async def test_a_request_waiting_on_a_hung_replica_moves_on_when_it_is_taken_out(mode):
    engines = Engines("ab")
    engines.generate["a"] = mode
    pool, dispatcher, transport = await ready_pool(engines)
    a, b = pool.replicas

    async def tokens() -> list[list[int]]:
        stream = await dispatcher.open(REQUEST)
        try:
            return [f.token_ids async for f in stream.frames()]
        finally:
            await stream.aclose()

    task = asyncio.create_task(tokens())
    await asyncio.sleep(0.05)
    assert not task.done() and a.in_flight == 1  # waits on a: nothing times it out by itself
    with capture_logs() as logs:
        await hang_up(pool, engines, "a")
    assert (await finished(task)).result() == [[5], [6]]
    assert engines.calls == ["a", "b"] and not a.ready and (a.in_flight, b.in_flight) == (0, 0)
    assert not a.streams and not b.streams
    interrupted = [x for x in logs if x["event"] == "replica_requests_interrupted"]
    assert interrupted == [{"event": "replica_requests_interrupted", "replica": "http://a:1", "requests": 1,
                            "log_level": "warning"}]
    await transport.aclose()


async def test_a_stream_hung_after_its_first_frame_fails_when_its_replica_is_taken_out():
    engines = Engines("ab")
    engines.generate["a"] = "hang_later"
    pool, dispatcher, transport = await ready_pool(engines)
    stream = await dispatcher.open(REQUEST)
    frames = stream.frames()
    assert (await anext(frames)).token_ids == [5]
    pending = asyncio.ensure_future(anext(frames))
    await asyncio.sleep(0.05)
    await hang_up(pool, engines, "a")
    with pytest.raises(EngineFailed, match="engine http://a:1 was taken out of service: .*ReadTimeout"):
        (await finished(pending)).result()
    assert engines.calls == ["a"]  # the client saw a token: no retry
    await stream.aclose()
    assert pool.replicas[0].in_flight == 0 and not pool.replicas[0].streams
    await transport.aclose()


async def test_cancelling_a_request_on_a_hung_replica_is_still_a_cancellation():
    engines = Engines("a")
    engines.generate["a"] = "hang_first"
    pool, dispatcher, transport = await ready_pool(engines)
    stream = await dispatcher.open(REQUEST)
    task = asyncio.ensure_future(anext(stream.frames()))
    await asyncio.sleep(0.05)
    task.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await task
    await stream.aclose()
    assert pool.replicas[0].in_flight == 0 and pool.replicas[0].ready
    await transport.aclose()
