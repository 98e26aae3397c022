"""Fixtures for the prefix index suite: both backends and throwaway Redis servers."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import redis
from index_testing import SHARED_REDIS_URL, RedisClusterServers, RedisServer, delete_namespace, free_port

from prefix_index.index import PrefixIndex, open_index


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """One Redis Cluster (3 masters, 3 replicas) for the session's suite runs on it."""
    cluster = RedisClusterServers(str(tmp_path_factory.mktemp("redis-cluster")))
    yield cluster
    cluster.stop()


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
def backend_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return f"memory://test-{uuid.uuid4().hex}"
    if request.param == "redis-cluster":
        return request.getfixturevalue("redis_cluster").url
    try:
        redis.Redis.from_url(SHARED_REDIS_URL, socket_connect_timeout=1).ping()
    except redis.ConnectionError as e:
        pytest.fail(f"the index tests need Redis >= 7 at {SHARED_REDIS_URL}: {e}")
    return SHARED_REDIS_URL


@pytest.fixture
def namespace(backend_url: str) -> Iterator[str]:
    """A namespace of this test alone; its Redis keys are deleted afterwards."""
    ns = f"kvgate-test-{uuid.uuid4().hex[:12]}"
    yield ns
    if backend_url.startswith("redis"):
        delete_namespace(backend_url, ns)


@pytest.fixture
async def open_test_index(
    backend_url: str, namespace: str
) -> AsyncIterator[Callable[..., PrefixIndex]]:
    """``open_test_index(model="m", block_size=16, **kw)`` on this test's backend and namespace."""
    opened: list[PrefixIndex] = []

    def _open(model: str = "m", block_size: int = 16, **kwargs) -> PrefixIndex:
        index = open_index(backend_url, model, block_size, namespace=namespace, **kwargs)
        opened.append(index)
        return index

    yield _open
    for index in opened:
        await index.close()


@pytest.fixture
def redis_servers() -> Iterator[Callable[..., RedisServer]]:
    """``start(port=None, *args)`` starts a throwaway server; all are stopped after the test."""
    started: list[RedisServer] = []

    def start(port: int | None = None, *extra_args: str, cwd: str | None = None) -> RedisServer:
        server = RedisServer(port or free_port(), *extra_args, cwd=cwd)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
