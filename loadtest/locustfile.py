"""Locust users over kvgate's OpenAI SSE API: AgentUser (multi-turn) and ChatUser (single turn).

    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s -H http://127.0.0.1:8000 \
        --records-csv requests.csv AgentUser

Each request streams ``/v1/chat/completions`` with ``stream_options.include_usage`` and fires, besides
the request itself (``POST chat/completions [agent]``, failures included), three custom metrics:

- ``TTFT <kind>``: ms to the first SSE chunk that carries generated tokens (the role chunk does not);
- ``ITL <kind>``: the request's mean gap in ms between chunks that carry tokens;
- ``CACHED <kind>``: ``usage.prompt_tokens_details.cached_tokens`` in the *time* columns (so Locust's
  percentiles are cached tokens per request) and the prompt tokens as the *size*.

Why a plain ``requests`` session in a ``User`` rather than ``HttpUser``'s client or the openai SDK:
Locust's HTTP clients time a streamed response only up to its headers, and the SDK hides the chunk
arrival times behind its own parsing and retries. Here every metric is taken on one clock from the
raw chunks (uvicorn sends each SSE event as its own HTTP chunk, and urllib3 hands chunks over as
they arrive), and the events are fired explicitly, as Locust documents for custom clients.

``--records-csv`` writes one :class:`loadtest.records.RequestRecord` per request through a listener
on the request event.
"""

from __future__ import annotations

import itertools
import json
import time

import requests
from locust import User, events, task
from locust.env import Environment

from loadtest.records import RecordWriter, RequestRecord
from loadtest.workload import (
    AGENT,
    CHAT,
    Conversation,
    Workload,
    WorkloadConfig,
    add_pause_arguments,
    add_workload_arguments,
)

CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 600  # the longest silence between two chunks (a long queue on a slow CPU)
COMPLETIONS = "/v1/chat/completions"


class RequestFailed(Exception):
    """Why a request counts as failed; Locust groups failures by this message."""


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    add_workload_arguments(parser)
    add_pause_arguments(parser)
    parser.add_argument("--records-csv", default="", help="write one CSV row per request here")
    parser.add_argument("--gateways", default="",
                        help="comma-separated gateway base URLs; user i talks to gateway i mod M (default: --host)")


@events.init.add_listener
def _open_records(environment: Environment, **_) -> None:
    path = environment.parsed_options.records_csv if environment.parsed_options else ""
    if not path:
        return
    writer = RecordWriter(path)

    def on_request(context: dict | None = None, **_) -> None:
        record = (context or {}).get("record")
        if record is not None:
            writer.write(record)

    environment.events.request.add_listener(on_request)
    environment.events.quitting.add_listener(lambda **_: writer.close())


class KvgateUser(User):
    """Streams chat completions from one gateway and reports them. Subclasses pick the conversations."""

    abstract = True
    _spawned = itertools.count()  # user numbers in spawn order, shared by all classes of the process

    def __init__(self, environment: Environment):
        super().__init__(environment)
        options = environment.parsed_options
        self.number = next(KvgateUser._spawned)
        self.stride = options.num_users  # user n takes items n, n + U, n + 2U, ...: disjoint, seeded
        self.workload = Workload(WorkloadConfig.from_options(options))
        gateways = [url.strip().rstrip("/") for url in options.gateways.split(",") if url.strip()]
        if not gateways and not self.host:
            raise ValueError("give the gateway URL with --host or --gateways")
        self.base_url = gateways[self.number % len(gateways)] if gateways else self.host.rstrip("/")
        self.think_times = self.workload.pauses("think", self.number, options.think_time)
        self.session = requests.Session()

    def wait_time(self) -> float:
        return next(self.think_times)

    def on_stop(self) -> None:
        self.session.close()

    def items(self):
        """This user's item numbers (conversations or chat requests)."""
        return itertools.count(self.number, self.stride)

    def send(self, conversation: Conversation, turn: int, arrival: float | None = None) -> None:
        """Stream one request and report it; ``arrival``: the Unix time it was due, if it had one."""
        record = RequestRecord(start=time.time(), kind=conversation.kind, user=self.number,
                               conversation=conversation.index, turn=turn)
        if arrival is not None:
            record.start_lag_ms = max(0.0, record.start - arrival) * 1e3
        body = {"messages": conversation.messages(turn), "max_tokens": conversation.turns[turn].max_tokens,
                "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        received = 0
        error: str | None = None
        try:
            with self.session.post(self.base_url + COMPLETIONS, json=body, stream=True,
                                   timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S)) as response:
                record.status = response.status_code
                record.replica = response.headers.get("x-kvgate-replica", "")
                if response.status_code != 200:
                    error = f"HTTP {response.status_code}: {_error_message(response.text)}"
                    received = len(response.content)
                else:
                    error, received = _read_stream(response, started, record)
        except requests.RequestException as exc:
            error = f"{type(exc).__name__}: {exc}"
        record.e2e_ms = (time.perf_counter() - started) * 1e3
        record.ok = error is None
        record.error = error or ""
        self._report(record, received)

    def _report(self, record: RequestRecord, received: int) -> None:
        fire = self.environment.events.request.fire
        fire(request_type="POST", name=f"chat/completions [{record.kind}]", response_time=record.e2e_ms,
             response_length=received, exception=None if record.ok else RequestFailed(record.error),
             context={"record": record})
        if not record.ok:
            return
        fire(request_type="TTFT", name=record.kind, response_time=record.ttft_ms, response_length=0,
             exception=None, context={})
        if record.itl_ms is not None:
            fire(request_type="ITL", name=record.kind, response_time=record.itl_ms, response_length=0,
                 exception=None, context={})
        fire(request_type="CACHED", name=record.kind, response_time=record.cached_tokens,
             response_length=record.prompt_tokens, exception=None, context={})


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]


def _read_stream(response: requests.Response, started: float, record: RequestRecord) -> tuple[str | None, int]:
    """Consume an SSE body into ``record``; returns (why it failed or None, bytes received)."""
    token_times: list[float] = []
    usage = None
    done = False
    received = 0
    # chunk_size=None: urllib3 yields each HTTP chunk as it arrives, so the clock reads arrival times.
    for line in response.iter_lines(chunk_size=None):
        received += len(line) + 1
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        now = time.perf_counter()
        try:
            event = json.loads(data)
        except ValueError:
            return f"malformed SSE data: {data[:120]!r}", received
        if "error" in event:
            return f"stream error: {event['error'].get('message')}", received
        if event.get("usage"):
            usage = event["usage"]
        if any("role" not in choice.get("delta", {}) for choice in event.get("choices", ())):
            token_times.append(now)
    if not done:
        return "the stream ended without [DONE]", received
    if usage is None or not token_times:
        return "the stream carried no usage or no tokens", received
    record.ttft_ms = (token_times[0] - started) * 1e3
    if len(token_times) > 1:
        record.itl_ms = (token_times[-1] - token_times[0]) * 1e3 / (len(token_times) - 1)
    record.token_chunks = len(token_times)
    record.prompt_tokens = usage["prompt_tokens"]
    record.completion_tokens = usage["completion_tokens"]
    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return None, received


class AgentUser(KvgateUser):
    """Multi-turn agent: its conversations one after another, each turn resending the whole history.

    A conversation starts after an exponential ``--conversation-gap``, or, with ``--conversation-rate``,
    at its arrival time on the run's Poisson clock (see :meth:`Workload.arrivals`), whose origin is
    the first AgentUser's start; a user still busy then starts it as soon as it is free."""

    clock_origin: float | None = None  # Unix time of the arrival clock's 0, shared by the process

    def on_start(self) -> None:
        options = self.environment.parsed_options
        if options.conversation_rate > 0 and options.conversation_gap > 0:
            raise ValueError("give --conversation-rate or --conversation-gap, not both")
        if AgentUser.clock_origin is None:
            AgentUser.clock_origin = time.time()
        self._conversations = self.items()
        if options.conversation_rate > 0:
            arrivals = self.workload.arrivals(options.conversation_rate)
            self._arrivals = itertools.islice(arrivals, self.number, None, self.stride)  # as self.items()
        else:
            self._arrivals = None
            self._gaps = self.workload.pauses("conversation", self.number, options.conversation_gap)
        self.arrival: float | None = None
        self._start_conversation()
        time.sleep(self._until_next_conversation())  # gevent's: only this user waits; later ones via wait_time

    def _start_conversation(self) -> None:
        self.conversation = self.workload.conversation(AGENT, next(self._conversations))
        self.turn = 0

    def _until_next_conversation(self) -> float:
        """Seconds to wait before the next conversation: its gap, or the time left to its arrival."""
        if self._arrivals is None:
            return next(self._gaps)
        self.arrival = AgentUser.clock_origin + next(self._arrivals)
        return max(0.0, self.arrival - time.time())

    def wait_time(self) -> float:
        think = super().wait_time()
        if self.turn < len(self.conversation.turns):
            return think
        wait = self._until_next_conversation()  # the next task starts a conversation
        return wait if self._arrivals is not None else think + wait

    @task
    def next_turn(self) -> None:
        if self.turn == len(self.conversation.turns):
            self._start_conversation()
        self.send(self.conversation, self.turn, self.arrival if self.turn == 0 else None)
        self.turn += 1


class ChatUser(KvgateUser):
    """Single-turn chat: one request per task, each a new question under a shared system prompt."""

    def on_start(self) -> None:
        self._requests = self.items()

    @task
    def ask(self) -> None:
        self.send(self.workload.conversation(CHAT, next(self._requests)), 0)
