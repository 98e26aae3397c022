"""docker-compose.yml is valid for docker-compose, wires what a deployment needs, and publishes nothing
but nginx: engines and Redis sit on an internal network, behind the engine token and a Redis password."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
INSTALL_HINT = (
    "docker-compose is not installed; install it with "
    "`apt-get update && apt-get install -y --no-install-recommends docker-compose` "
    "(`make test` does this)"
)
SECRETS = {"API_KEYS": "sk-test", "KVGATE_ENGINE_TOKEN": "0123456789abcdef0123456789abcdef",
           "REDIS_PASSWORD": "redis-test-password"}


def compose(*args: str, **overrides: str | None) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail(INSTALL_HINT)
    env = {k: v for k, v in os.environ.items()
           if k not in (*SECRETS, "REDIS_HOST", "REDIS_PORT", "MODEL", "PROXY_PORT")}
    env.update({k: v for k, v in {**SECRETS, **overrides}.items() if v is not None})
    return subprocess.run(
        [binary, "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"), *args],
        capture_output=True, text=True, env=env, timeout=120,
    )


def services() -> dict:
    result = compose("config")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def flag(command, name):
    return [command[i + 1] for i, arg in enumerate(command) if arg == name]


def test_compose_config_is_valid():
    result = compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_wires_engines_gateway_and_proxy():
    config = services()
    services_ = config["services"]
    assert set(services_) == {"redis", "engine-0", "engine-1", "gateway", "proxy"}
    gateway = services_["gateway"]
    index_urls = set(flag(gateway["command"], "--index-url"))
    assert index_urls == {f"redis://:{SECRETS['REDIS_PASSWORD']}@redis:6379/0"}
    assert gateway["environment"]["API_KEYS"] == "sk-test"
    assert "/health" in " ".join(gateway["healthcheck"]["test"])
    device_ids = []
    for name in ("engine-0", "engine-1"):
        engine = services_[name]
        assert flag(engine["command"], "--replica-id") == [name]
        assert set(flag(engine["command"], "--index-url")) == index_urls
        assert f"http://{name}:8100" in flag(gateway["command"], "--engine")
        (device,) = engine["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
        device_ids += device["device_ids"]
        assert "/health" in " ".join(engine["healthcheck"]["test"])
        assert engine["depends_on"]["redis"]["condition"] == "service_healthy"
    assert len(set(device_ids)) == 2  # one GPU each

    proxy = services_["proxy"]
    assert any(v.endswith(":/etc/nginx/nginx.conf:ro") for v in proxy["volumes"])
    nginx = (ROOT / "deploy" / "nginx.conf").read_text()
    for directive in ("proxy_buffering off", "proxy_http_version 1.1", "proxy_read_timeout 3600s",
                      "client_header_timeout 10s", "client_body_timeout 60s"):
        assert f"{directive};" in nginx


def test_only_nginx_is_published_and_the_backend_is_internal():
    config = services()
    published = {name: s.get("ports") for name, s in config["services"].items() if s.get("ports")}
    assert list(published) == ["proxy"]
    assert config["networks"]["backend"]["internal"] is True
    for name in ("redis", "engine-0", "engine-1"):
        assert set(config["services"][name]["networks"]) == {"backend"}
    assert set(config["services"]["gateway"]["networks"]) == {"backend", "frontend"}
    assert set(config["services"]["proxy"]["networks"]) == {"frontend"}


def test_engines_want_the_token_and_redis_a_password():
    svc = services()["services"]
    for name in ("engine-0", "engine-1", "gateway"):
        assert svc[name]["environment"]["KVGATE_ENGINE_TOKEN"] == SECRETS["KVGATE_ENGINE_TOKEN"]
    assert flag(svc["redis"]["command"], "--requirepass") == [SECRETS["REDIS_PASSWORD"]]
    assert svc["redis"]["environment"]["REDISCLI_AUTH"] == SECRETS["REDIS_PASSWORD"]


@pytest.mark.parametrize("missing", ["API_KEYS", "KVGATE_ENGINE_TOKEN", "REDIS_PASSWORD"])
def test_compose_refuses_to_run_without_its_secrets(missing):
    result = compose("config", "-q", **{missing: None})
    assert result.returncode != 0
    assert f"set {missing}" in result.stderr
