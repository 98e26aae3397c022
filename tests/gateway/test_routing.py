"""Routers, the engine pool and the engine client, against engines mocked at the HTTP transport."""

from __future__ import annotations

import json

import httpx2
import msgpack
import pytest
from stats_testing import engine_stats
from structlog.testing import capture_logs

from engine.protocol import EngineStats, GenerateRequest, OutputFrame, ProtocolError, SamplingParams, TokenLogprob
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.engine_client import EngineClient, EngineFailed, EngineRejected, EngineUnavailable
from gateway.metrics import GatewayMetrics
from gateway.pool import EnginePool, resolve_addresses
from gateway.replica import Replica
from gateway.router import LeastLoadRouter, PrefixRouter, RoundRobinRouter, RouteRequest, make_router

ROUTE = RouteRequest([1, 2, 3], None)


def stats(host: str) -> dict:
    """The /stats body of the idle engine on ``host``."""
    return engine_stats(replica_id=f"id-{host}").to_wire()


def replicas(*loads: tuple[int, int]) -> list[Replica]:
    out = []
    for i, (in_flight, waiting) in enumerate(loads):
        r = Replica(f"http://e{i}", client=None, ready=True, stats=engine_stats(num_waiting=waiting))
        r.streams.update(object() for _ in range(in_flight))  # stand-ins for this gateway's requests
        out.append(r)
    return out


async def test_round_robin_cycles():
    router, rs = RoundRobinRouter(), replicas((0, 0), (5, 0), (9, 9))
    chosen = [(await router.choose(ROUTE, rs)).replica.url for _ in range(6)]
    assert chosen == ["http://e0", "http://e1", "http://e2"] * 2


async def test_least_load_counts_own_in_flight_and_engine_queue():
    router = LeastLoadRouter()
    rs = replicas((3, 0), (1, 1), (0, 4))
    assert {(await router.choose(ROUTE, rs)).replica.url for _ in range(5)} == {"http://e1"}
    decision = await router.choose(ROUTE, rs)
    assert decision.reason == "least_load" and decision.predicted_cached_tokens == 0


async def test_least_load_spreads_ties():
    router = LeastLoadRouter()
    rs = replicas((1, 0), (1, 0), (2, 0))
    assert {(await router.choose(ROUTE, rs)).replica.url for _ in range(4)} == {"http://e0", "http://e1"}


def test_make_router_names_policies():
    metrics = GatewayMetrics()
    assert isinstance(make_router(GatewayConfig(routing="least-load"), metrics), LeastLoadRouter)
    assert isinstance(make_router(GatewayConfig(routing="round-robin"), metrics), RoundRobinRouter)
    prefix = make_router(GatewayConfig(routing="prefix", prefix_load_bound=100), metrics)
    assert isinstance(prefix, PrefixRouter) and prefix.policy == "prefix"
    with pytest.raises(ValueError, match="prefix, least-load, round-robin"):
        make_router(GatewayConfig(routing="random"), metrics)


def engine_transport(stats_by_host: dict[str, object]) -> httpx2.MockTransport:
    """/stats per host: a dict (200), an int (that status), or an exception to raise."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        answer = stats_by_host[request.url.host]
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, int):
            return httpx2.Response(answer, json={"error": {"message": "engine is loading", "param": None}})
        return httpx2.Response(200, json=answer)

    return httpx2.MockTransport(handler)


async def test_pool_readiness_model_and_mismatch():
    other_model = {**stats("d"), "max_model_len": 2048}
    answers = {"a": stats("a"), "b": 503, "c": httpx2.ConnectError("refused"), "d": other_model}
    async with engine_transport(answers) as transport:
        pool = EnginePool([f"http://{h}:1" for h in "abcd"], transport)
        model = await pool.wait_ready(timeout=5, require_all=False)
        assert (model.name, model.limits.max_model_len, model.block_size) == ("tiny", 1024, 16)
        assert [r.url for r in pool.ready_replicas()] == ["http://a:1"]
        errors = {r.url: r.error for r in pool.replicas}
        assert "loading" in errors["http://b:1"] and "unreachable" in errors["http://c:1"]
        assert "different model shape" in errors["http://d:1"]
        answers["b"] = stats("b")  # b finished loading: the next poll brings it in
        await pool.poll()
        assert [r.url for r in pool.ready_replicas()] == ["http://a:1", "http://b:1"]
        decision = await Dispatcher(pool, LeastLoadRouter(), pool.metrics).route(ROUTE, exclude=[pool.replicas[0]])
        assert decision.replica.url == "http://b:1"


async def test_pool_refuses_a_second_engine_under_the_same_replica_id():
    answers = {"a": {**stats("a"), "replica_id": "gpu-0"}, "b": {**stats("b"), "replica_id": "gpu-0"},
               "c": {**stats("c"), "replica_id": "gpu-1"}}
    async with engine_transport(answers) as transport:
        pool = EnginePool([f"http://{h}:1" for h in "abc"], transport)
        await pool.poll()
        assert [(r.url, r.replica_id) for r in pool.ready_replicas()] == [("http://a:1", "gpu-0"),
                                                                          ("http://c:1", "gpu-1")]
        assert "already used by http://a:1" in pool.replicas[1].error


async def test_unready_summary_counts_replicas_by_cause():
    """What a client's 503 says when no replica is ready: how many replicas, and why, by cause."""
    async with engine_transport({"b": 503, "c": httpx2.ConnectError("refused")}) as transport:
        pool = EnginePool(["http://b:1", "http://c:1", "http://e:1"], transport)
        assert pool.unready_summary() == "3 engine replicas, none ready: 3 not polled yet"
        for replica in pool.replicas[:2]:
            await pool._poll(replica)
        summary = pool.unready_summary()
        assert summary == "3 engine replicas, none ready: 1 not polled yet, 1 not ready, 1 unreachable"
        assert EnginePool([], transport).unready_summary() == "no engine replica is known"
        dns = EnginePool([], transport, dns=("kvgate-engine", 8100))
        assert dns.unready_summary() == "no engine replica is known (kvgate-engine has no addresses)"


async def test_wait_ready_times_out_naming_the_replicas():
    async with engine_transport({"a": 503}) as transport:
        pool = EnginePool(["http://a:1"], transport)
        with pytest.raises(RuntimeError, match="http://a:1: engine http://a:1 not ready"):
            await pool.wait_ready(timeout=0.3, require_all=True)


async def test_engine_dns_adds_and_drops_replicas_without_a_restart():
    """A headless Service's A records: pods come (ready and routed to at the next poll) and go."""
    records = {"10.0.0.1"}
    answers = {"10.0.0.1": stats("a"), "10.0.0.2": stats("b"), "fd00::3": stats("c")}

    async def resolver(name: str, port: int) -> set[str]:
        assert (name, port) == ("kvgate-engine", 8100)
        if isinstance(records, OSError):
            raise records
        return set(records)

    async with engine_transport(answers) as transport:
        pool = EnginePool(["http://10.0.0.9:8100"], transport, dns=("kvgate-engine", 8100), resolver=resolver)
        answers["10.0.0.9"] = stats("static")
        await pool.wait_ready(timeout=5, require_all=True)
        assert [r.url for r in pool.ready_replicas()] == ["http://10.0.0.9:8100", "http://10.0.0.1:8100"]
        pool.export_metrics()
        records = {"10.0.0.2", "fd00::3"}  # a scaled out, then rescheduled
        await pool.poll()
        assert [r.url for r in pool.ready_replicas()] == [
            "http://10.0.0.9:8100", "http://10.0.0.2:8100", "http://[fd00::3]:8100"]
        gauges = {s.labels["replica"] for s in pool.metrics.replica_ready.collect()[0].samples}
        assert "http://10.0.0.1:8100" not in gauges  # its gauges went with it
        records = OSError("resolver timed out")
        with capture_logs() as logs:
            await pool.poll()
            await pool.poll()
        assert len(pool.ready_replicas()) == 3  # a failing resolver drops nothing
        assert [e["event"] for e in logs if e["event"].startswith("engine_dns")] == ["engine_dns_failed"]
        records = set()  # no ready pod: no engine from the name
        await pool.poll()
        assert [r.url for r in pool.replicas] == ["http://10.0.0.9:8100"]


async def test_resolve_addresses_answers_from_the_system_resolver():
    assert "127.0.0.1" in await resolve_addresses("localhost", 8100)
    assert await resolve_addresses("no-such-engine.invalid", 8100) == set()


def test_engine_stats_round_trip():
    stats = engine_stats(num_waiting=3, kv_usage=0.25, total_busy_seconds=12.5)
    assert EngineStats.from_wire(json.loads(json.dumps(stats.to_wire()))) == stats
    assert EngineStats.from_wire({**stats.to_wire(), "added_later": 1}) == stats  # a newer engine's extras
    older = {k: v for k, v in stats.to_wire().items() if k not in ("kv_group_windows", "kv_bytes_per_token_by_group")}
    assert EngineStats.from_wire(older) == stats  # an engine from before the layer-group fields
    budgeted = engine_stats(mixed_prefill_budget=1536)
    assert EngineStats.from_wire(budgeted.to_wire()).mixed_prefill_budget == 1536
    older = {k: v for k, v in budgeted.to_wire().items() if k != "mixed_prefill_budget"}  # an optional field
    assert EngineStats.from_wire(older).mixed_prefill_budget == 0
    with pytest.raises(ProtocolError, match="mixed_prefill_budget must be an integer"):
        EngineStats.from_wire({**older, "mixed_prefill_budget": "1536"})


def test_engine_stats_name_a_missing_field():
    wire = stats("a")
    wire["num_queued"] = wire.pop("num_waiting")  # renamed on one side only
    with pytest.raises(ProtocolError, match="stats field 'num_waiting' is missing") as info:
        EngineStats.from_wire(wire)
    assert info.value.param == "num_waiting"


@pytest.mark.parametrize("field, value, message", [
    ("num_waiting", "3", "must be an integer, got str"),
    ("num_waiting", True, "must be an integer, got bool"),
    ("kv_usage", None, "must be a number, got NoneType"),
    ("replica_id", 7, "must be a string, got int"),
])
def test_engine_stats_name_a_mistyped_field(field: str, value: object, message: str):
    with pytest.raises(ProtocolError, match=f"{field} {message}") as info:
        EngineStats.from_wire({**stats("a"), field: value})
    assert info.value.param == field


async def test_a_replica_whose_stats_lack_a_field_is_not_ready_and_says_which():
    renamed = stats("a")
    renamed["num_queued"] = renamed.pop("num_waiting")
    async with engine_transport({"a": renamed}) as transport:
        pool = EnginePool(["http://a:1"], transport)
        with pytest.raises(RuntimeError, match="malformed /stats: stats field 'num_waiting' is missing"):
            await pool.wait_ready(timeout=0.3, require_all=True)
        assert not pool.replicas[0].breaker.failures  # it answered: not a health failure


def frames_body(frames: list[OutputFrame], chunk: int) -> httpx2.AsyncByteStream:
    data = b"".join(f.pack() for f in frames)

    class Chunks(httpx2.AsyncByteStream):
        async def __aiter__(self):
            for i in range(0, len(data), chunk):
                yield data[i:i + chunk]

    return Chunks()


async def test_engine_client_streams_frames_split_anywhere():
    frames = [OutputFrame("r", 0, [5, 6], [TokenLogprob(-0.5, [(5, -0.5), (9, -1.0)])] * 2, None, 3, 1),
              OutputFrame("r", 1, [7], None, "length", 3, 1)]
    seen = {}

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen["body"] = msgpack.unpackb(request.content, strict_map_key=False)
        seen["type"] = request.headers["content-type"]
        return httpx2.Response(200, stream=frames_body(frames, chunk=3))

    async with httpx2.MockTransport(handler) as transport:
        request = GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=2, n=2), "tenant", [2])
        stream = await EngineClient("http://e:1", transport).open(request)
        got = [f async for f in stream.frames()]
        await stream.aclose()
    assert got == frames
    assert seen["type"] == "application/x-msgpack" and seen["body"] == request.to_wire()


@pytest.mark.parametrize("status, error", [(400, EngineRejected), (503, EngineUnavailable), (500, EngineUnavailable)])
async def test_engine_client_maps_error_statuses(status, error):
    body = {"error": {"message": "prompt_ids[0] = 99999 is outside the vocabulary", "param": "prompt_ids"}}
    async with httpx2.MockTransport(lambda r: httpx2.Response(status, content=json.dumps(body))) as transport:
        with pytest.raises(error) as info:
            await EngineClient("http://e:1", transport).open(GenerateRequest("r", [1]))
    if status == 400:
        assert info.value.param == "prompt_ids" and "vocabulary" in info.value.message


async def test_engine_client_connection_errors():
    def refuse(request):
        raise httpx2.ConnectError("connection refused")

    async with httpx2.MockTransport(refuse) as transport:
        with pytest.raises(EngineUnavailable, match="unreachable"):
            await EngineClient("http://e:1", transport).open(GenerateRequest("r", [1]))

    class Broken(httpx2.AsyncByteStream):
        async def __aiter__(self):
            yield OutputFrame("r", 0, [5]).pack()
            raise httpx2.ReadError("connection reset")

    async with httpx2.MockTransport(lambda r: httpx2.Response(200, stream=Broken())) as transport:
        stream = await EngineClient("http://e:1", transport).open(GenerateRequest("r", [1]))
        got = []
        with pytest.raises(EngineFailed, match="lost the connection"):
            async for frame in stream.frames():
                got.append(frame)
        assert [f.token_ids for f in got] == [[5]]
