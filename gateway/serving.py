"""The OpenAI generation endpoints: admission, parsing, request → engine requests, routing, finish.

One OpenAI request becomes one engine request (a *job*) per prompt, with n sequences each
(``sampling.n``); :mod:`gateway.run` turns their frames into deltas and :mod:`gateway.responses` those
into JSON or SSE. Each API is one :class:`Endpoint`: its request model, its plan (prompts, and how each
choice's text is parsed: reasoning, tool calls) and its response shape. Output constraints are
compiled once here, in a worker thread, so that a bad one is a 400 before anything is routed.
Engine streams are opened before the response starts, so routing failures are plain HTTP errors;
whatever happens afterwards, :meth:`Serving._finish` closes them exactly once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from engine.protocol import GenerateRequest, SamplingParams
from gateway.config import GatewayConfig
from gateway.detokenizer import SequenceText
from gateway.dispatch import Dispatcher, NoReplicaAvailable
from gateway.engine_client import EngineFailed, EngineRejected
from gateway.errors import APIError, overloaded, record_of
from gateway.metrics import GatewayMetrics
from gateway.middleware import RequestRecord
from gateway.openai_responses import ResponsesRequest, ResponsesShape
from gateway.reasoning import REASONING_PARSERS
from gateway.replica import ModelInfo
from gateway.response_store import ResponseStore
from gateway.responses import ChatShape, CompletionShape, EventStream, ResponseShape, dumps
from gateway.run import CallParser, Choice, ChoiceOutput, Job, Run
from gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields, validation_error
from gateway.structured import NamedCall, RequiredCalls, ToolUse, check_grammars
from gateway.tokenizer import Tokenizer
from gateway.tool_parsers import TOOL_PARSERS, detect_tool_parser

RETRY_AFTER_BUSY = 1
RETRY_AFTER_NO_ENGINE = 5
_Req = TypeVar("_Req", bound=SamplingFields)


class Prompt(NamedTuple):
    """One engine request's input: token ids, the exact-position cache boundaries among them, sampling."""

    token_ids: list[int]
    cache_boundaries: list[int]
    sampling: SamplingParams


class Plan(NamedTuple):
    """What a request becomes: its engine requests' inputs, and a maker of each choice's output parsing
    (None: the text is the content as it is)."""

    prompts: list[Prompt]
    output: Callable[[], ChoiceOutput] | None = None


@dataclass(frozen=True, slots=True)
class Endpoint(Generic[_Req]):
    """One OpenAI generation API: the request body it parses, the plan a request becomes (prompts
    tokenized, with their sampling; 400 for what does not fit) and the shape of its answer."""

    request_model: type[_Req]
    plan: Callable[[_Req], Awaitable[Plan]]
    shape: ResponseShape[_Req] | ResponsesShape


def tool_call_parser_name(setting: str, chat_template: str | None) -> str:
    """--tool-call-parser: "auto" is the template's format where that is unambiguous, else hermes (the
    format in which a template that does not render tools gets them, see :mod:`gateway.tokenizer`)."""
    if setting != "auto":
        return setting
    return detect_tool_parser(chat_template or "") or "hermes"


class Serving:
    """Handlers for /v1/chat/completions, /v1/completions and /v1/responses. Owns no clients: the app's
    lifespan does."""

    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer, dispatcher: Dispatcher, model: ModelInfo,
                 model_name: str, metrics: GatewayMetrics, response_store: ResponseStore):
        self.config = config
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.model = model
        self.model_name = model_name
        self.metrics = metrics
        self.in_flight = 0
        self.tool_parser = TOOL_PARSERS[tool_call_parser_name(config.tool_call_parser, tokenizer.chat_template)]
        self.reasoning_parser = REASONING_PARSERS.get(config.reasoning_parser)  # None: "none"
        self._chat = Endpoint(ChatCompletionRequest, self._chat_plan, ChatShape(tokenizer, model_name))
        self._completions = Endpoint(CompletionRequest, self._completion_plan, CompletionShape(tokenizer, model_name))
        self.response_store = response_store
        self._responses = Endpoint(ResponsesRequest, self._responses_plan, ResponsesShape(model_name, response_store))

    # --- endpoints ---

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, self._chat)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, self._completions)

    async def responses(self, request: Request) -> Response:
        return await self._serve(request, self._responses)

    async def _serve(self, request: Request, endpoint: Endpoint[_Req]) -> Response:
        record = record_of(request)
        body = await self._admit(request)
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        run: Run | None = None
        handed_off = False
        try:
            req = self._parse(endpoint.request_model, body)
            run = self._build_run(req, await endpoint.plan(req), endpoint.shape.id_prefix, record)
            await self._route(run, record)
            headers = {"x-kvgate-replica": record.replica,
                       "x-kvgate-predicted-cached-tokens": str(record.predicted_cached_tokens)}
            created = int(time.time())
            if req.stream:
                events = self._guard(endpoint.shape.events(run, req, created), record)
                handed_off = True
                return EventStream(events, headers, lambda: self._finish(run, record))
            if not await self._collect(request, run):
                return Response(status_code=499)  # nobody reads it; the log line says the client left
            body = endpoint.shape.json(run, req, created)
            await endpoint.shape.finish(body, req)
            return Response(dumps(body), headers=headers, media_type="application/json")
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

    async def admit(self, request: Request) -> bytes:
        """Admission and the body, for the routes that do not generate (/tokenize, /detokenize)."""
        return await self._admit(request)

    def _parse(self, model_cls: type[_Req], body: bytes) -> _Req:
        try:
            req = model_cls.model_validate_json(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        req.check_supported()
        self.check_model(req.model)
        return req

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is the served one (or not given)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    # --- request → engine requests ---

    async def _chat_plan(self, req: ChatCompletionRequest) -> Plan:
        tools = req.tool_use
        await self._check_grammars(req)
        chat = self.tokenizer.chat_prompt(req.template_messages(), tools.tools, req.template_kwargs(),
                                          req.add_generation_prompt, req.continue_final_message)
        token_ids = req.truncated(chat.token_ids, self.model.limits)
        dropped = len(chat.token_ids) - len(token_ids)
        boundaries = [b - dropped for b in chat.cache_boundaries if b > dropped]
        sampling = req.sampling(req.max_new_tokens(), req.engine_logprobs(), len(token_ids), self.model.limits,
                                "top_logprobs")
        return Plan([Prompt(token_ids, boundaries, sampling)], self._chat_output(req))

    def _chat_output(self, req: ChatCompletionRequest) -> Callable[[], ChoiceOutput] | None:
        """How each choice's text is parsed. A constrained output is what its grammar allows from the
        first token, so it gets no reasoning parser; a forced call is parsed as the grammar writes it."""
        tools = req.tool_use
        reasoning = self.reasoning_parser if req.constraint is None else None
        calls = self._call_parser(tools)
        if reasoning is None and calls is None:
            return None
        max_calls = None if tools.parallel else 1
        return lambda: ChoiceOutput(reasoning() if reasoning else None, calls() if calls else None, max_calls)

    def _call_parser(self, tools: ToolUse) -> Callable[[], CallParser] | None:
        if tools.mode == "auto":
            return functools.partial(self.tool_parser, tools.names)
        if tools.mode == "required":
            return RequiredCalls
        if tools.mode == "named":
            return functools.partial(NamedCall, tools.name)
        return None

    async def _responses_plan(self, req: ResponsesRequest) -> Plan:
        previous = None
        if req.previous_response_id is not None:
            previous = await self.response_store.get(req.previous_response_id)
            if previous is None:
                raise APIError(404, f"no stored response {req.previous_response_id!r}: unknown, expired, or not "
                                    "stored (store: true keeps one)", param="previous_response_id", code="not_found")
        return await self._chat_plan(req.chat_request(previous))

    async def _completion_plan(self, req: CompletionRequest) -> Plan:
        await self._check_grammars(req)
        vocab = self.model.limits.vocab_size
        batch = []
        for prompt in req.prompts():
            if isinstance(prompt, str):
                batch.append(self.tokenizer.encode(prompt, add_special_tokens=True))
                continue
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
            batch.append(prompt)
        batch = [req.truncated(ids, self.model.limits) for ids in batch]
        return Plan([Prompt(ids, [], req.sampling(req.max_tokens, req.logprobs, len(ids), self.model.limits,
                                                  "logprobs")) for ids in batch])

    @staticmethod
    async def _check_grammars(req: SamplingFields) -> None:
        """Compile the request's output constraints in a worker thread (a large schema takes ms)."""
        checks = req.grammar_checks()
        if checks:
            await asyncio.to_thread(check_grammars, checks)

    def _build_run(self, req: SamplingFields, plan: Plan, id_prefix: str, record: RequestRecord) -> Run:
        stops = req.stop_strings()
        prompts = plan.prompts
        salt = request_salt(None if self.config.shared_prefix_cache else record.tenant, req.cache_salt)
        prefix = id_prefix + uuid.uuid4().hex
        jobs, choices = [], []
        for p, prompt in enumerate(prompts):
            n = prompt.sampling.n
            job_choices = [
                Choice(p * n + i, SequenceText(self.tokenizer, prompt.token_ids, stops, req.include_stop_str_in_output,
                                               req.skip_special_tokens, req.min_tokens),
                       plan.output() if plan.output is not None else None)
                for i in range(n)
            ]
            request_id = prefix if len(prompts) == 1 else f"{prefix}-{p}"
            request = GenerateRequest(request_id, prompt.token_ids, prompt.sampling, salt, prompt.cache_boundaries)
            jobs.append(Job(request, job_choices, open=n, running=n))
            choices += job_choices
        # every prompt of a request asks for logprobs or none does, and so for prompt logprobs
        sampling = prompts[0].sampling
        return Run(jobs, choices, logprobs=sampling.logprobs is not None,
                   prompt_logprobs=sampling.prompt_logprobs is not None)

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

    async def _collect(self, request: Request, run: Run) -> bool:
        """Consume a non-streamed run; False if the client left first (the caller's finish then closes
        the engine streams, which aborts them)."""

        async def client_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(run.collect())
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
        except Exception as exc:
            record.exc = exc
            error = APIError(500, "internal server error")
        yield f"data: {dumps(error.body())}\n\n"
        yield "data: [DONE]\n\n"


def request_salt(tenant_salt: str | None, cache_salt: str | None) -> str | None:
    """The engine's salt: the tenant's (None when prefixes are shared), and a request's cache_salt
    added to it, never replacing it: requests share KV only when both are equal."""
    if cache_salt is None:
        return tenant_salt
    return json.dumps([tenant_salt, cache_salt], ensure_ascii=False)


def _note_routing(run: Run, record: RequestRecord) -> None:
    """The log record's replicas, routing reasons and predicted cached tokens, of every job's stream."""
    record.replica = ",".join(dict.fromkeys(j.stream.replica.url for j in run.jobs))
    record.route = ",".join(dict.fromkeys(j.stream.decision.reason for j in run.jobs))
    record.predicted_cached_tokens = sum(j.stream.predicted_cached_tokens for j in run.jobs)

