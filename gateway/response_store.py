"""Stored Responses API conversations, read back by ``previous_response_id``. Backends by URL, the prefix
index's (``--index-url``): ``memory://`` keeps them in this gateway process only; ``redis://`` keeps them
in that Redis under ``kvgate:response:<id>`` with a TTL, so any gateway continues any stored response.

What is stored is the conversation as chat messages (the input without the instructions, then the
answer), JSON-encoded; it expires ``--response-ttl`` seconds after it was written.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any

import redis.exceptions

from gateway.errors import APIError
from prefix_index.redis_index import redis_client

KEY_PREFIX = "kvgate:response:"
MEMORY_MAX_RESPONSES = 10_000  # one process: the oldest go first beyond this


class ResponseStore(ABC):
    """Both backends: ``put`` and ``get`` raise :class:`APIError` 503 when the store cannot be reached;
    safe to call concurrently from the event loop."""

    def __init__(self, ttl: float):
        self.ttl = ttl

    @abstractmethod
    async def put(self, response_id: str, messages: list[dict[str, Any]]) -> None: ...

    @abstractmethod
    async def get(self, response_id: str) -> list[dict[str, Any]] | None:
        """The stored messages, None if unknown or expired."""

    async def close(self) -> None:
        return None


class MemoryResponseStore(ResponseStore):
    def __init__(self, ttl: float):
        super().__init__(ttl)
        self._items: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (expires at, JSON)

    async def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        self._items[response_id] = (now + self.ttl, json.dumps(messages, ensure_ascii=False))
        while self._items and (len(self._items) > MEMORY_MAX_RESPONSES or next(iter(self._items.values()))[0] <= now):
            self._items.popitem(last=False)

    async def get(self, response_id: str) -> list[dict[str, Any]] | None:
        item = self._items.get(response_id)
        if item is None or item[0] <= time.monotonic():
            return None
        return json.loads(item[1])


class RedisResponseStore(ResponseStore):
    def __init__(self, url: str, ttl: float):
        super().__init__(ttl)
        self._redis = redis_client(url)  # redis:// or redis+cluster://, as the index

    async def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        try:
            await self._redis.set(KEY_PREFIX + response_id, json.dumps(messages, ensure_ascii=False),
                                  px=int(self.ttl * 1000))
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            raise _unavailable(exc) from None

    async def get(self, response_id: str) -> list[dict[str, Any]] | None:
        try:
            raw = await self._redis.get(KEY_PREFIX + response_id)
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            raise _unavailable(exc) from None
        return None if raw is None else json.loads(raw)

    async def close(self) -> None:
        await self._redis.aclose()


def _unavailable(exc: Exception) -> APIError:
    return APIError(503, f"the response store is unavailable: {exc}")


def make_response_store(url: str, ttl: float) -> ResponseStore:
    return MemoryResponseStore(ttl) if url.startswith("memory:") else RedisResponseStore(url, ttl)
