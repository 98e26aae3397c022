"""Helpers of the prefix index suite (a module, not conftest, so test files can import them)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Callable

import pytest
import redis

from gateway.spawn import free_port

SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"


def delete_namespace(url: str, namespace: str) -> None:
    """Delete the namespace's keys on a Redis or, for a ``redis+cluster://`` URL, on every master."""
    if url.startswith("redis+cluster://"):
        hosts = url.removeprefix("redis+cluster://").split(",")
        for port in (int(host.rsplit(":", 1)[1]) for host in hosts):
            with redis.Redis(port=port) as node:
                if node.role()[0] == b"master":
                    _delete_matching(node, namespace)
        return
    client = redis.Redis.from_url(url)
    try:
        _delete_matching(client, namespace)
    finally:
        client.close()


def _delete_matching(client: redis.Redis, namespace: str) -> None:
    keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
    if keys:
        client.delete(*keys)


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


class RedisClusterServers:
    """A throwaway Redis Cluster on loopback ports: ``masters`` masters with one replica each."""

    def __init__(self, cwd: str, masters: int = 3):
        self.servers: list[RedisServer] = []
        try:
            for _ in range(2 * masters):
                port = free_port()
                self.servers.append(RedisServer(
                    port, "--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                    "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "2000", cwd=cwd))
            created = subprocess.run(
                [shutil.which("redis-cli"), "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers),
                 "--cluster-replicas", "1", "--cluster-yes"],
                capture_output=True, text=True, timeout=60,
            )
            if created.returncode != 0:
                pytest.fail(f"redis-cli --cluster create failed: {created.stdout}{created.stderr}")
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=5)

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every running node says the cluster is ok and every replica is in sync with its master."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = []
            for server in self.servers:
                if server.proc.poll() is not None:
                    continue
                with self.node(server.port) as node:
                    info = node.info("replication")
                    synced = info["role"] == "master" or info.get("master_link_status") == "up"
                    states.append(node.cluster("INFO")["cluster_state"] == "ok" and synced)
            if all(states):
                return
            if time.monotonic() > deadline:
                pytest.fail("the Redis Cluster did not become healthy")
            time.sleep(0.1)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
