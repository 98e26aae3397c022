"""Per-key rate limits: requests per second and tokens per minute, each a token bucket per tenant.

Buckets live in one place for all gateways: Redis (``redis://``, one Lua script per call, on the server's
clock) or this process (``memory://``). A request takes one token of its key's request bucket before its
body is read; its prompt tokens are charged to the token bucket once counted, which must then hold some
(a request larger than the bucket still passes when the bucket is full, leaving it in debt), and its
completion tokens when it ends. A key past its limit gets 429 with Retry-After: the seconds until its
bucket holds enough again. The limits are a guard, not a ledger: with Redis unreachable requests pass
(a warning per failure), as routing goes on without the index.

Keys and their limits (:class:`KeyRing`) come from ``--api-key`` / ``API_KEYS`` and ``--api-key-file``,
whose lines are ``KEY [rps=N] [tpm=N]``; the file is read again when it changes, without a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.errors import overloaded

log = structlog.get_logger("gateway.ratelimit")

RELOAD_CHECK_S = 1.0  # the key file's mtime is looked at most this often
BUCKET_PREFIX = "kvgate:ratelimit:"


@dataclass(frozen=True, slots=True)
class KeyLimits:
    requests_per_second: float | None = None  # None: unlimited
    tokens_per_minute: float | None = None

    @property
    def limited(self) -> bool:
        return self.requests_per_second is not None or self.tokens_per_minute is not None


class Key(NamedTuple):
    tenant: str
    limits: KeyLimits


def tenant_id(key: str) -> str:
    """Stable across gateways and key order; reveals nothing usable about the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def parse_api_key(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise ValueError("an API key must be non-empty and contain no whitespace")
    return text


def parse_key_line(line: str, default: KeyLimits) -> tuple[str, KeyLimits]:
    """``KEY [rps=N] [tpm=N]``; raises ValueError naming what is wrong."""
    key, *options = line.split()
    limits = {"rps": default.requests_per_second, "tpm": default.tokens_per_minute}
    for option in options:
        name, _, value = option.partition("=")
        if name not in limits:
            raise ValueError(f"unknown option {option!r} (rps=N, tpm=N)")
        try:
            limits[name] = float(value)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {value!r}") from None
        if not 0 < limits[name] < math.inf:
            raise ValueError(f"{name} must be positive")
    return parse_api_key(key), KeyLimits(limits["rps"], limits["tpm"])


def read_key_file(path: str, default: KeyLimits) -> dict[str, KeyLimits]:
    """Every key of the file with its limits; raises ValueError naming the line."""
    keys = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            key, limits = parse_key_line(line, default)
        except ValueError as exc:
            raise ValueError(f"{path} line {number}: {exc}") from None
        keys[key] = limits
    if not keys:
        raise ValueError(f"{path}: no keys in the file")
    return keys


class KeyRing:
    """The accepted keys, compared in constant time over all of them. Thread-safe reads; the key file is
    reloaded on the event loop when its mtime changes (a bad file keeps the previous keys, logged)."""

    def __init__(self, keys: Sequence[str], key_file: str | None, default: KeyLimits):
        self._fixed = {k: default for k in keys}
        self._file = key_file
        self._default = default
        self._mtime: int | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        self._entries: list[tuple[bytes, Key]] = []
        self._set(dict(self._fixed))
        if key_file is not None:
            self._mtime = os.stat(key_file).st_mtime_ns
            self._set({**self._fixed, **read_key_file(key_file, default)})

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def _set(self, keys: dict[str, KeyLimits]) -> None:
        entries = [(hashlib.sha256(k.encode()).digest(), Key(tenant_id(k), limits)) for k, limits in keys.items()]
        with self._lock:
            self._entries = entries

    def lookup(self, token: str) -> Key | None:
        self._maybe_reload()
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for key_digest, key in self._entries:  # no early exit: timing says nothing about which key
            if hmac.compare_digest(digest, key_digest):
                found = key
        return found

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if self._file is None or now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        try:
            mtime = os.stat(self._file).st_mtime_ns
            if mtime == self._mtime:
                return
            self._mtime = mtime
            keys = read_key_file(self._file, self._default)
        except (OSError, ValueError) as exc:
            log.error("api_key_file_not_reloaded", path=self._file, error=str(exc), keys=len(self._entries))
            return
        self._set({**self._fixed, **keys})
        log.info("api_key_file_reloaded", path=self._file, keys=len(self._entries))


class Buckets(ABC):
    """Token buckets by name. ``take`` refills a bucket (``rate`` per second up to ``capacity``), then takes
    ``cost`` if it holds at least ``need`` and answers 0, else answers the seconds until it will (taking
    nothing). Raises RedisError when the store is unreachable."""

    @abstractmethod
    async def take(self, name: str, rate: float, capacity: float, cost: float, need: float) -> float: ...

    async def close(self) -> None:  # noqa: B027 — optional hook
        """Release the store's client."""


class MemoryBuckets(Buckets):
    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # name -> (tokens, monotonic time)

    async def take(self, name: str, rate: float, capacity: float, cost: float, need: float) -> float:
        now = time.monotonic()
        tokens, then = self._buckets.get(name, (capacity, now))
        tokens = min(capacity, tokens + (now - then) * rate)
        if tokens < need:
            self._buckets[name] = (tokens, now)
            return (need - tokens) / rate
        self._buckets[name] = (tokens - cost, now)
        return 0.0


_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rate, capacity, cost, need = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or capacity
local at = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - at) * rate)
local wait = 0
if tokens < need then wait = (need - tokens) / rate else tokens = tokens - cost end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((capacity - tokens) / rate * 1000) + 1000)
return tostring(wait)
"""


class RedisBuckets(Buckets):
    """One EVALSHA per call, on the Redis server's clock: gateways need no synchronized clocks."""

    def __init__(self, url: str):
        self._redis = Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._script = self._redis.register_script(_TAKE)

    async def take(self, name: str, rate: float, capacity: float, cost: float, need: float) -> float:
        return float(await self._script(keys=[BUCKET_PREFIX + name], args=[rate, capacity, cost, need]))

    async def close(self) -> None:
        await self._redis.aclose()


def open_buckets(url: str) -> Buckets:
    return MemoryBuckets() if url.startswith("memory:") else RedisBuckets(url)


class RateLimiter:
    """The per-key checks of a request, on the buckets. Event loop only."""

    def __init__(self, buckets: Buckets):
        self.buckets = buckets

    async def admit(self, key: Key) -> None:
        """One request of ``key``: 429 past its requests per second."""
        rps = key.limits.requests_per_second
        if rps is not None:
            await self._take(key, "requests", f"{key.tenant}:rps", rps, max(1.0, rps), 1, 1,
                             f"{rps:g} requests per second")

    async def charge_prompt(self, key: Key, tokens: int) -> None:
        """The request's prompt tokens: 429 while its key's token bucket is empty (in debt)."""
        tpm = key.limits.tokens_per_minute
        if tpm is not None:
            await self._take(key, "tokens", f"{key.tenant}:tpm", tpm / 60, tpm, tokens, min(tokens, tpm),
                             f"{tpm:g} tokens per minute")

    async def charge_completion(self, key: Key, tokens: int) -> None:
        """The tokens a finished request generated, taken whatever the balance (the next requests wait)."""
        tpm = key.limits.tokens_per_minute
        if tpm is not None and tokens:
            await self._take(key, "tokens", f"{key.tenant}:tpm", tpm / 60, tpm, tokens, -math.inf, "")

    async def _take(self, key: Key, what: str, name: str, rate: float, capacity: float, cost: float, need: float,
                    limit: str) -> None:
        try:
            wait = await self.buckets.take(name, rate, capacity, cost, need)
        except (RedisError, OSError) as exc:
            log.warning("rate_limit_unavailable", error=repr(exc), tenant=key.tenant)
            return
        if wait > 0:
            raise overloaded(429, f"this API key is past its limit of {limit}; retry later",
                             max(1, math.ceil(wait)))
