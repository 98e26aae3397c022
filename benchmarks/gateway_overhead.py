"""Gateway overhead: the latency the gateway adds, and the highest request rate through it, each measured
against going straight to the engine's /generate in the same run.

Starts a tiny dummy engine and a gateway in front of it (subprocesses on free ports, default logging).
Latency: sequential keep-alive requests, max_tokens=1, small prompts, gateway and direct interleaved so
that both see the same machine load; the engine gets the very same token ids either way. Rate: closed
loops of C concurrent clients for a few seconds each. Prints one JSON line per measurement.

    .venv/bin/python benchmarks/gateway_overhead.py [--requests 400] [--seconds 5] [--concurrency 1,8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.protocol import MSGPACK, GenerateRequest, SamplingParams, default_model_path  # noqa: E402
from gateway.spawn import free_port  # noqa: E402
from gateway.tokenizer import Tokenizer, load_hf_tokenizer  # noqa: E402
from loadtest import stamp  # noqa: E402

GOAL_ADDED_P50_MS = 1.0
PROMPT = "Hello! How are you doing today?"
MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": PROMPT}]


def emit(**fields) -> None:
    stamp.emit(benchmark="gateway_overhead", **fields)


def start(argv: list[str], ready_url: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{argv[:4]} exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"{argv[:4]} not ready:\n{log.read_text()[-3000:]}")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Paths:
    """The same work three ways: the engine direct, and the gateway's completions and chat endpoints."""

    def __init__(self, engine: str, gateway: str, tokenizer: Tokenizer):
        self.engine, self.gateway = engine, gateway
        self.completion_ids = tokenizer.encode(PROMPT, add_special_tokens=True)
        chat = tokenizer.chat_prompt(MESSAGES)
        self.chat_ids, self.chat_boundaries = chat.token_ids, chat.cache_boundaries
        self.counter = 0

    def direct(self, ids: list[int], boundaries: list[int]) -> tuple[str, bytes, dict]:
        self.counter += 1
        req = GenerateRequest(f"bench-{self.counter}", ids, SamplingParams(max_tokens=1, temperature=0.0),
                              None, boundaries)
        return self.engine + "/generate", req.pack(), {"content-type": MSGPACK}

    def requests(self) -> dict[str, Callable[[], tuple[str, bytes, dict]]]:
        js = {"content-type": "application/json"}
        completion = json.dumps({"prompt": PROMPT, "max_tokens": 1, "temperature": 0}).encode()
        chat = json.dumps({"messages": MESSAGES, "max_tokens": 1, "temperature": 0}).encode()
        chat_stream = json.dumps({"messages": MESSAGES, "max_tokens": 1, "temperature": 0, "stream": True}).encode()
        return {
            "engine_completion": lambda: self.direct(self.completion_ids, []),
            "gateway_completion": lambda: (self.gateway + "/v1/completions", completion, js),
            "engine_chat": lambda: self.direct(self.chat_ids, self.chat_boundaries),
            "gateway_chat": lambda: (self.gateway + "/v1/chat/completions", chat, js),
            "gateway_chat_stream": lambda: (self.gateway + "/v1/chat/completions", chat_stream, js),
        }


def measure_latency(paths: Paths, n: int, warmup: int) -> dict[str, list[float]]:
    requests = paths.requests()
    samples: dict[str, list[float]] = {name: [] for name in requests}
    with httpx.Client(timeout=60) as client:
        for i in range(warmup + n):
            for name, make in requests.items():  # interleaved: every path sees the same load
                url, body, headers = make()
                t0 = time.perf_counter()
                resp = client.post(url, content=body, headers=headers)
                elapsed = time.perf_counter() - t0
                if resp.status_code != 200:
                    raise SystemExit(f"{name}: {resp.status_code} {resp.text[:300]}")
                if i >= warmup:
                    samples[name].append(elapsed * 1e3)
    return samples


async def closed_loop(make: Callable[[], tuple[str, bytes, dict]], concurrency: int,
                      seconds: float) -> tuple[int, list[float]]:
    latencies: list[float] = []
    stop = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def worker() -> None:
            while time.monotonic() < stop:
                url, body, headers = make()
                t0 = time.perf_counter()
                resp = await client.post(url, content=body, headers=headers)
                if resp.status_code != 200:
                    raise SystemExit(f"{url}: {resp.status_code} {resp.text[:300]}")
                latencies.append((time.perf_counter() - t0) * 1e3)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(latencies), latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400, help="latency samples per path (default: 400)")
    parser.add_argument("--warmup", type=int, default=50, help="unmeasured requests per path first (default: 50)")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each rate level (default: 5)")
    parser.add_argument("--concurrency", default="1,8,32", help="rate levels, comma-separated (default: 1,8,32)")
    args = parser.parse_args()

    logs = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    engine_port, gateway_port = free_port(), free_port()
    engine_url, gateway_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
    engine = start([sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", str(engine_port),
                    "--load-format", "dummy", "--model", "tiny", "--num-kv-blocks", "4096"],
                   engine_url + "/health", logs / "engine.log",
                   # one torch thread: OpenMP workers spin between the tiny model's steps and would take
                   # the CPU that the gateway and this client need on a small machine
                   env={"OMP_NUM_THREADS": "1"})
    gateway = start([sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(gateway_port),
                     "--engine", engine_url], gateway_url + "/ready", logs / "gateway.log")
    try:
        emit(measure="environment", cpus=os.cpu_count(), loadavg_1m=round(os.getloadavg()[0], 2),
             uvloop=importlib.util.find_spec("uvloop") is not None,
             httptools=importlib.util.find_spec("httptools") is not None, logs=str(logs))
        paths = Paths(engine_url, gateway_url, Tokenizer(load_hf_tokenizer(
            str(default_model_path()), Path(os.environ.get("KVGATE_CACHE_DIR", "~/.cache/kvgate")).expanduser())))

        cpu_before = cpu_seconds(gateway.pid)
        samples = measure_latency(paths, args.requests, args.warmup)
        gateway_requests = 3 * (args.requests + args.warmup)
        for name, values in samples.items():
            emit(measure="latency", path=name, n=len(values), p50_ms=round(statistics.median(values), 3),
                 p99_ms=round(percentile(values, 0.99), 3))
        for gateway_path, engine_path in (("gateway_completion", "engine_completion"),
                                          ("gateway_chat", "engine_chat"), ("gateway_chat_stream", "engine_chat")):
            g, e = samples[gateway_path], samples[engine_path]
            added_p50 = statistics.median(g) - statistics.median(e)
            emit(measure="added_latency", path=gateway_path, versus=engine_path, p50_ms=round(added_p50, 3),
                 p99_ms=round(percentile(g, 0.99) - percentile(e, 0.99), 3),
                 paired_median_ms=round(statistics.median(a - b for a, b in zip(g, e)), 3),
                 goal_p50_ms=GOAL_ADDED_P50_MS, goal_met=added_p50 <= GOAL_ADDED_P50_MS)
        emit(measure="gateway_cpu", cpu_ms_per_request=round((cpu_seconds(gateway.pid) - cpu_before)
                                                             / gateway_requests * 1e3, 3))

        requests = paths.requests()
        best: dict[str, tuple[float, int]] = {}
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for name in ("engine_completion", "gateway_completion"):
                count, latencies = asyncio.run(closed_loop(requests[name], concurrency, args.seconds))
                rate = count / args.seconds
                emit(measure="throughput", path=name, concurrency=concurrency, requests_per_s=round(rate, 1),
                     p50_ms=round(statistics.median(latencies), 3))
                if rate > best.get(name, (0.0, 0))[0]:
                    best[name] = (rate, concurrency)
        for name, (rate, concurrency) in best.items():
            emit(measure="max_throughput", path=name, requests_per_s=round(rate, 1), concurrency=concurrency)
    finally:
        for proc in (gateway, engine):
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
