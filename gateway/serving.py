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
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from engine.protocol import GenerateRequest, SamplingParams
from gateway.admission import Admission, AdmissionLimits, Ticket
from gateway.config import GatewayConfig
from gateway.detokenizer import SequenceText
from gateway.dispatch import Dispatcher, NoReplicaAvailable
from gateway.engine_client import EngineFailed, EngineRejected
from gateway.errors import APIError, overloaded, record_of
from gateway.metrics import GatewayMetrics
from gateway.middleware import RequestRecord, SaltKey
from gateway.openai_responses import ResponsesRequest, ResponsesShape
from gateway.ratelimit import Key, RateLimiter
from gateway.reasoning import REASONING_PARSERS
from gateway.replica import ModelInfo, Replica
from gateway.response_store import ResponseStore
from gateway.responses import ChatShape, CompletionShape, EventStream, ResponseShape, dumps
from gateway.run import CallParser, Choice, ChoiceOutput, Job, Run
from gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields, validation_error
from gateway.structured import NamedCall, RequiredCalls, ToolUse, check_grammars
from gateway.tokenizer import Tokenizer
from gateway.tool_parsers import TOOL_PARSERS, detect_tool_parser
from gateway.workers import WorkerPool

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
    num_prompts: Callable[[_Req], int]  # what its sequences are counted by (× n), before planning
    plan: Callable[[_Req, str | None], Awaitable[Plan]]  # (request, tenant)
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
                 model_name: str, metrics: GatewayMetrics, response_store: ResponseStore, workers: WorkerPool,
                 salt_key: SaltKey, limiter: RateLimiter):
        self.config = config
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.model = model
        self.model_name = model_name
        self.metrics = metrics
        self.workers = workers
        self.salt_key = salt_key
        self.limiter = limiter
        self.admission = Admission(AdmissionLimits(config.max_in_flight, config.max_sequences_in_flight,
                                                   config.max_prompt_tokens_in_flight))
        self.tool_parser = TOOL_PARSERS[tool_call_parser_name(config.tool_call_parser, tokenizer.chat_template)]
        self.reasoning_parser = REASONING_PARSERS.get(config.reasoning_parser)  # None: "none"
        self._chat = Endpoint(ChatCompletionRequest, lambda req: 1, self._chat_plan, ChatShape(tokenizer, model_name))
        self._completions = Endpoint(CompletionRequest, lambda req: len(req.prompts()), self._completion_plan,
                                     CompletionShape(tokenizer, model_name))
        self.response_store = response_store
        self._responses = Endpoint(ResponsesRequest, lambda req: 1, self._responses_plan,
                                   ResponsesShape(model_name, response_store))

    # --- endpoints ---

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, self._chat)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, self._completions)

    async def responses(self, request: Request) -> Response:
        return await self._serve(request, self._responses)

    async def _serve(self, request: Request, endpoint: Endpoint[_Req]) -> Response:
        record = record_of(request)
        key: Key | None = request.scope.get("kvgate.key")
        ticket = self._admit(request)  # before anything is awaited: the slot is this request's from here
        run: Run | None = None
        handed_off = failed = False
        try:
            if key is not None:
                await self.limiter.admit(key)
            body = await self._read_body(request)
            req = await self.workers.run(self._parse, endpoint.request_model, body)
            ticket.reserve(sequences=self._count_sequences(req, endpoint.num_prompts(req)))
            plan = await endpoint.plan(req, record.tenant)
            prompt_tokens = sum(len(p.token_ids) for p in plan.prompts)
            ticket.reserve(prompt_tokens=prompt_tokens)
            if key is not None:
                await self.limiter.charge_prompt(key, prompt_tokens)
            run = self._build_run(req, plan, endpoint.shape.id_prefix, record)
            await self._route(run, record)
            headers = {"x-kvgate-replica": record.replica,
                       "x-kvgate-predicted-cached-tokens": str(record.predicted_cached_tokens)}
            created = int(time.time())
            if req.stream:
                events = self._guard(endpoint.shape.events(run, req, created), record)
                handed_off = True
                return EventStream(events, headers, lambda: self._finish(run, record, ticket, key))
            if not await self._collect(request, run):
                return Response(status_code=499)  # nobody reads it; the log line says the client left
            body = endpoint.shape.json(run, req, created)
            await endpoint.shape.finish(body, req)
            return Response(dumps(body), headers=headers, media_type="application/json")
        except Exception:
            failed = True  # its handler writes the log record's error: the client did not leave
            raise
        finally:
            if not handed_off:
                await self._finish(run, record, ticket, key, failed)

    def _admit(self, request: Request) -> Ticket:
        """The checks of the request head, then its slot (synchronously: nothing else runs in between)."""
        content_type = request.headers.get("content-type", "")
        if content_type.split(";", 1)[0].strip().lower() != "application/json":
            raise APIError(415, f"Content-Type must be application/json, got {content_type or 'none'!r}")
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise APIError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes")
        replicas = self.dispatcher.pool.ready_replicas()
        if not replicas:
            raise overloaded(503, f"no engine replica is ready ({self.dispatcher.pool.unready_summary()}); retry later",
                             RETRY_AFTER_NO_ENGINE)
        self._shed(replicas)
        ticket = self.admission.enter()
        self.metrics.in_flight.set(self.admission.requests)
        return ticket

    def _shed(self, replicas: list[Replica]) -> None:
        """503 when every ready replica's queue predicts more than --max-queue-seconds before a new request
        would start: a request refused now keeps the admitted ones' latency, one queued would not. Retry-After:
        until the shortest queue is back under the bound."""
        queues = [r.queue_seconds for r in replicas]
        limit = self.config.max_queue_seconds
        if all(q is not None and q > limit for q in queues):
            shortest = min(q for q in queues if q is not None)
            raise overloaded(503, f"every engine replica has more than {limit:g} s of queued work "
                                  f"({shortest:.0f} s at the shortest); retry later",
                             max(1, math.ceil(shortest - limit)))

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise APIError(408, "the connection closed before the whole request body arrived") from None
        return b"".join(chunks)

    def _count_sequences(self, req: SamplingFields, num_prompts: int) -> int:
        """The sequences a request asks for; 400 past the per-request caps."""
        config = self.config
        if num_prompts > config.max_prompts_per_request:
            raise APIError(400, f"{num_prompts} prompts in one request; this server takes at most "
                                f"{config.max_prompts_per_request}", param="prompt")
        if req.n > config.max_n:
            raise APIError(400, f"n must be <= {config.max_n} on this server, got {req.n}", param="n")
        return num_prompts * max(req.n, 1)

    async def admit(self, request: Request) -> bytes:
        """Admission and the body, for the routes that do not generate (/tokenize, /detokenize)."""
        ticket = self._admit(request)
        try:
            return await self._read_body(request)
        finally:
            ticket.release()
            self.metrics.in_flight.set(self.admission.requests)

    def _parse(self, model_cls: type[_Req], body: bytes) -> _Req:
        """The request body as its model (in a worker thread: a large body takes milliseconds)."""
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

    async def _chat_plan(self, req: ChatCompletionRequest, tenant: str | None) -> Plan:
        tools = req.tool_use
        if len(req.messages) > self.config.max_messages:
            raise APIError(400, f"{len(req.messages)} messages; this server takes at most "
                                f"{self.config.max_messages}", param="messages")
        messages = req.template_messages()
        self._check_fits(req, sum(len(m["content"]) for m in messages), "messages")
        await self._check_grammars(req)
        chat = await self.workers.run(functools.partial(
            self.tokenizer.chat_prompt, messages, tools.tools, req.template_kwargs(), req.add_generation_prompt,
            req.continue_final_message, tenant=tenant))
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

    async def _responses_plan(self, req: ResponsesRequest, tenant: str | None) -> Plan:
        previous = None
        if req.previous_response_id is not None:
            previous = await self.response_store.get(req.previous_response_id)
            if previous is None:
                raise APIError(404, f"no stored response {req.previous_response_id!r}: unknown, expired, or not "
                                    "stored (store: true keeps one)", param="previous_response_id", code="not_found")
        return await self._chat_plan(req.chat_request(previous), tenant)

    async def _completion_plan(self, req: CompletionRequest, tenant: str | None) -> Plan:
        prompts = req.prompts()
        for prompt in prompts:
            self._check_fits(req, len(prompt) if isinstance(prompt, str) else 0, "prompt")
        await self._check_grammars(req)
        batch = [req.truncated(ids, self.model.limits) for ids in await self.workers.run(self._prompt_ids, prompts)]
        return Plan([Prompt(ids, [], req.sampling(req.max_tokens, req.logprobs, len(ids), self.model.limits,
                                                  "logprobs")) for ids in batch])

    def _prompt_ids(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        """Completion prompts as token ids: texts tokenized, ids checked against the vocabulary."""
        vocab = self.model.limits.vocab_size
        batch = []
        for prompt in prompts:
            if isinstance(prompt, str):
                batch.append(self.tokenizer.encode(prompt, add_special_tokens=True))
                continue
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
            batch.append(prompt)
        return batch

    def _check_fits(self, req: SamplingFields, chars: int, param: str) -> None:
        """400 for a text that cannot fit the context, before rendering or tokenizing it: no token covers
        more than ``max_token_chars`` characters, so the text has at least chars / that many tokens. (A
        request that asks for its prompt to be truncated is tokenized whole, in a worker thread.)"""
        if req.truncate_prompt_tokens is not None:
            return
        min_tokens = -(-chars // self.tokenizer.max_token_chars)
        if min_tokens >= self.model.limits.max_model_len:
            raise APIError(400, f"the prompt's {chars} characters are at least {min_tokens} tokens, more than "
                                f"the model's context of {self.model.limits.max_model_len} tokens", param=param)

    async def _check_grammars(self, req: SamplingFields) -> None:
        """Compile the request's output constraints in a worker thread (a large schema takes ms)."""
        checks = req.grammar_checks()
        if checks:
            await self.workers.run(check_grammars, checks)

    def _build_run(self, req: SamplingFields, plan: Plan, id_prefix: str, record: RequestRecord) -> Run:
        stops = req.stop_strings()
        prompts = plan.prompts
        tenant_salt = None if self.config.shared_prefix_cache else self.salt_key.salt(record.tenant)
        salt = request_salt(tenant_salt, req.cache_salt)
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

    async def _finish(self, run: Run | None, record: RequestRecord, ticket: Ticket, key: Key | None,
                      failed: bool = False) -> None:
        """Close the engine streams (aborting what still runs), release the admission ticket, charge the
        key's completion tokens, fill the log record. ``failed``: the request ended by an exception, whose
        handler tells why."""
        ticket.release()
        self.metrics.in_flight.set(self.admission.requests)
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
        if len(reasons) < len(run.choices) and not failed and record.error is None and record.exc is None:
            record.error = "the client left before the end; the engine request was aborted"
        if key is not None:
            await self.limiter.charge_completion(key, record.completion_tokens)
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

