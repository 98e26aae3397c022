"""Overload: admitted requests keep their latency when load sheds.

One CPU engine ("mini" dummy shape) behind a gateway with --max-queue-seconds. First the sustainable
rate is measured (requests served back to back), then open-loop Poisson arrivals run at the nominal
rate (``--nominal`` × sustainable) and at ``--overload`` × sustainable. Each request is a streamed
completion of a distinct prompt; its TTFT is measured when admitted, its status and Retry-After when
refused. "Lost" counts requests that neither completed nor were refused with a Retry-After (errors,
cut streams). TTFT is measured by the client and, free of the client's own scheduling, from the
gateway's request log. One JSON line per phase, then a verdict line.

    .venv/bin/python benchmarks/overload.py [--seconds 30] [--overload 3] [--max-queue-seconds 0.75]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest import stamp  # noqa: E402
from loadtest.stack import spawned_stack  # noqa: E402

GOAL_TTFT_P99_RATIO = 2.0
PROMPT_WORDS = 300  # ~600 tokens: prefill dominates, as in the long-prompt workloads that queue
MAX_TOKENS = 16


def prompt(rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(100000)}" for _ in range(PROMPT_WORDS))


async def one(client: httpx.AsyncClient, text: str) -> dict:
    start = time.perf_counter()
    body = {"prompt": text, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return {"status": resp.status_code, "retry_after": resp.headers.get("retry-after")}
            ttft, chunks, done = None, 0, False
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    if '"error"' in line:
                        return {"status": "stream_error"}
                done = done or line == "data: [DONE]"
            return {"status": 200, "ttft": ttft, "complete": done and chunks >= MAX_TOKENS}
    except httpx.HTTPError as exc:
        return {"status": f"transport:{type(exc).__name__}"}


async def sustainable_rate(client: httpx.AsyncClient, rng: random.Random, count: int = 8) -> float:
    """Requests per second served back to back: the rate the engine just keeps up with."""
    await one(client, prompt(rng))  # warm up
    start = time.perf_counter()
    for _ in range(count):
        await one(client, prompt(rng))
    return count / (time.perf_counter() - start)


async def phase(client: httpx.AsyncClient, rng: random.Random, rate: float, seconds: float) -> list[dict]:
    tasks = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        tasks.append(asyncio.create_task(one(client, prompt(rng))))
        await asyncio.sleep(rng.expovariate(rate))
    return await asyncio.gather(*tasks)


def summary(results: list[dict]) -> dict:
    admitted = [r for r in results if r["status"] == 200]
    ttfts = sorted(r["ttft"] for r in admitted if r.get("ttft") is not None)
    refused = [r for r in results if r["status"] in (429, 503)]
    lost = [r for r in results if not ((r["status"] == 200 and r.get("complete"))
                                       or (r in refused and r.get("retry_after")))]
    cuts = statistics.quantiles(ttfts, n=100) if len(ttfts) >= 2 else [float("nan")] * 99
    return {"requests": len(results), "admitted": len(admitted), "refused": len(refused),
            "refused_with_retry_after": sum(1 for r in refused if r.get("retry_after")),
            "lost": len(lost), "lost_examples": [r["status"] for r in lost[:5]],
            "ttft_p50_s": round(cuts[49], 3), "ttft_p99_s": round(cuts[98], 3)}


def gateway_ttfts(log: Path, seen: int) -> tuple[list[float], int]:
    """TTFTs (s) the gateway logged for completed requests after line ``seen``, and the new line count."""
    lines = log.read_text().splitlines()
    ttfts = []
    for line in lines[seen:]:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "request" and record.get("status") == 200 and "ttft_ms" in record:
            ttfts.append(record["ttft_ms"] / 1e3)
    return ttfts, len(lines)


async def run(url: str, key: str, log: Path, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300,
                                 limits=httpx.Limits(max_connections=None)) as client:
        sustainable = await sustainable_rate(client, rng)
        records = {}
        _, seen = gateway_ttfts(log, 0)
        for name, factor in (("nominal", args.nominal), ("overload", args.overload)):
            results = await phase(client, rng, sustainable * factor, args.seconds)
            records[name] = summary(results)
            logged, seen = gateway_ttfts(log, seen)
            cuts = statistics.quantiles(logged, n=100)
            records[name].update(gateway_ttft_p50_s=round(cuts[49], 3), gateway_ttft_p99_s=round(cuts[98], 3))
            stamp.emit(benchmark="overload", phase=name, load_factor=factor,
                       rate_rps=round(sustainable * factor, 3), sustainable_rps=round(sustainable, 3),
                       seconds=args.seconds, max_queue_seconds=args.max_queue_seconds, **records[name])
            await asyncio.sleep(args.max_queue_seconds + 2)  # drain between phases
    ratio = records["overload"]["ttft_p99_s"] / records["nominal"]["ttft_p99_s"]
    gateway_ratio = records["overload"]["gateway_ttft_p99_s"] / records["nominal"]["gateway_ttft_p99_s"]
    stamp.emit(benchmark="overload", phase="verdict", ttft_p99_ratio=round(ratio, 2),
               gateway_ttft_p99_ratio=round(gateway_ratio, 2),
               goal_ttft_p99_ratio=GOAL_TTFT_P99_RATIO, met=ratio <= GOAL_TTFT_P99_RATIO
               and records["overload"]["lost"] == 0 and records["nominal"]["lost"] == 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    parser.add_argument("--nominal", type=float, default=0.7, help="nominal load, × the sustainable rate")
    parser.add_argument("--overload", type=float, default=3.0, help="overload, × the sustainable rate")
    parser.add_argument("--max-queue-seconds", type=float, default=0.75, help="the gateway's shedding bound")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gateway_args = ["--max-queue-seconds", str(args.max_queue_seconds), "--health-interval", "0.25"]
    with tempfile.TemporaryDirectory() as tmp, spawned_stack(Path(tmp), gateway_args, model="mini",
                                                             engine_args=["--cpu-threads", "1"]) as (url, key, logs):
        asyncio.run(run(url, key, logs[1], args))


if __name__ == "__main__":
    main()
