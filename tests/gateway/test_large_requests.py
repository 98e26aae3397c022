"""Large requests neither block nor bloat the gateway: a 6 MB system prompt is refused before it is
rendered (it cannot fit the context), other requests and streams go on meanwhile, and ten of them leave
the process's memory where it was. (How long the event loop stalls is measured by
benchmarks/loop_stall.py.)"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import psutil
import pytest
from gw_harness import API_KEYS, Proc, start_gateway

AUTH = {"Authorization": f"Bearer {API_KEYS[0]}"}
SIX_MB = 6 * 1024 * 1024


@pytest.fixture(scope="module")
def roomy_gateway(dummy_engine, tmp_path_factory) -> Iterator[Proc]:
    gw = start_gateway(tmp_path_factory.mktemp("large") / "gateway.log", "--engine", dummy_engine.url,
                       "--api-key", API_KEYS[0], "--max-body-bytes", str(8 * 1024 * 1024), "--max-messages", "64")
    yield gw
    gw.stop()


def big_chat() -> dict:
    return {"messages": [{"role": "system", "content": "x" * SIX_MB}, {"role": "user", "content": "hi"}],
            "max_tokens": 4}


def test_six_mb_prompts_are_refused_before_rendering_while_a_stream_goes_on(roomy_gateway):
    rss = psutil.Process(roomy_gateway.proc.pid).memory_info().rss
    chunks = []

    def stream() -> None:
        body = {"prompt": "a stream", "max_tokens": 300, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", roomy_gateway.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            chunks.extend(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))

    reader = threading.Thread(target=stream)
    reader.start()
    with httpx.Client(base_url=roomy_gateway.url, headers=AUTH, timeout=60) as client:
        for _ in range(10):
            resp = client.post("/v1/chat/completions", json=big_chat())
            assert resp.status_code == 400
            error = resp.json()["error"]
            assert error["param"] == "messages" and "more than the model's context" in error["message"]
            assert client.get("/health").status_code == 200
    reader.join(120)
    assert chunks[-1]["usage"]["completion_tokens"] == 300  # the stream was served whole alongside
    assert psutil.Process(roomy_gateway.proc.pid).memory_info().rss - rss < 100 * 1024 * 1024
    assert "Traceback" not in roomy_gateway.log_path.read_text()


def test_too_many_messages_are_refused(roomy_gateway):
    messages = [{"role": "user", "content": "hi"}] * 65
    resp = httpx.post(roomy_gateway.url + "/v1/chat/completions", json={"messages": messages}, headers=AUTH)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    assert "at most 64" in resp.json()["error"]["message"]
