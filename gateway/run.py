"""The engine side of one OpenAI request: engine frames → per-choice deltas.

A run has one *job* (engine request) per prompt and n *choices* (sequences) per job. Frames of all jobs
are merged as they come; each goes through its choice's incremental detokenization and stop strings
(:class:`SequenceText`), then, for a chat choice with tools or reasoning, its :class:`ChoiceOutput`
(reasoning parser, then tool-call parser), and becomes a :class:`Delta`. A choice that hit a stop string
ignores its later frames; when every choice of a job is done its stream is closed, which aborts what the
engine still runs for it. Closing the streams at the end of the request is the caller's job
(``Serving._finish``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import anyio

from engine.protocol import GenerateRequest, OutputFrame, PromptLogprob, TokenLogprob
from gateway.detokenizer import SequenceText
from gateway.dispatch import RoutedStream
from gateway.engine_client import EngineFailed
from gateway.reasoning import ReasoningParser
from gateway.tool_parsers import ParsedDelta, ToolCall, ToolCallDelta


class Delta(NamedTuple):
    """What one engine frame added to one choice."""

    index: int
    text: str
    token_ids: list[int]  # the tokens consumed (none after a stop string)
    logprobs: list[TokenLogprob] | None
    offsets: list[int]  # text offset where each consumed token starts
    finish_reason: str | None
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    first: bool = False  # the choice's first delta (where an echo goes)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


class CallParser(Protocol):
    """What turns a choice's content into tool calls: a :class:`gateway.tool_parsers.ToolCallParser`,
    or one of :mod:`gateway.structured`'s parsers of grammar-forced calls."""

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...

    @property
    def calls(self) -> list[ToolCall]: ...


class ChoiceOutput:
    """One choice's text split as it comes: reasoning first (``reasoning``, if the request has a
    reasoning parser), then tool calls out of the rest (``calls``); what remains is content. Keeps the
    whole reasoning and content for a non-streamed answer. ``max_calls`` (1 without parallel tool
    calls) drops the calls after it."""

    def __init__(self, reasoning: ReasoningParser | None = None, calls: CallParser | None = None,
                 max_calls: int | None = None):
        self.reasoning_parser = reasoning
        self.call_parser = calls
        self.max_calls = max_calls
        self.reasoning: list[str] = []
        self.content: list[str] = []

    @property
    def calls(self) -> list[ToolCall]:
        calls = self.call_parser.calls if self.call_parser is not None else []
        return calls[:self.max_calls] if self.max_calls is not None else calls

    def feed(self, text: str, final: bool) -> tuple[str, str, tuple[ToolCallDelta, ...]]:
        """(reasoning, content, tool-call deltas) of the next text; ``final`` flushes the parsers."""
        reasoning, content = self.reasoning_parser.feed(text) if self.reasoning_parser else ("", text)
        if final and self.reasoning_parser is not None:
            more_reasoning, more_content = self.reasoning_parser.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls: tuple[ToolCallDelta, ...] = ()
        if self.call_parser is not None:
            parsed = self.call_parser.feed(content)
            content, calls = parsed.content, parsed.tool_calls
            if final:
                rest = self.call_parser.finish()
                content, calls = content + rest.content, calls + rest.tool_calls
            if self.max_calls is not None:
                calls = tuple(c for c in calls if c.index < self.max_calls)
        self.reasoning.append(reasoning)
        self.content.append(content)
        return reasoning, content, calls


@dataclass(slots=True)
class Choice:
    index: int
    seq: SequenceText
    output: ChoiceOutput | None = None  # None: the text is the content as it is
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    started: bool = False  # a delta was sent
    # accumulated for a non-streamed response (logprobs only when asked)
    token_ids: list[int] = field(default_factory=list)
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
    prompt_logprobs: list[PromptLogprob] | None = None  # of prompt tokens 1, 2, ... once the engine sent them
    echo_text: str | None = None  # the prompt as a completions echo shows it, once a response shape made it

    @property
    def done(self) -> bool:
        return self.open == 0


@dataclass(slots=True)
class Run:
    """The engine side of one OpenAI request. :meth:`deltas` (streamed) or :meth:`collect` (not
    streamed) reads it once; both raise :class:`EngineFailed` when an engine fails or breaks the protocol."""

    jobs: list[Job]
    choices: list[Choice]
    logprobs: bool
    prompt_logprobs: bool = False  # asked of the engine
    first_token_at: float | None = None
    finished: bool = False

    def job_of(self, choice: Choice) -> Job:
        return self.jobs[choice.index // len(self.jobs[0].choices)]

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(j.request.prompt_ids) for j in self.jobs)
        completion = sum(c.seq.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(j.cached_tokens for j in self.jobs)}}

    async def deltas(self) -> AsyncIterator[Delta]:
        aborted = False
        async with contextlib.aclosing(self._frames()) as frames:
            async for job, frame in frames:
                delta = self._apply(job, frame)
                if delta is not None:
                    yield delta
                if job.done and job.running:
                    await job.stream.aclose()  # stop strings ended it early: abort what the engine still runs
                    job.running = 0
                    aborted = True
                if aborted and all(j.done for j in self.jobs):
                    return
                # Otherwise read on to the end of each stream, so its connection goes back to the pool.
        if not all(j.done for j in self.jobs):
            raise EngineFailed("an engine stream ended before all its sequences finished")

    async def collect(self) -> None:
        """Read the run to its end for a non-streamed response: the text stays in each choice's
        ``seq``, its tokens in ``token_ids``, their logprobs (when asked) in the ``lp_*`` lists."""
        async for d in self.deltas():
            c = self.choices[d.index]
            c.token_ids += d.token_ids
            if self.logprobs:
                c.lp_values += d.logprobs
                c.lp_offsets += d.offsets

    async def _frames(self) -> AsyncIterator[tuple[Job, OutputFrame]]:
        """Frames of all jobs as they come; frames of a job already done are dropped."""
        if len(self.jobs) == 1:
            job = self.jobs[0]
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
            except Exception as exc:
                queue.put_nowait((job, exc))

        tasks = [asyncio.create_task(pump(job)) for job in self.jobs]
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

    def _apply(self, job: Job, frame: OutputFrame) -> Delta | None:
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
        if frame.prompt_logprobs is not None:
            job.prompt_logprobs = frame.prompt_logprobs
        elif self.prompt_logprobs and frame.token_ids and job.prompt_logprobs is None:
            raise EngineFailed("engine sent no prompt logprobs although they were asked for")
        seq = choice.seq
        offsets = seq.add(frame.token_ids)
        if offsets and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        finish = "stop" if seq.stopped else frame.finish_reason
        stop_reason = None
        if finish == "stop":
            last = frame.token_ids[-1] if frame.token_ids else None
            stop_reason = seq.stop_str if seq.stopped else last if last in job.request.sampling.stop_token_ids else None
        text = seq.finish() if finish else seq.release()
        reasoning, calls = "", ()
        if choice.output is not None:
            reasoning, text, calls = choice.output.feed(text, final=finish is not None)
            if finish == "stop" and choice.output.calls:
                finish = "tool_calls"
        if finish:
            choice.finish_reason, choice.stop_reason = finish, stop_reason
            job.open -= 1
        elif not text and not offsets and not reasoning and not calls and choice.started:
            return None
        first, choice.started = not choice.started, True
        consumed = len(offsets)
        token_ids = frame.token_ids if consumed == len(frame.token_ids) else frame.token_ids[:consumed]
        logprobs = None
        if self.logprobs:
            if frame.logprobs is None and consumed:
                raise EngineFailed("engine sent no logprobs although they were asked for")
            logprobs = (frame.logprobs or [])[:consumed]
        return Delta(choice.index, text, token_ids, logprobs, offsets, finish, reasoning, calls, first, stop_reason)
