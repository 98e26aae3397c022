"""``memory://`` backend: the index in this process, behind one lock.

Stores are shared per process by (URL, key prefix) and live while some index holds them, so an
engine's publisher thread and an embedded gateway opening the same URL see the same entries.
Times are milliseconds of ``time.monotonic``: TTLs mean the same as on Redis, measured locally.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence

from prefix_index.events import (
    DEVICE,
    HOST,
    AllCleared,
    BlockStored,
    KVEventBatch,
    check_batch,
    check_epoch,
    check_replica_id,
    pack_block_hashes,
)
from prefix_index.hashing import BlockHash
from prefix_index.index import PrefixIndex, TierMatch, ttl_ms


class _Store:
    __slots__ = ("lock", "blocks", "host", "spec", "live", "epochs", "__weakref__")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.blocks: dict[str, set[BlockHash]] = {}
        self.host: dict[str, set[BlockHash]] = {}  # the replicas' host tiers
        self.spec: dict[str, dict[BlockHash, int]] = {}  # replica -> block -> expiry (ms)
        self.live: dict[str, int] = {}  # replica -> heartbeat expiry (ms)
        self.epochs: dict[str, int] = {}

    def forget_entries(self, replica_id: str) -> None:
        self.blocks.pop(replica_id, None)
        self.host.pop(replica_id, None)
        self.spec.pop(replica_id, None)


_stores: weakref.WeakValueDictionary[tuple[str, str], _Store] = weakref.WeakValueDictionary()
_stores_lock = threading.Lock()


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class MemoryPrefixIndex(PrefixIndex):
    """:class:`PrefixIndex` in this process; see its docstring for the contracts."""

    def __init__(self, url: str, model: str, block_size: int, namespace: str, reap_after_s: float):
        super().__init__(model, block_size, namespace)
        self._reap_after_ms = ttl_ms(reap_after_s)
        with _stores_lock:
            store = _stores.get((url, self.key_prefix))
            if store is None:
                store = _stores[(url, self.key_prefix)] = _Store()
        self._store = store

    async def lookup_tiers(self, block_hashes: Sequence[BlockHash]) -> dict[str, TierMatch]:
        pack_block_hashes(block_hashes)
        s = self._store
        now = _now_ms()
        matched: dict[str, TierMatch] = {}
        with s.lock:
            for replica_id, expiry in s.live.items():
                if expiry <= now:
                    continue
                held = s.blocks.get(replica_id, ())
                host = s.host.get(replica_id, ())
                spec = s.spec.get(replica_id, {})
                device = total = 0
                for h in block_hashes:
                    if h in held or spec.get(h, 0) > now:
                        device += total == device
                    elif h not in host:
                        break
                    total += 1
                matched[replica_id] = TierMatch(device, total)
        return matched

    async def apply(self, batch: KVEventBatch) -> None:
        check_batch(batch)
        s = self._store
        replica_id = batch.replica_id
        with s.lock:
            if s.epochs.get(replica_id) != batch.epoch:
                s.forget_entries(replica_id)
                s.epochs[replica_id] = batch.epoch
            tiers = {DEVICE: s.blocks.setdefault(replica_id, set()), HOST: s.host.setdefault(replica_id, set())}
            for event in batch.events:
                if isinstance(event, AllCleared):
                    for held in tiers.values():
                        held.clear()
                    s.spec.pop(replica_id, None)
                elif isinstance(event, BlockStored):
                    tiers[event.tier].update(event.block_hashes)
                else:
                    tiers[event.tier].difference_update(event.block_hashes)

    async def clear(self, replica_id: str) -> None:
        check_replica_id(replica_id)
        with self._store.lock:
            self._store.forget_entries(replica_id)

    async def heartbeat(self, replica_id: str, epoch: int, ttl_s: float) -> bool:
        check_replica_id(replica_id)
        check_epoch(epoch)
        ttl = ttl_ms(ttl_s)
        s = self._store
        now = _now_ms()
        with s.lock:
            for dead in [r for r, e in s.live.items() if e + self._reap_after_ms <= now]:
                s.forget_entries(dead)
                s.epochs.pop(dead, None)
                del s.live[dead]
            if s.epochs.get(replica_id) != epoch:
                return False
            s.live[replica_id] = now + ttl
            spec = s.spec.get(replica_id)
            if spec:
                _drop_expired(spec, now)
            return True

    async def live_replicas(self) -> set[str]:
        now = _now_ms()
        with self._store.lock:
            return {r for r, expiry in self._store.live.items() if expiry > now}

    async def insert_speculative(
        self, replica_id: str, block_hashes: Sequence[BlockHash], ttl_s: float
    ) -> None:
        check_replica_id(replica_id)
        pack_block_hashes(block_hashes)
        s = self._store
        now = _now_ms()
        expiry = now + ttl_ms(ttl_s)
        with s.lock:
            spec = s.spec.setdefault(replica_id, {})
            _drop_expired(spec, now)
            for h in block_hashes:
                if spec.get(h, 0) < expiry:
                    spec[h] = expiry

    async def close(self) -> None:
        """Nothing to release: the store goes when the last index on it is gone."""


def _drop_expired(spec: dict[BlockHash, int], now: int) -> None:
    for h in [h for h, expiry in spec.items() if expiry <= now]:
        del spec[h]
