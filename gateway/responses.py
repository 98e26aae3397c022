"""OpenAI response shapes: a run as a JSON body once it is done, or as SSE events while it goes.

One :class:`ResponseShape` per API (chat, completions) holds its id prefix, JSON and SSE shapes and its
logprob format. :class:`EventStream` sends the SSE events and closes the run however the response ends.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar, Generic, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.protocol import TokenLogprob
from gateway.run import Choice, Delta, Run
from gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.tokenizer import Tokenizer

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM clamp here too
_Req = TypeVar("_Req", bound=SamplingFields)


class EventStream(StreamingResponse):
    """SSE response that always runs ``on_close`` when it ends, also when the client leaves early or
    before the first byte (an async generator that never started would run no ``finally``)."""

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str], on_close: Callable[[], Awaitable[None]]):
        super().__init__(content, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _clamp(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN and -inf


def _response_id(run: Run) -> str:
    """The OpenAI id: the engine request id, without the per-prompt suffix of a batch."""
    request_id = run.jobs[0].request.request_id
    return request_id if len(run.jobs) == 1 else request_id.rsplit("-", 1)[0]


class ResponseShape(ABC, Generic[_Req]):
    """How one API answers: ``json`` reads a collected run, ``events`` reads the run's deltas as they
    come. Subclasses give the object names and shape one choice (``_choice``) and one delta (``_delta``)."""

    id_prefix: ClassVar[str]  # of the response id, which is also the engine request id
    object: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(self, tokenizer: Tokenizer, model_name: str):
        self.tokenizer = tokenizer
        self.model_name = model_name

    def json(self, run: Run, req: _Req, created: int) -> dict:
        return {"id": _response_id(run), "object": self.object, "created": created, "model": self.model_name,
                "choices": [self._choice(c, run.logprobs) for c in run.choices], "usage": run.usage()}

    async def events(self, run: Run, req: _Req, created: int) -> AsyncIterator[str]:
        head = dumps({"id": _response_id(run), "object": self.chunk_object, "created": created,
                      "model": self.model_name})[:-1]
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        tail = ',"usage":null}\n\n' if include_usage else "}\n\n"
        for choice in self._opening(run):
            yield f'data: {head},"choices":[{dumps(choice)}]{tail}'
        async for d in run.deltas():
            for choice in self._deltas(d, run.logprobs):
                yield f'data: {head},"choices":[{dumps(choice)}]{tail}'
        if include_usage:
            yield f'data: {head},"choices":[],"usage":{dumps(run.usage())}}}\n\n'
        yield "data: [DONE]\n\n"

    def _opening(self, run: Run) -> list[dict]:
        """Choices sent before the first delta."""
        return []

    @abstractmethod
    def _choice(self, c: Choice, logprobs: bool) -> dict: ...

    @abstractmethod
    def _deltas(self, d: Delta, logprobs: bool) -> list[dict]:
        """The chunk choices of one delta (one SSE event each), the finish reason on the last."""


class ChatShape(ResponseShape[ChatCompletionRequest]):
    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _opening(self, run: Run) -> list[dict]:
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for c in run.choices]

    def _choice(self, c: Choice, logprobs: bool) -> dict:
        return {"index": c.index, "message": self._message(c),
                "logprobs": {"content": self._logprobs(c.lp_tokens, c.lp_values)} if logprobs else None,
                "finish_reason": c.finish_reason}

    @staticmethod
    def _message(c: Choice) -> dict:
        out = c.output
        if out is None:
            return {"role": "assistant", "content": c.seq.text}
        content = "".join(out.content)
        calls = out.calls
        message: dict[str, Any] = {"role": "assistant", "content": None if calls and not content.strip() else content}
        if out.reasoning_parser is not None:
            message["reasoning_content"] = "".join(out.reasoning) or None
        if calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}}
                                     for call in calls]
        return message

    def _deltas(self, d: Delta, logprobs: bool) -> list[dict]:
        # As OpenAI streams them: reasoning and content apart; a call's id and name first (arguments
        # ""), then its argument chunks, each in a chunk of its own.
        deltas: list[dict] = []
        if d.reasoning:
            deltas.append({"reasoning_content": d.reasoning})
        if d.text:
            deltas.append({"content": d.text})
        for call in d.tool_calls:
            if call.id is not None:
                deltas.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            if call.arguments:
                deltas.append({"tool_calls": [{"index": call.index, "function": {"arguments": call.arguments}}]})
        chunks = [{"index": d.index, "delta": delta, "logprobs": None, "finish_reason": None}
                  for delta in deltas or [{}]]
        if logprobs:
            chunks[0]["logprobs"] = {"content": self._logprobs(d.token_ids, d.logprobs)}
        chunks[-1]["finish_reason"] = d.finish_reason
        return chunks

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob]) -> list[dict]:
        tok = self.tokenizer
        return [
            {"token": tok.token_text(t), "logprob": _clamp(lp.logprob), "bytes": list(tok.token_bytes(t)),
             "top_logprobs": [{"token": tok.token_text(tid), "logprob": _clamp(v), "bytes": list(tok.token_bytes(tid))}
                              for tid, v in lp.top]}
            for t, lp in zip(token_ids, logprobs)
        ]


class CompletionShape(ResponseShape[CompletionRequest]):
    id_prefix = "cmpl-"
    object = chunk_object = "text_completion"

    def _choice(self, c: Choice, logprobs: bool) -> dict:
        return {"index": c.index, "text": c.seq.text,
                "logprobs": self._logprobs(c.lp_tokens, c.lp_values, c.lp_offsets) if logprobs else None,
                "finish_reason": c.finish_reason}

    def _deltas(self, d: Delta, logprobs: bool) -> list[dict]:
        return [{"index": d.index, "text": d.text,
                 "logprobs": self._logprobs(d.token_ids, d.logprobs, d.offsets) if logprobs else None,
                 "finish_reason": d.finish_reason}]

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob], offsets: list[int]) -> dict:
        tok = self.tokenizer
        return {
            "tokens": [tok.token_text(t) for t in token_ids],
            "token_logprobs": [_clamp(lp.logprob) for lp in logprobs],
            # OpenAI's legacy shape: the top alternatives and always the sampled token (k + 1 at most).
            "top_logprobs": [{**{tok.token_text(tid): _clamp(v) for tid, v in lp.top},
                              tok.token_text(t): _clamp(lp.logprob)} for t, lp in zip(token_ids, logprobs)],
            "text_offset": offsets,
        }
