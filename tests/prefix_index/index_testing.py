"""Helpers of the prefix index suite (a module, not conftest, so test files can import them)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Callable

import pytest
import redis

SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"


def delete_namespace(url: str, namespace: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throwaway ``redis-server`` without persistence on a port of its own."""

    def __init__(self, port: int, *extra_args: str, cwd: str | None = None):
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", *extra_args],
            cwd=cwd,
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(port=port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    pytest.fail(f"redis-server did not start on port {port}")
                time.sleep(0.02)
            finally:
                client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


async def wait_until(condition: Callable, timeout_s: float = 10.0, what: str = "condition"):
    """Poll ``condition`` (sync or async) until it returns a truthy value, which is returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)
