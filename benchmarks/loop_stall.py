"""Event-loop stalls from large requests: while a stream runs and /health is polled every 10 ms, the
gateway gets ten chat requests with a 6 MB system prompt (each refused: it cannot fit the context). The
peer is the same window without them. Reports the longest /health answer, the longest gap between the
stream's chunks (p50, p99, max: on a shared machine the peer's max is noise too), and the gateway's RSS
growth. One JSON line per phase.

    .venv/bin/python benchmarks/loop_stall.py [--requests 10] [--megabytes 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest import stamp  # noqa: E402
from loadtest.stack import spawned_stack  # noqa: E402

GOAL_MAX_STALL_MS = 100
GOAL_RSS_GROWTH_MB = 100


async def window(url: str, key: str, big_requests: int, megabytes: int) -> dict:
    """Stream + health probes, with ``big_requests`` large chat requests sent one after another."""
    auth = {"Authorization": f"Bearer {key}"}
    done = asyncio.Event()
    health_ms: list[float] = []
    gaps_ms: list[float] = []
    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=120) as client:

        async def probe() -> None:
            while not done.is_set():
                start = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                health_ms.append((time.perf_counter() - start) * 1e3)
                await asyncio.sleep(0.01)

        async def stream() -> None:
            body = {"prompt": "a stream", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                last = None
                async for _ in resp.aiter_lines():
                    now = time.perf_counter()
                    if last is not None and not done.is_set():
                        gaps_ms.append((now - last) * 1e3)
                    last = now

        async def senders() -> list[int]:
            messages = [{"role": "system", "content": "x" * (megabytes << 20)}, {"role": "user", "content": "hi"}]
            # encoded once, here: encoding 6 MB on this loop would stall the probes' own measurements
            body = json.dumps({"messages": messages, "max_tokens": 4}).encode()
            statuses = []
            for _ in range(big_requests):
                resp = await client.post("/v1/chat/completions", content=body,
                                         headers={"content-type": "application/json"})
                statuses.append(resp.status_code)
            if not big_requests:
                await asyncio.sleep(2.0)
            return statuses

        tasks = [asyncio.create_task(probe()), asyncio.create_task(stream())]
        await asyncio.sleep(0.5)  # the stream is running
        statuses = await senders()
        done.set()
        await asyncio.gather(*tasks)
    return {"big_requests": big_requests, "statuses": sorted(set(statuses)), "health_probes": len(health_ms),
            **percentiles("health_ms", health_ms), **percentiles("stream_gap_ms", gaps_ms)}


def percentiles(name: str, values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100)
    return {f"p50_{name}": round(cuts[49], 1), f"p99_{name}": round(cuts[98], 1), f"max_{name}": round(max(values), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--megabytes", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, spawned_stack(
            Path(tmp), ["--max-body-bytes", str((args.megabytes + 2) << 20)]) as (url, key, _):
        gateway = next(p for p in psutil.process_iter(["cmdline"]) if url.rsplit(":", 1)[1] in (p.info["cmdline"] or [])
                       and "gateway" in p.info["cmdline"])
        for phase, count in (("peer_without_large_requests", 0), ("with_large_requests", args.requests)):
            rss = gateway.memory_info().rss
            record = asyncio.run(window(url, key, count, args.megabytes))
            stamp.emit(benchmark="loop_stall", phase=phase, megabytes=args.megabytes, **record,
                       rss_growth_mb=round((gateway.memory_info().rss - rss) / 2**20, 1),
                       goal_max_stall_ms=GOAL_MAX_STALL_MS, goal_rss_growth_mb=GOAL_RSS_GROWTH_MB)


if __name__ == "__main__":
    main()
