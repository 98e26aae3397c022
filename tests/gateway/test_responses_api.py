"""POST /v1/responses through the official openai SDK against real processes: text and message input,
instructions, streaming events in OpenAI's order (also through the SDK's stream helper), usage, stored
conversations continued by previous_response_id (in one gateway's memory, and in Redis across two
gateways), and, on the real SmolLM2, function tools and text.format json_schema."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import redis
from gw_harness import API_KEYS, Proc, start_gateway
from test_e2e import MODEL, NO_EOS, sync_client

from gateway.response_store import KEY_PREFIX

STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def tokenize(gw: Proc, **body) -> list[int]:
    resp = httpx.post(gw.url + "/tokenize", json=body, headers={"Authorization": f"Bearer {API_KEYS[0]}"})
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def test_text_input_equals_chat_with_instructions(gateway):
    client = sync_client(gateway)
    resp = client.responses.create(model=MODEL, input="Say something.", instructions="You are a test.",
                                   max_output_tokens=6, temperature=0, extra_body=NO_EOS)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0, extra_body=NO_EOS,
        messages=[{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Say something."}])
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.output_tokens == 6 and resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + 6 and resp.instructions == "You are a test."
    assert resp.store is False and resp.previous_response_id is None


def test_message_array_input_and_streamed_events(gateway):
    client = sync_client(gateway)
    args = dict(model=MODEL, max_output_tokens=8, temperature=0, extra_body=NO_EOS,
                input=[{"role": "developer", "content": "Be brief."},
                       {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
                       {"type": "message", "role": "assistant", "content": "Hi."},
                       {"role": "user", "content": "Again"}])
    full = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    types = [e.type for e in events]
    assert types[:5] == STREAM_ORDER and types[-4:] == [*CLOSING, "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.output_text == full.output_text and final.usage.output_tokens == 8
    assert final.id == events[0].response.id and events[-2].item.id == events[2].item.id
    prompt = tokenize(gateway, messages=[{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hello"},
                                         {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again"}])
    assert full.usage.input_tokens == len(prompt)


def test_stream_helper_completes_at_a_stop_string(gateway):
    client = sync_client(gateway)
    text = client.responses.create(model=MODEL, input="Stop", max_output_tokens=12, temperature=0,
                                   extra_body=NO_EOS).output_text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    with client.responses.stream(model=MODEL, input="Stop", max_output_tokens=12, temperature=0,
                                 extra_body={**NO_EOS, "stop": [stop]}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text[:text.index(stop)] == "".join(deltas)


def test_store_and_previous_response_id_in_memory(gateway):
    client = sync_client(gateway)
    first = client.responses.create(model=MODEL, input="Remember this.", store=True, max_output_tokens=4,
                                    temperature=0, extra_body=NO_EOS)
    second = client.responses.create(model=MODEL, input="And now?", previous_response_id=first.id,
                                     instructions="Short.", max_output_tokens=4, temperature=0, extra_body=NO_EOS)
    conversation = [{"role": "user", "content": "Remember this."},
                    {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And now?"}]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == len(tokenize(gateway, messages=[{"role": "system", "content": "Short."},
                                                                        *conversation]))
    # not stored (the default), and unknown: both 404 naming the field
    stateless = client.responses.create(model=MODEL, input="x", max_output_tokens=1, extra_body=NO_EOS)
    for missing in (stateless.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.create(model=MODEL, input="y", previous_response_id=missing, max_output_tokens=1)
        assert err.value.body["param"] == "previous_response_id"


def test_refused_fields_are_named(gateway):
    client = sync_client(gateway)
    for extra in ({"reasoning": {"effort": "low"}}, {"background": True}, {"n": 2}, {"bogus": 1}):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, input="x", extra_body=extra)
        assert err.value.body["param"] == next(iter(extra)), err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=[{"type": "input_image", "image_url": "x"}])
    assert err.value.body["param"].startswith("input")


@pytest.fixture
def redis_db():
    client = redis.Redis(db=13)
    yield client
    client.close()


def test_stored_response_is_shared_by_gateways_through_redis(dummy_engine, tmp_path, redis_db):
    gateways = [start_gateway(tmp_path / f"gw{i}.log", "--engine", dummy_engine.url, "--routing", "least-load",
                              "--index-url", "redis://127.0.0.1:6379/13", "--response-ttl", "60")
                for i in range(2)]
    try:
        a, b = (openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0) for gw in gateways)
        first = a.responses.create(model=MODEL, input="Hello there", store=True, max_output_tokens=3,
                                   temperature=0, extra_body=NO_EOS)
        key = KEY_PREFIX + first.id
        assert 0 < redis_db.pttl(key) <= 60_000
        stored = json.loads(redis_db.get(key))
        assert stored == [{"role": "user", "content": "Hello there"},
                          {"role": "assistant", "content": first.output_text}]
        second = b.responses.create(model=MODEL, input="More", previous_response_id=first.id, max_output_tokens=3,
                                    temperature=0, extra_body=NO_EOS)
        assert second.status == "incomplete" and second.usage.input_tokens > first.usage.total_tokens
        redis_db.delete(key)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(model=MODEL, input="More", previous_response_id=first.id, max_output_tokens=1)
    finally:
        for gw in gateways:
            gw.stop()


WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


@pytest.mark.slow
def test_function_tool_round_trip_on_smollm2(smollm2_gateway):
    client = openai.OpenAI(base_url=smollm2_gateway.url + "/v1", api_key="none", max_retries=0, timeout=120)
    args = dict(input="What is the weather in Paris?", tools=[WEATHER], max_output_tokens=60, temperature=0,
                tool_choice={"type": "function", "name": "get_weather"})
    resp = client.responses.create(**args)
    (call,) = resp.output
    assert resp.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"} and call.call_id
    events = list(client.responses.create(**args, stream=True))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == events[-3].arguments == call.arguments and events[-1].response.output[0].name == "get_weather"
    # the call and its output sent back: the model answers in text
    answer = client.responses.create(
        input=[{"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}],
        tools=[WEATHER], tool_choice="none", max_output_tokens=30, temperature=0)
    assert answer.output[0].type == "message" and answer.output_text


@pytest.mark.slow
def test_text_format_json_schema_on_smollm2(smollm2_gateway):
    client = openai.OpenAI(base_url=smollm2_gateway.url + "/v1", api_key="none", max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "adult": {"type": "boolean"}},
              "required": ["name", "adult"], "additionalProperties": False}
    resp = client.responses.create(input="Invent a person.", max_output_tokens=80, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                    "strict": True}})
    person = json.loads(resp.output_text)
    assert resp.status == "completed" and set(person) == {"name", "adult"} and isinstance(person["adult"], bool)
    assert resp.text.format.type == "json_schema"
