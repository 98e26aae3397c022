"""docker-compose.yml is valid for docker-compose and wires what a deployment needs."""

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


def compose(*args: str, api_keys: str | None = "sk-test") -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail(INSTALL_HINT)
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEYS", "REDIS_URL", "MODEL")}
    if api_keys is not None:
        env["API_KEYS"] = api_keys
    return subprocess.run(
        [binary, "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"), *args],
        capture_output=True, text=True, env=env, timeout=120,
    )


@pytest.mark.parametrize("profile", [[], ["--profile", "proxy"]])
def test_compose_config_is_valid(profile):
    result = compose(*profile, "config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_wires_engines_gateway_and_proxy():
    result = compose("--profile", "proxy", "config")
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert set(services) == {"redis", "engine-0", "engine-1", "gateway", "proxy"}

    def flag(command, name):
        return [command[i + 1] for i, arg in enumerate(command) if arg == name]

    gateway = services["gateway"]
    index_urls = set(flag(gateway["command"], "--index-url"))
    assert index_urls == {"redis://redis:6379/0"}
    assert gateway["environment"]["API_KEYS"] == "sk-test"
    assert "/health" in " ".join(gateway["healthcheck"]["test"])
    device_ids = []
    for name in ("engine-0", "engine-1"):
        engine = services[name]
        assert flag(engine["command"], "--replica-id") == [name]
        assert set(flag(engine["command"], "--index-url")) == index_urls
        assert f"http://{name}:8100" in flag(gateway["command"], "--engine")
        (device,) = engine["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
        device_ids += device["device_ids"]
        assert "/health" in " ".join(engine["healthcheck"]["test"])
        assert engine["depends_on"]["redis"]["condition"] == "service_healthy"
    assert len(set(device_ids)) == 2  # one GPU each

    proxy = services["proxy"]
    assert proxy["profiles"] == ["proxy"]
    assert any(v.endswith(":/etc/nginx/nginx.conf:ro") for v in proxy["volumes"])
    nginx = (ROOT / "deploy" / "nginx.conf").read_text()
    for directive in ("proxy_buffering off", "proxy_http_version 1.1", "proxy_read_timeout 3600s"):
        assert f"{directive};" in nginx


def test_compose_refuses_to_run_without_api_keys():
    result = compose("config", "-q", api_keys=None)
    assert result.returncode != 0
    assert "set API_KEYS" in result.stderr
