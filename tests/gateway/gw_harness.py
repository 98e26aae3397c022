"""Real engine and gateway processes on free ports for the gateway tests, each logging to a file."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("KVGATE_CACHE_DIR", "~/.cache/kvgate")).expanduser()
API_KEYS = ("sk-test-alpha", "sk-test-beta")
TINY_ENGINE_ARGS = ["--load-format", "dummy", "--model", "tiny", "--num-kv-blocks", "2048"]
# The engines' token of the gateways that spawn theirs, where a test also talks to those engines.
ENGINE_TOKEN = "test-engine-token-0123456789abcdef"
ENGINE_AUTH = {"Authorization": f"Bearer {ENGINE_TOKEN}"}


@dataclass
class Proc:
    """A server process on a free port, logging to a file."""

    url: str
    proc: subprocess.Popen
    log_path: Path

    def log_lines(self) -> list[dict]:
        lines = []
        for line in self.log_path.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                lines.append({"raw": line})
        return lines

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_process(argv: list[str], log_path: Path, ready_path: str, port: int, timeout: float = 300.0,
                  env: dict[str, str] | None = None, max_open_files: int | None = None) -> Proc:
    log_file = log_path.open("w")
    # OpenMP workers spin between the tiny model's steps; on two shared cores that starves everything else.
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))

    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, preexec_fn=limit_files if max_open_files is not None else None)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv} exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(url + ready_path, timeout=2).status_code == 200:
                return Proc(url, proc, log_path)
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{argv} not ready after {timeout}s:\n{log_path.read_text()[-4000:]}")


def start_engine(log_path: Path, *engine_args: str, env: dict[str, str] | None = None) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", str(port), *engine_args]
    return start_process(argv, log_path, "/health", port, env=env)


def start_gateway(log_path: Path, *gateway_args: str, env: dict[str, str] | None = None,
                  max_open_files: int | None = None) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--cache-dir", str(CACHE_DIR), *gateway_args]
    return start_process(argv, log_path, "/ready", port, env=env, max_open_files=max_open_files)


def lines_for(proc: Proc, request_id: str, wait: float = 5.0) -> list[dict]:
    """The log lines bound to one request id (the request line is written when the answer is done)."""
    deadline = time.monotonic() + wait
    while True:
        lines = [x for x in proc.log_lines() if x.get("request_id") == request_id]
        if any(x.get("event") == "request" for x in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)
