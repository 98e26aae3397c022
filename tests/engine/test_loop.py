"""EngineThread's outbox: first tokens and ends go at once, other frames wait for the event loop's share,
a failure delivers what the steps before it produced first (a fake clock and event loop; no thread).
And an idle loop's thread governor ticks (a real thread over a fake core)."""

import queue
import threading
import time
from types import SimpleNamespace

import pytest

import engine.loop as loop_module
from engine.config import EngineConfig
from engine.loop import DELIVERY_LOOP_SHARE, DELIVERY_MAX_WAIT_S, EngineLoop, EngineThread, StepOutput, Stop
from engine.protocol import OutputFrame


class Clock:
    def __init__(self):
        self.wall = 100.0
        self.cpu = 5.0  # the event loop thread's CPU seconds

    def perf_counter(self) -> float:
        return self.wall

    def thread_time(self) -> float:
        return self.cpu


class FakeEventLoop:
    """Runs nothing by itself: the test runs the scheduled callbacks."""

    def __init__(self):
        self.soon: list[tuple] = []
        self.later: list[tuple] = []

    def call_soon_threadsafe(self, fn, *args):
        self.soon.append((fn, *args))

    def call_later(self, delay, fn, *args):
        self.later.append((delay, fn, *args))

    def run_soon(self):
        calls, self.soon = self.soon, []
        for fn, *args in calls:
            fn(*args)


@pytest.fixture
def setup(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(loop_module, "time", clock)
    engine = EngineThread(EngineConfig(model="tiny", load_format="dummy"), lambda: None)
    delivered: list[list[OutputFrame]] = []
    failures: list[BaseException] = []
    event_loop = FakeEventLoop()
    engine._loop, engine._on_failure = event_loop, failures.append
    engine._deliver = lambda output: delivered.append(output.frames)
    engine._delivered_at, engine._delivered_cpu = clock.wall, clock.cpu
    return engine, clock, event_loop, delivered, failures


def frame(rid: str, token: int, finish: str | None = None) -> OutputFrame:
    return OutputFrame(rid, 0, [token], finish_reason=finish)


def post(engine: EngineThread, frames: list[OutputFrame]) -> None:
    engine.post(StepOutput(frames, [0.001]))


def test_first_tokens_go_at_once_later_frames_wait_for_the_loops_share(setup):
    engine, clock, event_loop, delivered, _ = setup
    clock.cpu += 0.002  # the loop parsed the requests: its share is spent, yet first tokens are not paced
    post(engine, [frame("a", 1), frame("b", 1)])
    event_loop.run_soon()
    assert [[f.token_ids for f in d] for d in delivered] == [[[1], [1]]]

    clock.wall += 0.001
    clock.cpu += 0.001  # the writes of that delivery
    post(engine, [frame("a", 2), frame("b", 2)])
    event_loop.run_soon()
    assert len(delivered) == 1 and len(event_loop.later) == 1
    delay, fn, *args = event_loop.later.pop()
    assert delay == pytest.approx(0.001 / DELIVERY_LOOP_SHARE - 0.001)
    post(engine, [frame("a", 3), frame("b", 3)])  # the outbox is pending: no new callback
    assert event_loop.soon == []
    clock.wall += delay
    fn(*args)
    assert [[f.token_ids for f in d] for d in delivered[1:]] == [[[2], [2], [3], [3]]]

    clock.cpu += 0.001
    post(engine, [frame("a", 4), frame("b", 4, "length")])  # b's end: at once, with a's token
    event_loop.run_soon()
    assert [[f.token_ids for f in d] for d in delivered[2:]] == [[[4], [4]]] and len(event_loop.later) == 0


def hold_a_second_token(setup, loop_cpu: float) -> None:
    """a's first token goes at once; its second, posted after the event loop spent ``loop_cpu``
    seconds, waits."""
    engine, clock, event_loop, _, _ = setup
    post(engine, [frame("a", 1)])
    event_loop.run_soon()
    clock.cpu += loop_cpu
    post(engine, [frame("a", 2)])
    event_loop.run_soon()


def test_the_wait_is_bounded_and_an_idle_loop_delivers_at_once(setup):
    engine, clock, event_loop, delivered, _ = setup
    hold_a_second_token(setup, 1.0)
    assert event_loop.later[0][0] == DELIVERY_MAX_WAIT_S
    event_loop.later.clear()
    engine._outbox = StepOutput()
    clock.wall += 1.0 / DELIVERY_LOOP_SHARE
    post(engine, [frame("a", 3)])
    event_loop.run_soon()
    assert event_loop.later == [] and delivered[-1][0].token_ids == [3]


def test_a_failure_delivers_the_pending_frames_first(setup):
    engine, _, event_loop, delivered, failures = setup
    hold_a_second_token(setup, 0.001)
    assert len(event_loop.later) == 1
    error = RuntimeError("step failed")
    engine.engine.fail(error)
    event_loop.run_soon()
    assert delivered[-1][0].token_ids == [2] and failures == [error]


@pytest.mark.parametrize("governed", [True, False])
def test_an_idle_loop_ticks_its_thread_governor(monkeypatch, governed):
    monkeypatch.setattr(loop_module, "GOVERNOR_WINDOW_S", 0.01)
    ticks = []
    governor = SimpleNamespace(tick=lambda: ticks.append(time.monotonic())) if governed else None
    core = SimpleNamespace(thread_governor=governor, has_work=lambda: False, stats=lambda: None)
    stats = []
    host = SimpleNamespace(publish_stats=stats.append)
    engine = EngineLoop(EngineConfig(model="tiny", load_format="dummy"), lambda: None, host)
    inbox = queue.SimpleQueue()
    serving = threading.Thread(target=engine._serve, args=(core, inbox))
    serving.start()
    time.sleep(0.3)
    inbox.put(Stop())
    serving.join(5)
    assert not serving.is_alive()
    assert len(ticks) >= 5 if governed else ticks == []
