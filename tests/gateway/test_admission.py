"""Admission by work: the Admission object's arithmetic, the race against a real gateway (48
simultaneous requests against a limit of 4), a request of 100 prompts × n=16, and load shedding from
the engines' queues."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from gw_harness import API_KEYS, Proc, start_gateway
from stats_testing import engine_stats

from gateway.admission import Admission, AdmissionLimits
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.middleware import RequestRecord
from gateway.replica import Replica
from gateway.run import Run
from gateway.serving import Serving

AUTH = {"Authorization": f"Bearer {API_KEYS[0]}"}


def test_reservations_are_counted_and_released_exactly_once():
    admission = Admission(AdmissionLimits(max_requests=2, max_sequences=10, max_prompt_tokens=100))
    a = admission.enter()
    a.reserve(sequences=4)
    a.reserve(prompt_tokens=60)
    b = admission.enter()
    with pytest.raises(APIError) as busy:
        admission.enter()
    assert busy.value.status == 503 and int(busy.value.headers["Retry-After"]) >= 1
    with pytest.raises(APIError) as no_room:
        b.reserve(sequences=7)  # 4 + 7 > 10: not now, and nothing is reserved
    assert no_room.value.status == 503 and (admission.sequences, b.sequences) == (4, 0)
    with pytest.raises(APIError) as never:
        b.reserve(sequences=11)  # more than the whole budget: never
    assert never.value.status == 400 and never.value.param == "n"
    with pytest.raises(APIError) as tokens:
        b.reserve(prompt_tokens=50)
    assert tokens.value.status == 503
    a.release()
    a.release()  # the second release gives nothing back twice
    assert (admission.requests, admission.sequences, admission.prompt_tokens) == (1, 0, 0)
    b.reserve(sequences=10, prompt_tokens=100)
    b.release()
    assert (admission.requests, admission.sequences, admission.prompt_tokens) == (0, 0, 0)


@pytest.fixture(scope="module")
def gateway_of_4(dummy_engine, tmp_path_factory) -> Iterator[Proc]:
    gw = start_gateway(tmp_path_factory.mktemp("admission") / "gateway.log", "--engine", dummy_engine.url,
                       "--api-key", API_KEYS[0], "--max-in-flight", "4")
    yield gw
    gw.stop()


async def test_simultaneous_requests_admit_exactly_the_limit(gateway_of_4):
    """48 streams sent at once, each long enough to hold its slot while the others arrive."""
    body = {"prompt": "hold the slot", "max_tokens": 900, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=gateway_of_4.url, headers=AUTH, timeout=60,
                                 limits=httpx.Limits(max_connections=64)) as client:
        gate = asyncio.Event()

        async def one() -> tuple[int, str | None]:
            await gate.wait()
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code == 200:
                    async for _ in resp.aiter_lines():  # read on until all 48 have answered
                        if all_answered.is_set():
                            break
                return resp.status_code, resp.headers.get("retry-after")

        all_answered = asyncio.Event()
        tasks = [asyncio.create_task(one()) for _ in range(48)]
        await asyncio.sleep(0.2)
        gate.set()
        while sum(t.done() for t in tasks) < 44:
            await asyncio.sleep(0.05)
        all_answered.set()
        results = await asyncio.gather(*tasks)
    statuses = [s for s, _ in results]
    assert statuses.count(200) == 4 and statuses.count(503) == 44
    assert all(retry is not None and int(retry) >= 1 for s, retry in results if s == 503)


def test_a_request_beyond_the_sequence_budget_is_refused_before_the_engine(gateway_of_4, dummy_engine):
    body = {"prompt": [f"prompt {i}" for i in range(100)], "n": 16, "max_tokens": 4}
    resp = httpx.post(gateway_of_4.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "n" and "1600 sequences" in error["message"]
    stats = httpx.get(dummy_engine.url + "/stats").json()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    too_many = httpx.post(gateway_of_4.url + "/v1/completions", json={"prompt": ["x"] * 129, "max_tokens": 1},
                          headers=AUTH, timeout=30)
    assert too_many.status_code == 400 and "at most 128" in too_many.json()["error"]["message"]


def test_a_replica_predicts_its_queue_from_its_waiting_tokens_and_measured_rate():
    replica = Replica("http://e:1", client=None)
    replica.observe(engine_stats(num_waiting_tokens=8000, total_computed_tokens=0, total_busy_seconds=0.0), 0.0)
    assert replica.queue_seconds is None  # no rate yet
    replica.observe(engine_stats(num_waiting_tokens=8000, total_computed_tokens=4000, total_busy_seconds=1.0), 1.0)
    assert replica.token_rate == 4000 and replica.queue_seconds == 2.0
    replica.observe(engine_stats(num_waiting_tokens=0, total_computed_tokens=4000, total_busy_seconds=1.0), 2.0)
    assert replica.token_rate == 4000 and replica.queue_seconds == 0.0  # idle: the rate stays


def shedding(queues: list[float | None]) -> APIError | None:
    replicas = []
    for q in queues:
        replica = Replica("http://e:1", client=None)
        replica.stats = engine_stats(num_waiting_tokens=0 if q is None else int(q * 1000))
        replica.token_rate = None if q is None else 1000.0
        replicas.append(replica)
    serving = Serving.__new__(Serving)
    serving.config = GatewayConfig(max_queue_seconds=5.0)
    try:
        serving._shed(replicas)
    except APIError as exc:
        return exc
    return None


def test_load_is_shed_only_when_every_replica_is_past_the_bound():
    assert shedding([6.0, 4.0]) is None  # one replica can still take it in time
    assert shedding([6.0, None]) is None  # a replica without a measured rate: no prediction, no refusal
    refused = shedding([9.5, 7.2])
    assert refused.status == 503 and refused.headers["Retry-After"] == "3"  # until 7.2 s is under 5 s
    assert "more than 5 s of queued work" in refused.message


@pytest.mark.parametrize("failed, blamed", [(False, True), (True, False)])
async def test_an_unfinished_request_blames_the_client_only_when_no_exception_ended_it(failed, blamed):
    """A request cut short by our own failure must not log that the client left (its handler says why)."""
    serving = Serving.__new__(Serving)
    serving.admission = Admission(AdmissionLimits(1, 1, 1))
    serving.metrics = GatewayMetrics()
    choice = SimpleNamespace(finish_reason=None, seq=SimpleNamespace(num_tokens=3))
    run = Run(jobs=[], choices=[choice], logprobs=False)
    record = RequestRecord("r", 0.0)
    await serving._finish(run, record, serving.admission.enter(), None, failed)
    assert (record.error is not None and "client left" in record.error) == blamed
    assert serving.admission.requests == 0
