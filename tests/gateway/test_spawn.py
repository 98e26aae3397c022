"""`--spawn-engines`: the gateway starts its engines, fails over when one dies, answers 503 when all are
gone and when its in-flight limit is reached; also --root-path and an open (keyless) API."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from gw_harness import Proc, lines_for, start_gateway


@pytest.fixture(scope="module")
def spawning_gateway(tmp_path_factory) -> Iterator[Proc]:
    gw = start_gateway(
        tmp_path_factory.mktemp("spawn") / "gateway.log", "--spawn-engines", "2", "--model", "tiny",
        "--load-format", "dummy", "--engine-args", "--num-kv-blocks 256", "--max-in-flight", "1",
        "--root-path", "/llm", "--routing", "round-robin",
    )
    _await_all_replicas(gw)
    yield gw
    gw.stop()


def _await_all_replicas(gw: Proc, timeout: float = 120.0) -> None:
    """/ready answers once one replica is up; the round-robin test needs both (the second can lag on a busy box)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replicas = httpx.get(gw.url + "/ready", timeout=5).json()["replicas"]
        if len(replicas) == 2 and set(replicas.values()) == {"ready"}:
            return
        time.sleep(0.2)
    raise AssertionError(f"replicas not all ready after {timeout}s: {replicas}")


def engines_of(gw: Proc) -> list[dict]:
    return [x for x in gw.log_lines() if x.get("event") == "engine_spawned"]


def _alive(pid: int) -> bool:
    """Running, and not a zombie waiting for the gateway to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_open_api_serves_the_spawned_model(spawning_gateway):
    client = openai.OpenAI(base_url=spawning_gateway.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    lines = []
    for _ in range(2):  # round-robin: one request on each engine
        raw = client.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=2,
                                                          extra_body={"ignore_eos": True})
        assert raw.parse().usage.completion_tokens == 2
        # the request's line is written once its answer is done: on a busy box after the client has it
        lines += [x for x in lines_for(spawning_gateway, raw.headers["x-request-id"]) if x.get("event") == "request"]
    assert {x["replica"] for x in lines} == {e["url"] for e in engines_of(spawning_gateway)}
    assert {x["route"] for x in lines} == {"round_robin"}
    assert all("tenant" not in x for x in lines)  # no keys: no tenant, no salt
    for engine in engines_of(spawning_gateway):  # a random token of the gateway's guards each engine
        assert httpx.get(engine["url"] + "/stats").status_code == 401
        assert httpx.get(engine["url"] + "/health").status_code == 200


def test_root_path_shows_in_urls(spawning_gateway):
    resp = httpx.post(spawning_gateway.url + "/v1/nope", json={})
    assert resp.status_code == 404 and "POST /llm/v1/nope" in resp.json()["error"]["message"]


def test_in_flight_limit_answers_503_with_retry_after(spawning_gateway):
    body = {"model": "tiny", "prompt": "long", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", spawning_gateway.url + "/v1/completions", json=body, timeout=30) as busy:
        lines = busy.iter_lines()  # held: dropping the iterator would close the connection
        next(lines)  # the one allowed request is running
        resp = httpx.post(spawning_gateway.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["type"] == "service_unavailable_error"
    client = openai.OpenAI(base_url=spawning_gateway.url + "/v1", api_key="unused", max_retries=0)
    deadline = time.monotonic() + 10
    while True:  # the slot frees once the closed stream is cleaned up
        try:
            client.completions.create(model="tiny", prompt="x", max_tokens=1)
            break
        except openai.InternalServerError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_forwarded_for_is_ignored_without_trusted_proxies(spawning_gateway):
    resp = httpx.get(spawning_gateway.url + "/v1/models", headers={"X-Forwarded-For": "203.0.113.9",
                                                                    "X-Request-Id": "untrusted-xff"})
    assert resp.status_code == 200
    (line,) = lines_for(spawning_gateway, "untrusted-xff")
    assert line["client"] == "127.0.0.1"


def test_engine_dying_mid_stream_ends_it_with_an_error_event_then_done(spawning_gateway):
    body = {"model": "tiny", "prompt": "long", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", spawning_gateway.url + "/v1/completions", json=body, timeout=30) as resp:
        replica = resp.headers["x-kvgate-replica"]
        lines = resp.iter_lines()
        assert next(lines).startswith("data: {")
        (victim,) = [e for e in engines_of(spawning_gateway) if e["url"] == replica]
        os.kill(victim["pid"], signal.SIGKILL)
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"  # the stream still ends as every stream does
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert replica in error["message"]


def test_failover_then_503_when_every_engine_is_gone(spawning_gateway):
    alive = [e for e in engines_of(spawning_gateway) if _alive(e["pid"])]
    assert len(alive) == 1  # the previous test killed the other one
    client = openai.OpenAI(base_url=spawning_gateway.url + "/v1", api_key="unused", max_retries=0)
    for _ in range(3):  # whichever engine round-robin picks, the request lands on the live one
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=1).usage.completion_tokens == 1
    dead = next(e for e in engines_of(spawning_gateway) if e not in alive)
    assert any(x.get("event") == "replica_down" and x["replica"] == dead["url"] for x in spawning_gateway.log_lines())
    os.kill(alive[0]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(alive[0]["pid"]):  # until it has exited its sockets still accept connections, then reset them
        assert time.monotonic() < deadline
        time.sleep(0.05)
    resp = httpx.post(spawning_gateway.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert resp.status_code == 503 and resp.headers["retry-after"] == "5"
    assert resp.json()["error"]["type"] == "service_unavailable_error"
    # The request may have failed on a pooled connection the engine's death reset, which counts one failure
    # without opening the breaker; the next health poll finds the port closed and takes the replica out.
    deadline = time.monotonic() + 5
    while (ready := httpx.get(spawning_gateway.url + "/ready")).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert ready.json()["status"] == "not_ready"
    assert httpx.get(spawning_gateway.url + "/health").status_code == 200  # alive, just not ready
    resp = httpx.post(spawning_gateway.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert resp.status_code == 503 and resp.json()["error"]["message"] == (
        "no engine replica is ready (2 engine replicas, none ready: 2 unreachable); retry later")
