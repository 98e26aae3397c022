"""Fuzz a running gateway from its own OpenAPI document (schemathesis, fetched with a key): valid and
invalid requests for every operation, each sent for real. Counts the answers by status; any answer of 500
or more, and any traceback in the given log files, is a defect.

    python -m loadtest.fuzz --url http://127.0.0.1:8000 --key sk-... --cases 5000 --log gateway.log
    python -m loadtest.fuzz --spawn --cases 5000   # starts a tiny dummy engine (64-token context) and a gateway

Prints one JSON line (stamped with the commit); exits 1 on a defect.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import hypothesis
import schemathesis
from schemathesis import GenerationMode

from loadtest import stamp
from loadtest.stack import spawned_stack

# Most cases go to the generation endpoints, whose bodies have the room for them; the rest are small.
GENERATION_SHARE = 0.9


@dataclass
class FuzzResult:
    cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)  # "METHOD path status body" of each answer >= 500
    tracebacks: int = 0

    @property
    def clean(self) -> bool:
        return not self.server_errors and not self.tracebacks

    def record(self) -> dict:
        return {"cases": self.cases, "statuses": dict(sorted((str(k), v) for k, v in self.statuses.items())),
                "server_errors": len(self.server_errors), "tracebacks": self.tracebacks,
                "examples": self.server_errors[:5]}


def fuzz(url: str, key: str, cases: int, seed: int = 0, logs: Sequence[Path] = ()) -> FuzzResult:
    """At least ``cases`` generated requests against the gateway at ``url``, half valid and half invalid per
    operation; an operation with few possible requests gets fewer, and the POST ones make up the rest."""
    auth = {"Authorization": f"Bearer {key}"}
    document = httpx.get(url + "/openapi.json", headers=auth, timeout=30).raise_for_status().json()
    operations = [result.ok() for result in schemathesis.openapi.from_dict(document).get_all_operations()]
    generation = [op for op in operations if op.method.upper() == "POST"]
    result = FuzzResult()
    with httpx.Client(base_url=url, headers=auth, timeout=120) as client:
        for op in operations:
            share = GENERATION_SHARE / len(generation) if op in generation else (
                (1 - GENERATION_SHARE) / (len(operations) - len(generation)))
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _run_operation(client, op, mode, max(1, round(cases * share / 2)), seed, result)
        rounds = 0
        while result.cases < cases:
            rounds += 1
            each = -(-(cases - result.cases) // (2 * len(generation)))
            for op in generation:
                for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                    _run_operation(client, op, mode, each, seed + rounds, result)
    result.tracebacks = sum(path.read_text(errors="replace").count("Traceback") for path in logs)
    return result


def _run_operation(client: httpx.Client, op, mode: GenerationMode, examples: int, seed: int,
                   result: FuzzResult) -> None:
    @hypothesis.settings(max_examples=examples, database=None, deadline=None, derandomize=False,
                         suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate],
                         print_blob=False)
    @hypothesis.seed(seed)
    @hypothesis.given(op.as_strategy(generation_mode=mode))
    def send(case) -> None:
        kwargs = case.as_transport_kwargs()
        headers = {k: v for k, v in (kwargs.get("headers") or {}).items() if k.lower() != "authorization"}
        body = kwargs.get("json")
        content = kwargs.get("data") if body is None else None
        resp = client.request(case.method, case.formatted_path, params=kwargs.get("params"), headers=headers,
                              json=body, content=content)
        result.cases += 1
        result.statuses[resp.status_code] += 1
        if resp.status_code >= 500:
            result.server_errors.append(f"{case.method} {case.formatted_path} {resp.status_code} {resp.text[:300]}")

    try:
        send()
    except hypothesis.errors.Unsatisfiable:
        pass  # no invalid request exists for an operation without parameters or body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="the gateway (with --key); without it, --spawn")
    parser.add_argument("--key", help="an API key the gateway accepts")
    parser.add_argument("--spawn", action="store_true", help="start a tiny dummy engine and a gateway")
    parser.add_argument("--cases", type=int, default=5000, help="requests to generate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="generation seed (default: %(default)s)")
    parser.add_argument("--log", type=Path, action="append", default=[],
                        help="a log file of the server to search for tracebacks (repeatable)")
    args = parser.parse_args(argv)
    if args.spawn == bool(args.url):
        parser.error("give --url and --key, or --spawn")
    start = time.monotonic()
    if args.spawn:
        # a short context: valid requests generate little, so the run goes to the cases
        with tempfile.TemporaryDirectory() as tmp, spawned_stack(Path(tmp), engine_args=["--max-model-len", "64"]) as (
                url, key, logs):
            result = fuzz(url, key, args.cases, args.seed, logs)
    else:
        result = fuzz(args.url, args.key, args.cases, args.seed, args.log)
    stamp.emit(benchmark="fuzz", seconds=round(time.monotonic() - start, 1), seed=args.seed, **result.record())
    return 0 if result.clean else 1


if __name__ == "__main__":
    sys.exit(main())
