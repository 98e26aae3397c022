"""OpenAI request models (pydantic, strict) and their conversion into engine sampling parameters.

Unknown top-level fields are rejected by name; known OpenAI fields this server does not implement
(legacy functions, audio, image parts, ...) are rejected by name too, never ignored. Inside messages
it is lenient where OpenAI is: ``name``, text content parts and an assistant's ``refusal`` (which
the template does not render) are accepted. Numeric ranges are checked
by :func:`engine.protocol.parse_sampling`, so gateway and engine reject the same inputs with the same
words. Tools, ``tool_choice``, ``response_format`` and vLLM's ``structured_outputs`` become one output
constraint (:mod:`gateway.structured`); whether its grammar compiles is checked by the caller.
"""

from __future__ import annotations

import functools
import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.protocol import ModelLimits, ProtocolError, SamplingParams, StructuredOutput, parse_sampling
from gateway.errors import APIError
from gateway.structured import Constraint, ToolUse, schema_text

_STRICT = ConfigDict(extra="forbid", strict=True)


UNSUPPORTED_NOTE = "not supported by this server"


def _unsupported(accepted: str = "") -> Any:
    """An OpenAI field this server does not implement: declared so that setting it is a 400 naming it."""
    note = f" (only {accepted} is accepted)" if accepted else ""
    return Field(None, description=f"{UNSUPPORTED_NOTE}: setting it is an error{note}")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="usage so far on every chunk (vLLM's extra)")


class ContentPart(BaseModel):
    """A part of a message's content; ``{"type": "text", "text": ...}`` is served, an assistant's
    ``{"type": "refusal", "refusal": ...}`` accepted and not rendered."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None
    refusal: str | None = None


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history."""

    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an answer's reasoning sent back (vLLM): templates may render it
    refusal: str | None = None  # an assistant's refusal sent back: accepted, not rendered
    function_call: Any = _unsupported()
    audio: Any = _unsupported()


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionName


class JSONSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


_VALID = {"json_schema": "a valid JSON schema", "regex": "a supported regular expression",
          "grammar": "a valid EBNF grammar", "choice": "a list of strings"}


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of a JSON schema, a regex, a list of choices or an
    EBNF grammar."""

    model_config = _STRICT
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def constraint(self) -> Constraint:
        given = [(kind, value) for kind, value in (("json_schema", self.json_), ("regex", self.regex),
                                                   ("choice", self.choice), ("grammar", self.grammar))
                 if value is not None]
        if len(given) != 1:
            raise APIError(400, "structured_outputs must set exactly one of json, regex, choice and grammar",
                           param="structured_outputs")
        ((kind, value),) = given
        if kind == "choice" and not value:
            raise APIError(400, "structured_outputs.choice must not be empty", param="structured_outputs")
        if kind == "json_schema":
            spec = value if isinstance(value, str) else schema_text(value)
        else:
            spec = json.dumps(value, ensure_ascii=False) if kind == "choice" else value
        field = "json" if kind == "json_schema" else kind
        return Constraint(StructuredOutput(kind, spec), "structured_outputs",
                          f"structured_outputs.{field} is not {_VALID[kind]}")


class SamplingFields(BaseModel):
    """Fields shared by chat and completions, OpenAI's and the usual vLLM extras."""

    model_config = _STRICT
    model: str | None = Field(None, description="the served model name; default: the only one served")
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: int | None = Field(None, description="logprobs of each prompt token and the top k (vLLM's "
                                        "extra); the engine recomputes a cached prefix to give them")
    return_token_ids: bool = Field(False, description="the prompt's and each choice's token ids in the response")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="keep only the last k prompt tokens "
                                               "(-1: the model's context length)")
    cache_salt: str | None = Field(None, min_length=1, description="KV cache reuse only among requests with the "
                                   "same salt (combined with the API key's, never replacing it)")

    UNSUPPORTED: ClassVar[dict[str, Any]] = {}  # field -> the one non-null value still accepted

    def check_supported(self) -> None:
        for name, allowed in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and value is not False and value != allowed:
                raise APIError(400, f"{name} is not supported by this server", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs is not supported with stream (use echo with logprobs on "
                                "/v1/completions)", param="prompt_logprobs")
        if self.truncate_prompt_tokens == 0:
            raise APIError(400, "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")

    def stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        return stops

    @functools.cached_property
    def constraint(self) -> Constraint | None:
        """The one output constraint the request asks for, if any; 400 for two of them."""
        given = [c for c in self._constraints() if c is not None]
        if len(given) > 1:
            raise APIError(400, f"{given[1].param} cannot be combined with {given[0].param}", param=given[1].param)
        return given[0] if given else None

    def _constraints(self) -> list[Constraint | None]:
        """Every field's constraint, None for the fields that ask for none."""
        return [self.structured_outputs.constraint() if self.structured_outputs is not None else None]

    def grammar_checks(self) -> list[Constraint]:
        """The specs to compile (:func:`gateway.structured.check_grammars`) before the request is sent."""
        return [self.constraint] if self.constraint is not None else []

    def truncated(self, token_ids: list[int], limits: ModelLimits) -> list[int]:
        """The prompt after ``truncate_prompt_tokens`` (its last k tokens)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return token_ids
        return token_ids[-(limits.max_model_len if k == -1 else k):]

    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def engine_prompt_logprobs(self) -> int | None:
        """The prompt logprobs the engine computes (more than ``prompt_logprobs`` for an echo)."""
        return self.prompt_logprobs

    def sampling(self, max_tokens: int | None, logprobs: int | None, prompt_len: int,
                 limits: ModelLimits, logprobs_param: str) -> SamplingParams:
        """Engine sampling parameters; raises 400 for out-of-range values and prompts that do not fit."""
        room = limits.max_model_len - prompt_len
        if room <= 0:
            raise APIError(400, f"the prompt ({prompt_len} tokens) leaves no room in the model's context "
                                f"of {limits.max_model_len} tokens", param="prompt")
        wire: dict[str, Any] = {"max_tokens": room if max_tokens is None else max_tokens, "n": self.n,
                                "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens}
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "top_k",
                     "min_p", "repetition_penalty", "stop_token_ids", "logit_bias"):
            value = getattr(self, name)
            if value is not None:
                wire[name] = value
        if logprobs is not None:
            wire["logprobs"] = logprobs
        if self.engine_prompt_logprobs() is not None:
            wire["prompt_logprobs"] = self.engine_prompt_logprobs()
        constraint = self.constraint
        if constraint is not None:
            wire["structured"] = constraint.structured.to_wire()
        try:
            return parse_sampling(wire, limits, prompt_len)
        except ProtocolError as exc:
            named = {"logprobs": logprobs_param, "structured": constraint.param if constraint else None}
            param = named.get(exc.param, exc.param)
            raise APIError(400, exc.message, param=param) from None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="more variables for the chat template "
                                                        "(vLLM's extra), e.g. enable_thinking")
    add_generation_prompt: bool = Field(True, description="end the prompt with the template's generation prompt")
    continue_final_message: bool = Field(False, description="continue the final (assistant) message instead of "
                                         "starting a new one; needs add_generation_prompt false")
    echo: bool = Field(False, description="start the answer with the final message's content when it is the "
                       "assistant's")
    functions: Any = _unsupported()
    function_call: Any = _unsupported()
    audio: Any = _unsupported()
    modalities: Any = _unsupported('["text"]')
    prediction: Any = _unsupported()
    reasoning_effort: Any = _unsupported()
    web_search_options: Any = _unsupported()
    store: Any = _unsupported()
    metadata: Any = _unsupported()
    service_tier: Any = _unsupported()

    UNSUPPORTED = {
        "functions": None, "function_call": None, "audio": None, "modalities": ["text"], "prediction": None,
        "reasoning_effort": None, "web_search_options": None, "store": None, "metadata": None, "service_tier": None,
    }
    # set by the template call itself: a kwarg of the same name would clash with it
    RESERVED_TEMPLATE_KWARGS: ClassVar[frozenset[str]] = frozenset(
        {"messages", "tools", "documents", "add_generation_prompt"})

    def check_supported(self) -> None:
        super().check_supported()
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt to be false",
                           param="continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message needs the final message to be the assistant's",
                           param="continue_final_message")

    def echo_text(self) -> str:
        """What an echo starts the answer with: the final message's text when it is the assistant's."""
        last = self.messages[-1]
        return _message_text(len(self.messages) - 1, last) if self.echo and last.role == "assistant" else ""

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = self.chat_template_kwargs or {}
        clash = sorted(self.RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if clash:
            raise APIError(400, f"chat_template_kwargs must not set {clash[0]!r}: the server sets it",
                           param="chat_template_kwargs")
        return kwargs

    @functools.cached_property
    def tool_use(self) -> ToolUse:
        """The tools the template renders and what becomes of calls; 400 for a tool_choice the tools
        do not allow. Without a tool_choice: auto with tools, else none (as OpenAI)."""
        tools = tuple(_tool_dict(t) for t in self.tools or ())
        names = [t["function"]["name"] for t in tools]
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise APIError(400, f"tools: the function name {twice!r} is given twice", param="tools")
        choice = self.tool_choice if self.tool_choice is not None else "auto" if tools else "none"
        parallel = self.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not "
                                    "among the tools", param="tool_choice")
            return ToolUse("named", tools, choice.function.name, parallel)
        if choice == "none":
            return ToolUse("none")  # as OpenAI: the model must not call, so it is not shown the tools
        if not tools:
            raise APIError(400, f'tool_choice "{choice}" needs tools', param="tool_choice")
        return ToolUse(choice, tools, parallel=parallel)

    def _constraints(self) -> list[Constraint | None]:
        return [self.tool_use.constraint(), self._response_format_constraint(), *super()._constraints()]

    def _response_format_constraint(self) -> Constraint | None:
        fmt = self.response_format
        if fmt is None:
            return None
        if (fmt.json_schema is None) == (fmt.type == "json_schema"):
            raise APIError(400, "response_format.json_schema is required with type json_schema, and only then",
                           param="response_format")
        if fmt.type == "text":
            return None
        if fmt.type == "json_object" or fmt.json_schema.schema_ is None:
            return Constraint(StructuredOutput("json_object"), "response_format", "response_format is not valid")
        return Constraint(StructuredOutput("json_schema", schema_text(fmt.json_schema.schema_)), "response_format",
                          "response_format.json_schema.schema is not a valid JSON schema")

    def grammar_checks(self) -> list[Constraint]:
        return [*self.tool_use.checks(), *super().grammar_checks()]

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template sees them: text content, developer as system, tool calls with
        their arguments as objects (templates write ``arguments | tojson``)."""
        out = []
        for i, m in enumerate(self.messages):
            for name in ("function_call", "audio"):
                if getattr(m, name) is not None:
                    raise APIError(400, f"messages[{i}].{name} is not supported by this server",
                                   param=f"messages[{i}].{name}")
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                       "content": _message_text(i, m)}
            if m.name is not None:
                message["name"] = m.name
            if (m.role == "tool") != (m.tool_call_id is not None):
                raise APIError(400, f"messages[{i}].tool_call_id is required in tool messages, and only there",
                               param=f"messages[{i}].tool_call_id")
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            for name in ("tool_calls", "reasoning_content", "refusal"):
                if getattr(m, name) is not None and m.role != "assistant":
                    raise APIError(400, f"messages[{i}].{name}: only assistant messages have {name}",
                                   param=f"messages[{i}].{name}")
            if m.tool_calls:
                message["tool_calls"] = [_template_tool_call(f"messages[{i}].tool_calls[{j}]", c)
                                         for j, c in enumerate(m.tool_calls)]
            if m.reasoning_content is not None:
                message["reasoning_content"] = m.reasoning_content
            out.append(message)
        return out


def _tool_dict(tool: Tool) -> dict[str, Any]:
    """An OpenAI tool as the chat template sees it: the fields given, nothing null."""
    f = tool.function
    function = {"name": f.name, **{k: v for k, v in (("description", f.description), ("parameters", f.parameters),
                                                      ("strict", f.strict)) if v is not None}}
    return {"type": "function", "function": function}


def _message_text(i: int, m: ChatMessage) -> str:
    if m.content is None:
        if m.tool_calls or m.refusal is not None:
            return ""  # an assistant message with only calls or a refusal; "" as templates that concatenate need
        raise APIError(400, f"messages[{i}].content is required", param=f"messages[{i}].content")
    if isinstance(m.content, str):
        return m.content
    texts = []
    for j, part in enumerate(m.content):
        if part.type == "refusal" and m.role == "assistant" and part.refusal is not None:
            continue
        if part.type != "text" or part.text is None:
            raise APIError(400, f"content part type {part.type!r} is not supported (text only)",
                           param=f"messages[{i}].content[{j}]")
        texts.append(part.text)
    return "\n".join(texts)


def _template_tool_call(where: str, call: MessageToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise APIError(400, f"{where}.function.arguments is not valid JSON",
                       param=f"{where}.function.arguments") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: Any = _unsupported()

    UNSUPPORTED = {"suffix": None}

    def engine_prompt_logprobs(self) -> int | None:
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported by this server", param="best_of")

    def prompts(self) -> list[str] | list[list[int]]:
        """The batch of prompts: texts, or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            batch: list = [p]
        elif p and isinstance(p[0], int):
            batch = [p]
        else:
            batch = list(p)
        if not batch or any(len(x) == 0 for x in batch):
            raise APIError(400, "prompt must not be empty", param="prompt")
        return batch


_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of content parts",
    "input": "must be a string or a list of input items (messages, function_call, function_call_output, reasoning)",
    "tool_choice": 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
}


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field (``messages[0].content``)."""
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {err['msg']}")
    if err["type"] == "model_type" and not err["loc"]:
        return APIError(400, "request body must be a JSON object")
    param, union_hint = "", None
    for part in err["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper():
            union_hint = _UNION_HINTS.get(param.rsplit(".", 1)[-1].split("[")[0])  # a union member's tag
            break
        else:
            param += f".{part}" if param else part
    if err["type"] == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: {param}", param=param)
    message = union_hint or err["msg"][:1].lower() + err["msg"][1:]
    return APIError(400, f"{param}: {message}", param=param)
