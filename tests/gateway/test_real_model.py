"""The real SmolLM2-135M-Instruct behind the gateway, which spawned its engine with the default model as
`make run` does (the suite's shared SmolLM2 gateway): the answer must make sense. Shutdown must stop the
spawned engine."""

from __future__ import annotations

import os

import openai
import pytest
from gw_harness import start_gateway

pytestmark = pytest.mark.slow

QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


def test_chat_gives_a_sensible_answer(smollm2_gateway):
    client = openai.OpenAI(base_url=smollm2_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=24,
                                          temperature=0)
    answer = resp.choices[0].message.content
    assert "Paris" in answer, answer
    assert resp.choices[0].finish_reason in ("stop", "length")


async def test_streamed_answer_matches(smollm2_gateway):
    client = openai.AsyncOpenAI(base_url=smollm2_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    full = await client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=24,
                                                temperature=0)
    text = ""
    async for chunk in await client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION,
                                                            max_tokens=24, temperature=0, stream=True):
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert text == full.choices[0].message.content
    await client.close()


def test_shutdown_stops_the_spawned_engine(tmp_path):
    gw = start_gateway(tmp_path / "gateway.log", "--spawn-engines", "1", "--model", "tiny", "--load-format", "dummy")
    (spawned,) = [x for x in gw.log_lines() if x.get("event") == "engine_spawned"]
    gw.stop()
    assert gw.proc.returncode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(spawned["pid"], 0)
