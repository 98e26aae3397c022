"""The Responses API, ``POST /v1/responses``, served by the chat path.

A request becomes a chat completion request (:meth:`ResponsesRequest.chat_request`): ``instructions`` a
system message, ``input`` a user message (text) or the messages, function calls and their outputs it
lists, function ``tools`` and ``tool_choice`` as chat's, ``text.format`` as ``response_format``,
``max_output_tokens`` as ``max_completion_tokens``, and the sampling fields chat shares as they are. The
answer is told as output items (reasoning, a message of ``output_text``, function calls), built by one
:class:`OutputItems` for both the JSON body and the SSE events, which come in OpenAI's order:
``response.created``, ``response.in_progress``, per item ``output_item.added`` … its deltas … ``done``,
then ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it).

Stateless unless ``store`` is true: then the conversation (input without the instructions, and the
answer) is kept in the response store (:mod:`gateway.response_store`) and a later request continues it
with ``previous_response_id`` (404 when unknown or expired). As OpenAI, instructions and tools are not
carried over.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from gateway.errors import APIError
from gateway.response_store import ResponseStore
from gateway.responses import dumps
from gateway.run import Run
from gateway.schemas import ChatCompletionRequest, SamplingFields, _unsupported, validation_error
from gateway.tool_parsers import ToolCallDelta

_STRICT = ConfigDict(extra="forbid", strict=True)


class InputContent(BaseModel):
    """A text part of an input message; an output message sent back has ``output_text`` parts."""

    model_config = _STRICT
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # of output_text sent back: not rendered
    logprobs: list[Any] | None = None


class MessageItem(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputContent]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(BaseModel):
    """A reasoning item sent back: accepted, not rendered (as chat's templates mostly drop it)."""

    model_config = _STRICT
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = FunctionCallItem | FunctionCallOutputItem | ReasoningItem | MessageItem


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _STRICT
    format: TextFormat | None = None
    verbosity: Any = _unsupported()


_ROLE = {"developer": "system"}


class ResponsesRequest(SamplingFields):
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool = Field(False, description="keep the conversation for previous_response_id (default: stateless)")
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: Any = _unsupported()
    include: Any = _unsupported()
    background: Any = _unsupported()
    prompt: Any = _unsupported()
    service_tier: Any = _unsupported()
    top_logprobs: Any = _unsupported()
    prompt_cache_key: Any = _unsupported()
    safety_identifier: Any = _unsupported()
    max_tool_calls: Any = _unsupported()
    conversation: Any = _unsupported()
    stream_options: Any = _unsupported()

    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        name: None for name in ("reasoning", "include", "background", "prompt", "service_tier", "top_logprobs",
                                "prompt_cache_key", "safety_identifier", "max_tool_calls", "conversation",
                                "stream_options", "prompt_logprobs", "return_token_ids")
    } | {"n": 1}
    _conversation: list[dict[str, Any]] = PrivateAttr(default_factory=list)

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages: calls join the assistant message before them, outputs become tool
        messages, reasoning items are dropped."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
                out.append({"role": _ROLE.get(item.role, item.role), "content": content})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        if not out:
            raise APIError(400, "input holds no message", param="input")
        return out

    def chat_request(self, previous: list[dict[str, Any]] | None) -> ChatCompletionRequest:
        """The chat completion request this one is; keeps the conversation for :meth:`stored_conversation`."""
        self._conversation = [*(previous or []), *self.input_messages()]
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        shared = {name: getattr(self, name) for name in self.model_fields_set & SamplingFields.model_fields.keys()}
        chat: dict[str, Any] = {**shared, "messages": messages + self._conversation,
                                "max_completion_tokens": self.max_output_tokens}
        if self.tools is not None:
            chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                           "function": {"name": choice.name}}
        if self.parallel_tool_calls is not None:
            chat["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = self.text.format if self.text is not None else None
        if fmt is not None:
            chat["response_format"] = self._response_format(fmt)
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as exc:
            raise validation_error(exc) from None

    @staticmethod
    def _response_format(fmt: TextFormat) -> dict[str, Any]:
        if fmt.type != "json_schema":
            return {"type": fmt.type}
        if fmt.name is None or fmt.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs a name and a schema", param="text.format")
        spec = {"name": fmt.name, "schema": fmt.schema_}
        spec.update({k: v for k, v in (("description", fmt.description), ("strict", fmt.strict)) if v is not None})
        return {"type": "json_schema", "json_schema": spec}

    def stored_conversation(self, answer: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What a stored response keeps: the conversation through this input, then the answer."""
        return [*self._conversation, *answer]


class OutputItems:
    """One answer's output items as they grow, and the stream events that tell each step.

    Content that is only whitespace waits: before a function call it is dropped (as chat's content
    becomes null), otherwise it opens the message. A new kind of item closes the open one."""

    def __init__(self, response_id: str):
        self._base = response_id.removeprefix("resp_")
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._pending = ""
        self._calls: dict[int, dict[str, Any]] = {}  # a choice's call index -> its item

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = self._start("reasoning") if self._kind() != "reasoning" else []
        item = self._open
        item["content"][0]["text"] += text
        return [*events, {"type": "response.reasoning_text.delta", "item_id": item["id"],
                          "output_index": len(self.items) - 1, "content_index": 0, "delta": text}]

    def content(self, text: str) -> list[dict[str, Any]]:
        if self._kind() != "message":
            self._pending += text
            if not self._pending.strip():
                return []
            text, self._pending = self._pending, ""
            events = self._start("message")
        else:
            events = []
        item = self._open
        item["content"][0]["text"] += text
        return [*events, {"type": "response.output_text.delta", "item_id": item["id"],
                          "output_index": len(self.items) - 1, "content_index": 0, "delta": text, "logprobs": []}]

    def call(self, delta: ToolCallDelta) -> list[dict[str, Any]]:
        events = []
        if delta.id is not None:
            self._pending = ""
            events = self._start("function_call", call_id=delta.id, name=delta.name)
            self._calls[delta.index] = self._open
        item = self._calls[delta.index]
        if not delta.arguments:
            return events
        item["arguments"] += delta.arguments
        return [*events, {"type": "response.function_call_arguments.delta", "item_id": item["id"],
                          "output_index": self.items.index(item), "delta": delta.arguments}]

    def close(self, complete: bool) -> list[dict[str, Any]]:
        """Close the open item; with no item at all, first a message of the waiting text (maybe "")."""
        events: list[dict[str, Any]] = []
        if not self.items:
            text, self._pending = self._pending, ""
            events = self._start("message")
            if text:
                events += self.content(text)
        return [*events, *self._close("completed" if complete else "incomplete")]

    def _kind(self) -> str | None:
        return self._open["type"] if self._open is not None else None

    def _start(self, kind: str, **fields: Any) -> list[dict[str, Any]]:
        events = self._close("completed")
        n = len(self.items)
        if kind == "message":
            item = {"id": f"msg_{self._base}_{n}", "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
        elif kind == "reasoning":
            item = {"id": f"rs_{self._base}_{n}", "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
        else:
            item = {"id": f"fc_{self._base}_{n}", "type": "function_call", "status": "in_progress", "arguments": "",
                    **fields}
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": n, "item": _copy(item)})
        self._open = item
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": n,
                           "content_index": 0, "part": _copy(part)})
        elif kind == "reasoning":
            item["content"].append({"type": "reasoning_text", "text": ""})
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        n = self.items.index(item)
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": n,
                        "content_index": 0, "text": part["text"], "logprobs": []},
                       {"type": "response.content_part.done", "item_id": item["id"], "output_index": n,
                        "content_index": 0, "part": _copy(part)}]
        elif item["type"] == "reasoning":
            events.append({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": n,
                           "content_index": 0, "text": item["content"][0]["text"]})
        else:
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": n, "name": item["name"], "arguments": item["arguments"]})
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": n, "item": _copy(item)})
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {k: [dict(p) for p in v] if k == "content" else v for k, v in item.items()}


class ResponsesShape:
    """The Responses API's JSON body and SSE events of a run (one choice), and the storing of what
    ``store`` asks to keep."""

    id_prefix: ClassVar[str] = "resp_"

    def __init__(self, model_name: str, store: ResponseStore):
        self.model_name = model_name
        self.store = store

    def json(self, run: Run, req: ResponsesRequest, created: int) -> dict[str, Any]:
        (choice,) = run.choices
        items = OutputItems(_id(run))
        out = choice.output
        if out is not None and out.reasoning_parser is not None:
            items.reasoning("".join(out.reasoning))
        items.content("".join(out.content) if out is not None else choice.seq.text)
        for i, call in enumerate(out.calls if out is not None else ()):
            items.call(ToolCallDelta(i, call.id, call.name, call.arguments))
        items.close(choice.finish_reason != "length")
        return self._response(run, req, created, choice.finish_reason, items.items)

    async def finish(self, body: dict[str, Any], req: ResponsesRequest) -> None:
        """Store the conversation when asked (before the answer is sent, so it can be continued at once)."""
        if req.store:
            await self.store.put(body["id"], req.stored_conversation(_answer_messages(body["output"])))

    async def events(self, run: Run, req: ResponsesRequest, created: int) -> AsyncIterator[str]:
        number = 0

        def event(data: dict[str, Any]) -> str:
            nonlocal number
            number += 1
            return f"event: {data['type']}\ndata: {dumps({**data, 'sequence_number': number - 1})}\n\n"

        started = self._response(run, req, created, None, [])
        yield event({"type": "response.created", "response": started})
        yield event({"type": "response.in_progress", "response": started})
        items = OutputItems(_id(run))
        finish = None
        async for d in run.deltas():
            for data in [*items.reasoning(d.reasoning), *items.content(d.text),
                         *(e for call in d.tool_calls for e in items.call(call))]:
                yield event(data)
            finish = d.finish_reason or finish
        for data in items.close(finish != "length"):
            yield event(data)
        body = self._response(run, req, created, finish, items.items)
        await self.finish(body, req)
        yield event({"type": f"response.{body['status']}", "response": body})

    def _response(self, run: Run, req: ResponsesRequest, created: int, finish: str | None,
                  output: list[dict[str, Any]]) -> dict[str, Any]:
        """The response object; ``finish`` None while it runs."""
        status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
        usage = None
        if finish is not None:
            u = run.usage()
            usage = {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
                     "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u["total_tokens"]}
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        choice = req.tool_choice
        return {
            "id": _id(run), "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model_name,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "store": req.store,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()], "truncation": "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata or {},
        }


def _id(run: Run) -> str:
    return run.jobs[0].request.request_id


def _answer_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An answer's output items as the chat messages a later turn's template renders."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in output:
        if item["type"] == "message":
            message["content"] = (message["content"] or "") + item["content"][0]["text"]
        elif item["type"] == "reasoning":
            message["reasoning_content"] = item["content"][0]["text"]
        else:
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    if message["content"] is None and "tool_calls" not in message:
        message["content"] = ""
    return [message]

