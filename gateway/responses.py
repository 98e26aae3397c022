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
from gateway.detokenizer import SequenceText
from gateway.run import Choice, Delta, Job, Run
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
    come. Subclasses give the object names and shape one choice (``_choice``) and one delta (``_delta``).

    Shared by both: ``stop_reason`` on each finished choice (the stop string or stop token id, null for
    EOS and length), ``return_token_ids`` (the prompt's and each choice's token ids, vLLM's fields),
    ``stream_options.continuous_usage_stats`` (the usage so far on every chunk)."""

    id_prefix: ClassVar[str]  # of the response id, which is also the engine request id
    object: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(self, tokenizer: Tokenizer, model_name: str):
        self.tokenizer = tokenizer
        self.model_name = model_name

    def json(self, run: Run, req: _Req, created: int) -> dict:
        choices = []
        for c in run.choices:
            choice = self._choice(c, run, req)
            choice["stop_reason"] = c.stop_reason
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return {"id": _response_id(run), "object": self.object, "created": created, "model": self.model_name,
                "choices": choices, "usage": run.usage(), **self._extras(run, req)}

    async def events(self, run: Run, req: _Req, created: int) -> AsyncIterator[str]:
        head = dumps({"id": _response_id(run), "object": self.chunk_object, "created": created,
                      "model": self.model_name})[:-1]
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = req.continuous_usage()

        def tail() -> str:
            if continuous:
                return f',"usage":{dumps(run.usage())}}}\n\n'
            return ',"usage":null}\n\n' if include_usage else "}\n\n"

        for choice in self._opening(run, req):
            yield f'data: {head},"choices":[{dumps(choice)}]{tail()}'
        async for d in run.deltas():
            chunks = self._deltas(d, run, req)
            if d.finish_reason is not None:
                chunks[-1]["stop_reason"] = d.stop_reason
            if req.return_token_ids:
                chunks[0]["token_ids"] = d.token_ids
            for choice in chunks:
                yield f'data: {head},"choices":[{dumps(choice)}]{tail()}'
        if include_usage:
            yield f'data: {head},"choices":[],"usage":{dumps(run.usage())}}}\n\n'
        yield "data: [DONE]\n\n"

    async def finish(self, body: dict, req: _Req) -> None:
        """A non-streamed body is done: nothing is kept (the Responses API stores some)."""

    def _opening(self, run: Run, req: _Req) -> list[dict]:
        """Choices sent before the first delta."""
        return []

    def _extras(self, run: Run, req: _Req) -> dict:
        """Top-level fields of a non-streamed response besides the common ones."""
        return {}

    @abstractmethod
    def _choice(self, c: Choice, run: Run, req: _Req) -> dict: ...

    @abstractmethod
    def _deltas(self, d: Delta, run: Run, req: _Req) -> list[dict]:
        """The chunk choices of one delta (one SSE event each), the finish reason on the last."""

    def _prompt_logprobs(self, job: Job, k: int) -> list[dict | None]:
        """vLLM's prompt_logprobs: null for the first token, then per token its own entry and the top k,
        ``{token id: {logprob, rank, decoded_token}}``."""
        tok = self.tokenizer
        out: list[dict | None] = [None]
        for token_id, lp in zip(job.request.prompt_ids[1:], job.prompt_logprobs):
            entry = {str(tid): {"logprob": _clamp(v), "rank": rank, "decoded_token": tok.token_text(tid)}
                     for rank, (tid, v) in enumerate(lp.top[:k], 1)}
            entry[str(token_id)] = {"logprob": _clamp(lp.logprob), "rank": lp.rank,
                                    "decoded_token": tok.token_text(token_id)}
            out.append(entry)
        return out


class ChatShape(ResponseShape[ChatCompletionRequest]):
    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _opening(self, run: Run, req: ChatCompletionRequest) -> list[dict]:
        # An echo is the first content; with return_token_ids the prompt's ids travel here.
        echo = req.echo_text()
        opening = [{"index": c.index, "delta": {"role": "assistant", "content": echo}, "logprobs": None,
                    "finish_reason": None} for c in run.choices]
        if req.return_token_ids:
            for choice in opening:
                choice["prompt_token_ids"] = run.jobs[0].request.prompt_ids
        return opening

    def _extras(self, run: Run, req: ChatCompletionRequest) -> dict:
        extras: dict[str, Any] = {}
        job = run.jobs[0]
        if req.prompt_logprobs is not None:
            extras["prompt_logprobs"] = self._prompt_logprobs(job, req.prompt_logprobs)
        if req.return_token_ids:
            extras["prompt_token_ids"] = job.request.prompt_ids
        return extras

    def _choice(self, c: Choice, run: Run, req: ChatCompletionRequest) -> dict:
        return {"index": c.index, "message": self._message(c, req.echo_text()),
                "logprobs": {"content": self._logprobs(c.token_ids, c.lp_values)} if run.logprobs else None,
                "finish_reason": c.finish_reason}

    @staticmethod
    def _message(c: Choice, echo: str = "") -> dict:
        out = c.output
        if out is None:
            return {"role": "assistant", "content": echo + c.seq.text}
        content = echo + "".join(out.content)
        calls = out.calls
        message: dict[str, Any] = {"role": "assistant", "content": None if calls and not content.strip() else content}
        if out.reasoning_parser is not None:
            message["reasoning_content"] = "".join(out.reasoning) or None
        if calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}}
                                     for call in calls]
        return message

    def _deltas(self, d: Delta, run: Run, req: ChatCompletionRequest) -> list[dict]:
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
        if run.logprobs:
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
    """With ``echo`` each choice starts with its prompt (decoded from its ids, so that the text offsets
    of its tokens are exact) and, with ``logprobs``, the prompt tokens' logprobs: null for the first,
    then those the engine computed in the prefill."""

    id_prefix = "cmpl-"
    object = chunk_object = "text_completion"

    def _choice(self, c: Choice, run: Run, req: CompletionRequest) -> dict:
        job = run.job_of(c)
        text, logprobs = c.seq.text, None
        if run.logprobs:
            logprobs = self._logprobs(c.token_ids, c.lp_values, c.lp_offsets)
        if req.echo:
            echo, logprobs = self._echo(job, req, logprobs)
            text = echo + text
        choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(job, req.prompt_logprobs)
        if req.return_token_ids:
            choice["prompt_token_ids"] = job.request.prompt_ids
        return choice

    def _deltas(self, d: Delta, run: Run, req: CompletionRequest) -> list[dict]:
        text = d.text
        logprobs = self._logprobs(d.token_ids, d.logprobs, d.offsets) if run.logprobs else None
        choice: dict[str, Any] = {"index": d.index}
        job = run.job_of(run.choices[d.index])
        if d.first:
            if req.echo:
                echo, logprobs = self._echo(job, req, logprobs)
                text = echo + text
            if req.return_token_ids:
                choice["prompt_token_ids"] = job.request.prompt_ids
        elif req.echo and logprobs is not None:
            logprobs["text_offset"] = [o + len(job.echo_text) for o in logprobs["text_offset"]]
        choice.update(text=text, logprobs=logprobs, finish_reason=d.finish_reason)
        return [choice]

    def _echo(self, job: Job, req: CompletionRequest, logprobs: dict | None) -> tuple[str, dict | None]:
        """The prompt's text, and the logprobs with the prompt's before (offsets shifted past it)."""
        prompt = SequenceText(self.tokenizer, [], skip_special_tokens=req.skip_special_tokens)
        offsets = prompt.add(job.request.prompt_ids)
        prompt.finish()
        job.echo_text = prompt.text
        if logprobs is None:
            return prompt.text, None
        tok, k = self.tokenizer, req.logprobs
        ids = job.request.prompt_ids
        prompt_lps = job.prompt_logprobs or []
        shift = len(prompt.text)
        return prompt.text, {
            "tokens": [tok.token_text(t) for t in ids] + logprobs["tokens"],
            "token_logprobs": [None, *(_clamp(lp.logprob) for lp in prompt_lps), *logprobs["token_logprobs"]],
            "top_logprobs": [None, *({**{tok.token_text(tid): _clamp(v) for tid, v in lp.top[:k]},
                                      tok.token_text(t): _clamp(lp.logprob)} for t, lp in zip(ids[1:], prompt_lps)),
                             *logprobs["top_logprobs"]],
            "text_offset": offsets + [o + shift for o in logprobs["text_offset"]],
        }

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
