"""``redis://`` backend: every operation is one Lua script (EVALSHA), hence one round trip.

Keys, all under ``P = {namespace}:{{model}:{block_size}}`` (one cluster slot per model):

- ``P:live``               sorted set, replica -> heartbeat expiry (ms, Redis server clock)
- ``P:epochs``             hash, replica -> epoch
- ``P:parent:<replica>``   hash, held block -> its parent (16 zero bytes for a first block): the
  replica's durable entries
- ``P:children:<replica>`` hash, block -> number of held blocks whose parent it is
- ``P:holes:<replica>``    set of blocks not held that have held children
- ``P:spec:<replica>``     sorted set, block -> expiry (ms) of speculative entries; the key expires
  with its latest entry and heartbeats trim expired members
- ``P:host:<replica>``     set of blocks the replica's host tier holds (``HOST`` events)

Why parents: while a replica has no holes, the blocks it holds are closed under "parent of", so
along any prompt "held" is true up to some position and false after it, and a lookup finds that
position by binary search: about 12 probes per replica instead of one per block. Speculative
entries are inserted for whole prompts from their first block and keep the latest expiry, so they
are prefix-closed too and are binary-searched the same way; the matched length is the larger of
the two. A replica with holes (a parent evicted before its children) is walked block by block,
which is exact whatever it holds. A lookup walks the host tier the same way, from where the device
tier's match ends, only for replicas that have one. Clearing a replica is one UNLINK of its keys,
without SCAN.

Hashes travel as one concatenated string (16 bytes each) rather than one argument per hash, which
keeps the client's encoding and the script's argument setup cheap. Expiry uses the server clock
(TIME), so gateways and engines need no synchronized clocks. Needs Redis >= 7.0.

On a Redis Cluster (``redis+cluster://``) every key of one index shares the hash tag
``{model:block_size}``: the scripts, which build replica keys from the prefix, run on the one
node that holds that slot, and redis-py routes each call there by ``KEYS[1]``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError

from prefix_index.events import (
    HOST,
    AllCleared,
    BlockStored,
    KVEventBatch,
    check_batch,
    check_epoch,
    check_replica_id,
    pack_block_hashes,
)
from prefix_index.hashing import HASH_BYTES, BlockHash
from prefix_index.index import CLUSTER_SCHEMES, IndexUnavailableError, PrefixIndex, TierMatch, ttl_ms

# The index must never hold up routing: fail within about a second and retry once, which is
# enough to replace a pooled connection that a Redis restart broke. URL query options override.
_CLIENT_DEFAULTS: dict[str, Any] = {
    "socket_timeout": 1.0,
    "socket_connect_timeout": 1.0,
    "retry": Retry(NoBackoff(), 1),
}
_NO_PARENT = b"\x00" * HASH_BYTES
_REPLICA_KEY_KINDS = ("parent", "children", "holes", "spec", "host")  # as replica_keys() in Lua

# Shared by all scripts: ARGV[1] is the key prefix, ARGV[2] the hash size in bytes.
_LUA_COMMON = """
local prefix, hash_size = ARGV[1], tonumber(ARGV[2])
local NO_PARENT = string.rep('\\0', hash_size)
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function hash_at(blob, i)
  return string.sub(blob, (i - 1) * hash_size + 1, i * hash_size)
end
local function replica_keys(replica)
  local p = prefix .. ':'
  return p .. 'parent:' .. replica, p .. 'children:' .. replica, p .. 'holes:' .. replica,
    p .. 'spec:' .. replica, p .. 'host:' .. replica
end
"""

# KEYS[1] live; ARGV[3] concatenated hashes -> {replica, device blocks, total blocks, ...} for live
# replicas.
_LOOKUP = (
    "#!lua flags=no-writes\n"
    + _LUA_COMMON
    + """
local now = now_ms()
local blob = ARGV[3]
local n = #blob / hash_size
local cut = {}
local function h(i)
  local v = cut[i]
  if not v then
    v = hash_at(blob, i)
    cut[i] = v
  end
  return v
end
-- Number of leading positions where held(i) is true, for a held() that is true up to some point,
-- trying ``hint`` first: replicas sharing a prompt's system prompt mostly stop where the one before
-- stopped, and then two probes answer instead of a whole binary search.
local function leading(held, hint)
  if n == 0 or not held(1) then return 0 end
  local lo, hi = 1, n  -- held(lo), not held(hi) once held(n) is known false
  if hint > 1 and hint < n then
    if held(hint) then
      if not held(hint + 1) then return hint end
      lo = hint + 1
    else
      hi = hint
    end
  end
  if hi == n and held(n) then return n end
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if held(mid) then lo = mid else hi = mid end
  end
  return lo
end
-- Exact for any contents: block by block from ``matched``, in growing chunks, until the first
-- miss; with ``xkey`` (a host tier) a block it holds counts too.
local function walk(pkey, skey, has_spec, xkey, matched)
  local step = 16
  while matched < n do
    local first, last = matched + 1, math.min(n, matched + step)
    local args = {}
    for i = first, last do args[#args + 1] = h(i) end
    local parents = redis.call('HMGET', pkey, unpack(args))
    local expiry = has_spec and redis.call('ZMSCORE', skey, unpack(args))
    local host = xkey and redis.call('SMISMEMBER', xkey, unpack(args))
    for j = 1, #args do
      if not (parents[j] or (expiry and expiry[j] and tonumber(expiry[j]) > now) or (host and host[j] == 1)) then
        return matched
      end
      matched = matched + 1
    end
    step = math.min(step * 4, 1024)
  end
  return matched
end
local out = {}
local hint = 0  -- the last replica's durable match
for _, replica in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')) do
  local pkey, _, hkey, skey, xkey = replica_keys(replica)
  local has_spec = redis.call('EXISTS', skey) == 1
  local matched
  if redis.call('EXISTS', hkey) == 1 then
    matched = walk(pkey, skey, has_spec, nil, 0)
  else
    matched = leading(function(i) return redis.call('HEXISTS', pkey, h(i)) == 1 end, hint)
    if matched > 0 then hint = matched end
    local function spec_held(i)
      local e = redis.call('ZSCORE', skey, h(i))
      return e and tonumber(e) > now
    end
    -- speculative entries matter only past the durable match: one probe says whether they reach it
    if has_spec and matched < n and spec_held(matched + 1) then
      matched = leading(spec_held, matched + 1)
    end
  end
  local total = matched
  if matched < n and redis.call('EXISTS', xkey) == 1 then
    total = walk(pkey, skey, has_spec, xkey, matched)
  end
  out[#out + 1] = replica
  out[#out + 1] = matched
  out[#out + 1] = total
end
return out
"""
)

LOOKUP_SHA = hashlib.sha1(_LOOKUP.encode()).hexdigest()  # names lookups in Redis's slow log and stats

# KEYS[1] live; ARGV[3] replica, ARGV[4] epoch, ARGV[5] one op per event (S store, R remove,
# C clear; H and X store and remove in the host tier), ARGV[6] the hash count of each event,
# ARGV[7] the hashes of all events, each S event preceded by its parent (NO_PARENT for a first
# block).
_APPLY = (
    _LUA_COMMON
    + """
local replica, epoch, ops, blob = ARGV[3], ARGV[4], ARGV[5], ARGV[7]
local pkey, ckey, hkey, skey, xkey = replica_keys(replica)
local ekey = prefix .. ':epochs'
if redis.call('HGET', ekey, replica) ~= epoch then
  redis.call('UNLINK', pkey, ckey, hkey, skey, xkey)
  redis.call('HSET', ekey, replica, epoch)
end
local function store(block, parent, parent_held)
  if redis.call('HSETNX', pkey, block, parent) == 0 then return end
  redis.call('SREM', hkey, block)
  if parent ~= NO_PARENT then
    redis.call('HINCRBY', ckey, parent, 1)
    if not parent_held and redis.call('HEXISTS', pkey, parent) == 0 then
      redis.call('SADD', hkey, parent)
    end
  end
end
local function remove(block)
  local parent = redis.call('HGET', pkey, block)
  if not parent then return end
  redis.call('HDEL', pkey, block)
  if parent ~= NO_PARENT and redis.call('HINCRBY', ckey, parent, -1) <= 0 then
    redis.call('HDEL', ckey, parent)
    redis.call('SREM', hkey, parent)
  end
  if redis.call('HEXISTS', ckey, block) == 1 then redis.call('SADD', hkey, block) end
end
local pos, e = 1, 0
for count in string.gmatch(ARGV[6], '%d+') do
  e = e + 1
  local op = string.sub(ops, e, e)
  count = tonumber(count)
  if op == 'C' then
    redis.call('UNLINK', pkey, ckey, hkey, skey, xkey)
  elseif op == 'H' or op == 'X' then
    local args = {}
    for i = 0, count - 1 do args[#args + 1] = hash_at(blob, pos + i) end
    for first = 1, #args, 1024 do
      redis.call(op == 'H' and 'SADD' or 'SREM', xkey, unpack(args, first, math.min(#args, first + 1023)))
    end
    pos = pos + count
  elseif op == 'S' then
    local parent = hash_at(blob, pos)
    for i = 1, count do
      local block = hash_at(blob, pos + i)
      store(block, parent, i > 1)
      parent = block
    end
    pos = pos + count + 1
  else
    for i = 0, count - 1 do remove(hash_at(blob, pos + i)) end
    pos = pos + count
  end
end
return 1
"""
)

# KEYS[1] live; ARGV[3] replica, ARGV[4] epoch, ARGV[5] ttl ms, ARGV[6] reap after ms -> 1 | 0.
_HEARTBEAT = (
    _LUA_COMMON
    + """
local replica, epoch = ARGV[3], ARGV[4]
local ekey = prefix .. ':epochs'
local now = now_ms()
for _, dead in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[6]))) do
  redis.call('UNLINK', replica_keys(dead))
  redis.call('HDEL', ekey, dead)
  redis.call('ZREM', KEYS[1], dead)
end
if redis.call('HGET', ekey, replica) ~= epoch then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[5]), replica)
local _, _, _, skey = replica_keys(replica)
redis.call('ZREMRANGEBYSCORE', skey, '-inf', now)
return 1
"""
)

# KEYS[1] live; ARGV[3] replica, ARGV[4] ttl ms, ARGV[5] concatenated hashes.
_SPECULATE = (
    _LUA_COMMON
    + """
local _, _, _, skey = replica_keys(ARGV[3])
local ttl, blob = tonumber(ARGV[4]), ARGV[5]
local now = now_ms()
local n = #blob / hash_size
for first = 1, n, 1024 do
  local args = {}
  for i = first, math.min(n, first + 1023) do
    args[#args + 1] = now + ttl
    args[#args + 1] = hash_at(blob, i)
  end
  redis.call('ZADD', skey, 'GT', unpack(args))
end
redis.call('ZREMRANGEBYSCORE', skey, '-inf', now)
if redis.call('PTTL', skey) < ttl then
  redis.call('PEXPIRE', skey, ttl)
end
return 1
"""
)

_LIVE = (
    "#!lua flags=no-writes\n"
    + _LUA_COMMON
    + """
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now_ms(), '+inf')
"""
)


class RedisPrefixIndex(PrefixIndex):
    """:class:`PrefixIndex` in Redis; see its docstring for the contracts.

    An injected ``client`` must keep redis-py's default ``decode_responses=False``.
    """

    def __init__(
        self,
        url: str,
        model: str,
        block_size: int,
        namespace: str,
        reap_after_s: float,
        client: Redis | None = None,
    ):
        super().__init__(model, block_size, namespace)
        self._reap_after_ms = ttl_ms(reap_after_s)
        self._owns_client = client is None
        self._redis = client if client is not None else redis_client(url)
        self._keys = [f"{self.key_prefix}:live"]
        self._lookup = self._redis.register_script(_LOOKUP)
        self._apply = self._redis.register_script(_APPLY)
        self._heartbeat = self._redis.register_script(_HEARTBEAT)
        self._speculate = self._redis.register_script(_SPECULATE)
        self._live = self._redis.register_script(_LIVE)

    async def _run(self, script: Any, *args: Any) -> Any:
        return await _unavailable_on_error(
            script(keys=self._keys, args=(self.key_prefix, HASH_BYTES, *args))
        )

    async def lookup_tiers(self, block_hashes: Sequence[BlockHash]) -> dict[str, TierMatch]:
        flat = await self._run(self._lookup, pack_block_hashes(block_hashes))
        return {flat[i].decode(): TierMatch(flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)}

    async def apply(self, batch: KVEventBatch) -> None:
        check_batch(batch)
        ops, counts, hashes = [], [], []
        for event in batch.events:
            if isinstance(event, AllCleared):
                ops.append("C")
                counts.append("0")
                continue
            if event.tier == HOST:
                ops.append("H" if isinstance(event, BlockStored) else "X")
            elif isinstance(event, BlockStored):
                ops.append("S")
                hashes.append(event.parent_hash or _NO_PARENT)
            else:
                ops.append("R")
            counts.append(str(len(event.block_hashes)))
            hashes.extend(event.block_hashes)
        await self._run(
            self._apply, batch.replica_id, str(batch.epoch), "".join(ops), ",".join(counts),
            b"".join(hashes),
        )

    async def clear(self, replica_id: str) -> None:
        check_replica_id(replica_id)
        p = self.key_prefix
        await _unavailable_on_error(
            self._redis.unlink(*(f"{p}:{kind}:{replica_id}" for kind in _REPLICA_KEY_KINDS))
        )

    async def heartbeat(self, replica_id: str, epoch: int, ttl_s: float) -> bool:
        check_replica_id(replica_id)
        check_epoch(epoch)
        ttl = ttl_ms(ttl_s)
        beat = await self._run(self._heartbeat, replica_id, str(epoch), ttl, self._reap_after_ms)
        return beat == 1

    async def live_replicas(self) -> set[str]:
        return {r.decode() for r in await self._run(self._live)}

    async def insert_speculative(
        self, replica_id: str, block_hashes: Sequence[BlockHash], ttl_s: float
    ) -> None:
        check_replica_id(replica_id)
        blob = pack_block_hashes(block_hashes)
        await self._run(self._speculate, replica_id, ttl_ms(ttl_s), blob)

    async def close(self) -> None:
        if self._owns_client:
            await self._redis.aclose()


def redis_client(url: str) -> Redis | RedisCluster:
    """A client for a ``redis://``-style URL, or a ``RedisCluster`` for a ``redis+cluster://`` one (any
    Redis user of ``--index-url`` opens it here, so every scheme works for all of them).

    A cluster URL lists its start-up nodes comma-separated (``redis+cluster://:PASS@a:6379,b:6379``);
    credentials, path and query options apply to every node."""
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        return Redis.from_url(url, **_CLIENT_DEFAULTS)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    nodes = []
    for host in hosts.split(","):
        node = urlsplit(f"//{host}")
        try:
            port = node.port or 6379
        except ValueError:
            port = None
        if not node.hostname or port is None:
            raise ValueError(f"cluster index URL: {host!r} is not host[:port] in {url!r}")
        nodes.append(ClusterNode(node.hostname, port))
    first = urlunsplit((parts.scheme.removesuffix("+cluster"), userinfo + at + hosts.split(",")[0],
                        parts.path, parts.query, ""))
    return RedisCluster.from_url(first, startup_nodes=nodes[1:], **_CLIENT_DEFAULTS)


async def _unavailable_on_error(call: Awaitable[Any]) -> Any:
    try:
        return await call
    except (RedisError, RedisClusterException, OSError) as e:  # the cluster's own errors are no RedisError
        raise IndexUnavailableError(f"redis: {e}") from e
