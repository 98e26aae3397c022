"""The prefix index: which replica holds which KV blocks, behind one interface with two backends.

``open_index(url, model, block_size)`` picks the backend by URL:

- ``memory://NAME`` — in-process. Every index opened in one process with the same URL, namespace,
  model and block size shares one store, so an engine's publisher thread and an embedded gateway
  see the same entries. Distinct names give distinct stores.
- ``redis://[user:pass@]host:port/db`` (or ``rediss://``, ``unix://``) — shared by every gateway
  and engine: redis-py asyncio with a connection pool, created here or injected.
- ``redis+cluster://[user:pass@]host:port,host:port,...`` (or ``rediss+cluster://``) — the same on a
  Redis Cluster (redis-py's ``RedisCluster``); the listed nodes are where it starts discovering.

Keys are namespaced by model and block size: every Redis key starts with
``{namespace}:{{model}:{block_size}}`` (for example ``kvgate:{SmolLM2-135M-Instruct:16}:live``).
The braces are a Redis Cluster hash tag: all keys of one (model, block size) hash to one slot, so
the Lua scripts that walk a prompt's blocks touch a single node in one round trip, while different
models spread over the cluster.

Replica ids are free-form non-empty strings (engine URL or name); block hashes are the 16-byte
chained hashes of :mod:`prefix_index.hashing`. The index is a hint: callers treat
:class:`IndexUnavailableError` as "no cache information" and route by load.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import urlsplit, urlunsplit

from prefix_index.events import KVEventBatch
from prefix_index.hashing import BlockHash

if TYPE_CHECKING:
    from redis.asyncio import Redis

DEFAULT_NAMESPACE = "kvgate"
MEMORY_SCHEMES = ("memory",)
REDIS_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
INDEX_SCHEMES = MEMORY_SCHEMES + REDIS_SCHEMES + CLUSTER_SCHEMES
# A replica silent this long is forgotten (entries, epoch, liveness) by the next heartbeat of any
# replica; a live publisher that was forgotten gets heartbeat() == False and resyncs.
DEFAULT_REAP_AFTER_S = 300.0


class TierMatch(NamedTuple):
    """A replica's matched prefix of a lookup, in blocks, by tier (see :mod:`prefix_index.events`)."""

    device: int  # leading blocks its KV pool holds (durably or speculatively)
    total: int  # leading blocks it holds in either tier (>= device): the rest come back from host memory


class IndexUnavailableError(Exception):
    """The backend could not answer (Redis down, timed out or refused the command)."""


class PrefixIndex(ABC):
    """Longest cached prefix per live replica, for one (model, block size).

    Contracts shared by both backends:

    - Entries are (replica, block hash) pairs: durable ones from engine events (:meth:`apply`)
      and speculative ones with a TTL (:meth:`insert_speculative`). A pair counts while it exists
      and, if speculative, has not expired.
    - A replica is live while its last :meth:`heartbeat` TTL runs. Only live replicas appear in
      :meth:`lookup`; entries of dead replicas stay (they may come back) until the replica is
      reaped ``reap_after_s`` after its heartbeat expired.
    - Every method is a coroutine, safe to call concurrently from many tasks; each call is atomic
      (one Lua script on Redis, one lock on memory). ``memory://`` stores are also safe to share
      across threads and event loops; a Redis index belongs to the event loop it was first used on
      (redis-py's rule), so each thread opens its own.
    - Bad arguments raise ValueError before anything is touched; a backend failure raises
      :class:`IndexUnavailableError`, and the call may or may not have taken effect (a Redis script
      that fails midway, out of memory say, is not rolled back).
    """

    def __init__(self, model: str, block_size: int, namespace: str):
        if not model or "{" in model or "}" in model:
            raise ValueError(f"model must be a non-empty name without braces, got {model!r}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must be non-empty without braces, got {namespace!r}")
        self.model = model
        self.block_size = block_size
        self.namespace = namespace

    @property
    def key_prefix(self) -> str:
        """Prefix of every key of this index; ``{model:block_size}`` is the cluster hash tag."""
        return f"{self.namespace}:{{{self.model}:{self.block_size}}}"

    async def lookup(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Matched prefix length, in blocks of the KV pool (the ``DEVICE`` tier), of every live
        replica (0 included); see :meth:`lookup_tiers`."""
        return {replica: match.device for replica, match in (await self.lookup_tiers(block_hashes)).items()}

    @abstractmethod
    async def lookup_tiers(self, block_hashes: Sequence[BlockHash]) -> dict[str, TierMatch]:
        """Matched prefix length, in blocks, of every live replica (0 included), by tier. Read-only.

        A replica matches block i in the device tier (durably or speculatively) only if it also
        matches blocks 0..i-1 there: a replica holding blocks 0, 1 and 3 of a prompt scores 2.
        Exact as long as stored parents are right and speculative inserts are chains from block 0
        (see :meth:`apply` and :meth:`insert_speculative`). ``total`` counts the blocks held in
        either tier the same way (a block missing from the pool may come from the host tier). One
        round trip on Redis, any prompt length.
        """

    @abstractmethod
    async def apply(self, batch: KVEventBatch) -> None:
        """Apply one replica's events in order, atomically; each tier's stores and removals
        change that tier's entries only.

        A batch whose epoch differs from the replica's recorded one first drops all of the
        replica's entries (durable and speculative) and records the new epoch: a restarted engine
        never inherits its predecessor's cache. ``AllCleared`` drops every kind and tier; stores and
        removals leave speculative entries to expire. Liveness is untouched. ``BlockStored``
        parents must be right (see its docstring): lookups on Redis trust them.
        """

    @abstractmethod
    async def clear(self, replica_id: str) -> None:
        """Drop every entry (durable and speculative) of the replica; epoch and liveness stay."""

    @abstractmethod
    async def heartbeat(self, replica_id: str, epoch: int, ttl_s: float) -> bool:
        """Mark the replica live for ``ttl_s`` seconds if the index holds its state at ``epoch``.

        Returns False, marking nothing, when the recorded epoch differs or is missing (never
        applied, reaped, or replaced by another process with the same id): the caller must resync
        (apply ``AllCleared``, then all its cached blocks as ``BlockStored`` chains, at its epoch)
        and beat again.
        Also expires stale speculative entries of the replica and reaps long-dead replicas.
        """

    @abstractmethod
    async def live_replicas(self) -> set[str]:
        """Replicas whose heartbeat has not expired. Read-only."""

    @abstractmethod
    async def insert_speculative(
        self, replica_id: str, block_hashes: Sequence[BlockHash], ttl_s: float
    ) -> None:
        """Record that the replica will hold these blocks soon (a request was just routed there).

        ``block_hashes`` is a prompt's chain from its first block, as given to :meth:`lookup`
        (Redis binary-searches speculative entries, which needs them prefix-closed). The entries
        count in :meth:`lookup` for ``ttl_s`` seconds (a later insert of the same block extends
        it, never shortens it) unless the replica's epoch changes or it is cleared first.
        """

    @abstractmethod
    async def close(self) -> None:
        """Release connections this index created (an injected client is left open)."""


def open_index(
    url: str,
    model: str,
    block_size: int,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    redis_client: Redis | None = None,
    reap_after_s: float = DEFAULT_REAP_AFTER_S,
) -> PrefixIndex:
    """Open the index at ``url`` for one model and block size; raises ValueError on a bad URL.

    Redis URLs take redis-py's query options (``?socket_timeout=1&max_connections=64``); without
    them a created client fails fast (connect and read timeouts of 1 s, one retry) because the
    index must never hold up routing or decoding. ``redis_client`` replaces the created client
    (a ``redis.asyncio.Redis`` or ``RedisCluster``; the caller owns it). A cluster URL with a
    malformed node list raises ValueError.
    """
    if not (math.isfinite(reap_after_s) and reap_after_s > 0):
        raise ValueError(f"reap_after_s must be positive, got {reap_after_s}")
    scheme = urlsplit(url).scheme
    if scheme in MEMORY_SCHEMES:
        from prefix_index.memory import MemoryPrefixIndex

        return MemoryPrefixIndex(url, model, block_size, namespace, reap_after_s)
    if scheme in REDIS_SCHEMES + CLUSTER_SCHEMES:
        from prefix_index.redis_index import RedisPrefixIndex

        return RedisPrefixIndex(url, model, block_size, namespace, reap_after_s, redis_client)
    raise ValueError(f"index URL must start with one of {', '.join(s + '://' for s in INDEX_SCHEMES)}: {url!r}")


def redact_url(url: str) -> str:
    """``url`` with its password (``redis://:PASSWORD@host``) replaced by ``***``, for logs."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hosts}"))


def ttl_ms(ttl_s: float) -> int:
    """A positive TTL in whole milliseconds (at least 1); raises ValueError otherwise."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not (
        math.isfinite(ttl_s) and ttl_s > 0
    ):
        raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
    return max(1, math.ceil(ttl_s * 1000))
