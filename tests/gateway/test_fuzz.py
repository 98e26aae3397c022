"""Fuzzing from the OpenAPI document (schemathesis, with a key): 500 generated requests, valid and
invalid, against the real gateway; none may answer 500 or more, and no log may hold a traceback.
The longer run is ``python -m loadtest.fuzz --spawn --cases 5000``."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from gw_harness import API_KEYS, TINY_ENGINE_ARGS, Proc, start_engine, start_gateway

from loadtest.fuzz import fuzz


@pytest.fixture(scope="module")
def short_context(tmp_path_factory) -> Iterator[tuple[Proc, Proc]]:
    """A gateway in front of a tiny engine with a 64-token context: valid requests generate little."""
    tmp = tmp_path_factory.mktemp("fuzz")
    engine = start_engine(tmp / "engine.log", *TINY_ENGINE_ARGS, "--max-model-len", "64")
    gw = start_gateway(tmp / "gateway.log", "--engine", engine.url, "--api-key", API_KEYS[0],
                       "--max-sequences-in-flight", "256")
    yield gw, engine
    gw.stop()
    engine.stop()


def test_openapi_states_the_401s_and_the_bounds(gateway):
    assert httpx.get(gateway.url + "/openapi.json").status_code == 401
    doc = httpx.get(gateway.url + "/openapi.json", headers={"Authorization": f"Bearer {API_KEYS[0]}"}).json()
    for path, item in doc["paths"].items():
        for operation in item.values():
            if operation.get("security") != []:
                assert "401" in operation["responses"], path
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    top_k = next(s for s in props["top_k"]["anyOf"] if s.get("type") == "integer")
    assert (top_k["minimum"], top_k["maximum"]) == (-1, 2**31 - 1)
    top_p = next(s for s in props["top_p"]["anyOf"] if s.get("type") == "number")
    assert (top_p["exclusiveMinimum"], top_p["maximum"]) == (0.0, 1.0)
    assert props["n"]["maximum"] == 128 and props["model"]["anyOf"][0]["enum"] == ["tiny"]


def test_500_generated_requests_answer_below_500_without_tracebacks(short_context):
    gateway, engine = short_context
    result = fuzz(gateway.url, API_KEYS[0], cases=500, seed=19, logs=[gateway.log_path, engine.log_path])
    assert result.cases >= 500
    assert result.server_errors == [] and result.tracebacks == 0
    assert result.statuses[200] > 0 and result.statuses[400] > 0  # both valid and invalid ones went through
