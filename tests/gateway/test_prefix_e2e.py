"""Prefix routing end to end: 3 tiny dummy engines and 2 gateways sharing a throwaway Redis, real
processes, the openai SDK.

In file order (module-scoped processes): multi-turn conversations alternating between the gateways
land where their prefix is cached; Redis stopped under load fails no request and the index comes
back when it does; an engine killed under load leaves no request hanging, fails over the requests
it had not started, and new requests succeed.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import redis
from gw_harness import TINY_ENGINE_ARGS, Proc, lines_for, start_engine, start_gateway

from gateway.spawn import free_port

BLOCK = 16
KEYS = "kvgate:{tiny:16}"  # the engines' index namespace: default namespace, model tiny, block size 16
MAX_NUM_SEQS = 2  # per engine: more concurrent requests wait in its queue, without a frame yet


class RedisServer:
    """A throwaway redis-server that can be stopped and started again on its port."""

    def __init__(self, log_path):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (apt-get install redis-server)"
        with open(self._log_path, "a") as log:
            self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                          "--appendonly", "no"], stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline and self.proc.poll() is None, "redis-server did not start"
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@dataclass
class Cluster:
    redis: RedisServer
    engines: list[Proc]
    gateways: list[Proc]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("prefix-e2e")
    server = RedisServer(logs / "redis.log")
    started: list[Proc] = []
    try:
        for i in range(3):
            started.append(start_engine(logs / f"engine-{i}.log", *TINY_ENGINE_ARGS, "--max-num-seqs",
                                        str(MAX_NUM_SEQS), "--replica-id", f"e{i}", "--index-url", server.url))
        engines = list(started)
        for j in range(2):
            started.append(start_gateway(logs / f"gateway-{j}.log", "--routing", "prefix", "--index-url", server.url,
                                         "--health-interval", "0.5",
                                         *(flag for e in engines for flag in ("--engine", e.url))))
        yield Cluster(server, engines, started[3:])
    finally:
        for proc in reversed(started):
            proc.stop()
        server.stop()


def client(gateway: Proc) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def routed(gateway: Proc) -> dict[str, float]:
    """kvgate_gateway_routed_total summed per reason."""
    totals: dict[str, float] = {}
    for line in httpx.get(gateway.url + "/metrics").text.splitlines():
        if line.startswith("kvgate_gateway_routed_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            totals[reason] = totals.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


# Below this smoothed utilization the router's expected queue (ρ / (1 − ρ) times its mean uncached prompt,
# here at most 100 tokens) rounds to no tokens: idle engines then differ only by their KV footprint.
IDLE_UTILIZATION = 0.004


def replica_gauge(gateway: Proc, name: str) -> dict[str, float]:
    """kvgate_gateway_replica_<name> per replica: what the gateway's last polls saw."""
    prefix = f'kvgate_gateway_replica_{name}{{replica="'
    return {line[len(prefix):].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in httpx.get(gateway.url + "/metrics").text.splitlines() if line.startswith(prefix)}


def ideal_cached(prompt: list[int], earlier: list[list[int]]) -> int:
    """What one unlimited cache would reuse: the longest block-aligned prefix shared with an earlier
    prompt, leaving one token to compute."""
    best = 0
    for other in earlier:
        n = 0
        while n + BLOCK <= min(len(prompt), len(other)) and prompt[n:n + BLOCK] == other[n:n + BLOCK]:
            n += BLOCK
        best = max(best, n)
    return min(best, (len(prompt) - 1) // BLOCK * BLOCK)


async def test_sequential_new_conversations_spread_over_idle_engines(cluster: Cluster):
    """On fresh engines, 6 conversations of 3 turns with distinct prompts, one after another through one
    gateway, each once the gateway has seen the last one's blocks cached and its engine idle again: each engine
    gets two, by their KV footprints (the policy once put them all on one engine, by list order)."""
    rng = random.Random(9)
    gateway = client(cluster.gateways[0])
    placed: dict[str, int] = {}
    for _ in range(6):
        prompt = [rng.randrange(300, 40000) for _ in range(100)]
        before = replica_gauge(cluster.gateways[0], "kv_footprint")
        replicas = set()
        for _turn in range(3):
            raw = await gateway.completions.with_raw_response.create(
                model="tiny", prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True})
            replicas.add(raw.headers["x-kvgate-replica"])
            prompt = prompt + [rng.randrange(300, 40000) for _ in range(40)]
        assert len(replicas) == 1  # its later turns followed its first
        engine = replicas.pop()
        placed[engine] = placed.get(engine, 0) + 1
        deadline = time.monotonic() + 60
        # the gateway's polls (every 0.5 s) see the conversation's blocks cached and every engine idle again
        while (replica_gauge(cluster.gateways[0], "kv_footprint")[engine] <= before[engine]
               or max(replica_gauge(cluster.gateways[0], "utilization").values()) >= IDLE_UTILIZATION):
            assert time.monotonic() < deadline, "the gateway never saw the cached blocks and idle engines"
            await asyncio.sleep(0.1)
    assert sorted(placed.values()) == [2, 2, 2], placed


async def test_conversations_land_where_their_prefix_is(cluster: Cluster):
    """6 conversations of 4 turns at once, each turn on the other gateway than the turn before."""
    rng = random.Random(4)
    clients = [client(g) for g in cluster.gateways]
    sent: list[list[int]] = []
    results: list[tuple[int, int, int, str]] = []  # cached, ideal, prompt tokens, replica

    async def conversation(c: int) -> None:
        prompt = [rng.randrange(300, 40000) for _ in range(200)]
        for turn in range(4):
            ideal = ideal_cached(prompt, sent)
            sent.append(prompt)
            raw = await clients[(c + turn) % 2].completions.with_raw_response.create(
                model="tiny", prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
            usage = raw.parse().usage
            assert usage.prompt_tokens == len(prompt)
            assert int(raw.headers["x-kvgate-predicted-cached-tokens"]) <= len(prompt) - 1
            results.append((usage.prompt_tokens_details.cached_tokens, ideal, len(prompt),
                            raw.headers["x-kvgate-replica"]))
            # the scripted answer and the next user message
            prompt = prompt + [rng.randrange(300, 40000) for _ in range(rng.randrange(100, 160))]

    await asyncio.gather(*(conversation(c) for c in range(6)))
    cached, ideal = sum(r[0] for r in results), sum(r[1] for r in results)
    assert ideal > 5000
    assert cached >= 0.9 * ideal, f"hit rate {cached}/{ideal} of the single-cache ideal"
    reasons = [routed(g) for g in cluster.gateways]
    for per_gateway in reasons:  # each gateway found the turns the other one had routed
        assert per_gateway.get("prefix_hit", 0) >= 8, reasons
    assert len({r[3] for r in results}) == 3  # and the conversations spread over every engine


class _Conversations:
    """Worker threads, each growing one conversation through both gateways until stopped."""

    def __init__(self, cluster: Cluster, workers: int):
        self.cluster, self.done, self.failures = cluster, 0, []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._worker, args=(w,)) for w in range(workers)]

    def _worker(self, w: int) -> None:
        sync = [openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0, timeout=60)
                for g in self.cluster.gateways]
        rng = random.Random(w)
        prefix = [rng.randrange(300, 40000) for _ in range(100)]
        i = 0
        while not self.stop.is_set():
            try:
                sync[i % 2].completions.create(model="tiny", prompt=prefix + [w, i], max_tokens=2,
                                               extra_body={"ignore_eos": True})
                self.done += 1
            except openai.OpenAIError as exc:
                self.failures.append(repr(exc))
            i += 1

    def __enter__(self) -> _Conversations:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def wait_for_index_repopulated(cluster: Cluster, timeout: float = 20) -> None:
    """The engines resync into a fresh Redis by themselves: every replica live with its cache again."""
    client_ = redis.Redis(port=cluster.redis.port)
    deadline = time.monotonic() + timeout
    while True:
        live = {r.decode() for r in client_.zrange(f"{KEYS}:live", 0, -1)}
        held = {f"e{i}": client_.hlen(f"{KEYS}:parent:e{i}") for i in range(3)}
        if live == {"e0", "e1", "e2"} and all(held.values()):
            break
        assert time.monotonic() < deadline, f"index not repopulated: live {live}, blocks {held}"
        time.sleep(0.2)
    client_.close()


async def test_redis_stopped_under_load_fails_no_request(cluster: Cluster):
    with _Conversations(cluster, workers=4) as load:
        time.sleep(1.5)
        cluster.redis.stop()
        before = load.done
        time.sleep(3)
        assert load.done > before  # served while Redis was down
        cluster.redis.start()
        time.sleep(2)
    assert load.failures == []
    for gateway in cluster.gateways:
        events = [x.get("event") for x in gateway.log_lines()]
        assert "prefix_index_unavailable" in events
        assert routed(gateway).get("no_index", 0) > 0
    wait_for_index_repopulated(cluster)
    # and the gateways route on it again
    prompt = [random.Random(9).randrange(300, 40000) for _ in range(120)]
    first = await client(cluster.gateways[0]).completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=2)
    second = await client(cluster.gateways[1]).completions.with_raw_response.create(
        model="tiny", prompt=prompt + [5] * 20, max_tokens=2)
    assert second.headers["x-kvgate-replica"] == first.headers["x-kvgate-replica"]
    assert int(second.headers["x-kvgate-predicted-cached-tokens"]) >= 112
    assert "prefix_index_available" in [x.get("event") for x in cluster.gateways[1].log_lines()]
    (line,) = [x for x in lines_for(cluster.gateways[1], second.headers["x-request-id"]) if x.get("event") == "request"]
    assert line["route"] == "prefix_hit"
    assert line["predicted_cached_tokens"] == int(second.headers["x-kvgate-predicted-cached-tokens"])


async def break_under_load(cluster: Cluster, victim: Proc, fault: Callable[[], None], error: str) -> None:
    """12 streamed requests (MAX_NUM_SEQS run on each engine, the rest wait); ``fault`` hits ``victim``
    once requests stream and it runs MAX_NUM_SEQS with more waiting (requests elsewhere may have
    ended by then). Its running requests end with an error event naming ``error``, its waiting ones
    fail over; none hangs."""
    clients = [client(g) for g in cluster.gateways]
    rng = random.Random(7)
    streaming = 0
    outcomes: list[str] = []

    async def one(i: int) -> None:
        nonlocal streaming
        prompt = [rng.randrange(300, 40000) for _ in range(64)]
        try:
            stream = await clients[i % 2].completions.create(model="tiny", prompt=prompt, max_tokens=300,
                                                             stream=True, extra_body={"ignore_eos": True})
            first = True
            async for _ in stream:
                if first:
                    streaming += 1
                    first = False
            outcomes.append("ok")
        except openai.APIError as exc:
            assert isinstance(exc.body, dict) and exc.body["type"] == "server_error", exc
            assert exc.body["code"] == "engine_error" and error in exc.body["message"], exc.body
            outcomes.append("error")

    failovers_before = sum(routed(g).get("failover", 0) for g in cluster.gateways)
    tasks = [asyncio.create_task(one(i)) for i in range(12)]
    deadline = time.monotonic() + 60
    while True:  # requests stream, and the victim runs all it may while more wait there
        failed = [t.exception() for t in tasks if t.done() and t.exception() is not None]
        assert time.monotonic() < deadline and not failed, f"requests did not start: {streaming} streaming, {failed}"
        stats = httpx.get(victim.url + "/stats").json()
        if streaming >= MAX_NUM_SEQS and stats["num_running"] == MAX_NUM_SEQS and stats["num_waiting"] >= 1:
            break
        await asyncio.sleep(0.02)
    waiting = stats["num_waiting"]
    fault()
    await asyncio.wait_for(asyncio.gather(*tasks), 90)  # none hangs
    assert len(outcomes) == 12
    assert outcomes.count("error") <= MAX_NUM_SEQS  # only what was streaming on the victim
    failovers = sum(routed(g).get("failover", 0) for g in cluster.gateways) - failovers_before
    assert failovers >= waiting  # what waited there (no token yet) moved to another engine
    for gateway in cluster.gateways:
        assert any(x.get("event") == "replica_down" and x["replica"] == victim.url for x in gateway.log_lines())
    for c in clients * 3:  # new requests: the victim is out, or they fail over from it
        resp = await c.completions.create(model="tiny", prompt=[rng.randrange(300, 40000) for _ in range(40)],
                                          max_tokens=2)
        assert resp.usage.completion_tokens == 2


def readiness(gateway: Proc) -> dict[str, str]:
    return httpx.get(gateway.url + "/ready").json()["replicas"]


async def test_engine_stopped_under_load(cluster: Cluster):
    """A hung engine (SIGSTOP: its connections stay open, nothing answers) is taken out by its failed
    health checks, and the requests waiting on it are interrupted rather than left hanging; once it
    runs again (SIGCONT) a probe brings it back."""
    victim = cluster.engines[1]
    await break_under_load(cluster, victim, lambda: os.kill(victim.proc.pid, signal.SIGSTOP), "taken out of service")
    for gateway in cluster.gateways:
        assert any(x.get("event") == "replica_requests_interrupted" and x["replica"] == victim.url
                   for x in gateway.log_lines())
    os.kill(victim.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60  # the breaker's cooldown doubles per failed probe
    while any(readiness(g)[victim.url] != "ready" for g in cluster.gateways):
        assert time.monotonic() < deadline, "the engine did not come back"
        await asyncio.sleep(0.2)


async def test_engine_killed_under_load(cluster: Cluster):
    """As above with the engine killed: its connections close, so the requests on it fail at once."""
    victim = cluster.engines[0]
    await break_under_load(cluster, victim, lambda: os.kill(victim.proc.pid, signal.SIGKILL), "lost the connection")
    ready = readiness(cluster.gateways[0])
    assert ready[victim.url] != "ready" and sum(v == "ready" for v in ready.values()) == 2
