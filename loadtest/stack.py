"""A tiny local stack for scripts: one dummy engine and one gateway, as subprocesses on free ports."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from gateway.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def spawned_stack(workdir: Path, gateway_args: Sequence[str] = (), model: str = "tiny",
                  engine_args: Sequence[str] = ()) -> Iterator[tuple[str, str, list[Path]]]:
    """A dummy engine of shape ``model`` (with a token) and a gateway in front of it, logging into
    ``workdir``: (gateway URL, API key, their log files)."""
    key = "sk-local-" + secrets.token_hex(8)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVGATE_ENGINE_TOKEN": secrets.token_hex(32)}
    engine_port, gateway_port = free_port(), free_port()
    logs = [workdir / "engine.log", workdir / "gateway.log"]
    argvs = [
        [sys.executable, "-m", "engine", "serve", "--port", str(engine_port), "--load-format", "dummy",
         "--model", model, "--num-kv-blocks", "2048", *engine_args],
        [sys.executable, "-m", "gateway", "serve", "--port", str(gateway_port), "--engine",
         f"http://127.0.0.1:{engine_port}", "--api-key", key, *gateway_args],
    ]
    procs = []
    try:
        for argv, log, ready in zip(argvs, logs, (f"http://127.0.0.1:{engine_port}/health",
                                                  f"http://127.0.0.1:{gateway_port}/ready")):
            procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT))
            _wait_ready(ready, procs[-1], log)
        yield f"http://127.0.0.1:{gateway_port}", key, logs
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(30)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} not ready after 300 s")
