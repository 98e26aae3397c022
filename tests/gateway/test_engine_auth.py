"""Engine authentication end to end: an engine with a token answers nothing but /health without it, a
gateway given the token file serves through it, and an engine refuses to listen beyond loopback without one."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator

import httpx
import msgpack
import pytest
from gw_harness import API_KEYS, ROOT, TINY_ENGINE_ARGS, Proc, start_engine, start_gateway

from engine.protocol import MSGPACK, GenerateRequest, SamplingParams
from engine.server import Sidecar
from gateway.middleware import SaltKey
from gateway.ratelimit import tenant_id

TOKEN = secrets.token_hex(32)


@pytest.fixture(scope="module")
def token_engine(tmp_path_factory) -> Iterator[Proc]:
    engine = start_engine(tmp_path_factory.mktemp("auth-engine") / "engine.log", *TINY_ENGINE_ARGS,
                          env={"KVGATE_ENGINE_TOKEN": TOKEN})
    yield engine
    engine.stop()


def engine_paths() -> list[tuple[str, str]]:
    """Every route of the sidecar, and one that does not exist."""
    routes = Sidecar.routes(Sidecar.__new__(Sidecar))
    return [(sorted(r.methods - {"HEAD"})[0], r.path) for r in routes] + [("GET", "/no-such-path")]


@pytest.mark.parametrize("auth", [None, "Bearer wrong-token", f"Basic {TOKEN}", TOKEN],
                         ids=["none", "wrong", "basic", "bare"])
def test_no_endpoint_but_health_answers_without_the_token(token_engine, auth):
    headers = {"authorization": auth} if auth is not None else {}
    for method, path in engine_paths():
        resp = httpx.request(method, token_engine.url + path, headers=headers, content=b"\x80")
        if path == "/health":
            assert resp.status_code == 200
        else:
            assert resp.status_code == 401, (method, path, resp.status_code)
            assert "engine token" in resp.json()["error"]["message"]


def test_the_token_opens_every_endpoint(token_engine):
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.get(token_engine.url + "/stats", headers=auth).status_code == 200
    req = GenerateRequest("auth-1", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    resp = httpx.post(token_engine.url + "/generate", content=req.pack(),
                      headers={**auth, "content-type": MSGPACK})
    unpacker = msgpack.Unpacker(strict_map_key=False)
    unpacker.feed(resp.content)
    assert resp.status_code == 200 and [m["finish_reason"] for m in unpacker][-1] == "length"


def test_a_gateway_with_the_token_file_serves_and_salts_with_the_secret(token_engine, tmp_path):
    token_file = tmp_path / "engine-token"
    token_file.write_text(TOKEN + "\n")
    gw = start_gateway(tmp_path / "gateway.log", "--engine", token_engine.url, "--api-key", API_KEYS[0],
                       "--engine-token-file", str(token_file))
    try:
        resp = httpx.post(gw.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                          headers={"Authorization": f"Bearer {API_KEYS[0]}"}, timeout=30)
        assert resp.status_code == 200
    finally:
        gw.stop()
    log = gw.log_path.read_text()
    assert TOKEN not in log  # the secret is never logged
    tenant = tenant_id(API_KEYS[0])
    salt = SaltKey(TOKEN).salt(tenant)
    assert tenant in log and salt not in log and salt != SaltKey(None).salt(tenant)


def run_engine_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "serve", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", **(env or {})})


def test_engine_refuses_a_public_address_without_a_token():
    result = run_engine_cli("--host", "0.0.0.0", *TINY_ENGINE_ARGS)
    assert result.returncode == 2 and "--engine-token-file" in result.stderr


def test_engine_refuses_a_weak_token(tmp_path):
    result = run_engine_cli("--host", "0.0.0.0", *TINY_ENGINE_ARGS, env={"KVGATE_ENGINE_TOKEN": "short"})
    assert result.returncode == 2 and "at least 16 characters" in result.stderr
