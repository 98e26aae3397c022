"""OpenAI request models (pydantic, strict) and their conversion into engine sampling parameters.

Unknown fields are rejected by name; known OpenAI fields this server does not implement (tools,
response_format other than text, echo, image parts, ...) are rejected by name too, never ignored.
Numeric ranges are checked by :func:`engine.protocol.parse_sampling`, so gateway and engine reject
the same inputs with the same words.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.protocol import ModelLimits, ProtocolError, SamplingParams, parse_sampling
from gateway.errors import APIError

_STRICT = ConfigDict(extra="forbid", strict=True)


def _unsupported(accepted: str = "") -> Any:
    """An OpenAI field this server does not implement: declared so that setting it is a 400 naming it."""
    note = f" (only {accepted} is accepted)" if accepted else ""
    return Field(None, description=f"not supported by this server: setting it is an error{note}")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ContentPart(BaseModel):
    """A part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any = _unsupported()
    tool_call_id: Any = _unsupported()
    function_call: Any = _unsupported()
    audio: Any = _unsupported()
    refusal: Any = _unsupported()


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

    UNSUPPORTED: ClassVar[dict[str, Any]] = {}  # field -> the one non-null value still accepted

    def check_supported(self) -> None:
        for name, allowed in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and value is not False and value != allowed:
                raise APIError(400, f"{name} is not supported by this server", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    def stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        return stops

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
        try:
            return parse_sampling(wire, limits, prompt_len)
        except ProtocolError as exc:
            param = logprobs_param if exc.param == "logprobs" else exc.param
            raise APIError(400, exc.message, param=param) from None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Any = _unsupported()
    tool_choice: Any = _unsupported('"none"')
    parallel_tool_calls: Any = _unsupported()
    functions: Any = _unsupported()
    function_call: Any = _unsupported()
    response_format: Any = _unsupported('{"type": "text"}')
    audio: Any = _unsupported()
    modalities: Any = _unsupported('["text"]')
    prediction: Any = _unsupported()
    reasoning_effort: Any = _unsupported()
    web_search_options: Any = _unsupported()
    store: Any = _unsupported()
    metadata: Any = _unsupported()
    service_tier: Any = _unsupported()

    UNSUPPORTED = {
        "tools": None, "tool_choice": "none", "parallel_tool_calls": None, "functions": None,
        "function_call": None, "response_format": {"type": "text"}, "audio": None, "modalities": ["text"],
        "prediction": None, "reasoning_effort": None, "web_search_options": None, "store": None,
        "metadata": None, "service_tier": None,
    }

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template sees them: text content, developer as system."""
        out = []
        for i, m in enumerate(self.messages):
            for name in ("tool_calls", "tool_call_id", "function_call", "audio", "refusal"):
                if getattr(m, name) is not None:
                    raise APIError(400, f"messages[{i}].{name} is not supported by this server",
                                   param=f"messages[{i}].{name}")
            if m.role == "tool":
                raise APIError(400, "tool messages are not supported by this server", param=f"messages[{i}].role")
            if m.content is None:
                raise APIError(400, f"messages[{i}].content is required", param=f"messages[{i}].content")
            if isinstance(m.content, str):
                text = m.content
            else:
                texts = []
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        raise APIError(400, f"content part type {part.type!r} is not supported (text only)",
                                       param=f"messages[{i}].content[{j}]")
                    texts.append(part.text)
                text = "\n".join(texts)
            message = {"role": "system" if m.role == "developer" else m.role, "content": text}
            if m.name is not None:
                message["name"] = m.name
            out.append(message)
        return out


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: Any = _unsupported()
    best_of: int | None = None
    suffix: Any = _unsupported()

    UNSUPPORTED = {"echo": None, "suffix": None}

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
