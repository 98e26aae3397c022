"""Local engine subprocesses (``--spawn-engines N``): started on free ports, stopped with the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal
import socket
import sys

import structlog

from gateway.config import SpawnConfig

log = structlog.get_logger("gateway.spawn")

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in the child before exec: a gateway killed with SIGKILL must not leave engines behind."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class EngineProcesses:
    def __init__(self, spawn: SpawnConfig):
        self._spawn = spawn
        self.urls: list[str] = []
        self._procs: list[asyncio.subprocess.Process] = []

    async def start(self) -> list[str]:
        for index in range(self._spawn.count):
            port = free_port()
            argv = self._spawn.argv(HOST, port, index)
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
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
