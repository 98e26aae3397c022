"""Per-key rate limits: token buckets in memory and in a real Redis (shared by two gateways), the key
file's per-key limits, and its reload without a restart."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest
import redis
from gw_harness import start_gateway

from gateway.ratelimit import BUCKET_PREFIX, MemoryBuckets, RedisBuckets, tenant_id

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def bucket_name():
    name = "test-" + secrets.token_hex(6)
    yield name
    redis.Redis.from_url(REDIS_URL).delete(BUCKET_PREFIX + name)


@pytest.mark.parametrize("make", [MemoryBuckets, lambda: RedisBuckets(REDIS_URL)], ids=["memory", "redis"])
async def test_a_bucket_takes_while_it_holds_enough_then_says_how_long_to_wait(make, bucket_name):
    buckets = make()
    try:
        assert await buckets.take(bucket_name, 1.0, 2.0, 1, 1) == 0  # full: 2 tokens
        assert await buckets.take(bucket_name, 1.0, 2.0, 1, 1) == 0
        wait = await buckets.take(bucket_name, 1.0, 2.0, 1, 1)
        assert 0.5 < wait <= 1.0  # one token refills in a second
        assert await buckets.take(bucket_name, 1.0, 2.0, 5, -float("inf")) == 0  # a forced charge: into debt
        assert await buckets.take(bucket_name, 1.0, 2.0, 1, 1) > 5
    finally:
        await buckets.close()


async def test_two_clients_share_one_redis_bucket(bucket_name):
    a, b = RedisBuckets(REDIS_URL), RedisBuckets(REDIS_URL)
    try:
        assert await a.take(bucket_name, 0.1, 1.0, 1, 1) == 0
        assert await b.take(bucket_name, 0.1, 1.0, 1, 1) > 0  # the other gateway took the only token
    finally:
        await a.close()
        await b.close()


def test_limits_per_key_shared_by_gateways_and_a_reloaded_key_file(dummy_engine, tmp_path):
    slow, heavy, new = (f"sk-{name}-{secrets.token_hex(4)}" for name in ("slow", "heavy", "new"))
    key_file = tmp_path / "keys"
    key_file.write_text(f"{slow} rps=0.2\n{heavy} tpm=60\n")
    args = ["--engine", dummy_engine.url, "--api-key-file", str(key_file), "--rate-limit-url", REDIS_URL]
    gateways = [start_gateway(tmp_path / f"gw{i}.log", *args) for i in range(2)]
    try:
        def post(gw, key, **body):
            return httpx.post(gw.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                              json={"prompt": "hello there", "max_tokens": 1, **body})

        assert post(gateways[0], slow).status_code == 200
        refused = post(gateways[1], slow)  # the bucket is shared: the other gateway refuses
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        # tokens: prompt and completion tokens are charged; 40 of a 60-token bucket, then the rest is debt
        assert post(gateways[0], heavy, max_tokens=40, ignore_eos=True).status_code == 200
        assert post(gateways[1], heavy, max_tokens=40, ignore_eos=True).status_code == 200
        assert post(gateways[0], heavy).status_code == 429

        assert post(gateways[0], new).status_code == 401
        key_file.write_text(f"{new}\n")  # slow and heavy are revoked, new is accepted, without a restart
        deadline = time.monotonic() + 10
        while post(gateways[0], new).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert post(gateways[0], slow).status_code == 401
    finally:
        for gw in gateways:
            gw.stop()
        redis.Redis.from_url(REDIS_URL).delete(*(f"{BUCKET_PREFIX}{tenant_id(k)}:{kind}"
                                                  for k in (slow, heavy) for kind in ("rps", "tpm")))
    assert any(x.get("event") == "api_key_file_reloaded" for x in gateways[0].log_lines())
