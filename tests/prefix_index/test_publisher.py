"""The engine-side publisher against both backends, a dead Redis, a hung Redis and a restart."""

from __future__ import annotations

import asyncio

import redis
from index_testing import free_port, wait_until
from test_index import chain

from prefix_index.events import HOST, AllCleared, BlockRemoved, BlockStored, KVEventBatch
from prefix_index.index import TierMatch, open_index
from prefix_index.publisher import KVEventPublisher

HEARTBEAT_S = 0.1


class FakeEngineCache:
    """The engine's view: block -> parent, snapshotted by the publisher from its own thread."""

    def __init__(self, chain_from_block_0=()):
        self.parents = {}
        for i, block in enumerate(chain_from_block_0):
            self.add(block, chain_from_block_0[i - 1] if i else None)
        self.snapshots = 0

    def add(self, block, parent):
        self.parents[block] = parent

    def snapshot(self):
        self.snapshots += 1
        return list(self.parents.items())


def make_publisher(url, namespace, cache, replica_id="engine-0", **kwargs):
    return KVEventPublisher(
        url, replica_id, "m", 16, HEARTBEAT_S, snapshot=cache.snapshot, namespace=namespace,
        **kwargs,
    )


async def test_events_reach_the_index(backend_url, namespace, open_test_index):
    index = open_test_index()
    h = chain(10)
    cache = FakeEngineCache(h[:2])
    publisher = make_publisher(backend_url, namespace, cache)
    publisher.start()
    try:
        await wait_until(lambda: index.lookup(h), what="the resync and first heartbeat")
        assert await index.lookup(h) == {"engine-0": 2}
        await wait_until(lambda: not publisher.stats().needs_resync, what="the resync")

        publisher.publish([BlockStored(h[2:5], parent_hash=h[1])])
        publisher.publish([BlockStored(h[5:8], parent_hash=h[4])])
        publisher.publish([])
        await wait_until(lambda: _matched(index, h, 8), what="stored events")
        publisher.publish([BlockRemoved([h[6]])])
        await wait_until(lambda: _matched(index, h, 6), what="a removed event")
        publisher.publish([AllCleared(), BlockStored(h[:1])])
        await wait_until(lambda: _matched(index, h, 1), what="a cleared event")
        stats = publisher.stats()
        assert stats.connected and stats.resyncs == 1 and stats.writes >= 3
        assert stats.overflows == 0 and cache.snapshots == 1
    finally:
        await asyncio.to_thread(publisher.close)
    assert await index.lookup(h) in ({}, {"engine-0": 0})  # cleared on the way out


async def _matched(index, hashes, expected):
    return (await index.lookup(hashes)).get("engine-0") == expected


async def test_an_idle_publisher_sleeps_until_the_next_event(backend_url, namespace, open_test_index):
    """No polling while the engine is idle, and an event goes out at once, not at the next heartbeat."""
    index = open_test_index()
    h = chain(3)
    publisher = KVEventPublisher(backend_url, "engine-0", "m", 16, 60.0, snapshot=FakeEngineCache(h[:1]).snapshot,
                                 namespace=namespace)
    passes = 0
    write_pending = publisher._write_pending

    async def counted():
        nonlocal passes
        passes += 1
        return await write_pending()

    publisher._write_pending = counted
    publisher.start()
    try:
        await wait_until(lambda: _matched(index, h, 1), what="the resync")
        await asyncio.sleep(0.1)
        idle_from = passes
        await asyncio.sleep(0.5)
        assert passes == idle_from  # polling every 5 ms would have made ~100 passes
        publisher.publish([BlockStored(h[1:3], parent_hash=h[0])])
        await wait_until(lambda: _matched(index, h, 3), timeout_s=2.0, what="the event, well before the heartbeat")
    finally:
        await asyncio.to_thread(publisher.close)


async def test_resync_of_a_large_branching_cache(backend_url, namespace, open_test_index):
    """Two prompts sharing 700 blocks, snapshotted in an interleaved order, over several writes."""
    index = open_test_index()
    trunk = chain(1500)
    branch = chain(600, seed=3, prefix=trunk[:700])
    cache = FakeEngineCache()
    for i in range(1500):
        cache.add(trunk[i], trunk[i - 1] if i else None)
        if 700 <= i < 1300:
            cache.add(branch[i], branch[i - 1])
    publisher = make_publisher(backend_url, namespace, cache)
    publisher.start()
    try:
        await wait_until(lambda: _matched(index, trunk, 1500), what="the resync")
        assert await index.lookup(branch) == {"engine-0": 1300}
        diverging = chain(50, seed=4, prefix=branch[:1000])
        assert await index.lookup(diverging) == {"engine-0": 1000}
    finally:
        await asyncio.to_thread(publisher.close)


async def test_host_tier_events_and_resync(backend_url, namespace, open_test_index):
    """Host-tier events reach the index in slices that keep their tier; a resync restores the
    host tier from its own snapshot."""
    index = open_test_index()
    h = chain(900)
    cache = FakeEngineCache(h[:2])
    host = list(h[2:4])
    publisher = make_publisher(backend_url, namespace, cache, host_snapshot=lambda: list(host))
    publisher.start()
    try:
        await wait_until(lambda: _tiers(index, h, TierMatch(2, 4)), what="the resync with the host tier")
        publisher.publish([BlockStored(h[4:900], None, HOST)])  # more hashes than one write takes
        await wait_until(lambda: _tiers(index, h, TierMatch(2, 900)), what="host-tier stores")
        publisher.publish([BlockRemoved(h[3:4], HOST)])
        await wait_until(lambda: _tiers(index, h, TierMatch(2, 3)), what="a host-tier removal")
    finally:
        await asyncio.to_thread(publisher.close)


async def _tiers(index, hashes, expected):
    return (await index.lookup_tiers(hashes)).get("engine-0") == expected


async def test_restart_replaces_the_previous_engines_entries(
    backend_url, namespace, open_test_index
):
    index = open_test_index()
    h = chain(6)
    # What a crashed engine left behind: entries and a heartbeat still running.
    await index.apply(KVEventBatch("engine-0", 1, [BlockStored(h)]))
    assert await index.heartbeat("engine-0", 1, 60)
    publisher = make_publisher(backend_url, namespace, FakeEngineCache(h[:1]), epoch=2)
    publisher.start()
    try:
        await wait_until(lambda: _matched(index, h, 1), what="the new engine's resync")
        assert not await index.heartbeat("engine-0", 1, 60)
    finally:
        await asyncio.to_thread(publisher.close)


async def test_overflow_drops_and_resyncs_from_the_snapshot(
    backend_url, namespace, open_test_index
):
    index = open_test_index()
    h = chain(12)
    cache = FakeEngineCache()
    publisher = make_publisher(backend_url, namespace, cache, max_pending_steps=2)
    publisher.start()
    try:
        await wait_until(lambda: _matched(index, h, 0), what="the first resync")
        await wait_until(lambda: not publisher.stats().needs_resync, what="the first resync")
        # A burst far faster than the 5 ms flush: the bounded queue overflows.
        for i in range(12):
            cache.add(h[i], h[i - 1] if i else None)
            publisher.publish([BlockStored([h[i]], h[i - 1] if i else None)])
        for _ in range(1000):
            publisher.publish([BlockRemoved([h[11]]), BlockStored([h[11]], h[10])])
        assert publisher.stats().overflows >= 1
        await wait_until(lambda: _matched(index, h, 12), what="the resync after the overflow")
        # counted on the publisher's thread once its write returns, which can be after the index shows it
        await wait_until(lambda: publisher.stats().resyncs >= 2, what="the resync's count")
    finally:
        await asyncio.to_thread(publisher.close)


async def test_survives_a_failing_snapshot_and_a_malformed_event(
    backend_url, namespace, open_test_index
):
    index = open_test_index()
    h = chain(4)
    cache = FakeEngineCache(h[:2])
    calls = 0

    def flaky_snapshot():
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("cache busy")
        return cache.snapshot()

    publisher = KVEventPublisher(backend_url, "engine-0", "m", 16, HEARTBEAT_S,
                                 snapshot=flaky_snapshot, namespace=namespace)
    publisher.start()
    try:
        await wait_until(lambda: _matched(index, h, 2), what="the resync after a failed snapshot")
        await wait_until(lambda: not publisher.stats().needs_resync, what="the resync")
        cache.add(h[2], h[1])
        publisher.publish([BlockStored([b"not a 16-byte hash"])])  # dropped, then a resync
        await wait_until(lambda: _matched(index, h, 3), what="the resync after a bad event")
        publisher.publish([BlockStored([h[3]], h[2])])
        await wait_until(lambda: _matched(index, h, 4), what="events after the recovery")
        assert publisher.stats().resyncs == 2
    finally:
        await asyncio.to_thread(publisher.close)


async def test_publish_never_waits_for_a_dead_redis():
    cache = FakeEngineCache(chain(3))
    publisher = make_publisher(f"redis://127.0.0.1:{free_port()}/0", "kvgate-test-dead", cache)
    publisher.start()
    try:
        for _ in range(10_000):
            publisher.publish([BlockStored(chain(1))])
        stats = publisher.stats()
        assert not stats.connected and stats.needs_resync
        assert cache.snapshots == 0  # no snapshot is taken while Redis cannot take it
    finally:
        await asyncio.to_thread(publisher.close)


async def test_publish_never_waits_for_a_hung_redis(redis_servers):
    """Redis stops answering (CLIENT PAUSE) while the publisher is connected: its thread hangs in
    a call, publish() keeps returning, the queue overflows, and a resync follows the pause."""
    server = redis_servers()
    h = chain(8)
    cache = FakeEngineCache(h[:1])
    publisher = make_publisher(server.url, "kvgate-test-hung", cache)
    publisher.start()
    index = open_index(server.url, "m", 16, namespace="kvgate-test-hung")
    try:
        await wait_until(lambda: _matched(index, h, 1), what="the first resync")
        with redis.Redis.from_url(server.url) as admin:
            admin.client_pause(1500, all=True)  # longer than the client's 1 s read timeout
        await asyncio.sleep(2 * HEARTBEAT_S)  # the thread is now waiting on a heartbeat reply
        writes = publisher.stats().writes
        for i in range(1, 8):
            cache.add(h[i], h[i - 1])
            publisher.publish([BlockStored([h[i]], h[i - 1])])
        for _ in range(10_000):
            publisher.publish([BlockRemoved([h[7]]), BlockStored([h[7]], h[6])])
        stats = publisher.stats()
        assert stats.overflows == 1 and stats.needs_resync and stats.writes == writes
        await wait_until(lambda: _matched(index, h, 8), what="the resync after the pause")
    finally:
        await asyncio.to_thread(publisher.close)
        await index.close()


async def test_recovers_with_a_resync_when_redis_appears_and_restarts(redis_servers):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    h = chain(8)
    cache = FakeEngineCache(h[:3])
    publisher = make_publisher(url, "kvgate-test-recover", cache)
    publisher.start()
    index = open_index(url, "m", 16, namespace="kvgate-test-recover")
    try:
        publisher.publish([BlockStored(h[3:4], h[2])])  # lost: nobody to take it
        cache.add(h[3], h[2])

        server = redis_servers(port)
        await wait_until(lambda: _matched(index, h, 4), what="the resync once Redis is up")
        assert publisher.stats().connected

        cache.add(h[4], h[3])  # its event is never published: only a resync can tell
        server.stop()  # restart empty: the index forgets everything
        redis_servers(port)
        await wait_until(lambda: _matched(index, h, 5), what="the resync after a Redis restart")
        assert publisher.stats().resyncs >= 2

        publisher.publish([BlockStored(h[5:8], h[4])])
        await wait_until(lambda: _matched(index, h, 8), what="events after the recovery")
    finally:
        await asyncio.to_thread(publisher.close)
        await index.close()
