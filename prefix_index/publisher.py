"""Engine side of the prefix index: ship KV events without ever slowing the engine loop.

The engine calls :meth:`KVEventPublisher.publish` once per step with that step's events. The call
appends to a bounded queue and returns (no lock, no I/O); only the first event after an idle spell
wakes the publisher's thread (one self-pipe write). That thread, with its own event loop, drains the
queue every few milliseconds while events keep coming, each time in one index write, and sleeps
until the next event or heartbeat when none come (an idle replica costs no CPU). It beats the
replica's heartbeat, and resyncs the whole cache (``AllCleared``, then the snapshot as
``BlockStored`` chains) at start, after any failed write, after an overflow and whenever the index
no longer knows this replica's epoch (Redis restarted or flushed, replica reaped). Until a resync
starts, new events are dropped at once: the snapshot will cover them.

Why a snapshot taken in the background thread is enough: the queue is emptied before
``snapshot()`` runs, so every dropped event is already reflected in the snapshot, and every event
applied after the resync reflects a change at least as recent as the snapshot. Each event sets the
membership of its blocks, so replaying a change the snapshot already holds changes nothing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import structlog

from prefix_index.events import (
    HOST,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    check_replica_id,
)
from prefix_index.hashing import BlockHash
from prefix_index.index import DEFAULT_NAMESPACE, IndexUnavailableError, PrefixIndex, open_index

log = structlog.get_logger(__name__)

_FLUSH_INTERVAL_S = 0.005  # after a write: gather the next steps' events into one
# Hashes per index write: one Lua call blocks Redis for everyone, and a stored or removed block
# costs it a few microseconds, so big steps and resyncs go out in slices of a millisecond or two.
_MAX_HASHES_PER_WRITE = 512
_CLOSE_TIMEOUT_S = 1.0
_TTL_HEARTBEATS = 3  # a replica stays live through two missed heartbeats


@dataclass(frozen=True, slots=True)
class PublisherStats:
    connected: bool  # the last index call succeeded
    needs_resync: bool
    writes: int  # event batches written
    resyncs: int  # full resyncs written
    overflows: int  # times the queue was full and events were dropped


class KVEventPublisher:
    """Publishes one engine's KV events to the prefix index at ``index_url``.

    ``snapshot()`` returns ``(block_hash, parent_hash)`` for every block the engine can reuse now
    from its KV pool (``parent_hash`` None for a sequence's first block), best in insertion order
    so that chains stay together; ``host_snapshot()`` (None: no host tier) the hashes its host
    tier holds. Both are called from the publisher's thread, so they must be thread-safe and
    return a copy (``list(d.items())`` of a dict is atomic under the GIL). ``epoch`` defaults to the start
    time in nanoseconds: a restarted engine gets a new one and the index drops its predecessor's
    entries.

    The replica beats every ``heartbeat_s`` with a TTL of three beats. :meth:`publish` may be
    called from one thread (the engine loop) and never blocks; the other methods are for the
    thread that owns the publisher.
    """

    def __init__(
        self,
        index_url: str,
        replica_id: str,
        model: str,
        block_size: int,
        heartbeat_s: float = 2.0,
        *,
        snapshot: Callable[[], Iterable[tuple[BlockHash, BlockHash | None]]],
        host_snapshot: Callable[[], list[BlockHash]] | None = None,
        epoch: int | None = None,
        max_pending_steps: int = 4096,
        namespace: str = DEFAULT_NAMESPACE,
    ):
        check_replica_id(replica_id)
        if not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be positive, got {heartbeat_s}")
        if max_pending_steps <= 0:
            raise ValueError(f"max_pending_steps must be positive, got {max_pending_steps}")
        # Opened here so that a bad URL, model or block size fails in the caller, not the thread;
        # its Redis client connects lazily, on the publisher's own event loop.
        self._index: PrefixIndex = open_index(index_url, model, block_size, namespace=namespace)
        self.replica_id = replica_id
        self.epoch = time.time_ns() if epoch is None else epoch
        self._snapshot = snapshot
        self._host_snapshot = host_snapshot
        self._heartbeat_s = heartbeat_s
        self._max_pending = max_pending_steps
        self._pending: deque[Sequence[KVEvent]] = deque()
        self._needs_resync = True
        self._connected = False
        self._writes = self._resyncs = self._overflows = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._parked = False  # the thread sleeps until publish() wakes it (or its next heartbeat)
        self._stopping = False
        self._thread = threading.Thread(
            target=self._thread_main, name=f"kv-events-{replica_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one step's events (the list is taken over, not copied). Never blocks; wakes the
        publisher's thread if it sleeps for want of events."""
        if not events or self._needs_resync:
            return
        if len(self._pending) >= self._max_pending:
            self._needs_resync = True
            self._overflows += 1
            return
        self._pending.append(events)
        if self._parked:
            self._parked = False
            self._wake_thread()

    def stats(self) -> PublisherStats:
        return PublisherStats(
            self._connected, self._needs_resync, self._writes, self._resyncs, self._overflows
        )

    def close(self, timeout_s: float = 2 * _CLOSE_TIMEOUT_S) -> None:
        """Stop the thread; it clears this replica's entries (best effort, bounded) on the way."""
        self._stopping = True
        self._wake_thread()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _wake_thread(self) -> None:
        if self._loop is not None and self._wake is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the loop already finished
                pass

    def _thread_main(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        next_beat = 0.0
        try:
            while not self._stopping:
                try:
                    if self._needs_resync:
                        await self._resync()
                        next_beat = 0.0
                    wrote = await self._write_pending()
                    if time.monotonic() >= next_beat:
                        if not await self._index.heartbeat(
                            self.replica_id, self.epoch, _TTL_HEARTBEATS * self._heartbeat_s
                        ):
                            log.warning("kv_index_lost_replica", replica_id=self.replica_id)
                            self._needs_resync = True
                            continue
                        next_beat = time.monotonic() + self._heartbeat_s
                    self._set_connected(True)
                    if wrote:
                        await asyncio.sleep(_FLUSH_INTERVAL_S)
                    else:
                        await self._park(next_beat - time.monotonic())
                except IndexUnavailableError as e:
                    self._needs_resync = True
                    self._set_connected(False, error=str(e))
                    await self._sleep(self._heartbeat_s)
                except Exception:  # a failing snapshot() or a malformed event: never die silently
                    log.exception("kv_publisher_failed", replica_id=self.replica_id)
                    self._needs_resync = True
                    await self._sleep(self._heartbeat_s)
        finally:
            await self._leave()

    async def _resync(self) -> None:
        """Replace this replica's entries with a snapshot of the engine's cache."""
        # Probe first: a snapshot of a large cache is not free, and is useless while Redis is down.
        await self._index.live_replicas()
        self._needs_resync = False
        self._pending.clear()
        chains = _chains(self._snapshot())
        host = self._host_snapshot() if self._host_snapshot is not None else []
        await self._write([AllCleared(), *chains, *([BlockStored(host, None, HOST)] if host else [])])
        self._resyncs += 1
        num_blocks = sum(len(c.block_hashes) for c in chains)
        log.info("kv_index_resynced", replica_id=self.replica_id, num_blocks=num_blocks, num_host_blocks=len(host))

    async def _write_pending(self) -> bool:
        """Write everything queued; True if there was anything."""
        events: list[KVEvent] = []
        while self._pending:
            events.extend(self._pending.popleft())
        await self._write(events)
        return bool(events)

    async def _write(self, events: list[KVEvent]) -> None:
        for batch in _slices(events):
            await self._index.apply(KVEventBatch(self.replica_id, self.epoch, batch))
            self._writes += 1

    def _set_connected(self, connected: bool, error: str | None = None) -> None:
        if connected != self._connected:
            self._connected = connected
            if connected:
                log.info("kv_index_connected", replica_id=self.replica_id)
            else:
                log.warning("kv_index_unavailable", replica_id=self.replica_id, error=error)

    async def _park(self, seconds: float) -> None:
        """Sleep until :meth:`publish` has events, or for ``seconds`` (until the next heartbeat)."""
        self._parked = True
        if self._pending:  # published since the last write, before the flag was up: no wake-up comes
            self._parked = False
            return
        await self._sleep(seconds)
        self._parked = False

    async def _sleep(self, seconds: float) -> None:
        """Sleep for ``seconds``, or until woken (by publish() while parked, or by close())."""
        assert self._wake is not None
        self._wake.clear()
        if self._stopping:
            return
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            pass

    async def _leave(self) -> None:
        """The engine is going away, its cache with it; bounded so a dead Redis cannot hang exit."""
        try:
            await asyncio.wait_for(self._index.clear(self.replica_id), _CLOSE_TIMEOUT_S)
        except (IndexUnavailableError, TimeoutError):
            pass
        await self._index.close()


def _chains(pairs: Iterable[tuple[BlockHash, BlockHash | None]]) -> list[BlockStored]:
    """Group (block, parent) pairs into chains: a pair continues the previous chain when its
    parent is that chain's last block, so a snapshot in insertion order needs few events."""
    chains: list[tuple[BlockHash | None, list[BlockHash]]] = []
    for block, parent in pairs:
        if chains and parent is not None and parent == chains[-1][1][-1]:
            chains[-1][1].append(block)
        else:
            chains.append((parent, [block]))
    return [BlockStored(blocks, parent) for parent, blocks in chains]


def _slices(events: list[KVEvent]) -> Iterator[list[KVEvent]]:
    """Cut events, in order, into batches of at most ``_MAX_HASHES_PER_WRITE`` hashes; a long
    event is split into pieces (a stored piece's parent is the block before it)."""
    batch: list[KVEvent] = []
    room = _MAX_HASHES_PER_WRITE
    for event in events:
        if isinstance(event, AllCleared):
            batch.append(event)
            continue
        hashes = event.block_hashes
        start = 0
        while start < len(hashes):
            if room == 0:
                yield batch
                batch, room = [], _MAX_HASHES_PER_WRITE
            piece = hashes[start : start + room]
            if isinstance(event, BlockStored):
                batch.append(BlockStored(piece, hashes[start - 1] if start else event.parent_hash, event.tier))
            else:
                batch.append(BlockRemoved(piece, event.tier))
            start += len(piece)
            room -= len(piece)
    if batch:
        yield batch
