"""Local engine subprocesses (``--spawn-engines N``): their command line, started on free ports,
stopped with the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import sys
from dataclasses import dataclass

import structlog

from engine.parent import die_with_parent
from engine.protocol import ENGINE_TOKEN_ENV

log = structlog.get_logger("gateway.spawn")

HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class SpawnConfig:
    """The engines the gateway starts: how many, and the `python -m engine serve` flags they get. A flag
    left None is not passed, so the engine's own default applies."""

    count: int
    model: str
    load_format: str | None = None
    device: str | None = None
    dtype: str | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    served_model_name: str | None = None  # None: the engines derive it from --model
    index_url: str | None = None  # where engines publish KV events; memory:// lives in one process only
    engine_args: tuple[str, ...] = ()  # more `engine serve` flags, last so that they win

    def argv(self, host: str, port: int, index: int) -> list[str]:
        """The command line of engine number ``index``; ``--device cuda`` puts engine i on cuda:i. Each
        engine gets its own replica id (host name and port) for the prefix index."""
        device = f"cuda:{index}" if self.device == "cuda" and self.count > 1 else self.device
        args = [sys.executable, "-m", "engine", "serve", "--host", host, "--port", str(port),
                "--model", self.model, "--replica-id", f"{socket.gethostname()}:{port}"]
        for flag, value in (
            ("--load-format", self.load_format),
            ("--device", device),
            ("--dtype", self.dtype),
            ("--block-size", self.block_size),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--served-model-name", self.served_model_name),
            ("--index-url", self.index_url),
        ):
            if value is not None:
                args += [flag, str(value)]
        return args + list(self.engine_args)


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EngineProcesses:
    """The spawned engines; ``token`` reaches them in their environment (never on a command line)."""

    def __init__(self, spawn: SpawnConfig, token: str):
        self._spawn = spawn
        self._env = {**os.environ, ENGINE_TOKEN_ENV: token}
        self.urls: list[str] = []
        self._procs: list[asyncio.subprocess.Process] = []

    async def start(self) -> list[str]:
        for index in range(self._spawn.count):
            port = free_port()
            argv = self._spawn.argv(HOST, port, index)
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, env=self._env,
                # in the child before exec: a gateway killed with SIGKILL must not leave engines behind
                preexec_fn=functools.partial(die_with_parent, signal.SIGTERM, os.getpid()),
            )
            self._procs.append(proc)
            self.urls.append(f"http://{HOST}:{port}")
            log.info("engine_spawned", pid=proc.pid, url=self.urls[-1], argv=argv[1:])
        return self.urls

    def check_alive(self) -> None:
        for proc, url in zip(self._procs, self.urls):
            if proc.returncode is not None:
                raise RuntimeError(f"engine {url} (pid {proc.pid}) exited with status {proc.returncode}")

    async def stop(self, grace: float = 10.0) -> None:
        for proc in self._procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in self._procs:
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            log.info("engine_stopped", pid=proc.pid, returncode=proc.returncode)
