"""A choice's text → reasoning, content and tool calls (gateway/run.py's ChoiceOutput) and their OpenAI
shapes (gateway/responses.py), with synthetic engine frames of recorded outputs and the real tokenizer;
the SSE and JSON bodies are also read back by the openai SDK (its stream helper reassembles the calls)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_run import PROMPT, FakeStream

from engine.protocol import GenerateRequest, OutputFrame, SamplingParams
from gateway.detokenizer import SequenceText
from gateway.reasoning import REASONING_PARSERS
from gateway.responses import ChatShape
from gateway.run import Choice, ChoiceOutput, Job, Run
from gateway.schemas import ChatCompletionRequest
from gateway.structured import NamedCall, RequiredCalls
from gateway.tool_parsers import TOOL_PARSERS

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HERMES_TWO_CALLS = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                    '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō 東京"}}\n'
                    '</tool_call>')
EXPECTED_CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tōkyō 東京"})]


def hermes() -> ChoiceOutput:
    return ChoiceOutput(calls=TOOL_PARSERS["hermes"](["get_weather"]))


def make_run(tokenizer, text: str, output: ChoiceOutput, per_frame: int = 1, finish: str = "stop",
             stops: tuple[str, ...] = ()) -> Run:
    """One choice whose engine output is ``text``, ``per_frame`` tokens a frame."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    frames = [OutputFrame("r", 0, ids[k:k + per_frame]) for k in range(0, len(ids), per_frame)]
    frames[-1].finish_reason = finish
    choice = Choice(0, SequenceText(tokenizer, PROMPT, stops), output)
    job = Job(GenerateRequest("chatcmpl-test", PROMPT, SamplingParams()), [choice], open=1, running=1,
              stream=FakeStream(frames))
    return Run([job], [choice], logprobs=False)


def assembled(deltas) -> tuple[str, str, list[tuple[str, dict]], list[str | None]]:
    """What a client puts together from the deltas: reasoning, content, calls, finish reasons."""
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.tool_calls:
            if c.id is not None:
                assert c.index not in calls and c.name  # a call's id and name come once, first
                calls[c.index] = {"id": c.id, "name": c.name, "arguments": ""}
            calls[c.index]["arguments"] += c.arguments
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls.values())
    return ("".join(d.reasoning for d in deltas), "".join(d.text for d in deltas),
            [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
            [d.finish_reason for d in deltas if d.finish_reason])


@pytest.mark.parametrize("per_frame", [1, 2, 3, 1000])
async def test_hermes_calls_split_across_frames_come_out_the_same(tokenizer, per_frame):
    run = make_run(tokenizer, HERMES_TWO_CALLS, hermes(), per_frame)
    deltas = [d async for d in run.deltas()]
    reasoning, content, calls, finishes = assembled(deltas)
    assert reasoning == "" and content.strip() == "Let me check both." and "<tool_call>" not in content
    assert calls == EXPECTED_CALLS and finishes == ["tool_calls"]
    assert run.choices[0].finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in run.choices[0].output.calls] == EXPECTED_CALLS
    assert sum(len(d.token_ids) for d in deltas) == len(tokenizer.encode(HERMES_TWO_CALLS, False))


async def test_collected_choice_has_the_same_calls_and_content(tokenizer):
    run = make_run(tokenizer, HERMES_TWO_CALLS, hermes(), per_frame=2)
    await run.collect()
    message = ChatShape(tokenizer, "tiny")._message(run.choices[0])
    assert message["role"] == "assistant" and message["content"].strip() == "Let me check both."
    assert "reasoning_content" not in message  # no reasoning parser
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("function", *c) for c in EXPECTED_CALLS]
    assert len({c["id"] for c in message["tool_calls"]}) == 2


async def test_only_calls_means_null_content(tokenizer):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    run = make_run(tokenizer, text, hermes())
    await run.collect()
    message = ChatShape(tokenizer, "tiny")._message(run.choices[0])
    assert message["content"] is None and len(message["tool_calls"]) == 1


async def test_a_call_cut_by_max_tokens_is_content_and_the_finish_stays_length(tokenizer):
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    run = make_run(tokenizer, text, hermes(), finish="length")
    deltas = [d async for d in run.deltas()]
    assert "".join(d.text for d in deltas) == text and not any(d.tool_calls for d in deltas)
    assert run.choices[0].finish_reason == "length"


async def test_a_finished_call_with_length_keeps_length(tokenizer):
    run = make_run(tokenizer, HERMES_TWO_CALLS, hermes(), finish="length")
    _, _, calls, finishes = assembled([d async for d in run.deltas()])
    assert calls == EXPECTED_CALLS and finishes == ["length"]


async def test_stop_strings_apply_to_the_raw_text_before_parsing(tokenizer):
    text = HERMES_TWO_CALLS + " STOP and then more"
    run = make_run(tokenizer, text, hermes(), stops=("STOP",))
    _, content, calls, finishes = assembled([d async for d in run.deltas()])
    assert calls == EXPECTED_CALLS and finishes == ["tool_calls"] and "STOP" not in content


async def test_without_parallel_calls_only_the_first_is_kept(tokenizer):
    output = ChoiceOutput(calls=TOOL_PARSERS["hermes"](["get_weather"]), max_calls=1)
    run = make_run(tokenizer, HERMES_TWO_CALLS, output)
    _, _, calls, _ = assembled([d async for d in run.deltas()])
    assert calls == EXPECTED_CALLS[:1] and len(output.calls) == 1


@pytest.mark.parametrize("per_frame", [1, 1000])
async def test_reasoning_then_a_call(tokenizer, per_frame):
    text = ('<think>The user wants the weather; I should call the tool.</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    output = ChoiceOutput(REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"](["get_weather"]))
    run = make_run(tokenizer, text, output, per_frame)
    deltas = [d async for d in run.deltas()]
    reasoning, content, calls, finishes = assembled(deltas)
    assert reasoning == "The user wants the weather; I should call the tool."
    assert content.strip() == "" and calls == EXPECTED_CALLS[:1] and finishes == ["tool_calls"]
    message = ChatShape(tokenizer, "tiny")._message(run.choices[0])
    assert message["reasoning_content"] == reasoning and message["content"] is None


async def test_reasoning_only(tokenizer):
    output = ChoiceOutput(REASONING_PARSERS["qwen3"]())
    run = make_run(tokenizer, "<think>Two plus two.</think>It is 4.", output)
    reasoning, content, calls, finishes = assembled([d async for d in run.deltas()])
    assert (reasoning, content, calls, finishes) == ("Two plus two.", "It is 4.", [], ["stop"])


@pytest.mark.parametrize("per_frame", [1, 1000])
async def test_required_tool_choice_output_becomes_calls(tokenizer, per_frame):
    text = ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_weather", "arguments": {"city": "Tōkyō 東京"}}]')
    run = make_run(tokenizer, text, ChoiceOutput(calls=RequiredCalls()), per_frame)
    deltas = [d async for d in run.deltas()]
    _, content, calls, finishes = assembled(deltas)
    assert content == "" and calls == EXPECTED_CALLS and finishes == ["tool_calls"]
    assert all(d.tool_calls == () for d in deltas[:-1])  # known once the array is complete


async def test_required_output_cut_short_is_content(tokenizer):
    text = '[{"name": "get_weather", "arguments": {"ci'
    run = make_run(tokenizer, text, ChoiceOutput(calls=RequiredCalls()), finish="length")
    _, content, calls, finishes = assembled([d async for d in run.deltas()])
    assert content == text and calls == [] and finishes == ["length"]


@pytest.mark.parametrize("per_frame", [1, 1000])
async def test_named_tool_choice_output_is_the_arguments_streamed_as_they_come(tokenizer, per_frame):
    text = '{"city": "Paris"}'
    output = ChoiceOutput(calls=NamedCall("get_weather"))
    run = make_run(tokenizer, text, output, per_frame)
    deltas = [d async for d in run.deltas()]
    _, content, calls, finishes = assembled(deltas)
    assert content == "" and calls == EXPECTED_CALLS[:1] and finishes == ["tool_calls"]
    pieces = [c for d in deltas for c in d.tool_calls]
    assert pieces[0].name == "get_weather" and all(p.name is None and p.id is None for p in pieces[1:])
    assert output.calls[0].arguments == text  # the raw text: streamed and whole calls are alike


# --- OpenAI shapes ---


def chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


async def test_streamed_chunks_are_shaped_as_openai_sends_them(tokenizer):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    run = make_run(tokenizer, text, hermes(), per_frame=1000)
    events = [e async for e in ChatShape(tokenizer, "tiny").events(run, chat_request(stream=True), 1)]
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert events[-1] == "data: [DONE]\n\n"
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    (first,) = choices[1]["delta"]["tool_calls"]
    call_id = first["id"]
    assert first == {"index": 0, "id": call_id, "type": "function", "function": {"name": "get_weather",
                                                                                  "arguments": ""}}
    pieces = [c["delta"]["tool_calls"] for c in choices[2:]]
    assert all(list(p[0]) == ["index", "function"] and list(p[0]["function"]) == ["arguments"] for p in pieces)
    assert json.loads("".join(p[0]["function"]["arguments"] for p in pieces)) == {"city": "Paris"}
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["tool_calls"]


async def test_reasoning_and_content_are_separate_deltas(tokenizer):
    output = ChoiceOutput(REASONING_PARSERS["qwen3"]())
    run = make_run(tokenizer, "<think>Hmm.</think>Yes.", output, per_frame=1000)
    events = [e async for e in ChatShape(tokenizer, "tiny").events(run, chat_request(stream=True), 1)]
    deltas = [json.loads(e[len("data: "):])["choices"][0]["delta"] for e in events[1:-1]]
    assert deltas == [{"reasoning_content": "Hmm."}, {"content": "Yes."}]


def sdk_client(body_for) -> openai.OpenAI:
    """The openai SDK over a transport that answers each request with ``body_for(request)``."""

    def handle(request: httpx.Request) -> httpx.Response:
        stream = json.loads(request.content).get("stream", False)
        return httpx.Response(200, content=body_for(stream), headers={
            "content-type": "text/event-stream" if stream else "application/json"})

    return openai.OpenAI(base_url="http://gateway.test/v1", api_key="k", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handle)))


async def rendered_bodies(tokenizer, text: str, output_maker, per_frame: int) -> dict[bool, bytes]:
    shape = ChatShape(tokenizer, "tiny")
    streamed = make_run(tokenizer, text, output_maker(), per_frame)
    events = [e async for e in shape.events(streamed, chat_request(stream=True), 1)]
    whole = make_run(tokenizer, text, output_maker(), per_frame)
    await whole.collect()
    return {True: "".join(events).encode(), False: json.dumps(shape.json(whole, chat_request(), 1)).encode()}


@pytest.mark.parametrize("output_maker, text", [
    (hermes, HERMES_TWO_CALLS),
    (lambda: ChoiceOutput(calls=NamedCall("get_weather")), '{"city": "Paris"}'),
    (lambda: ChoiceOutput(calls=RequiredCalls()), '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
])
async def test_sdk_stream_helper_reassembles_the_same_calls_as_non_streaming(tokenizer, output_maker, text):
    bodies = await rendered_bodies(tokenizer, text, output_maker, per_frame=1)
    client = sdk_client(lambda stream: bodies[stream])
    args = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER])
    whole = client.chat.completions.create(**args)
    with client.chat.completions.stream(**args) as stream:
        streamed = stream.get_final_completion()
    for resp in (whole, streamed):
        assert resp.choices[0].finish_reason == "tool_calls"
    calls = [[(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
             for r in (whole, streamed)]
    assert calls[0] == calls[1] and calls[0][0] == EXPECTED_CALLS[0]
