"""A bounded pool of worker threads for the CPU work of a request (parsing, chat template, tokenizing),
so that no request blocks the event loop, with a deadline per request.

At most ``threads`` calls run at once and at most ``queue`` more wait; past that a request gets a 503
at once. A call that misses its deadline answers 503 too; its thread cannot be stopped, so it keeps
its place in the pool until it ends, and the pool's bound stays true.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gateway.errors import overloaded

T = TypeVar("T")
RETRY_AFTER_S = 1


class WorkerPool:
    def __init__(self, threads: int, queue: int, deadline_s: float):
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvgate-render")
        self._capacity = threads + queue
        self.pending = 0  # calls running or waiting, deadline missed or not
        self.deadline_s = deadline_s

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker thread; its exceptions propagate. Event loop only."""
        if self.pending >= self._capacity:
            raise overloaded(503, "this gateway's tokenizer workers are all busy; retry later", RETRY_AFTER_S)
        self.pending += 1
        # in the request's context, as asyncio.to_thread: its log lines keep the request id
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        future = asyncio.get_running_loop().run_in_executor(self._executor, call)
        future.add_done_callback(self._done)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.deadline_s)
        except TimeoutError:
            raise overloaded(503, f"preparing the prompt took longer than {self.deadline_s:g} s; retry later",
                             RETRY_AFTER_S) from None

    def _done(self, future: asyncio.Future) -> None:
        self.pending -= 1
        if not future.cancelled():
            future.exception()  # retrieved: a call past its deadline fails unseen, not as "never retrieved"

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
