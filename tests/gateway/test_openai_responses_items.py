"""The Responses API's output items and events (reasoning, whitespace before calls, content after a
call, an empty answer), the request → chat mapping, and the in-process response store's expiry."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import APIError
from gateway.openai_responses import OutputItems, ResponsesRequest
from gateway.response_store import MemoryResponseStore
from gateway.tool_parsers import ToolCallDelta


def kinds(events: list[dict]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


def test_reasoning_then_text_then_calls():
    items = OutputItems("resp_x")
    events = [*items.reasoning("Let me "), *items.reasoning("think."), *items.content("\n\n"),
              *items.call(ToolCallDelta(0, "call_1", "f", '{"a":')), *items.call(ToolCallDelta(0, arguments=" 1}")),
              *items.call(ToolCallDelta(1, "call_2", "g", "{}")), *items.close(True)]
    assert kinds(events) == [
        "output_item.added", "reasoning_text.delta", "reasoning_text.delta", "reasoning_text.done",
        "output_item.done",
        # the whitespace before the first call opened no message
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done", "output_item.done"]
    reasoning, first, second = items.items
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text",
                                                                          "text": "Let me think."}]
    assert first == {"id": "fc_x_1", "type": "function_call", "status": "completed", "arguments": '{"a": 1}',
                     "call_id": "call_1", "name": "f"}
    assert second["call_id"] == "call_2" and second["arguments"] == "{}"
    assert [e["output_index"] for e in events if "output_index" in e] == [0] * 5 + [1] * 5 + [2] * 4
    assert all(e["item"]["status"] == "in_progress" for e in events if e["type"] == "response.output_item.added")


def test_text_around_a_call_and_incomplete_status():
    items = OutputItems("resp_y")
    events = [*items.content("Sure. "), *items.call(ToolCallDelta(0, "call_1", "f", "{}")), *items.content("Done"),
              *items.close(False)]
    assert kinds(events) == [
        "output_item.added", "content_part.added", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done"]
    message, call, tail = items.items
    assert message["content"][0]["text"] == "Sure. " and message["status"] == "completed"
    assert tail["content"][0]["text"] == "Done" and tail["status"] == "incomplete"  # the length ended it
    assert events[-1]["item"] == tail and call["status"] == "completed"


@pytest.mark.parametrize("text", ["", "  "])
def test_an_answer_of_nothing_is_one_message(text):
    items = OutputItems("resp_z")
    events = [*items.content(text), *items.close(True)]
    (message,) = items.items
    assert message["type"] == "message" and message["content"][0]["text"] == text
    assert kinds(events)[0] == "output_item.added" and kinds(events)[-1] == "output_item.done"


def test_input_items_become_chat_messages():
    req = ResponsesRequest.model_validate({
        "input": [{"role": "user", "content": "Weather?"},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                                         "annotations": []}]},
                  {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "sun"},
                  {"type": "function_call_output", "call_id": "c2", "output": "rain"}],
        "instructions": "Be short.", "max_output_tokens": 9, "temperature": 0.5, "top_k": 3,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}})
    chat = req.chat_request([{"role": "user", "content": "Before"}, {"role": "assistant", "content": "Ok"}])
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user", "assistant", "tool", "tool"]
    assert [c.id for c in chat.messages[4].tool_calls] == ["c1", "c2"] and chat.messages[4].content == "Checking."
    assert chat.max_completion_tokens == 9 and chat.temperature == 0.5 and chat.top_k == 3
    assert chat.response_format.json_schema.name == "x"
    stored = req.stored_conversation([{"role": "assistant", "content": "Sunny"}])
    assert stored[0] == {"role": "user", "content": "Before"} and stored[-1]["content"] == "Sunny"
    assert all(m["role"] != "system" for m in stored)  # instructions are not carried over
    with pytest.raises(APIError) as err:
        ResponsesRequest.model_validate({"input": [{"type": "reasoning"}]}).chat_request(None)
    assert err.value.param == "input"


async def test_memory_store_expires():
    store = MemoryResponseStore(ttl=0.05)
    await store.put("resp_a", [{"role": "user", "content": "x"}])
    assert await store.get("resp_a") == [{"role": "user", "content": "x"}]
    assert await store.get("resp_b") is None
    await asyncio.sleep(0.1)
    assert await store.get("resp_a") is None
