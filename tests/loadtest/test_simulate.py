"""loadtest/simulate.py: the fitted step model, the simulated engine's cache and KV events, and a
small fleet run of the real router against the baselines."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import uuid

import pytest

from loadtest.simulate import BENCH, BLOCK_SIZE, Conversations, SimEngine, SimRequest, StepModel, simulate
from loadtest.stamp import stamp
from loadtest.workload import WorkloadConfig
from prefix_index.events import KVEventBatch
from prefix_index.hashing import block_hashes
from prefix_index.index import open_index


def test_the_step_model_fits_the_h200_measurements():
    model = StepModel.fit(BENCH)
    assert model.overhead_s > 0 and model.prefill_token_s > 0 and model.decode_seq_s > 0
    assert model.fit_error < 0.35  # every measurement within 35 % of the fitted line
    assert (model.num_kv_blocks, model.max_num_seqs, model.max_num_batched_tokens) == (55302, 64, 8192)
    assert model.step_s(8190, 0) == pytest.approx(0.2095, rel=0.35)  # the 8K prefill, measured 209.5 ms


def request(tokens: list[int], max_tokens: int = 2) -> SimRequest:
    return SimRequest(0, tokens, block_hashes(tokens, BLOCK_SIZE), max_tokens, 0.0, 0)


def run_to_end(engine: SimEngine, index) -> None:
    while engine.running or engine.waiting:
        engine.step()
        batch = engine.events()
        if batch is not None:
            asyncio.run(index.apply(batch))


def test_the_engine_reuses_cached_prefixes_evicts_lru_and_publishes_both():
    small = dataclasses.replace(StepModel.fit(BENCH), num_kv_blocks=12)
    engine = SimEngine("e0", small)
    index = open_index(f"memory://sim-{uuid.uuid4().hex}", "m", BLOCK_SIZE)
    asyncio.run(index.apply(KVEventBatch("e0", 1, [])))
    assert asyncio.run(index.heartbeat("e0", 1, 60))
    first = request(list(range(100, 180)))  # 5 blocks
    engine.waiting.append(first)
    run_to_end(engine, index)
    assert first.cached_tokens == 0 and len(engine.refs) == 5 and not engine.running
    assert asyncio.run(index.lookup(first.hashes)) == {"e0": 5}
    longer = request(list(range(100, 180)) + [7] * 40)  # its next turn: 4 of its 7 blocks cached
    engine.waiting.append(longer)
    run_to_end(engine, index)
    assert longer.cached_tokens == 5 * BLOCK_SIZE
    assert asyncio.run(index.lookup(longer.hashes)) == {"e0": 7}
    other = request(list(range(900, 980)))  # 5 new blocks + 1 for its answer: the LRU ones go
    engine.waiting.append(other)
    run_to_end(engine, index)
    assert engine.free + len(engine.lru) + sum(1 for h in engine.refs if engine.refs[h]) == 12
    assert asyncio.run(index.lookup(longer.hashes))["e0"] < 7  # the index saw the evictions
    assert asyncio.run(index.lookup(other.hashes)) == {"e0": 5}
    asyncio.run(index.close())


def test_each_turn_extends_the_last():
    turns = list(Conversations(WorkloadConfig(turns=3)).turns(5))
    assert len(turns) == 3
    for (before, *_), (after, *_) in zip(turns, turns[1:], strict=False):
        assert after[:len(before)] == before and len(after) > len(before)
    other = list(Conversations(WorkloadConfig(turns=3)).turns(6))
    shared = turns[0][3] if turns[0][2] == other[0][2] else 0  # the same system prompt: its blocks shared
    assert block_hashes(turns[0][0], BLOCK_SIZE)[:shared] == block_hashes(other[0][0], BLOCK_SIZE)[:shared]


def test_prefix_routing_beats_round_robin_in_a_small_fleet():
    args = argparse.Namespace(backend="memory", rate=1.0, think_time=2.0, seed=0)
    model = StepModel.fit(BENCH)
    stamped = stamp()
    prefix = asyncio.run(simulate(args, model, 4, 40, "prefix", stamped))
    baseline = asyncio.run(simulate(args, model, 4, 40, "round-robin", stamped))
    for record in (prefix, baseline):
        assert record["requests"] == 40 * 8 and record["ideal_hit_rate"] > 0.5
    assert prefix["of_ideal"] > 0.95 > baseline["of_ideal"]
    assert prefix["ttft_p90_ms"] < baseline["ttft_p90_ms"]
    assert prefix["commit"] and prefix["date"]
