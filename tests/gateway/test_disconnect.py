"""A client that goes away aborts its engine request: the engine's running count returns to 0 and all its
KV blocks are free again, for streamed and non-streamed requests, and under a soak of many streams."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
from gw_harness import API_KEYS, Proc, lines_for

LONG = {"model": "tiny", "prompt": "Tell me a very long story.", "max_tokens": 900, "ignore_eos": True}


def engine_stats(engine: Proc) -> dict:
    return httpx.get(engine.url + "/stats").json()


def wait_for(engine: Proc, idle: bool, timeout: float = 10.0) -> float:
    """Seconds until the engine is idle with every block free (or, with idle=False, runs something)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        s = engine_stats(engine)
        is_idle = s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]
        if is_idle == idle:
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"engine not {'idle' if idle else 'busy'} after {timeout}s: {engine_stats(engine)}")


def test_streaming_client_disconnect_aborts_the_engine_request(gateway, dummy_engine):
    wait_for(dummy_engine, idle=True)
    headers = {"Authorization": f"Bearer {API_KEYS[0]}", "X-Request-Id": "disconnect-sse"}
    with httpx.stream("POST", gateway.url + "/v1/completions", json={**LONG, "stream": True}, headers=headers,
                      timeout=30) as resp:
        lines = resp.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        assert engine_stats(dummy_engine)["num_running"] == 1
        closed_at = time.monotonic()
    seconds = wait_for(dummy_engine, idle=True)
    print(f"streamed request aborted {seconds * 1e3:.0f} ms after the client closed")
    (line,) = [x for x in lines_for(gateway, "disconnect-sse") if x.get("event") == "request"]
    assert line["status"] == 200 and line["completion_tokens"] < LONG["max_tokens"]
    assert line["error"] == "the client left before the end; the engine request was aborted"
    engine_line = next(x for x in dummy_engine.log_lines()
                       if x.get("event") == "request" and x.get("request_id") == first["id"])
    assert engine_line["finish_reason"] == "abort"
    assert time.monotonic() - closed_at < 10


def test_non_streaming_client_disconnect_aborts_the_engine_request(gateway, dummy_engine):
    wait_for(dummy_engine, idle=True)
    body = json.dumps(LONG).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEYS[1]}\r\n"
            f"X-Request-Id: disconnect-json\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body)
        wait_for(dummy_engine, idle=False)  # generating; it would take far longer than this test
    seconds = wait_for(dummy_engine, idle=True)
    print(f"non-streamed request aborted {seconds * 1e3:.0f} ms after the client closed")
    (line,) = [x for x in lines_for(gateway, "disconnect-json") if x.get("event") == "request"]
    assert line["status"] == 499 and line["completion_tokens"] < LONG["max_tokens"]
    assert "the client left" in line["error"]


async def test_disconnect_soak_leaks_no_block(gateway, dummy_engine):
    """60 streams, 12 at a time, of which every third is dropped abruptly after a few chunks: every one
    that stays ends whole, the engine ends idle with every block free and its integrity check passes."""
    wait_for(dummy_engine, idle=True)
    headers = {"Authorization": f"Bearer {API_KEYS[0]}"}
    body = {**LONG, "max_tokens": 60, "stream": True, "stream_options": {"include_usage": True}}
    gate = asyncio.Semaphore(12)

    async def one(client: httpx.AsyncClient, i: int) -> str:
        async with gate, client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            chunks, tokens = 0, 0
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    tokens = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", tokens)
                if i % 3 == 0 and chunks == 3:
                    return "dropped"  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":  # a chunk may carry several tokens: the usage counts them
                    return "whole" if tokens == body["max_tokens"] else f"short:{tokens}"
        return "cut"

    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
        outcomes = await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(60))), 120)
    assert outcomes.count("dropped") == 20 and outcomes.count("whole") == 40
    wait_for(dummy_engine, idle=True, timeout=20)
    integrity = httpx.get(dummy_engine.url + "/debug/integrity").json()
    assert integrity["ok"] and integrity["used"] == 0
