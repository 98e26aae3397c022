"""The gateway's connection pool to its engines: httpx2's (gateway.engine_client.engine_transport) against
httpx 0.28's (httpcore 1.0.9, the pool the gateway used before), same sidecar, same requests, same run.

Starts a real engine sidecar (``python -m engine serve``, the tiny dummy model on the CPU, one torch thread)
and opens ``--streams`` /generate streams at once, round after round, through each pool in turn (each pool
its own transport, kept across its rounds, as the gateway keeps its one; the rounds interleaved, each pool
first every other round, so both see the same machine load). The first round finds an empty pool; later
rounds find the last round's connections idle and kept alive, which is the gateway's steady state. Per
round: how long until every response head arrived (the sidecar submits a request to its engine before it
sends the head, so this bounds the spread of the arrivals the engine sees), the round's wall time and the
client's CPU. One JSON line per round, then a summary per pool.

    .venv/bin/python benchmarks/engine_client_pool.py [--streams 64] [--rounds 4] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import httpx2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.protocol import MSGPACK, GenerateRequest, SamplingParams  # noqa: E402
from gateway.engine_client import engine_transport  # noqa: E402
from gateway.spawn import free_port  # noqa: E402
from loadtest import stamp  # noqa: E402

KEEPALIVE = 256  # the gateway's: min(--max-in-flight, 256)


def emit(**fields) -> None:
    stamp.emit(benchmark="engine_client_pool", **fields)


def pools() -> dict[str, tuple[object, object]]:
    """Pool name -> (transport, its library)."""
    return {
        "httpx2 2.17 (engine_transport)": (engine_transport(KEEPALIVE), httpx2),
        "httpx 0.28 / httpcore 1.0.9": (httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=KEEPALIVE)), httpx),
    }


async def one_round(transport, lib, url: str, streams: int, tokens: int, tag: str) -> dict:
    heads: list[float] = []
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t0, cpu0 = time.perf_counter(), time.process_time()

    async def one(i: int) -> None:
        body = GenerateRequest(f"{tag}-{i}", [1 + (i + k) % 100 for k in range(16)], sampling).pack()
        request = lib.Request("POST", lib.URL(url + "/generate"), content=body, headers={"content-type": MSGPACK},
                              extensions={"timeout": {"connect": 5.0, "read": None, "write": 30.0, "pool": 30.0}})
        response = await transport.handle_async_request(request)
        heads.append(time.perf_counter() - t0)
        try:
            if response.status_code != 200:
                raise SystemExit(f"{tag}-{i}: {response.status_code} {(await response.aread())[:200]!r}")
            async for _ in response.aiter_raw():
                pass
        finally:
            await response.aclose()

    await asyncio.gather(*(one(i) for i in range(streams)))
    return dict(heads_spread_ms=round(max(heads) * 1e3, 1), first_head_ms=round(min(heads) * 1e3, 1),
                wall_ms=round((time.perf_counter() - t0) * 1e3, 1),
                client_cpu_ms=round((time.process_time() - cpu0) * 1e3, 1))


async def run(url: str, streams: int, rounds: int, tokens: int) -> None:
    warmup = engine_transport(1)  # the engine's first steps, on a pool of its own
    await one_round(warmup, httpx2, url, 1, tokens, "warmup")
    await warmup.aclose()
    clients = pools()
    results: dict[str, list[dict]] = {name: [] for name in clients}
    for r in range(rounds):
        order = list(clients.items())
        for name, (transport, lib) in order if r % 2 == 0 else reversed(order):  # each pool first every other round
            result = await one_round(transport, lib, url, streams, tokens, f"r{r}-{len(results[name])}-{lib.__name__}")
            results[name].append(result)
            emit(measure="round", pool=name, round=r, streams=streams, tokens=tokens, warm_pool=r > 0,
                 loadavg_1m=round(os.getloadavg()[0], 2), **result)
    for transport, _ in clients.values():
        await transport.aclose()
    for name, rows in results.items():
        warm = rows[1:]
        emit(measure="summary", pool=name, streams=streams, rounds=rounds,
             cold_heads_spread_ms=rows[0]["heads_spread_ms"],
             warm_heads_spread_ms_median=statistics.median(row["heads_spread_ms"] for row in warm),
             warm_client_cpu_ms_median=statistics.median(row["client_cpu_ms"] for row in warm),
             warm_wall_ms_median=statistics.median(row["wall_ms"] for row in warm),
             peer="the other pool, same sidecar and rounds, interleaved")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64, help="streams opened at once per round (default: 64)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per pool, the first cold (default: 4)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens each stream generates (default: 32)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the first finds an empty pool)")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="engine-client-pool-")) / "engine.log"
    with open(log, "wb") as out:
        engine = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", str(port), "--load-format",
             "dummy", "--model", "tiny", "--device", "cpu", "--max-num-seqs", str(args.streams)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 180
        while True:
            if engine.poll() is not None:
                raise SystemExit(f"engine serve exited with {engine.returncode}: see {log}")
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"engine serve not ready in 180 s: see {log}")
            time.sleep(0.2)
        emit(measure="environment", cpus=os.cpu_count(), loadavg_1m=round(os.getloadavg()[0], 2), engine_log=str(log))
        asyncio.run(run(url, args.streams, args.rounds, args.tokens))
    finally:
        engine.terminate()
        engine.wait(30)


if __name__ == "__main__":
    main()
