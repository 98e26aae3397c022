"""The boundary between the sidecar's HTTP process and its engine process: an engine process that dies
mid-stream ends every open stream with an error and turns health red; the engine process ends with its
parent, however the parent ends; a request crosses the pipe in its wire form unchanged."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import msgpack
import psutil
import pytest
from test_server import ROOT, free_port, post, wait_ready
from test_tp import spawned_children

from engine.protocol import GenerateRequest, OutputFrame, SamplingParams, StructuredOutput


def start_sidecar(tmp_path) -> tuple[subprocess.Popen, str, psutil.Process]:
    """A tiny sidecar, ready: its process, URL and engine process."""
    port = free_port()
    log_path = tmp_path / "engine.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", "--port", str(port), "--model", "tiny", "--load-format",
             "dummy", "--num-kv-blocks", "128", "--cpu-threads", "1"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, log_path)
    return proc, url, spawned_children(proc.pid)[0]


def gone(process: psutil.Process, timeout_s: float = 10) -> bool:
    """Whether ``process`` ends (or is left a zombie for its new parent to reap) within ``timeout_s``."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_killed_engine_process_ends_every_stream_and_turns_health_red(tmp_path):
    proc, url, engine = start_sidecar(tmp_path)
    try:
        assert httpx.get(f"{url}/stats").json()["cpu_threads"] == 1  # --cpu-threads reached the engine process
        long = [GenerateRequest(f"long-{i}", list(range(5 + i, 40)), SamplingParams(max_tokens=900, ignore_eos=True))
                for i in range(2)]
        with httpx.Client(timeout=60) as client:
            streams = [client.stream("POST", f"{url}/generate", content=r.pack()) for r in long]
            chunks = [s.__enter__().iter_raw() for s in streams]
            unpackers = [msgpack.Unpacker(strict_map_key=False) for _ in long]
            for it, unpacker in zip(chunks, unpackers):
                unpacker.feed(next(it))  # both generating
            engine.send_signal(signal.SIGKILL)
            for it, unpacker in zip(chunks, unpackers):
                for chunk in it:
                    unpacker.feed(chunk)
            for stream in streams:
                stream.__exit__(None, None, None)
        for unpacker in unpackers:
            frames = [OutputFrame.from_wire(m) for m in unpacker]
            assert frames[-1].finish_reason == "error"
            assert frames[-1].error == "engine failed: engine process exited (code -9)"
            assert sum(len(f.token_ids) for f in frames) < 900
        for path in ("/health", "/stats", "/debug/integrity"):
            resp = httpx.get(url + path)
            assert resp.status_code == 503
            assert resp.json()["error"]["message"] == "engine failed: engine process exited (code -9)"
        assert post(url, GenerateRequest("after", [5, 6], SamplingParams(max_tokens=2)).pack()).status_code == 503
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_the_engine_process_ends_with_the_http_process(tmp_path, how):
    proc, _, engine = start_sidecar(tmp_path)
    proc.send_signal(how)
    proc.wait(timeout=30)
    assert gone(engine)
    assert proc.returncode == -how  # uvicorn raises SIGTERM again once it has shut down


PARENT = """
import functools, os, signal, subprocess, sys, time
from engine.parent import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         preexec_fn=functools.partial(die_with_parent, signal.SIGTERM, os.getpid()))
print(child.pid, flush=True)
time.sleep(60)
"""


def test_die_with_parent_ties_a_child_to_its_parent():
    """What a gateway does for the engines it spawns: a child dies with its SIGKILLed parent; and one whose
    parent is already gone (another pid than it was told) exits at once."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait(timeout=10)
    assert gone(child)
    orphan = subprocess.run([sys.executable, "-c", "import signal; from engine.parent import die_with_parent; "
                             "die_with_parent(signal.SIGTERM, 1); print('alive')"], cwd=ROOT, capture_output=True,
                            text=True)
    assert (orphan.returncode, orphan.stdout) == (1, "")


def test_a_request_crosses_the_pipe_unchanged():
    request = GenerateRequest(
        "r", [5, 6, 7], SamplingParams(max_tokens=9, temperature=0.5, seed=-3, stop_token_ids=[4], logprobs=2,
                                       logit_bias={11: -2.5}, structured=StructuredOutput("regex", "[a-z]+")),
        salt="tenant", cache_boundaries=[2],
    )
    wire = msgpack.unpackb(msgpack.packb(request.to_wire()), strict_map_key=False)
    assert GenerateRequest.from_wire(wire) == request
