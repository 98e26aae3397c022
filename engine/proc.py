"""The engine in a process of its own, the HTTP server in the parent (``python -m engine serve``'s default).

One process would share one GIL between the event loop and the engine's step loop: at 64 streams of
SmolLM2 on the H200 the HTTP work of a step took as long as the step, and the sidecar decoded at 0.71 of the
offline rate even with paced deliveries (benchmarks/results/served_h200.jsonl; on an H100 0.73-0.80, and
0.90 with the engine in its own process: served_h100_process.jsonl). So, as vLLM's API server
and EngineCoreProc: the parent serves HTTP and spawns (never forks: CUDA) the engine process, whose main
thread runs :class:`engine.loop.EngineLoop`; a tensor-parallel engine's other ranks are its children.

They talk over a pipe (a socket pair), one msgpack array per message, in the protocol's wire forms:

    HTTP -> engine   ["add", GenerateRequest]  ["abort", request_id]  ["call", id, name, args]  ["stop"]
    engine -> HTTP   ["started", ModelLimits, EngineStats]  ["out", [OutputFrame], step_seconds, queue_seconds]
                     ["stats", EngineStats]  ["reply", id, error | None, result]  ["failed", message]

The engine sends a message per step; the event loop reads whatever has arrived when the pipe turns
readable and delivers it at once (under load several steps a delivery). Pacing the deliveries as the
thread host does cut the event loop's CPU at 64 SmolLM2 streams (1.15 -> 0.7 ms a step) but not the
engine's steps, and the sidecar decoded slower: 0.82 of offline against 0.90 unpaced (H100,
benchmarks/results/served_h100_process.jsonl). A failure:
a step that raises, or a dead tensor-parallel rank, is sent as "failed" and ends the engine process; an
engine process that ends without one (killed, out of memory) is one too. Either way health goes red and
every open stream ends with an error. The engine process dies with its parent (PR_SET_PDEATHSIG) and
stops when the pipe closes; SIGINT (a terminal's Ctrl-C reaches the whole process group) is left to the
parent, which stops it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import structlog

from engine.config import EngineConfig
from engine.logs import configure_logging
from engine.loop import Abort, Add, Call, Command, EngineLoop, StepOutput, Stop
from engine.parent import die_with_parent
from engine.protocol import EngineStats, GenerateRequest, ModelLimits, OutputFrame, ProtocolError

log = structlog.get_logger("engine.proc")

_STOP_JOIN_S = 20.0  # the engine process's stop: a tensor-parallel engine stops its ranks first


def _pack(message: list) -> bytes:
    return msgpack.packb(message)


def _unpack(data: bytes) -> list:
    return msgpack.unpackb(data, strict_map_key=False)  # logit_bias: int keys


def _error_wire(exc: BaseException) -> list:
    return [type(exc).__name__, str(exc), getattr(exc, "param", None)]


def _error(wire: list) -> BaseException:
    """The exception a reply's error stands for: ProtocolError (a 400), AssertionError (an integrity
    check), else RuntimeError."""
    kind, message, param = wire
    if kind == "ProtocolError":
        return ProtocolError(message, param)
    return AssertionError(message) if kind in ("IntegrityError", "AssertionError") else RuntimeError(message)


class EngineProcess:
    """The HTTP process's handle on the engine process.

    Called on the event loop: :meth:`start`, :meth:`stop`, :meth:`submit`, :meth:`abort`, :meth:`request`;
    ``ready``, ``failed``, ``limits`` and ``snapshot`` are set there. ``make_core``, when given, runs in the
    engine process (so it must pickle: a module-level function)."""

    def __init__(self, config: EngineConfig, make_core: Callable[[], Any] | None = None):
        self._config = config
        self._make_core = make_core
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.limits: ModelLimits | None = None
        self.snapshot: EngineStats | None = None
        self.process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Callable[[StepOutput], None] | None = None
        self._on_failure: Callable[[BaseException], None] | None = None
        self._pending: dict[int, asyncio.Future] = {}  # requests by call id
        self._call_ids = itertools.count()

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[StepOutput], None],
              on_failure: Callable[[BaseException], None]) -> None:
        """Spawn the engine process: ``deliver(output)`` as outputs arrive and ``on_failure(exc)`` once if
        the engine fails, both on ``loop``."""
        import torch

        self._loop, self._deliver, self._on_failure = loop, deliver, on_failure
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        # not a daemon: a daemon may not start children (a tensor-parallel engine's ranks); stop() ends it
        self.process = ctx.Process(
            target=_engine_main, name="engine-core",
            args=(self._config, self._make_core, child, os.getpid(), torch.get_num_threads(), log_level),
        )
        self.process.start()
        child.close()
        loop.add_reader(self._conn.fileno(), self._read)
        log.info("engine_process_started", pid=self.process.pid)

    def stop(self) -> None:
        """Stop the engine process (killed if it does not end in time) and close the pipe."""
        if self.process is None:
            return
        self._send(["stop"])
        self.process.join(_STOP_JOIN_S)
        if self.process.is_alive():
            log.warning("engine_process_killed", pid=self.process.pid)
            self.process.kill()
            self.process.join()
        if not self._conn.closed:
            self._loop.remove_reader(self._conn.fileno())
            self._conn.close()

    def submit(self, request: GenerateRequest) -> None:
        self._send(["add", request.to_wire()])

    def abort(self, request_id: str) -> None:
        self._send(["abort", request_id])

    async def request(self, name: str, *args: Any) -> Any:
        """The named request's (:data:`engine.loop.CALLS`) result; raises its error (or the engine's failure)."""
        if self.failed is not None:
            raise self.failed
        call_id = next(self._call_ids)
        future = self._pending[call_id] = self._loop.create_future()
        self._send(["call", call_id, name, list(args)])
        try:
            return await future
        finally:
            self._pending.pop(call_id, None)

    def _send(self, message: list) -> None:
        try:
            self._conn.send_bytes(_pack(message))
        except OSError:  # the engine process is gone: the pipe's end, read by _read, fails the engine
            pass

    def _read(self) -> None:
        """The pipe is readable: handle every message that has arrived, then deliver their frames at once."""
        output = StepOutput()
        try:
            while self._conn.poll():
                message = _unpack(self._conn.recv_bytes())
                match message[0]:
                    case "out":
                        output.frames += [OutputFrame.from_wire(wire) for wire in message[1]]
                        output.step_seconds += message[2]
                        output.queue_seconds += message[3]
                    case "stats":
                        self.snapshot = EngineStats.from_wire(message[1])
                    case "reply":
                        _, call_id, error, result = message
                        future = self._pending.get(call_id)
                        if future is None or future.done():
                            continue
                        if error is not None:
                            future.set_exception(_error(error))
                        else:
                            future.set_result(result)
                    case "started":
                        self.limits, self.snapshot = ModelLimits(*message[1]), EngineStats.from_wire(message[2])
                        self.ready.set()
                    case "failed":
                        self._deliver_and_fail(output, RuntimeError(message[1]))
                        output = StepOutput()
        except (EOFError, OSError):
            self._loop.remove_reader(self._conn.fileno())
            self._conn.close()
            self.process.join(1.0)
            log.error("engine_process_exited", pid=self.process.pid, exitcode=self.process.exitcode)
            self._deliver_and_fail(output, RuntimeError(f"engine process exited (code {self.process.exitcode})"))
            return
        if output.frames or output.step_seconds:
            self._deliver(output)

    def _deliver_and_fail(self, output: StepOutput, exc: BaseException) -> None:
        """The frames of the steps before the failure, then the failure (once: the first one wins)."""
        if output.frames or output.step_seconds:
            self._deliver(output)
        if self.failed is not None:
            return
        self.failed = exc
        for future in self._pending.values():
            if not future.done():
                future.set_exception(exc)
        self._on_failure(exc)


# --- the engine process --------------------------------------------------------------------------
class _Pipe:
    """The engine process's end: the loop's inbox (commands decoded from the pipe) and its host (outputs
    encoded onto it; sends are locked, as the compile worker and a rank's watchdog send too)."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._lock = threading.Lock()

    def _send(self, message: list) -> None:
        data = _pack(message)
        with self._lock:
            self._conn.send_bytes(data)

    def get(self, block: bool = True, timeout: float | None = None) -> Command:
        if not self._conn.poll(timeout if block else 0):
            raise queue.Empty
        try:
            message = _unpack(self._conn.recv_bytes())
        except EOFError:  # the HTTP process is gone
            return Stop()
        match message[0]:
            case "add":
                return Add(GenerateRequest.from_wire(message[1]))
            case "abort":
                return Abort(message[1])
            case "call":
                return Call(message[2], tuple(message[3]), functools.partial(self._reply, message[1]))
            case _:
                return Stop()

    def _reply(self, call_id: int, error: BaseException | None, result: Any) -> None:
        self._send(["reply", call_id, None if error is None else _error_wire(error), result])

    def started(self, core, stats: EngineStats) -> None:
        limits = core.limits
        self._send(["started", [limits.vocab_size, limits.max_model_len, limits.max_kv_tokens], stats.to_wire()])

    def post(self, output: StepOutput) -> None:
        self._send(["out", [f.to_wire() for f in output.frames], output.step_seconds, output.queue_seconds])

    def publish_stats(self, stats: EngineStats) -> None:
        self._send(["stats", stats.to_wire()])

    def report_failure(self, exc: BaseException) -> None:
        try:
            self._send(["failed", str(exc)])
        except OSError:  # the HTTP process is gone
            pass
        if threading.current_thread() is not threading.main_thread():
            # a dead rank's watchdog: the loop may be blocked in a collective with it, so end here (the
            # other ranks see their pipes close and end too)
            os._exit(1)


def _engine_main(config: EngineConfig, make_core: Callable[[], Any] | None, conn: Connection, parent_pid: int,
                 cpu_threads: int, log_level: str) -> None:
    """The engine process: run the loop until Stop, the pipe's end or a failure (exit code 1)."""
    die_with_parent(signal.SIGKILL, parent_pid)  # elsewhere than Linux the pipe's end stops it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(log_level)
    import torch

    torch.set_num_threads(cpu_threads)  # --cpu-threads; the governor and OMP env came with the environment
    pipe = _Pipe(conn)
    engine = EngineLoop(config, make_core, pipe)
    try:
        engine.run(pipe)
    finally:
        engine.close()
    sys.exit(1 if engine.failed is not None else 0)
