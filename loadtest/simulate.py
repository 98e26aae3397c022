"""Fleet simulation: the real router and prefix index over simulated engines, from 16 to 512 replicas.

A discrete-event simulation on a virtual clock. What is real: the routing policies of
:mod:`gateway.router` (block hashing, one index lookup, scoring, speculative inserts), the
:class:`gateway.replica.Replica` load figures they read (polled /stats, in-flight requests, queued
prefill, utilization), and the prefix index (``memory://``, or ``redis://`` on a throwaway
redis-server) that the simulated engines publish their KV events to and heartbeat into. What is
simulated: the engines. Each runs continuous batching (up to ``max_num_seqs`` sequences, a token
budget per step with chunked prefill, decode of every sequence past its prefill) over a KV cache of
``num_kv_blocks`` blocks with LRU eviction of unreferenced cached blocks, and a step costs
``overhead + prefill_tokens * per_prefill_token + decode_seqs * per_decode_seq``, fitted by least
squares to the H200 measurements in ``benchmarks/results/gpu_bench_h200.jsonl`` (Llama-3-8B: TTFT
at 1-8 concurrent 512-token prompts, the 8K prefill, batch-1 decode, 64-request continuous
batching), with that run's KV size and step limits.

The workload is :mod:`loadtest.workload`'s agent conversations (shared system prompts, growing
histories), one word one token, arriving as a Poisson stream; a turn follows its answer after an
exponential think time. Each request's single-cache ideal is what one unlimited cache would reuse
(the previous turn's prompt, or a system prompt seen before).

Output: one JSON line per (backend, replicas, policy) with hit rate against the ideal, TTFT
percentiles, load overrides, the router's CPU per request, index lookup latency (and, on Redis,
the server's own time per lookup from its slow log, memory per replica and commands per simulated
second), stamped with commit and date (``loadtest/stamp.py``)::

    python -m loadtest.simulate --replicas 16,64,512 --conversations 2000,4000,10000 \
        --out loadtest/results/simulate_memory.jsonl
    python -m loadtest.simulate --backend redis --policies prefix --replicas 16,64,512 \
        --conversations 1000,2000,4000 --out loadtest/results/simulate_redis.jsonl

The memory index's clock is the simulation's; Redis's TTLs run on its own clock, so on Redis the
heartbeats are long and the speculative TTL is the gateway default in real seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import json
import math
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis

from engine.logs import configure_logging
from engine.protocol import EngineStats
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.replica import Replica
from gateway.router import LOAD_OVERRIDE, NO_INDEX, ROUTERS, PrefixRouter, PrefixSettings, Router, RouteRequest
from loadtest.stamp import stamp
from loadtest.workload import WORDS, Workload, WorkloadConfig
from prefix_index import memory as memory_index
from prefix_index.events import BlockRemoved, BlockStored, KVEventBatch
from prefix_index.hashing import BlockHash, block_hashes
from prefix_index.index import open_index
from prefix_index.redis_index import LOOKUP_SHA

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu_bench_h200.jsonl"
MODEL = "llama3-8b"
BLOCK_SIZE = 16
POLL_S = 1.0  # the gateway's --health-interval
HEARTBEAT_S = 2.0  # the publisher's default
SYSTEM, USER, ASSISTANT = 1, 2, 3  # chat-template tokens; words are 1000 + their index in WORDS
WORD_IDS = {w: 1000 + i for i, w in enumerate(WORDS)}


@dataclass(frozen=True)
class StepModel:
    """An engine step's seconds: overhead + prefill tokens and decoding sequences, each at a cost."""

    overhead_s: float
    prefill_token_s: float
    decode_seq_s: float
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    fit_error: float  # largest relative error over the measurements fitted

    def step_s(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.overhead_s + prefill_tokens * self.prefill_token_s + decode_seqs * self.decode_seq_s

    @classmethod
    def fit(cls, path: Path = BENCH, model: str = MODEL) -> StepModel:
        """Least squares over the run's TTFT, prefill, batch-1 decode and continuous-batching records."""
        rows, seconds, limits = [], [], None
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("model") != model:
                continue
            bench = r["bench"]
            if bench == "engine_start":
                limits = r
            elif bench == "ttft":  # c prompts prefilled together: one step
                rows.append((1, r["concurrent"] * r["prompt_tokens"], 0))
                seconds.append(r["steady_ms"] / 1e3)
            elif bench == "prefill_8k":
                rows.append((1, r["tokens"], 0))
                seconds.append(r["ours_ms"] / 1e3)
            elif bench == "decode_b1" and "ours_ms_per_token" in r:
                rows.append((1, 0, 1))
                seconds.append(r["ours_ms_per_token"] / 1e3)
            elif bench == "cont_batch" and "ours_output_tok_s" in r:
                # all prompts prefilled in budget-sized steps, then one decode step per further token
                n, prompt, out = r["requests"], r["prompt_tokens"], r["output_tokens_each"]
                prefill_steps = math.ceil(n * prompt / 8192)
                rows.append((prefill_steps + out - 1, n * prompt, n * (out - 1)))
                seconds.append(n * out / r["ours_output_tok_s"])
        if limits is None or len(rows) < 3:
            raise ValueError(f"{path}: too few {model} records to fit a step model")
        a = np.array(rows, dtype=float)
        y = np.array(seconds)
        # relative least squares: each measurement counts alike, whatever its size
        coef, *_ = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)
        coef = np.maximum(coef, 0.0)
        error = float(np.max(np.abs(a @ coef - y) / y))
        return cls(float(coef[0]), float(coef[1]), float(coef[2]), limits["num_kv_blocks"],
                   limits["max_num_seqs"], limits["max_num_batched_tokens"], error)


@dataclass(eq=False)
class SimRequest:
    conversation: int
    prompt_ids: list[int]
    hashes: list[BlockHash]  # full prompt blocks
    max_tokens: int
    arrival: float
    ideal_blocks: int
    predicted_prefill: int = 0  # counted in its replica's pending_prefill_tokens until its first token
    replica: Replica | None = None
    cached_tokens: int = 0
    prefill_left: int = 0
    generated: int = 0
    pinned: list[BlockHash] = field(default_factory=list)  # cached blocks it references
    private: int = 0  # blocks only it holds
    first_token: float | None = None
    reason: str = ""


class SimEngine:
    """One engine: continuous batching over an LRU block cache; its KV events go to the index."""

    def __init__(self, replica_id: str, model: StepModel):
        self.replica_id = replica_id
        self.model = model
        self.free = model.num_kv_blocks  # empty blocks
        self.refs: dict[BlockHash, int] = {}  # cached block -> requests referencing it
        self.lru: OrderedDict[BlockHash, None] = OrderedDict()  # cached, unreferenced: evictable
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.busy_s = 0.0
        self.computed_tokens = 0  # prefill and decode tokens of every step, as /stats counts them
        self.stepping = False
        self.stored: list[tuple[list[BlockHash], BlockHash | None]] = []
        self.removed: list[BlockHash] = []

    def stats(self, model_name: str) -> EngineStats:
        m = self.model
        return EngineStats(
            model=model_name, replica_id=self.replica_id, block_size=BLOCK_SIZE, max_model_len=32768,
            vocab_size=128256, num_running=len(self.running), num_waiting=len(self.waiting),
            num_free_blocks=self.free + len(self.lru), num_total_blocks=m.num_kv_blocks,
            kv_usage=1 - (self.free + len(self.lru)) / m.num_kv_blocks, num_cached_blocks=len(self.refs),
            prefix_hit_rate=0.0, num_position_entries=0, num_preemptions=0,
            max_num_batched_tokens=m.max_num_batched_tokens, prefill_pack_tokens=m.max_num_batched_tokens,
            max_num_seqs=m.max_num_seqs, total_busy_seconds=self.busy_s,
            num_waiting_tokens=sum(len(r.prompt_ids) for r in self.waiting)
            + sum(r.prefill_left for r in self.running),
            total_computed_tokens=self.computed_tokens,
            kv_cache_dtype="bfloat16", kv_tokens_per_gib=8192,  # a Llama-3-8B-shaped bf16 pool
            spec_num_drafts=0, spec_num_draft_tokens=0, spec_num_accepted_tokens=0,
            spec_num_accepted_tokens_per_pos=[])

    def _allocate(self, blocks: int) -> bool:
        while self.free < blocks and self.lru:
            victim, _ = self.lru.popitem(last=False)
            del self.refs[victim]
            self.removed.append(victim)
            self.free += 1
        if self.free < blocks:
            return False
        self.free -= blocks
        return True

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.model.max_num_seqs:
            req = self.waiting[0]
            prompt = len(req.prompt_ids)
            hit = 0
            for h in req.hashes[:(prompt - 1) // BLOCK_SIZE]:
                if h not in self.refs:
                    break
                hit += 1
            need = math.ceil((prompt + req.max_tokens) / BLOCK_SIZE) - hit
            for h in req.hashes[:hit]:  # pin before evicting for the rest
                if self.refs[h] == 0:
                    del self.lru[h]
                self.refs[h] += 1
            if not self._allocate(need):
                self._release(req.hashes[:hit])
                return  # waits for blocks to free
            self.waiting.popleft()
            req.pinned, req.private = list(req.hashes[:hit]), need
            req.cached_tokens = hit * BLOCK_SIZE
            req.prefill_left = prompt - req.cached_tokens
            self.running.append(req)

    def _release(self, hashes: list[BlockHash]) -> None:
        for h in hashes:
            self.refs[h] -= 1
            if self.refs[h] == 0:
                self.lru[h] = None

    def _cache_prompt(self, req: SimRequest) -> None:
        """The request's computed prompt blocks become cached (stored events, parent first)."""
        run: list[BlockHash] = []
        parent = req.pinned[-1] if req.pinned else None
        for h in req.hashes[len(req.pinned):]:
            if h in self.refs:  # another request cached it meanwhile: its copy stays private
                if run:
                    self.stored.append((run, parent))
                    run = []
                self._pin(h)
                req.pinned.append(h)
                parent = h
                continue
            self.refs[h] = 1
            req.pinned.append(h)
            req.private -= 1
            run.append(h)
        if run:
            self.stored.append((run, parent))

    def _pin(self, h: BlockHash) -> None:
        if self.refs[h] == 0:
            del self.lru[h]
        self.refs[h] += 1

    def step(self) -> tuple[float, list[SimRequest], list[SimRequest]]:
        """One step: its seconds, the requests that got their first token and those that finished."""
        self._admit()
        budget = self.model.max_num_batched_tokens
        prefill = decode = 0
        first, done = [], []
        for req in self.running:
            if req.prefill_left:
                chunk = min(req.prefill_left, budget)
                if not chunk:
                    continue
                budget -= chunk
                prefill += chunk
                req.prefill_left -= chunk
                if req.prefill_left:
                    continue
                first.append(req)
                self._cache_prompt(req)
            else:
                decode += 1
            req.generated += 1
            if req.generated >= req.max_tokens:
                done.append(req)
        for req in done:
            self.running.remove(req)
            self._release(req.pinned)
            self.free += req.private
        seconds = self.model.step_s(prefill, decode)
        self.busy_s += seconds
        self.computed_tokens += prefill + decode
        return seconds, first, done

    def events(self) -> KVEventBatch | None:
        events = [BlockStored(run, parent) for run, parent in self.stored]
        if self.removed:
            events.append(BlockRemoved(self.removed))
        self.stored, self.removed = [], []
        return KVEventBatch(self.replica_id, 1, events) if events else None


class Conversations:
    """The workload's agent conversations as token ids; each prompt extends the one before."""

    def __init__(self, config: WorkloadConfig):
        self.workload = Workload(config)
        self.system_ids = {}

    def turns(self, index: int) -> Iterator[tuple[list[int], int, int, int]]:
        """(prompt ids, answer tokens, system prompt index, its full blocks) of each turn."""
        c = self.workload.agent(index)
        ids = self.system_ids.get(c.system_index)
        if ids is None:
            ids = self.system_ids[c.system_index] = [SYSTEM, *(WORD_IDS[w] for w in c.system.split())]
        prompt = list(ids)
        for turn in c.turns:
            prompt += [USER, *(WORD_IDS[w] for w in turn.user.split()), ASSISTANT]
            yield list(prompt), turn.max_tokens, c.system_index, len(ids) // BLOCK_SIZE
            prompt += [WORD_IDS[w] for w in turn.answer.split()]


@dataclass
class Result:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ideal_tokens: int = 0
    load_overrides: int = 0
    no_index: int = 0  # routed by load: the index failed or was backing off
    ttft: list[float] = field(default_factory=list)
    route_cpu_s: float = 0.0
    lookups: list[float] = field(default_factory=list)


class Fleet:
    """One simulation run: engines, the router, the index, the event queue."""

    def __init__(self, args: argparse.Namespace, model: StepModel, replicas: int, conversations: int,
                 policy: str, index_url: str):
        self.args, self.model, self.policy = args, model, policy
        self.num_conversations = conversations
        self.engines = [SimEngine(f"engine-{i}", model) for i in range(replicas)]
        self.replicas = [Replica(f"http://engine-{i}", client=None) for i in range(replicas)]
        self.by_replica = dict(zip(self.replicas, self.engines, strict=True))
        self.index_url = index_url
        self.metrics = GatewayMetrics()
        self.router = _router(policy, index_url, self.metrics)
        self.index = open_index(index_url, MODEL, BLOCK_SIZE)
        self.now = 0.0
        self.queue: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.rng = random.Random(f"simulate/{args.seed}")
        self.result = Result()
        self.seen_systems: set[int] = set()
        self.conversations = Conversations(WorkloadConfig(seed=args.seed))
        self.turns: dict[int, Iterator] = {}
        self.prev_hashes: dict[int, list[BlockHash]] = {}
        self.active = 0

    def at(self, when: float, kind: str, what: object = None) -> None:
        heapq.heappush(self.queue, (when, next(self.seq), kind, what))

    async def run(self) -> Result:
        heartbeat_ttl = 3 * HEARTBEAT_S if self.index_url.startswith("memory") else 3600.0
        for engine in self.engines:
            await self.index.apply(KVEventBatch(engine.replica_id, 1, []))
            await self.index.heartbeat(engine.replica_id, 1, heartbeat_ttl)
        self._poll()
        await self.router.start(MODEL, BLOCK_SIZE)
        arrival = 0.0
        rate = self.args.rate * len(self.engines)
        for c in range(self.num_conversations):
            arrival += self.rng.expovariate(rate)
            self.at(arrival, "turn", c)
        self.at(POLL_S, "poll")
        self.at(HEARTBEAT_S, "heartbeat")
        pending = self.num_conversations
        while pending:
            self.now, _, kind, what = heapq.heappop(self.queue)
            if kind == "turn":
                if not await self._send(what):
                    pending -= 1
            elif kind == "step":
                await self._step_done(*what)
            elif kind == "poll":
                self._poll()
                self.at(self.now + POLL_S, "poll")
            elif kind == "heartbeat":
                for engine in self.engines:
                    await self.index.heartbeat(engine.replica_id, 1, heartbeat_ttl)
                self.at(self.now + HEARTBEAT_S, "heartbeat")
        await self.router.close()
        await self.index.close()
        return self.result

    def _poll(self) -> None:
        for replica, engine in self.by_replica.items():
            replica.observe(engine.stats(MODEL), self.now)
            replica.engine_ready = replica.ready = True

    async def _send(self, conversation: int) -> bool:
        """Route the conversation's next turn; False when it has no more."""
        turns = self.turns.setdefault(conversation, self.conversations.turns(conversation))
        try:
            prompt, max_tokens, system_index, system_blocks = next(turns)
        except StopIteration:
            del self.turns[conversation], self.prev_hashes[conversation]
            return False
        hashes = block_hashes(prompt, BLOCK_SIZE, prefix=self.prev_hashes.get(conversation, ()))
        previous = self.prev_hashes.get(conversation)
        ideal = len(previous) if previous else (system_blocks if system_index in self.seen_systems else 0)
        self.seen_systems.add(system_index)
        self.prev_hashes[conversation] = hashes
        req = SimRequest(conversation, prompt, hashes, max_tokens, self.now,
                         min(ideal, (len(prompt) - 1) // BLOCK_SIZE))
        start = time.process_time()
        decision = await self.router.choose(RouteRequest(prompt, None), self.replicas)
        self.result.route_cpu_s += time.process_time() - start
        await asyncio.sleep(0)  # the router's speculative insert runs in the background, as in a gateway
        req.replica, req.reason = decision.replica, decision.reason
        # as the dispatcher counts it: in flight until it ends, its predicted prefill until its first token
        decision.replica.streams.add(req)
        req.predicted_prefill = len(prompt) - decision.predicted_cached_tokens
        decision.replica.pending_prefill_tokens += req.predicted_prefill
        engine = self.by_replica[decision.replica]
        engine.waiting.append(req)
        if not engine.stepping:
            self._step(engine)
        return True

    def _step(self, engine: SimEngine) -> None:
        """Start the engine's next step; its results land when it ends."""
        seconds, first, done = engine.step()
        engine.stepping = bool(engine.running or first or done)
        if engine.stepping:
            self.at(self.now + seconds, "step", (engine, first, done))

    async def _step_done(self, engine: SimEngine, first: list[SimRequest], done: list[SimRequest]) -> None:
        batch = engine.events()
        if batch is not None:
            await self.index.apply(batch)
        r = self.result
        for req in first:
            req.first_token = self.now
            req.replica.pending_prefill_tokens -= req.predicted_prefill
            r.requests += 1
            r.prompt_tokens += len(req.prompt_ids)
            r.cached_tokens += req.cached_tokens
            r.ideal_tokens += req.ideal_blocks * BLOCK_SIZE
            r.load_overrides += req.reason == LOAD_OVERRIDE
            r.no_index += req.reason == NO_INDEX
            r.ttft.append(req.first_token - req.arrival)
        for req in done:
            req.replica.streams.discard(req)
            self.at(self.now + self.rng.expovariate(1 / self.args.think_time), "turn", req.conversation)
        engine.stepping = False
        if engine.running or engine.waiting:
            self._step(engine)


def _router(policy: str, index_url: str, metrics: GatewayMetrics) -> Router:
    if policy == PrefixRouter.policy:
        # The lookup timeout guards a real gateway against a slow Redis; here every answer counts.
        settings = dataclasses.replace(PrefixSettings.from_config(GatewayConfig()), lookup_timeout_s=60.0)
        return PrefixRouter(index_url, settings, metrics)
    return ROUTERS[policy]()


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


@contextlib.contextmanager
def simulated_clock(fleet_now) -> Iterator[None]:
    """The memory index reads the simulation's clock (milliseconds), not the machine's."""
    real = memory_index._now_ms
    memory_index._now_ms = lambda: int(fleet_now() * 1000)
    try:
        yield
    finally:
        memory_index._now_ms = real


class ThrowawayRedis:
    """A redis-server on a free port whose slow log records every command's own time."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.TemporaryDirectory()
        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--slowlog-log-slower-than", "0", "--slowlog-max-len", "1000000"],
            cwd=self.dir.name, stdout=subprocess.DEVNULL)
        self.client = redis.Redis(port=self.port, socket_timeout=300)  # its slow log can be long to fetch
        for _ in range(200):
            with contextlib.suppress(redis.ConnectionError):
                self.client.ping()
                break
            time.sleep(0.05)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(10)
        self.dir.cleanup()


async def simulate(args: argparse.Namespace, model: StepModel, replicas: int, conversations: int,
                   policy: str, stamped: dict) -> dict:
    """One run's record; ``stamped`` is the commit and date the runs started at (:func:`loadtest.stamp.stamp`)."""
    server = ThrowawayRedis() if args.backend == "redis" else None
    index_url = server.url if server else f"memory://simulate-{replicas}-{policy}"
    fleet = Fleet(args, model, replicas, conversations, policy, index_url)
    record: dict = {}
    wall = time.perf_counter()
    try:
        if server:
            server.client.slowlog_reset()
        with simulated_clock(lambda: fleet.now):
            r = await fleet.run()
        lookups = [] if server is None else _lookup_micros(server)
        record = {
            "bench": "simulate", "backend": args.backend, "replicas": replicas, "policy": policy,
            "conversations": conversations, "requests": r.requests, "simulated_s": round(fleet.now, 1),
            "hit_rate": round(r.cached_tokens / r.prompt_tokens, 4),
            "ideal_hit_rate": round(r.ideal_tokens / r.prompt_tokens, 4),
            "of_ideal": round(r.cached_tokens / r.ideal_tokens, 4) if r.ideal_tokens else None,
            "load_overrides": r.load_overrides, "no_index": r.no_index,
            "ttft_p50_ms": round(_percentile(r.ttft, 50) * 1e3, 1),
            "ttft_p90_ms": round(_percentile(r.ttft, 90) * 1e3, 1),
            "ttft_p99_ms": round(_percentile(r.ttft, 99) * 1e3, 1),
            "engine_busy": round(sum(e.busy_s for e in fleet.engines) / (replicas * fleet.now), 3),
            "router_cpu_us_per_request": round(r.route_cpu_s / r.requests * 1e6),
            "wall_s": round(time.perf_counter() - wall, 1),
        }
        hist = {s.name.rsplit("_", 1)[1]: s.value for s in fleet.metrics.index_lookup.collect()[0].samples}
        if hist["count"]:  # the router's own timing of its lookups (wall clock: this host's load counts)
            record["lookup_mean_ms"] = round(hist["sum"] / hist["count"] * 1e3, 3)
        if server:
            by_kind: dict[str, int] = {}  # the index's bytes by key kind: parent, children, holes, spec, ...
            for key in server.client.scan_iter(match=f"{fleet.index.key_prefix}:*", count=1000):
                kind = key.decode().removeprefix(fleet.index.key_prefix + ":").split(":")[0]
                by_kind[kind] = by_kind.get(kind, 0) + (server.client.memory_usage(key, samples=0) or 0)
            scripts = server.client.info("commandstats")["cmdstat_evalsha"]  # every index call is one script
            blocks = sum(len(e.refs) for e in fleet.engines)
            used = sum(by_kind.values())  # the keys alone: the slow log kept for the timings takes memory too
            record |= {
                "redis_lookup_us_p50": round(_percentile(lookups, 50), 1),
                "redis_lookup_us_p99": round(_percentile(lookups, 99), 1),
                "redis_lookups_timed": len(lookups),
                "redis_index_kib_per_replica": round(used / replicas / 1024, 1),
                "redis_bytes_per_cached_block": round(used / blocks) if blocks else None,
                "redis_key_kib_per_replica": {k: round(v / replicas / 1024, 1) for k, v in sorted(by_kind.items())},
                "redis_calls_per_simulated_s": round(scripts["calls"] / fleet.now),
                # of one Redis core, at the simulated request rate: where one Redis (or one cluster slot) fills up
                "redis_busy_fraction": round(scripts["usec"] / 1e6 / fleet.now, 3),
            }
    finally:
        if server:
            server.close()
    return record | {"model_fit": dataclasses.asdict(model), "workload": WorkloadConfig(seed=args.seed).to_json(),
                     "rate_per_replica": args.rate, "think_time_s": args.think_time, **stamped}


def _lookup_micros(server: ThrowawayRedis) -> list[float]:
    """Redis's own time (µs) of each lookup script run: its slow log logs every command."""
    sha = LOOKUP_SHA.encode()
    return [e["duration"] for e in server.client.slowlog_get(1_000_000) if sha in e["command"][:60]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="16,64,512", help="comma-separated fleet sizes (default: %(default)s)")
    parser.add_argument("--conversations", default="2000,4000,10000",
                        help="conversations per fleet size, in the same order (default: %(default)s)")
    parser.add_argument("--policies", default="prefix,least-load,round-robin",
                        help="routing policies to compare (default: %(default)s)")
    parser.add_argument("--backend", choices=("memory", "redis"), default="memory",
                        help="prefix index: in-process, or a throwaway redis-server (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=1.0,
                        help="conversations arriving per second per replica (default: %(default)s)")
    parser.add_argument("--think-time", type=float, default=2.0,
                        help="mean seconds between an answer and the next turn (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="append the JSON lines here too")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.replicas.split(",")]
    counts = [int(n) for n in args.conversations.split(",")]
    if len(sizes) != len(counts):
        parser.error("--replicas and --conversations need as many values")
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in ROUTERS]
    if unknown:
        parser.error(f"unknown policy {unknown[0]!r}; choose from {', '.join(ROUTERS)}")
    configure_logging("ERROR")  # the router warns that a memory:// index is local: here that is the point
    model = StepModel.fit()
    stamped = stamp()  # the code that runs is the code at the start, whatever the tree becomes meanwhile
    for replicas, conversations in zip(sizes, counts, strict=True):
        for policy in policies:
            record = asyncio.run(simulate(args, model, replicas, conversations, policy, stamped))
            line = json.dumps(record)
            print(line, flush=True)
            if args.out:
                with args.out.open("a") as out:
                    out.write(line + "\n")


if __name__ == "__main__":
    main()
