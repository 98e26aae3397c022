"""The OpenAI generation endpoints: request → engine requests → JSON or SSE.

One OpenAI request becomes one engine request (a *job*) per prompt, with n sequences each
(``sampling.n``). Each sequence is a *choice*: its frames go through incremental detokenization and
stop strings (:class:`SequenceText`). A choice that hit a stop string ignores its later frames; when
every choice of a job is done its stream is closed, which aborts what the engine still runs for it.
Engine streams are opened before the response starts, so routing failures are plain HTTP errors;
whatever happens afterwards, :meth:`Serving._finish` closes them exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import anyio
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.protocol import GenerateRequest, OutputFrame, SamplingParams, TokenLogprob
from gateway.config import GatewayConfig
from gateway.detokenizer import SequenceText
from gateway.dispatch import Dispatcher, NoReplicaAvailable, RoutedStream
from gateway.engine_client import EngineFailed, EngineRejected
from gateway.errors import APIError, overloaded, record_of
from gateway.metrics import GatewayMetrics
from gateway.middleware import RequestRecord
from gateway.replica import ModelInfo
from gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields, validation_error
from gateway.tokenizer import Tokenizer

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM clamp here too
RETRY_AFTER_BUSY = 1
RETRY_AFTER_NO_ENGINE = 5
_Req = TypeVar("_Req", bound=SamplingFields)


class Delta(NamedTuple):
    """What one engine frame added to one choice."""

    index: int
    text: str
    token_ids: list[int]  # the tokens consumed (none after a stop string)
    logprobs: list[TokenLogprob] | None
    offsets: list[int]  # text offset where each consumed token starts
    finish_reason: str | None


@dataclass(slots=True)
class Choice:
    index: int
    seq: SequenceText
    finish_reason: str | None = None
    # accumulated for a non-streamed response with logprobs
    lp_tokens: list[int] = field(default_factory=list)
    lp_values: list[TokenLogprob] = field(default_factory=list)
    lp_offsets: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Job:
    """One engine request and its n choices."""

    request: GenerateRequest
    choices: list[Choice]
    open: int  # choices not finished yet
    running: int  # sequences the engine has not finished yet
    cached_tokens: int = 0
    stream: RoutedStream | None = None  # once routed

    @property
    def done(self) -> bool:
        return self.open == 0


@dataclass(slots=True)
class Run:
    """The engine side of one OpenAI request."""

    jobs: list[Job]
    choices: list[Choice]
    logprobs: bool
    first_token_at: float | None = None
    finished: bool = False

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(j.request.prompt_ids) for j in self.jobs)
        completion = sum(c.seq.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(j.cached_tokens for j in self.jobs)}}


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


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _clamp(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN and -inf


class Serving:
    """Handlers for /v1/chat/completions and /v1/completions. Owns no clients: the app's lifespan does."""

    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer, dispatcher: Dispatcher, model: ModelInfo,
                 model_name: str, metrics: GatewayMetrics):
        self.config = config
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.model = model
        self.model_name = model_name
        self.metrics = metrics
        self.in_flight = 0

    # --- endpoints ---

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, self._chat_jobs, self._chat_json, self._chat_events)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, self._completion_jobs, self._completion_json,
                                 self._completion_events)

    async def _serve(self, request: Request, model_cls: type[_Req], jobs_of, to_json, to_events) -> Response:
        record = record_of(request)
        body = await self._admit(request)
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        run: Run | None = None
        handed_off = False
        try:
            req = self._parse(model_cls, body)
            prompts, samplings, logprobs = jobs_of(req)
            run = self._build_run(req, prompts, samplings, logprobs, record)
            await self._route(run, record)
            headers = {"x-kvgate-replica": record.replica,
                       "x-kvgate-predicted-cached-tokens": str(record.predicted_cached_tokens)}
            created = int(time.time())
            if req.stream:
                events = self._guard(to_events(run, req, created), record)
                handed_off = True
                return EventStream(events, headers, lambda: self._finish(run, record))
            if not await self._collect(request, run):
                return Response(status_code=499)  # nobody reads it; the log line says the client left
            return Response(_dumps(to_json(run, req, created)), headers=headers, media_type="application/json")
        finally:
            if not handed_off:
                await self._finish(run, record)

    async def _admit(self, request: Request) -> bytes:
        content_type = request.headers.get("content-type", "")
        if content_type.split(";", 1)[0].strip().lower() != "application/json":
            raise APIError(415, f"Content-Type must be application/json, got {content_type or 'none'!r}")
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise APIError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes")
        if self.in_flight >= self.config.max_in_flight:
            raise overloaded(429, f"this gateway is serving its limit of {self.config.max_in_flight} requests; "
                                  "retry later", RETRY_AFTER_BUSY)
        if not self.dispatcher.pool.ready_replicas():
            raise overloaded(503, "no engine replica is ready; retry later", RETRY_AFTER_NO_ENGINE)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _parse(self, model_cls: type[_Req], body: bytes) -> _Req:
        try:
            req = model_cls.model_validate_json(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        req.check_supported()
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return req

    # --- request → engine requests ---

    def _chat_jobs(self, req: ChatCompletionRequest):
        prompt = self.tokenizer.chat_prompt(req.template_messages())
        logprobs = req.engine_logprobs()
        sampling = req.sampling(req.max_new_tokens(), logprobs, len(prompt.token_ids), self.model.limits,
                                "top_logprobs")
        return [(prompt.token_ids, prompt.cache_boundaries)], [sampling], logprobs is not None

    def _completion_jobs(self, req: CompletionRequest):
        vocab = self.model.limits.vocab_size
        prompts = []
        for prompt in req.prompts():
            if isinstance(prompt, str):
                prompts.append((self.tokenizer.encode(prompt, add_special_tokens=True), []))
                continue
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
            prompts.append((prompt, []))
        samplings = [req.sampling(req.max_tokens, req.logprobs, len(ids), self.model.limits, "logprobs")
                     for ids, _ in prompts]
        return prompts, samplings, req.logprobs is not None

    def _build_run(self, req: SamplingFields, prompts: list[tuple[list[int], list[int]]],
                   samplings: list[SamplingParams], logprobs: bool, record: RequestRecord) -> Run:
        stops = req.stop_strings()
        salt = None if self.config.shared_prefix_cache else record.tenant
        prefix = ("chatcmpl-" if isinstance(req, ChatCompletionRequest) else "cmpl-") + uuid.uuid4().hex
        jobs, choices = [], []
        for p, ((prompt_ids, boundaries), sampling) in enumerate(zip(prompts, samplings)):
            job_choices = [
                Choice(p * sampling.n + i, SequenceText(self.tokenizer, prompt_ids, stops,
                                                         req.include_stop_str_in_output, req.skip_special_tokens,
                                                         req.min_tokens))
                for i in range(sampling.n)
            ]
            request_id = prefix if len(prompts) == 1 else f"{prefix}-{p}"
            jobs.append(Job(GenerateRequest(request_id, prompt_ids, sampling, salt, boundaries), job_choices,
                            open=sampling.n, running=sampling.n))
            choices += job_choices
        return Run(jobs, choices, logprobs)

    async def _route(self, run: Run, record: RequestRecord) -> None:
        """Open every job's engine stream (the pool fails over between replicas)."""
        for job in run.jobs:
            try:
                job.stream = await self.dispatcher.open(job.request)
            except NoReplicaAvailable as exc:
                raise overloaded(503, f"{exc}; retry later", RETRY_AFTER_NO_ENGINE) from None
            except EngineRejected as exc:
                raise APIError(400, exc.message, param=exc.param) from None
        _note_routing(run, record)

    async def _finish(self, run: Run | None, record: RequestRecord) -> None:
        """Close the engine streams (aborting what still runs), release counts, fill the log record."""
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)
        if run is None or run.finished:
            return
        run.finished = True
        for job in run.jobs:
            if job.stream is not None:
                await job.stream.aclose()
        if all(j.stream is not None for j in run.jobs):
            _note_routing(run, record)  # where they ended, after any failover
        usage = run.usage()
        record.prompt_tokens = usage["prompt_tokens"]
        record.completion_tokens = usage["completion_tokens"]
        record.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
        reasons = [c.finish_reason for c in run.choices if c.finish_reason]
        record.finish_reason = ",".join(dict.fromkeys(reasons)) or None
        if len(reasons) < len(run.choices) and record.error is None and record.exc is None:
            record.error = "the client left before the end; the engine request was aborted"
        self.metrics.prompt_tokens.inc(record.prompt_tokens)
        self.metrics.cached_tokens.inc(record.cached_tokens)
        self.metrics.completion_tokens.inc(record.completion_tokens)
        if run.first_token_at is not None:
            ttft = run.first_token_at - record.arrival
            record.ttft_ms = round(ttft * 1e3, 2)
            self.metrics.ttft.observe(ttft)

    # --- engine frames → deltas ---

    async def _frames(self, run: Run) -> AsyncIterator[tuple[Job, OutputFrame]]:
        """Frames of all jobs as they come; frames of a job already done are dropped."""
        if len(run.jobs) == 1:
            job = run.jobs[0]
            async with contextlib.aclosing(job.stream.frames()) as frames:
                async for frame in frames:
                    yield job, frame
            return
        queue: asyncio.Queue[tuple[Job, OutputFrame | Exception | None]] = asyncio.Queue()

        async def pump(job: Job) -> None:
            try:
                async with contextlib.aclosing(job.stream.frames()) as frames:
                    async for frame in frames:
                        queue.put_nowait((job, frame))
                queue.put_nowait((job, None))
            except Exception as exc:  # noqa: BLE001 — handed to the consumer, which decides
                queue.put_nowait((job, exc))

        tasks = [asyncio.create_task(pump(job)) for job in run.jobs]
        try:
            running = len(tasks)
            while running:
                job, item = await queue.get()
                if item is None or isinstance(item, Exception):
                    running -= 1
                if job.done:
                    continue
                if isinstance(item, Exception):
                    raise item
                if item is not None:
                    yield job, item
        finally:
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _deltas(self, run: Run) -> AsyncIterator[Delta]:
        aborted = False
        async with contextlib.aclosing(self._frames(run)) as frames:
            async for job, frame in frames:
                delta = self._apply(run, job, frame)
                if delta is not None:
                    yield delta
                if job.done and job.running:
                    await job.stream.aclose()  # stop strings ended it early: abort what the engine still runs
                    job.running = 0
                    aborted = True
                if aborted and all(j.done for j in run.jobs):
                    return
                # Otherwise read on to the end of each stream, so its connection goes back to the pool.
        if not all(j.done for j in run.jobs):
            raise EngineFailed("an engine stream ended before all its sequences finished")

    def _apply(self, run: Run, job: Job, frame: OutputFrame) -> Delta | None:
        if not 0 <= frame.index < len(job.choices):
            raise EngineFailed(f"engine sent a frame for sequence {frame.index} of {len(job.choices)}")
        if frame.finish_reason is not None:
            job.running -= 1
        choice = job.choices[frame.index]
        if choice.finish_reason is not None:
            return None
        job.cached_tokens = max(job.cached_tokens, frame.num_cached_tokens)
        if frame.finish_reason in ("error", "abort"):
            raise EngineFailed(
                f"engine {job.stream.replica.url} ended the request: {frame.error or frame.finish_reason}")
        seq = choice.seq
        offsets = seq.add(frame.token_ids)
        if offsets and run.first_token_at is None:
            run.first_token_at = time.perf_counter()
        finish = "stop" if seq.stopped else frame.finish_reason
        text = seq.finish() if finish else seq.release()
        if finish:
            choice.finish_reason = finish
            job.open -= 1
        elif not text and not offsets:
            return None
        consumed = len(offsets)
        token_ids = frame.token_ids if consumed == len(frame.token_ids) else frame.token_ids[:consumed]
        logprobs = None
        if run.logprobs:
            if frame.logprobs is None and consumed:
                raise EngineFailed("engine sent no logprobs although they were asked for")
            logprobs = (frame.logprobs or [])[:consumed]
        return Delta(choice.index, text, token_ids, logprobs, offsets, finish)

    async def _collect(self, request: Request, run: Run) -> bool:
        """Consume a non-streamed run; False if the client left first (the caller's finish then closes
        the engine streams, which aborts them)."""

        async def consume() -> None:
            async for d in self._deltas(run):
                if run.logprobs:
                    c = run.choices[d.index]
                    c.lp_tokens += d.token_ids
                    c.lp_values += d.logprobs
                    c.lp_offsets += d.offsets

        async def client_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(consume())
        watch = asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watch):
                task.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
        if work.cancelled():
            return False
        try:
            work.result()
        except EngineFailed as exc:
            raise APIError(502, str(exc)) from None
        return True

    async def _guard(self, events: AsyncIterator[str], record: RequestRecord) -> AsyncIterator[str]:
        """An error after the response started can only be told as an SSE error event; the
        stream then ends with ``[DONE]`` as every stream does (as vLLM's), so SSE clients that
        read to the end stop there."""
        try:
            async for event in events:
                yield event
            return
        except EngineFailed as exc:
            record.error = str(exc)
            error = APIError(502, str(exc))
        except Exception as exc:  # noqa: BLE001 — logged once with its traceback via the record
            record.exc = exc
            error = APIError(500, "internal server error")
        yield f"data: {_dumps(error.body())}\n\n"
        yield "data: [DONE]\n\n"

    # --- response shapes ---

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob]) -> list[dict]:
        tok = self.tokenizer
        return [
            {"token": tok.token_text(t), "logprob": _clamp(lp.logprob), "bytes": list(tok.token_bytes(t)),
             "top_logprobs": [{"token": tok.token_text(tid), "logprob": _clamp(v), "bytes": list(tok.token_bytes(tid))}
                              for tid, v in lp.top]}
            for t, lp in zip(token_ids, logprobs)
        ]

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob], offsets: list[int]) -> dict:
        tok = self.tokenizer
        return {
            "tokens": [tok.token_text(t) for t in token_ids],
            "token_logprobs": [_clamp(lp.logprob) for lp in logprobs],
            "top_logprobs": [{tok.token_text(tid): _clamp(v) for tid, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def _chat_json(self, run: Run, req: ChatCompletionRequest, created: int) -> dict:
        choices = [
            {"index": c.index, "message": {"role": "assistant", "content": c.seq.text},
             "logprobs": {"content": self._chat_logprobs(c.lp_tokens, c.lp_values)} if run.logprobs else None,
             "finish_reason": c.finish_reason}
            for c in run.choices
        ]
        return {"id": _response_id(run), "object": "chat.completion", "created": created,
                "model": self.model_name, "choices": choices, "usage": run.usage()}

    def _completion_json(self, run: Run, req: CompletionRequest, created: int) -> dict:
        choices = [
            {"index": c.index, "text": c.seq.text,
             "logprobs": self._completion_logprobs(c.lp_tokens, c.lp_values, c.lp_offsets) if run.logprobs else None,
             "finish_reason": c.finish_reason}
            for c in run.choices
        ]
        return {"id": _response_id(run), "object": "text_completion", "created": created,
                "model": self.model_name, "choices": choices, "usage": run.usage()}

    async def _chat_events(self, run: Run, req: ChatCompletionRequest, created: int) -> AsyncIterator[str]:
        head = _dumps({"id": _response_id(run), "object": "chat.completion.chunk", "created": created,
                       "model": self.model_name})[:-1]
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        tail = ',"usage":null}\n\n' if include_usage else "}\n\n"
        for c in run.choices:
            role = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}
            yield f'data: {head},"choices":[{_dumps(role)}]{tail}'
        async for d in self._deltas(run):
            choice = {"index": d.index, "delta": {"content": d.text} if d.text else {},
                      "logprobs": {"content": self._chat_logprobs(d.token_ids, d.logprobs)} if run.logprobs else None,
                      "finish_reason": d.finish_reason}
            yield f'data: {head},"choices":[{_dumps(choice)}]{tail}'
        if include_usage:
            yield f'data: {head},"choices":[],"usage":{_dumps(run.usage())}}}\n\n'
        yield "data: [DONE]\n\n"

    async def _completion_events(self, run: Run, req: CompletionRequest, created: int) -> AsyncIterator[str]:
        head = _dumps({"id": _response_id(run), "object": "text_completion", "created": created,
                       "model": self.model_name})[:-1]
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        tail = ',"usage":null}\n\n' if include_usage else "}\n\n"
        async for d in self._deltas(run):
            logprobs = self._completion_logprobs(d.token_ids, d.logprobs, d.offsets) if run.logprobs else None
            choice = {"index": d.index, "text": d.text, "logprobs": logprobs, "finish_reason": d.finish_reason}
            yield f'data: {head},"choices":[{_dumps(choice)}]{tail}'
        if include_usage:
            yield f'data: {head},"choices":[],"usage":{_dumps(run.usage())}}}\n\n'
        yield "data: [DONE]\n\n"


def _note_routing(run: Run, record: RequestRecord) -> None:
    """The log record's replicas, routing reasons and predicted cached tokens, of every job's stream."""
    record.replica = ",".join(dict.fromkeys(j.stream.replica.url for j in run.jobs))
    record.route = ",".join(dict.fromkeys(j.stream.decision.reason for j in run.jobs))
    record.predicted_cached_tokens = sum(j.stream.predicted_cached_tokens for j in run.jobs)


def _response_id(run: Run) -> str:
    """The OpenAI id: the engine request id, without the per-prompt suffix of a batch."""
    request_id = run.jobs[0].request.request_id
    return request_id if len(run.jobs) == 1 else request_id.rsplit("-", 1)[0]
