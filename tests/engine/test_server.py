"""The sidecar over real HTTP: streaming frames, bad input, abort and stream close free blocks, the
engine's step timings in /metrics; with the engine in its own process (the default) and in a thread."""

import os
import subprocess
import sys
import time

import httpx
import msgpack
import pytest

from engine.protocol import GenerateRequest, OutputFrame, SamplingParams
from gateway.spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wait_ready(url: str, proc: subprocess.Popen, log_path) -> None:
    """Wait until the sidecar at ``url`` (process ``proc``, logging to ``log_path``) reports healthy."""
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, log_path.read_text()
        time.sleep(0.2)
    raise TimeoutError(log_path.read_text())


@pytest.fixture(scope="module", params=[[], ["--async-scheduling"], ["--no-engine-process"]],
                ids=["sync", "async", "thread"])
def engine_url(tmp_path_factory, request):
    """A tiny sidecar; every test runs against the synchronous loop and the overlapped one in an engine
    process, and the synchronous one in a thread of the HTTP process."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--port", str(port), "--model", "tiny",
         "--load-format", "dummy", "--num-kv-blocks", "64", "--block-size", "16",
         "--max-num-batched-tokens", "64", "--host-kv-cache-gib", "0.001", *request.param],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, log_path)
    yield url
    proc.terminate()
    proc.wait(timeout=10)
    log.close()


def post(url, body: bytes, **kw):
    return httpx.post(f"{url}/generate", content=body, headers={"content-type": "application/x-msgpack"}, **kw)


def frames_of(resp) -> list[OutputFrame]:
    unpacker = msgpack.Unpacker(strict_map_key=False)
    unpacker.feed(resp.content)
    return [OutputFrame.from_wire(m) for m in unpacker]


def wait_idle(url):
    for _ in range(100):
        stats = httpx.get(f"{url}/stats").json()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {stats}")


def assert_all_blocks_free(url):
    stats = wait_idle(url)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    integrity = httpx.get(f"{url}/debug/integrity").json()
    assert integrity["ok"] and integrity["used"] == 0
    host = integrity["host"]  # the host tier's slots, all accounted for
    assert host["used"] == 0 and host["free"] + host["cached"] == stats["num_host_blocks"] > 0


def test_generate_streams_frames_with_counts(engine_url):
    req = GenerateRequest("r1", list(range(100, 140)),
                          SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2))
    resp = post(engine_url, req.pack())
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/x-msgpack"
    frames = frames_of(resp)
    assert sum(len(f.token_ids) for f in frames) == 5
    assert frames[-1].finish_reason == "length"
    assert all(f.num_prompt_tokens == 40 for f in frames)
    assert all(len(lp.top) == 2 for f in frames for lp in f.logprobs)
    # the same prompt again hits the prefix cache: 2 full blocks, then r1's last page (an
    # exact-position entry from token 32 on) up to the one prompt token left to compute
    again = frames_of(post(engine_url, GenerateRequest("r2", req.prompt_ids, req.sampling).pack()))
    assert again[-1].num_cached_tokens == 39
    assert [t for f in again for t in f.token_ids] == [t for f in frames for t in f.token_ids]
    stats = httpx.get(f"{engine_url}/stats").json()
    assert stats["block_size"] == 16 and stats["model"] == "tiny" and stats["prefix_hit_rate"] > 0
    assert "kvgate_engine_generation_tokens_total" in httpx.get(f"{engine_url}/metrics").text


def test_n_sequences_share_the_prompt_cache(engine_url):
    req = GenerateRequest("n3", list(range(200, 250)),
                          SamplingParams(max_tokens=4, temperature=1.0, seed=7, n=3, ignore_eos=True))
    frames = frames_of(post(engine_url, req.pack()))
    by_index = {i: [t for f in frames if f.index == i for t in f.token_ids] for i in range(3)}
    assert all(len(toks) == 4 for toks in by_index.values())
    assert len({tuple(t) for t in by_index.values()}) > 1  # independent samples
    finals = {f.index: f for f in frames if f.finish_reason}
    assert finals[0].num_cached_tokens == 0 and finals[1].num_cached_tokens == 48
    assert_all_blocks_free(engine_url)


BAD_REQUESTS = [
    ({"request_id": "b", "prompt_ids": []}, "prompt_ids"),
    ({"request_id": "b", "prompt_ids": [1, 10**6]}, "prompt_ids"),
    ({"request_id": "b", "prompt_ids": [1, -1]}, "prompt_ids"),
    ({"request_id": "b", "prompt_ids": [1], "sampling": {"max_tokens": 0}}, "max_tokens"),
    ({"request_id": "b", "prompt_ids": [1], "sampling": {"max_tokens": -3}}, "max_tokens"),
    ({"request_id": "b", "prompt_ids": [1] * 1000, "sampling": {"max_tokens": 100}}, "max_tokens"),
    ({"request_id": "b", "prompt_ids": [1], "bogus": 1}, "bogus"),
    ({"request_id": "b", "prompt_ids": [1], "sampling": {"temprature": 1}}, "temprature"),
    ({"request_id": "b", "prompt_ids": "hello"}, "prompt_ids"),
    ({"request_id": "b", "prompt_ids": [1.5]}, "prompt_ids"),
    ({"request_id": "b", "prompt_ids": [1], "sampling": {"temperature": "hot"}}, "temperature"),
    ({"request_id": "b", "prompt_ids": [1], "sampling": {"logprobs": 21}}, "logprobs"),
    ({"request_id": "b", "prompt_ids": [1], "sampling": {"top_p": 0}}, "top_p"),
    ({"request_id": 5, "prompt_ids": [1]}, "request_id"),
    ([1, 2, 3], None),
]


@pytest.mark.parametrize("body,param", BAD_REQUESTS)
def test_bad_requests_get_400_naming_the_problem(engine_url, body, param):
    resp = post(engine_url, msgpack.packb(body))
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == param and error["message"]


def test_malformed_msgpack_is_400_and_engine_keeps_serving(engine_url):
    resp = post(engine_url, b"\xc1\xff not msgpack")
    assert resp.status_code == 400 and "msgpack" in resp.json()["error"]["message"]
    ok = post(engine_url, GenerateRequest("after-bad", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True)).pack())
    assert ok.status_code == 200 and frames_of(ok)[-1].finish_reason == "length"


def test_abort_endpoint_and_stream_close_free_every_block(engine_url):
    long = GenerateRequest("long-1", list(range(300, 340)), SamplingParams(max_tokens=500, ignore_eos=True))
    with httpx.Client() as client:
        with client.stream("POST", f"{engine_url}/generate", content=long.pack()) as resp:
            assert resp.status_code == 200
            next(resp.iter_raw())  # generating now
        # leaving the block closed the connection mid-stream
    assert_all_blocks_free(engine_url)

    aborted = GenerateRequest("long-2", list(range(400, 440)), SamplingParams(max_tokens=500, ignore_eos=True))
    with httpx.Client() as client:
        with client.stream("POST", f"{engine_url}/generate", content=aborted.pack()) as resp:
            it = resp.iter_raw()
            next(it)
            assert httpx.post(f"{engine_url}/abort", json={"request_id": "long-2"}).status_code == 200
            rest = b"".join(it)
    unpacker = msgpack.Unpacker(strict_map_key=False)
    unpacker.feed(rest)
    assert [m["finish_reason"] for m in unpacker][-1] == "abort"
    assert_all_blocks_free(engine_url)
    assert httpx.post(f"{engine_url}/abort", content=b"nope").status_code == 400



def engine_metrics(url) -> dict[str, float]:
    """The unlabelled kvgate_engine_* samples of /metrics."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return {name: float(value) for name, value in (line.split(" ") for line in lines if line.startswith("kvgate_"))}


def test_the_engines_step_timings_and_stats_reach_the_http_side(engine_url):
    before = engine_metrics(engine_url)
    req = GenerateRequest("timed", list(range(500, 520)), SamplingParams(max_tokens=6, ignore_eos=True))
    assert sum(len(f.token_ids) for f in frames_of(post(engine_url, req.pack()))) == 6
    stats = wait_idle(engine_url)
    after = engine_metrics(engine_url)
    steps = after["kvgate_engine_steps_total"] - before["kvgate_engine_steps_total"]
    assert steps >= 6  # a prefill, then a step per token after the first
    assert after["kvgate_engine_step_seconds_count"] - before["kvgate_engine_step_seconds_count"] == steps
    assert after["kvgate_engine_step_seconds_sum"] > before["kvgate_engine_step_seconds_sum"]
    assert after["kvgate_engine_request_queue_time_seconds_count"] == \
        before["kvgate_engine_request_queue_time_seconds_count"] + 1
    assert stats["total_computed_tokens"] >= 20 + 5 and stats["total_busy_seconds"] > 0
