"""One engine, two topologies: a gateway that spawned it and a gateway given its URL list the same model
id, the one the engine reports in /stats. The engine runs the default model, whose name differs from its
file's stem; its uvicorn and stdlib lines are JSON like its own."""

from __future__ import annotations

import httpx
import openai
import pytest
from gw_harness import ENGINE_AUTH, ENGINE_TOKEN, Proc, start_gateway

from engine.protocol import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow


def engine_url(gw: Proc) -> str:
    (spawned_line,) = [x for x in gw.log_lines() if x.get("event") == "engine_spawned"]
    return spawned_line["url"]


def model_ids(gw: Proc) -> list[str]:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    return [m.id for m in client.models.list().data]


def test_spawned_and_url_gateways_list_the_engines_name(smollm2_gateway, tmp_path):
    url = engine_url(smollm2_gateway)
    assert httpx.get(url + "/stats", headers=ENGINE_AUTH).json()["model"] == DEFAULT_MODEL_NAME
    by_url = start_gateway(tmp_path / "gateway.log", "--engine", url, env={"KVGATE_ENGINE_TOKEN": ENGINE_TOKEN})
    try:
        assert model_ids(by_url) == model_ids(smollm2_gateway) == [DEFAULT_MODEL_NAME]
    finally:
        by_url.stop()


def test_engine_stdlib_lines_are_json(smollm2_gateway):
    # The spawned engine writes to the gateway's stderr: uvicorn's startup line names the engine's port.
    port = engine_url(smollm2_gateway).rsplit(":", 1)[1]
    lines = smollm2_gateway.log_lines()
    assert [x for x in lines if "raw" in x] == []
    assert any(x.get("logger") == "uvicorn.error" and f":{port}" in x["event"] for x in lines)
