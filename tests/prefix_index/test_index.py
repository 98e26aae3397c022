"""One suite for both index backends (memory:// and a real Redis), plus Redis-only checks."""

from __future__ import annotations

import asyncio
import random
import threading
import uuid

import pytest
import redis
from index_testing import SHARED_REDIS_URL, RedisClusterServers, delete_namespace, free_port, wait_until
from redis.crc import key_slot

from prefix_index.events import HOST, AllCleared, BlockRemoved, BlockStored, KVEventBatch
from prefix_index.hashing import block_hashes
from prefix_index.index import IndexUnavailableError, TierMatch, open_index, redact_url

BS = 16
LIVE_S = 60.0


def chain(num_blocks: int, seed: int = 0, prefix: list[bytes] = ()) -> list[bytes]:
    """Hashes of a prompt of ``num_blocks`` blocks (after ``prefix``), distinct per seed."""
    tokens = [(seed * 7919 + i) % 49152 for i in range((len(prefix) + num_blocks) * BS)]
    if prefix:
        return block_hashes(tokens, BS, prefix=prefix)
    return block_hashes(tokens, BS)


async def store(index, replica_id, hashes, epoch=1, parent=None):
    await index.apply(KVEventBatch(replica_id, epoch, [BlockStored(hashes, parent)]))


async def join(index, replica_id, hashes=(), epoch=1, ttl_s=LIVE_S):
    """Record the replica's blocks (a chain from block 0) at ``epoch`` and make it live."""
    await store(index, replica_id, list(hashes), epoch)
    assert await index.heartbeat(replica_id, epoch, ttl_s)


async def test_longest_prefix_counts_only_unbroken_chains(open_test_index):
    index = open_test_index()
    h = chain(8)
    await join(index, "gap", h[:2])
    await store(index, "gap", [h[3]], parent=h[2])
    await join(index, "deep", h[:6])
    await join(index, "empty")
    await join(index, "tail")
    await store(index, "tail", h[2:8], parent=h[1])  # later blocks only: no prefix at all

    assert await index.lookup(h) == {"gap": 2, "deep": 6, "empty": 0, "tail": 0}
    assert await index.lookup(h[:1]) == {"gap": 1, "deep": 1, "empty": 0, "tail": 0}
    assert await index.lookup([]) == {"gap": 0, "deep": 0, "empty": 0, "tail": 0}
    assert await index.lookup(chain(8, seed=1)) == {"gap": 0, "deep": 0, "empty": 0, "tail": 0}


async def test_many_replicas_with_matches_above_below_and_equal_to_their_neighbours(open_test_index):
    """Redis tries the last replica's match first: every order of deeper, shallower, equal, full and
    empty answers is exact, and speculative entries count only past the durable match."""
    index = open_test_index()
    h = chain(12)
    depths = [5, 5, 3, 12, 0, 5, 7, 1, 11, 6, 2, 12, 5]
    for i, depth in enumerate(depths):
        await join(index, f"r{i:02}", h[:depth])
    await index.insert_speculative("r02", h[:9], LIVE_S)  # 3 durable, 9 speculative
    await index.insert_speculative("r06", h[:4], LIVE_S)  # shorter than its 7 durable
    await index.insert_speculative("r04", h[:1], LIVE_S)  # nothing durable
    expected = {f"r{i:02}": d for i, d in enumerate(depths)} | {"r02": 9, "r04": 1}
    assert await index.lookup(h) == expected
    assert await index.lookup(h[:6]) == {r: min(d, 6) for r, d in expected.items()}
    assert await index.lookup(h[:1]) == {r: min(d, 1) for r, d in expected.items()}


async def test_holes_left_by_evictions_cut_the_prefix_until_refilled(open_test_index):
    index = open_test_index()
    h = chain(8)
    await join(index, "r", h[:6])
    await join(index, "ref", h[:6])
    await index.apply(KVEventBatch("r", 1, [BlockRemoved([h[2]])]))  # parent before children
    assert await index.lookup(h) == {"r": 2, "ref": 6}
    await index.apply(KVEventBatch("r", 1, [BlockRemoved([h[5], h[4], h[3]])]))
    assert await index.lookup(h) == {"r": 2, "ref": 6}
    await store(index, "r", h[2:7], parent=h[1])
    assert await index.lookup(h) == {"r": 7, "ref": 6}
    await index.apply(KVEventBatch("r", 1, [BlockRemoved([h[0]])]))
    assert await index.lookup(h) == {"r": 0, "ref": 6}
    await store(index, "r", h[:1])
    assert await index.lookup(h) == {"r": 7, "ref": 6}


async def test_host_tier_extends_the_match_past_the_device_tier(open_test_index):
    """A block either tier holds counts towards ``total``, only the pool's (and speculative
    entries) towards ``device``; host events change the host tier alone."""
    index = open_test_index()
    h = chain(10)
    await join(index, "tiered", h[:3])
    await index.apply(KVEventBatch("tiered", 1, [BlockStored([h[5], h[3], h[4], h[7]], None, HOST)]))
    await join(index, "device", h[:5])
    await join(index, "host-only")
    await index.apply(KVEventBatch("host-only", 1, [BlockStored(h[:2], None, HOST)]))
    await join(index, "holes", h[:4])
    await index.apply(KVEventBatch("holes", 1, [BlockRemoved([h[1]]), BlockStored([h[1], h[4]], None, HOST)]))
    assert await index.lookup_tiers(h) == {
        "tiered": TierMatch(3, 6), "device": TierMatch(5, 5), "host-only": TierMatch(0, 2),
        "holes": TierMatch(1, 5),
    }
    assert await index.lookup(h) == {"tiered": 3, "device": 5, "host-only": 0, "holes": 1}
    await index.insert_speculative("host-only", h[:1], LIVE_S)
    await index.apply(KVEventBatch("tiered", 1, [BlockRemoved([h[4]], HOST), BlockRemoved([h[0]])]))
    assert await index.lookup_tiers(h[:8]) == {
        "tiered": TierMatch(0, 0), "device": TierMatch(5, 5), "host-only": TierMatch(1, 2),
        "holes": TierMatch(1, 5),
    }
    await store(index, "tiered", h[:1])  # the device tier again: the host tier's blocks follow
    await index.apply(KVEventBatch("tiered", 1, [BlockStored([h[4]], None, HOST)]))
    assert (await index.lookup_tiers(h))["tiered"] == TierMatch(3, 6)
    await index.apply(KVEventBatch("tiered", 1, [AllCleared()]))
    assert (await index.lookup_tiers(h))["tiered"] == TierMatch(0, 0)
    with pytest.raises(ValueError, match=r"events\[0\].tier"):
        await index.apply(KVEventBatch("tiered", 1, [BlockStored(h[:1], None, "disk")]))


async def test_branching_prompts_share_their_common_prefix(open_test_index):
    index = open_test_index()
    system = chain(4)
    turn_a = chain(3, seed=1, prefix=system)
    turn_b = chain(5, seed=2, prefix=system)
    await join(index, "r0", turn_a)
    await join(index, "r1", turn_b)
    assert await index.lookup(turn_a) == {"r0": 7, "r1": 4}
    assert await index.lookup(turn_b) == {"r0": 4, "r1": 9}


class ReferenceIndex:
    """The contract in a few lines: the suite compares both backends against it."""

    def __init__(self):
        self.held: dict[str, dict[str, set[bytes]]] = {}  # replica -> tier -> blocks

    def apply(self, replica_id, events):
        tiers = self.held.setdefault(replica_id, {"device": set(), "host": set()})
        for event in events:
            if isinstance(event, AllCleared):
                for held in tiers.values():
                    held.clear()
            elif isinstance(event, BlockStored):
                tiers[event.tier].update(event.block_hashes)
            else:
                tiers[event.tier].difference_update(event.block_hashes)

    def lookup_tiers(self, hashes):
        matched = {}
        for replica_id, tiers in self.held.items():
            device = 0
            while device < len(hashes) and hashes[device] in tiers["device"]:
                device += 1
            total = device
            while total < len(hashes) and (hashes[total] in tiers["device"] or hashes[total] in tiers["host"]):
                total += 1
            matched[replica_id] = TierMatch(device, total)
        return matched


@pytest.mark.parametrize("seed", [0, 1])
async def test_random_events_match_the_reference(open_test_index, seed):
    rng = random.Random(seed)
    index = open_test_index()
    reference = ReferenceIndex()
    shared = chain(10, seed=100 + seed)
    prompts = [chain(14, seed=200 + seed, prefix=shared), chain(20, seed=300 + seed, prefix=shared)]
    replicas = ["r0", "r1", "r2"]
    for replica_id in replicas:
        await join(index, replica_id)
        reference.apply(replica_id, [])
    for _ in range(80):
        replica_id = rng.choice(replicas)
        prompt = rng.choice(prompts)
        kind = rng.random()
        if kind < 0.4:
            start = rng.randrange(len(prompt))
            stop = rng.randrange(start, len(prompt)) + 1
            events = [BlockStored(prompt[start:stop], prompt[start - 1] if start else None)]
        elif kind < 0.55:
            events = [BlockStored(rng.sample(prompt, rng.randint(1, 8)), None, HOST)]
        elif kind < 0.8:
            events = [BlockRemoved(rng.sample(prompt, rng.randint(1, 4)))]
        elif kind < 0.93:
            events = [BlockRemoved(rng.sample(prompt, rng.randint(1, 4)), HOST)]
        else:
            events = [AllCleared(), BlockStored(prompt[: rng.randrange(len(prompt))])]
        await index.apply(KVEventBatch(replica_id, 1, events))
        reference.apply(replica_id, events)
        for p in prompts:
            assert await index.lookup_tiers(p) == reference.lookup_tiers(p)


async def test_dead_replicas_are_excluded(open_test_index):
    index = open_test_index()
    h = chain(4)
    await join(index, "steady", h[:2])
    await join(index, "fading", h, ttl_s=0.5)
    await store(index, "silent", h)  # events but never a heartbeat
    assert await index.lookup(h) == {"steady": 2, "fading": 4}
    assert await index.live_replicas() == {"steady", "fading"}

    await asyncio.sleep(0.55)
    assert await index.lookup(h) == {"steady": 2}
    assert await index.live_replicas() == {"steady"}

    assert await index.heartbeat("fading", 1, LIVE_S)  # back, with its entries intact
    assert await index.lookup(h) == {"steady": 2, "fading": 4}


async def test_heartbeat_needs_the_recorded_epoch(open_test_index):
    index = open_test_index()
    assert not await index.heartbeat("new", 5, LIVE_S)  # nothing applied yet
    assert await index.live_replicas() == set()
    await store(index, "new", chain(2), epoch=5)
    assert not await index.heartbeat("new", 4, LIVE_S)
    assert await index.live_replicas() == set()
    assert await index.heartbeat("new", 5, LIVE_S)
    assert await index.live_replicas() == {"new"}


async def test_clear_drops_one_replica_only(open_test_index):
    index = open_test_index()
    h = chain(6)
    await join(index, "a", h[:3])
    await store(index, "a", [h[4]], parent=h[3])  # and a hole
    await join(index, "b", h)
    await index.insert_speculative("a", h, ttl_s=LIVE_S)
    assert await index.lookup(h) == {"a": 6, "b": 6}

    await index.clear("a")
    assert await index.lookup(h) == {"a": 0, "b": 6}
    assert await index.heartbeat("a", 1, LIVE_S)  # epoch and liveness stay
    await store(index, "a", h[:2])
    assert await index.lookup(h) == {"a": 2, "b": 6}


async def test_new_epoch_replaces_the_replica_state(open_test_index):
    index = open_test_index()
    h = chain(6)
    await join(index, "r", h, epoch=1)
    await index.insert_speculative("r", chain(3, seed=9), ttl_s=LIVE_S)
    await index.apply(KVEventBatch("r", 1, [BlockRemoved([h[2]])]))  # a hole, wiped below
    await join(index, "other", h[:2], epoch=1)

    assert await index.lookup(h) == {"r": 2, "other": 2}
    await store(index, "r", h[:1], epoch=2)  # the engine restarted
    assert await index.lookup(h) == {"r": 1, "other": 2}
    assert await index.lookup(chain(3, seed=9)) == {"r": 0, "other": 0}
    assert not await index.heartbeat("r", 1, LIVE_S)
    assert await index.heartbeat("r", 2, LIVE_S)

    # An old epoch coming back (a second process with the same id) takes over in turn.
    await store(index, "r", h[:3], epoch=1)
    assert await index.lookup(h) == {"r": 3, "other": 2}
    assert not await index.heartbeat("r", 2, LIVE_S)


async def test_speculative_entries_expire(open_test_index):
    index = open_test_index()
    h = chain(8)
    other = chain(4, seed=5)
    await join(index, "r", h[:2])
    await join(index, "holey", h[:1])
    await store(index, "holey", [h[3]], parent=h[2])
    await index.insert_speculative("r", h[:5], ttl_s=0.6)
    await index.insert_speculative("r", h[:3], ttl_s=0.01)  # a shorter TTL never shortens
    await index.insert_speculative("r", other, ttl_s=LIVE_S)
    await index.insert_speculative("holey", h[:3], ttl_s=0.6)  # fills its hole for a while
    await asyncio.sleep(0.05)
    assert await index.lookup(h) == {"r": 5, "holey": 4}
    assert await index.lookup(other) == {"r": 4, "holey": 0}

    await store(index, "r", h[2:3], parent=h[1])  # stored for real: outlives the TTL
    await asyncio.sleep(0.6)
    assert await index.lookup(h) == {"r": 3, "holey": 1}
    assert await index.heartbeat("r", 1, LIVE_S)  # trims what expired; nothing else changes
    assert await index.lookup(h) == {"r": 3, "holey": 1}
    assert await index.lookup(other) == {"r": 4, "holey": 0}

    await index.apply(KVEventBatch("r", 1, [AllCleared()]))  # drops speculative entries too
    assert await index.lookup(other) == {"r": 0, "holey": 0}
    await index.insert_speculative("not-live", h, ttl_s=LIVE_S)
    assert "not-live" not in await index.lookup(h)


async def test_long_dead_replicas_are_reaped(open_test_index):
    index = open_test_index(reap_after_s=0.1)
    h = chain(3)
    await join(index, "gone", h, ttl_s=0.05)
    await join(index, "alive", h[:1])
    await asyncio.sleep(0.2)
    assert await index.heartbeat("alive", 1, LIVE_S)  # any heartbeat reaps
    assert not await index.heartbeat("gone", 1, LIVE_S)  # forgotten: it must resync
    await join(index, "gone")
    assert await index.lookup(h) == {"gone": 0, "alive": 1}


async def test_models_and_block_sizes_do_not_mix(open_test_index):
    a = open_test_index("model-a", 16)
    b = open_test_index("model-b", 16)
    a32 = open_test_index("model-a", 32)
    h = chain(3)
    await join(a, "r", h)
    assert await a.lookup(h) == {"r": 3}
    assert await b.lookup(h) == {}
    assert await a32.lookup(h) == {}
    assert open_test_index("model-a", 16) is not a
    assert await open_test_index("model-a", 16).lookup(h) == {"r": 3}


async def test_bad_arguments_raise_and_change_nothing(open_test_index, backend_url):
    index = open_test_index()
    h = chain(3)
    await join(index, "r", h)
    bad_hashes = [["not bytes"], [h[0][:8]], [h[0], h[1] + b"x"], "abc", None, [1, 2]]
    for hashes in bad_hashes:
        with pytest.raises(ValueError, match="block hashes"):
            await index.lookup(hashes)
        with pytest.raises(ValueError, match="block hashes"):
            await index.insert_speculative("r", hashes, 1.0)
    with pytest.raises(ValueError, match="events\\[1\\].block_hashes"):
        await index.apply(KVEventBatch("r", 1, [AllCleared(), BlockStored([b"short"])]))
    with pytest.raises(ValueError, match="not a KV event"):
        await index.apply(KVEventBatch("r", 1, [AllCleared(), "stored"]))
    with pytest.raises(ValueError, match="epoch"):
        await index.apply(KVEventBatch("r", -1, [AllCleared()]))
    with pytest.raises(ValueError, match="replica_id"):
        await index.apply(KVEventBatch("", 1, []))
    for ttl in (0, -1, float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match="ttl_s"):
            await index.insert_speculative("r", h, ttl)
        with pytest.raises(ValueError, match="ttl_s"):
            await index.heartbeat("r", 1, ttl)
    with pytest.raises(ValueError, match="replica_id"):
        await index.clear("")
    assert await index.lookup(h) == {"r": 3}

    for model, block_size in (("", 16), ("a{b}", 16), ("m", 0)):
        with pytest.raises(ValueError):
            open_index(backend_url, model, block_size)
    with pytest.raises(ValueError, match="memory://, redis://"):
        open_index("http://localhost:6379", "m", 16)


async def _write_chain(ix, replica_id, h, depth):
    """In chain order, several blocks at a time: a replica's count only ever grows."""
    for start in range(0, depth, 5):
        stop = min(start + 5, depth)
        await store(ix, replica_id, h[start:stop], parent=h[start - 1] if start else None)
        await asyncio.sleep(0)


async def _read_while(ix, h, depths, keep_going) -> int:
    """Look up ``h`` until ``keep_going()`` is false (at least 3 times); every answer must be a
    state that existed: each replica's count between the last one seen and its final depth."""
    seen = dict.fromkeys(depths, 0)
    reads = 0
    while keep_going() or reads < 3:
        await asyncio.sleep(0)  # memory:// lookups never suspend: let the writers run
        matched = await ix.lookup(h)
        assert matched.keys() == depths.keys()
        for replica_id, n in matched.items():
            assert seen[replica_id] <= n <= depths[replica_id]
            seen[replica_id] = n
        reads += 1
    return reads


def _writer_thread(backend_url, namespace, replica_id, h, depths, errors: list[BaseException]):
    """A thread with its own loop and client that writes one replica's chain while reading."""

    async def main():
        ix = open_index(backend_url, "m", BS, namespace=namespace)
        written = False

        async def write_all():
            nonlocal written
            await _write_chain(ix, replica_id, h, depths[replica_id])
            written = True

        try:
            await asyncio.gather(write_all(), _read_while(ix, h, depths, lambda: not written))
        finally:
            await ix.close()

    try:
        asyncio.run(main())
    except BaseException as e:
        errors.append(e)


async def test_concurrent_tasks_and_threads(open_test_index, backend_url, namespace):
    """Writers on many tasks and threads, readers checking every answer is a state that existed."""
    index = open_test_index()
    h = chain(96)
    depths = {f"task-{i}": 8 * (i + 1) for i in range(6)}
    depths |= {f"thread-{i}": 20 + 25 * i for i in range(3)}
    for replica_id in depths:
        await join(index, replica_id)
    writing = True
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_writer_thread, args=(backend_url, namespace, r, h, depths, errors))
        for r in depths if r.startswith("thread")
    ]
    for t in threads:
        t.start()
    readers = [asyncio.create_task(_read_while(index, h, depths, lambda: writing)) for _ in range(3)]
    await asyncio.gather(*(_write_chain(index, r, h, depths[r]) for r in depths if r.startswith("task")))
    await asyncio.to_thread(lambda: [t.join() for t in threads])
    writing = False
    assert all(await asyncio.gather(*readers))
    assert not errors, errors
    assert await index.lookup(h) == depths


# --- Redis only ---------------------------------------------------------------------------------


async def test_redis_keys_share_one_cluster_slot_per_model():
    namespace = f"kvgate-test-{uuid.uuid4().hex[:12]}"
    index = open_index(SHARED_REDIS_URL, "org/Model-7B", 16, namespace=namespace)
    h = chain(3)
    try:
        await join(index, "engine-0", h[:2])
        await store(index, "engine-0", [h[2]], parent=h[1])
        await index.apply(KVEventBatch("engine-0", 1, [BlockRemoved([h[1]])]))  # a hole
        await index.insert_speculative("engine-1", h, LIVE_S)
        client = redis.Redis.from_url(SHARED_REDIS_URL)
        keys = sorted(client.scan_iter(match=f"{namespace}:*"))
        client.close()
    finally:
        await index.close()
        delete_namespace(SHARED_REDIS_URL, namespace)
    assert keys == sorted(
        f"{namespace}:{{org/Model-7B:16}}:{suffix}".encode()
        for suffix in ("live", "epochs", "parent:engine-0", "holes:engine-0",
                       "children:engine-0", "spec:engine-1")
    )
    assert len({key_slot(k) for k in keys}) == 1


async def test_redis_down_raises_index_unavailable():
    index = open_index(f"redis://127.0.0.1:{free_port()}/0", "m", BS)
    for call in (
        index.lookup(chain(2)),
        index.apply(KVEventBatch("r", 1, [AllCleared()])),
        index.heartbeat("r", 1, 1.0),
        index.clear("r"),
        index.live_replicas(),
        index.insert_speculative("r", chain(2), 1.0),
    ):
        with pytest.raises(IndexUnavailableError):
            await call
    await index.close()


async def test_a_cluster_failover_of_the_models_slot_keeps_the_index(tmp_path):
    """The master holding a model's slot dies; its replica takes over and the index answers as before,
    through the same redis+cluster:// URL, while another model's keys live on another master."""
    cluster = RedisClusterServers(str(tmp_path))
    index = other = None
    try:
        index = open_index(cluster.url, "llama-3-8b", BS)
        other = open_index(cluster.url, "qwen3-0.6b", BS)
        slot = key_slot(f"{index.key_prefix}:live".encode())
        assert slot != key_slot(f"{other.key_prefix}:live".encode())
        h = chain(40)
        await join(index, "e0", h[:30])
        await join(index, "e1", h[:2])
        await store(index, "e1", [h[3]], parent=h[2])
        await index.insert_speculative("e1", h[:3], LIVE_S)
        await index.apply(KVEventBatch("e0", 1, [BlockRemoved([h[20]])]))
        await join(other, "e0", h[:5])
        assert await index.lookup(h) == {"e0": 20, "e1": 4}

        roles = {}
        for server in cluster.servers:
            with cluster.node(server.port) as node:
                keys = node.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)
                roles[server.port] = (node.info("replication"), keys)
        (master_port,) = [p for p, (info, keys) in roles.items() if info["role"] == "master" and keys > 0]
        (replica_port,) = [p for p, (info, _) in roles.items() if info.get("master_port") == master_port]
        with cluster.node(master_port) as node:
            assert node.execute_command("WAIT", 1, 5000) == 1  # every write is on the replica
        (dying,) = [s for s in cluster.servers if s.port == master_port]
        dying.stop()
        with cluster.node(replica_port) as node:
            assert node.execute_command("CLUSTER", "FAILOVER", "TAKEOVER") in (b"OK", True)

        async def answers():
            try:
                return await index.lookup(h)
            except IndexUnavailableError:
                return None  # the client finds the new master on a later call

        assert await wait_until(answers, 30, "the index to answer after the failover") == {"e0": 20, "e1": 4}
        with cluster.node(replica_port) as node:
            assert node.info("replication")["role"] == "master"
        await store(index, "e1", [h[4]], parent=h[3])  # writes go to the new master
        assert await index.heartbeat("e1", 1, LIVE_S)
        assert await index.lookup(h) == {"e0": 20, "e1": 5}
        assert await other.lookup(h) == {"e0": 5}
    finally:
        for opened in (index, other):
            if opened is not None:
                await opened.close()
        cluster.stop()


def test_logged_urls_hide_the_password():
    assert redact_url("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redact_url("redis+cluster://app:s3cret@a:1,b:2/0?x=1") == "redis+cluster://app:***@a:1,b:2/0?x=1"
    assert redact_url("redis://redis:6379/0") == "redis://redis:6379/0"
    assert redact_url("memory://") == "memory://"


@pytest.mark.parametrize("url", [
    "redis+cluster://",
    "redis+cluster://127.0.0.1:7000,:7001",
    "redis+cluster://127.0.0.1:70x0",
])
def test_malformed_cluster_urls_are_refused(url):
    with pytest.raises(ValueError, match="cluster index URL"):
        open_index(url, "m", BS)


async def test_a_cluster_that_does_not_answer_raises_index_unavailable():
    index = open_index(f"redis+cluster://:secret@127.0.0.1:{free_port()},127.0.0.1:{free_port()}", "m", BS)
    with pytest.raises(IndexUnavailableError):
        await index.lookup(chain(2))
    await index.close()
