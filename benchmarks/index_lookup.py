"""Prefix index lookup latency for 32K-token prompts, and the engine-side cost of publish().

Lookups: a 2048-block prompt (32768 tokens, block size 16) against 4 live replicas holding it to
different depths, each also holding unrelated blocks, on Redis and on the memory backend (the
peer), one lookup at a time, one JSON line per (backend, scenario). A third peer is the floor of
any one-script Redis design: a no-op EVALSHA carrying the same 32 KiB argument. Goal: Redis
p99 <= 2 ms.

Wall-clock percentiles depend on what else the machine runs (each line carries the load average),
so each Redis line also gives the CPU time per lookup of the Redis server (from INFO; exact on the
private server this script starts by default) and of this client: their sum plus a loopback round
trip is the latency on an idle machine.

publish(): microseconds per call with Redis up, with Redis absent, and for a bare deque.append.

    .venv/bin/python benchmarks/index_lookup.py [--redis-url URL]  (default: a private redis-server)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterator

import redis
import structlog

from loadtest import stamp
from prefix_index.events import BlockStored, KVEventBatch
from prefix_index.hashing import block_hashes
from prefix_index.index import PrefixIndex, open_index
from prefix_index.publisher import KVEventPublisher

BLOCK_SIZE = 16
PROMPT_TOKENS = 32768
GOAL_P99_MS = 2.0
SCENARIOS = {  # matched depth, in blocks, of each of the 4 live replicas
    "mixed": [2048, 1536, 512, 0],
    "all_full": [2048, 2048, 2048, 2048],
    "one_full": [2048, 0, 0, 0],
    "all_miss": [0, 0, 0, 0],
}


def emit(**fields) -> None:
    stamp.emit(load_avg_1m=round(os.getloadavg()[0], 2), **fields)


def percentiles(samples_s: list[float], unit: str = "ms") -> dict[str, float]:
    scale = {"ms": 1e3, "us": 1e6}[unit]
    ordered = sorted(samples_s)
    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * scale, 3)

    return {f"p50_{unit}": at(0.5), f"p99_{unit}": at(0.99), f"max_{unit}": at(1.0)}


def server_cpu_s(url: str) -> float:
    with redis.Redis.from_url(url) as client:
        cpu = client.info("cpu")
    return cpu["used_cpu_user"] + cpu["used_cpu_sys"]


async def timed(call: Callable[[], Awaitable], iterations: int, url: str) -> dict[str, float]:
    for _ in range(min(50, iterations)):
        await call()
    samples = []
    server0, client0 = server_cpu_s(url), time.process_time()
    for _ in range(iterations):
        t0 = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - t0)
    client_cpu = (time.process_time() - client0) / iterations
    server_cpu = (server_cpu_s(url) - server0) / iterations
    return {**percentiles(samples), "server_cpu_us": round(server_cpu * 1e6, 1),
            "client_cpu_us": round(client_cpu * 1e6, 1)}


async def fill(index: PrefixIndex, prompt: list[bytes], depths: list[int], background: int) -> None:
    rng = random.Random(0)
    for i, depth in enumerate(depths):
        hashes = prompt[:depth] + [rng.randbytes(16) for _ in range(background)]
        for start in range(0, len(hashes), 4096):
            chunk = hashes[start : start + 4096]
            await index.apply(KVEventBatch(f"engine-{i}", 1, [BlockStored(chunk)]))
        assert await index.heartbeat(f"engine-{i}", 1, 3600)


async def bench_lookups(redis_url: str, iterations: int, background: int) -> None:
    rng = random.Random(1)
    prompt = block_hashes([rng.randrange(49152) for _ in range(PROMPT_TOKENS)], BLOCK_SIZE)
    for backend, url in (("redis", redis_url), ("memory", f"memory://bench-{uuid.uuid4().hex}")):
        for scenario, depths in SCENARIOS.items():
            namespace = f"kvgate-bench-{uuid.uuid4().hex[:8]}"
            index = open_index(url, "bench-model", BLOCK_SIZE, namespace=namespace)
            try:
                await fill(index, prompt, depths, background)
                expected = {f"engine-{i}": d for i, d in enumerate(depths)}
                assert await index.lookup(prompt) == expected
                if backend == "redis":
                    result = await timed(lambda: index.lookup(prompt), iterations, url)
                else:
                    samples = []
                    for _ in range(iterations):
                        t0 = time.perf_counter()
                        await index.lookup(prompt)
                        samples.append(time.perf_counter() - t0)
                    result = percentiles(samples)
            finally:
                await index.close()
                if backend == "redis":
                    drop_namespace(redis_url, namespace)
            emit(bench="index_lookup", backend=backend, scenario=scenario, depths=depths,
                 prompt_tokens=PROMPT_TOKENS, num_blocks=len(prompt),
                 background_blocks_per_replica=background, iterations=iterations,
                 goal_p99_ms=GOAL_P99_MS if backend == "redis" else None, **result)

    client = redis.asyncio.Redis.from_url(redis_url)
    noop = client.register_script("return 1")
    blob = b"".join(prompt)
    result = await timed(lambda: noop(keys=["kvgate-bench-noop"], args=[blob]), iterations,
                         redis_url)
    await client.aclose()
    emit(bench="index_lookup", backend="redis", scenario="noop_script_same_payload",
         prompt_tokens=PROMPT_TOKENS, num_blocks=len(prompt), iterations=iterations, **result)


def drop_namespace(url: str, namespace: str) -> None:
    with redis.Redis.from_url(url) as client:
        keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        if keys:
            client.delete(*keys)


def bench_publish(redis_url: str, calls: int) -> None:
    """publish() as the engine calls it: once per step (a step every 0.2 ms here)."""
    events = [BlockStored(block_hashes(list(range(64)), BLOCK_SIZE))]
    cases = [("redis_up", redis_url), ("redis_absent", f"redis://127.0.0.1:{free_port()}/0")]
    for case, url in cases:
        namespace = f"kvgate-bench-{uuid.uuid4().hex[:8]}"
        publisher = KVEventPublisher(url, "engine-0", "bench-model", BLOCK_SIZE, 0.5,
                                     snapshot=list, namespace=namespace)
        publisher.start()
        deadline = time.monotonic() + 5
        while case == "redis_up" and publisher.stats().needs_resync and time.monotonic() < deadline:
            time.sleep(0.01)
        samples = paced(lambda: publisher.publish(events), calls)
        stats = publisher.stats()
        publisher.close()
        if case == "redis_up":
            drop_namespace(redis_url, namespace)
        emit(bench="kv_publish", case=case, calls=calls, connected=stats.connected,
             writes=stats.writes, overflows=stats.overflows, **percentiles(samples, "us"))
    queue: deque = deque()
    samples = paced(lambda: queue.append(events), calls)
    emit(bench="kv_publish", case="peer_deque_append", calls=calls, **percentiles(samples, "us"))


def paced(call: Callable[[], None], calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
        time.sleep(0.0002)
    return samples


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        with redis.Redis.from_url(url) as client:
            for _ in range(500):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.01)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="an existing Redis (default: start a private one)")
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--background-blocks", type=int, default=50_000,
                        help="unrelated cached blocks per replica, so sets have a realistic size")
    parser.add_argument("--publish-calls", type=int, default=5000)
    args = parser.parse_args()
    # stdout carries only the JSON lines; the publisher's logs go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    with contextlib.nullcontext(args.redis_url) if args.redis_url else private_redis() as url:
        asyncio.run(bench_lookups(url, args.iterations, args.background_blocks))
        bench_publish(url, args.publish_calls)


if __name__ == "__main__":
    main()
