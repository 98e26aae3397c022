"""Host-memory KV tier: full blocks evicted from the KV pool wait in host memory, by hash, so that a
later prefix hit copies them back instead of recomputing them (``--host-kv-cache-gib``).

Agent conversations pause for tool calls and think time, and the pool evicts them meanwhile; a
copy back over PCIe costs a fraction of the prefill it replaces. Two halves:

- :class:`HostBlockPool`: which slot holds which block, by ``(layer group, block hash)``, with its
  own LRU, its KV events and its integrity check. Pure bookkeeping, driven by the KV manager in the
  engine loop; it plans :class:`HostTransfers` that the engine runs before the next forward.
- :class:`HostKVStore`: the bytes, one host page per slot, each page all of a pool page's K/V
  tensors (quantized bytes as they are, for an FP8 pool), and the copies that move them.

When a copy happens: a block whose hash leaves the pool (allocation takes it from the free queue)
is *offloaded*: its page is copied to a host slot unless the host tier already holds that key
(then the slot is only touched). A prefix hit that continues past the pool's cached blocks into
host-held ones *loads* them: the sequence gets new blocks, registered under their hashes at once
(other sequences may share them), and the host pages are copied in before the forward reads them.
Exact-position entries stay in the pool (partial pages are not offloaded).

Ordering on CUDA, without ever blocking the engine thread: evicted pages are gathered into a device
staging buffer on the compute stream (their KV is final; the forward that reuses the blocks comes
after), then copied to host on a dedicated copy stream; loads are copied to device staging on the
copy stream and scattered into the pool on the compute stream after waiting for the copy's event,
so the step that reads them waits on the GPU, not the CPU. One copy stream keeps host-slot reads
and writes in the order they were planned; a slot that a planned load will read is referenced
(``used``) until the transfers are taken, so no offload of the same plan overwrites it. On the
CPU the store is ordinary memory and every copy is synchronous: the same code path, in CI.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

from engine.kv_cache import BlockCounts, IntegrityError
from prefix_index.events import HOST, BlockRemoved, BlockStored, KVEvent
from prefix_index.hashing import BlockHash

HostKey = tuple[int, BlockHash]  # (layer group, block hash): a hybrid pool caches each group apart


class HostTransfers(NamedTuple):
    """Copies planned since the last :meth:`HostBlockPool.take_transfers`, each list in order."""

    offloads: list[tuple[int, int]]  # (pool block, host slot)
    loads: list[tuple[int, int]]  # (host slot, pool block)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.loads)


class HostBlockPool:
    """Slots of the host tier. Each is *free* (holds nothing), *cached* (holds the KV of a key,
    evictable) or *used* (cached and read by a planned load not yet taken). Free and cached slots
    sit in one LRU queue; an offload takes its head. Not thread-safe, except :meth:`snapshot`:
    the engine loop alone calls it. KV events cover group 0's blocks, as the pool's do."""

    def __init__(self, num_slots: int, record_events: bool = False):
        if num_slots <= 0:
            raise ValueError(f"a host tier needs a positive number of slots, got {num_slots}")
        self.num_slots = num_slots
        self.record_events = record_events
        self.ref_cnt = [0] * num_slots
        self.slot_key: list[HostKey | None] = [None] * num_slots
        self.cached: dict[HostKey, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))  # LRU first
        self._offloads: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._events: list[KVEvent] = []
        self.num_offloaded = 0  # blocks copied out since start
        self.num_loaded = 0  # blocks copied back since start

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def get(self, key: HostKey) -> int | None:
        """The slot holding ``key``, or None. Pure query."""
        return self.cached.get(key)

    def offload(self, key: HostKey, block_id: int) -> None:
        """Plan to copy pool block ``block_id``, whose KV ``key`` names, to the least recently used
        slot, unless a slot holds ``key`` already (then it becomes the most recently used) or every
        slot is used (then the block is dropped: the tier is a cache)."""
        slot = self.cached.get(key)
        if slot is not None:
            self._touch(slot)
            return
        if not self.free_queue:
            return
        slot, _ = self.free_queue.popitem(last=False)
        old = self.slot_key[slot]
        if old is not None:
            del self.cached[old]
            self._record(BlockRemoved, old)
        self.slot_key[slot] = key
        self.cached[key] = slot
        self.free_queue[slot] = None
        self._offloads.append((block_id, slot))
        self._record(BlockStored, key)
        self.num_offloaded += 1

    def pin(self, key: HostKey) -> int:
        """The slot holding ``key``, used from now until the transfers are taken: pass it to
        :meth:`load` before then. Raises KeyError if no slot holds ``key``."""
        slot = self.cached[key]
        if self.ref_cnt[slot] == 0:
            del self.free_queue[slot]
        self.ref_cnt[slot] += 1
        return slot

    def load(self, slot: int, block_id: int) -> None:
        """Plan to copy pinned ``slot`` into pool block ``block_id``."""
        self._loads.append((slot, block_id))
        self.num_loaded += 1

    def take_transfers(self) -> HostTransfers:
        """The copies planned since the last call; their loads' slots become the most recently
        used. Run them (:meth:`HostKVStore.run`) before anything else reads or writes the pool."""
        transfers = HostTransfers(self._offloads, self._loads)
        self._offloads, self._loads = [], []
        for slot, _ in transfers.loads:
            self.ref_cnt[slot] -= 1
            if self.ref_cnt[slot] == 0:
                self.free_queue[slot] = None
        return transfers

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def snapshot(self) -> list[BlockHash]:
        """Group 0's block hashes held, for an index resync (thread-safe: ``list()`` of a dict)."""
        return [block_hash for group, block_hash in list(self.cached) if group == 0]

    def _touch(self, slot: int) -> None:
        if self.ref_cnt[slot] == 0:
            self.free_queue.move_to_end(slot)

    def _record(self, kind: type[BlockStored] | type[BlockRemoved], key: HostKey) -> None:
        """Append ``key``'s event, merged into the last one when it is of the same kind."""
        group, block_hash = key
        if not self.record_events or group != 0:
            return
        last = self._events[-1] if self._events else None
        if type(last) is kind:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockStored([block_hash], None, HOST) if kind is BlockStored
                                else BlockRemoved([block_hash], HOST))

    def check_integrity(self) -> BlockCounts:
        """Prove free + cached + used == the host tier's slots, that the key map agrees with the
        slots, and that only slots of planned loads are referenced (by exactly those loads)."""
        planned = [0] * self.num_slots
        for slot, _ in self._loads:
            planned[slot] += 1
        if planned != self.ref_cnt:
            raise IntegrityError("host slot references differ from the planned loads")
        unreferenced = {i for i, r in enumerate(self.ref_cnt) if r == 0}
        if unreferenced != set(self.free_queue):
            raise IntegrityError("the host free queue differs from the set of unreferenced slots")
        for key, slot in self.cached.items():
            if self.slot_key[slot] != key:
                raise IntegrityError(f"host slot {slot}'s cache entry is stale")
        if sum(k is not None for k in self.slot_key) != len(self.cached):
            raise IntegrityError("a host slot holds a key that the cache map lacks")
        used = self.num_slots - len(unreferenced)
        cached = sum(1 for i in unreferenced if self.slot_key[i] is not None)
        counts = BlockCounts(len(unreferenced) - cached, cached, used, 0)
        assert sum(counts) == self.num_slots
        return counts


class HostKVStore:
    """Host pages for a pool's K/V page tensors, and the copies between them (see the module
    docstring for their order). Pinned memory and a copy stream on CUDA; on the CPU, ordinary
    memory and synchronous copies. Not thread-safe: the engine loop alone calls it."""

    def __init__(self, pages: list[tuple[torch.Tensor, torch.Tensor]], num_slots: int):
        self.device = pages[0][0].device
        # every K/V tensor of a pool page as raw bytes: [num_blocks, page bytes] (fp8 has no index_copy_)
        self._raw = [t.view(t.shape[0], -1).view(torch.uint8) for pair in pages for t in pair]
        self._page_shape = self._raw[0].shape[1:]
        cuda = self.device.type == "cuda"
        self.host = torch.empty((num_slots, len(self._raw), *self._page_shape), dtype=torch.uint8, pin_memory=cuda)
        self._stream = torch.cuda.Stream(self.device) if cuda else None

    @staticmethod
    def slots_for(gib: float, page_bytes: int) -> int:
        """Slots ``gib`` GiB of host memory holds, for pool pages of ``page_bytes`` bytes."""
        return int(gib * 2**30 // page_bytes)

    @torch.inference_mode()
    def run(self, transfers: HostTransfers) -> None:
        """Queue ``transfers`` (never blocks the calling thread on CUDA): the offloaded pages are read
        before the loads write the pool, the loaded slots before the offloads write host memory."""
        if self._stream is None:
            self._run_sync(transfers)
            return
        compute = torch.cuda.current_stream(self.device)
        staged_out = None
        if transfers.offloads:  # snapshot the evicted pages before this step's loads or forward reuse them
            blocks = self._index([b for b, _ in transfers.offloads])
            staged_out = torch.stack([raw.index_select(0, blocks) for raw in self._raw], dim=1)
        if transfers.loads:
            with torch.cuda.stream(self._stream):
                staged_in = torch.empty((len(transfers.loads), *self.host.shape[1:]), dtype=torch.uint8,
                                        device=self.device)
                for i, (slot, _) in enumerate(transfers.loads):
                    staged_in[i].copy_(self.host[slot], non_blocking=True)
            compute.wait_stream(self._stream)
            staged_in.record_stream(compute)
            blocks = self._index([b for _, b in transfers.loads])
            for j, raw in enumerate(self._raw):
                raw.index_copy_(0, blocks, staged_in[:, j])
        if staged_out is not None:
            self._stream.wait_stream(compute)
            with torch.cuda.stream(self._stream):
                for i, (_, slot) in enumerate(transfers.offloads):
                    self.host[slot].copy_(staged_out[i], non_blocking=True)
            staged_out.record_stream(self._stream)

    def _run_sync(self, transfers: HostTransfers) -> None:
        """Offloads first: a load may write a block just evicted (never a slot an offload writes)."""
        if transfers.offloads:
            blocks = torch.tensor([b for b, _ in transfers.offloads])
            slots = torch.tensor([s for _, s in transfers.offloads])
            for j, raw in enumerate(self._raw):
                self.host[slots, j] = raw.index_select(0, blocks)
        if transfers.loads:
            slots = torch.tensor([s for s, _ in transfers.loads])
            blocks = torch.tensor([b for _, b in transfers.loads])
            for j, raw in enumerate(self._raw):
                raw.index_copy_(0, blocks, self.host[slots, j])

    def _index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.device)
