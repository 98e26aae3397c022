"""The mixed-prefill budget: a fit of step cost fed recorded (tokens, elapsed, graphed) samples, and
the scheduler holding a prompt to it beside running decodes."""

import pytest

from engine.kv_cache import KVCacheManager
from engine.mixed_budget import BUDGET_QUANTUM, DecayedLineFit, MixedPrefillBudget
from engine.protocol import SamplingParams
from engine.request import Sequence
from engine.scheduler import Scheduler

# Eager steps of an 8B-like shape: 6 ms fixed, 10 us per token; graph-replayed decode steps cost 4 ms
# whatever their size, which must not pull the eager fit's fixed part down.
EAGER = [(t, 0.006 + 10e-6 * t, False) for t in (300, 700, 1100, 1500, 1900, 2300, 2700)]
GRAPHED = [(b, 0.004, True) for b in (1, 8, 64)]


def test_fit_recovers_the_line_and_needs_spread_sizes():
    fit = DecayedLineFit()
    for tokens, elapsed, _ in EAGER:
        fit.add(tokens, elapsed)
    fixed, per_token = fit.line()
    assert fixed == pytest.approx(0.006) and per_token == pytest.approx(10e-6)
    same = DecayedLineFit()
    for _ in range(5):
        same.add(512, 0.01)
    assert same.line() is None  # one size: no slope
    falling = DecayedLineFit()
    for tokens, elapsed in ((100, 0.02), (200, 0.015), (300, 0.01)):
        falling.add(tokens, elapsed)
    assert falling.line() is None


def test_budget_grows_by_a_quantum_until_fitted_then_doubles_to_the_goal():
    budget = MixedPrefillBudget(target_s=0.050, max_tokens=8192)
    seen = [budget.budget]
    for sample in [GRAPHED[0], *EAGER[:2], GRAPHED[1], *EAGER[2:], GRAPHED[2]]:
        budget.observe(*sample)
        seen.append(budget.budget)
    q = BUDGET_QUANTUM
    goal = round((0.050 - 0.006) / 10e-6)  # 4400 tokens fit 50 ms
    # graphed samples leave it; two eager ones: one quantum each (no fit yet); then 2x per step
    assert seen[:6] == [q, q, 2 * q, 3 * q, 3 * q, 6 * q]
    assert seen[6:9] == [12 * q, goal, goal]
    assert seen[-1] == goal
    assert budget.graphed.line() is None  # flat: graph replays cost the same at every size


def test_budget_floor_is_the_prefill_that_costs_the_fixed_part():
    budget = MixedPrefillBudget(target_s=0.008, max_tokens=8192)  # 8 ms: barely above the 6 ms fixed part
    for sample in EAGER:
        budget.observe(*sample)
    assert budget.goal(budget.eager.line()) == 600  # 6 ms / 10 us, not (8 - 6) / 0.01 = 200
    assert budget.budget == 600
    # a slower load (a 30 ms fixed part): the decayed fit follows it, the budget to its floor
    for tokens in (500, 1000, 1500, 2000, 2500, 3000) * 8:
        budget.observe(tokens, 0.030 + 10e-6 * tokens, False)
    assert budget.budget == pytest.approx(3000, rel=0.02)


def test_budget_caps_at_the_step_budget_and_never_drops_below_a_quantum():
    budget = MixedPrefillBudget(target_s=10.0, max_tokens=2048)
    for sample in EAGER:
        budget.observe(*sample)
    assert budget.budget == 2048
    cheap = MixedPrefillBudget(target_s=0.001, max_tokens=8192)
    for tokens in (100, 200, 300, 400):
        cheap.observe(tokens, 1e-5 * tokens, False)  # no fixed part at all
    assert cheap.budget == BUDGET_QUANTUM
    with pytest.raises(ValueError, match="positive"):
        MixedPrefillBudget(target_s=0.0, max_tokens=8192)


def seq(rid: str, prompt_len: int) -> Sequence:
    sampling = SamplingParams(max_tokens=100, ignore_eos=True)
    return Sequence(rid, 0, list(range(1, prompt_len + 1)), sampling, None, [], None)


def test_scheduler_holds_a_prompt_beside_decodes_to_the_budget():
    budget = MixedPrefillBudget(target_s=0.050, max_tokens=4096, quantum=64)
    scheduler = Scheduler(KVCacheManager(4096, 16), max_num_seqs=8, max_num_batched_tokens=4096, mixed_budget=budget)
    decoding = seq("decoding", 10)
    scheduler.add(decoding)
    [(s, n)] = scheduler.schedule().scheduled
    assert n == 10  # no decode yet: the whole prompt
    scheduler.update([(s, n)], [])
    decoding.append_token(7)
    long = seq("long", 1000)
    scheduler.add(long)
    assert [(s.request_id, n) for s, n in scheduler.schedule().scheduled] == [("decoding", 1), ("long", 64)]
    budget.budget = 200
    scheduler.update([(decoding, 1), (long, 64)], [])
    decoding.append_token(8)
    assert [(s.request_id, n) for s, n in scheduler.schedule().scheduled] == [("decoding", 1), ("long", 200)]


def test_the_core_feeds_the_budget_its_steps_and_reports_it(tiny):
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.protocol import GenerateRequest

    model, config = tiny
    settings = EngineConfig(model="tiny", max_num_batched_tokens=64, num_kv_blocks=128, block_size=4,
                            mixed_prefill_step_latency_ms=1000.0)
    core = EngineCore.from_model(settings, model, config)
    assert core.stats().mixed_prefill_budget == BUDGET_QUANTUM // 4 == 64  # a quantum, capped at the step budget
    core.add_request(GenerateRequest("a", list(range(10, 20)), SamplingParams(max_tokens=4, ignore_eos=True)))
    while core.has_work():
        core.step()
    assert core.scheduler.mixed_budget.eager.num_samples == 4  # the prefill and 3 decodes, all eager on the CPU
    assert core.stats().mixed_prefill_budget == core.scheduler.mixed_budget.budget
    off = EngineCore.from_model(EngineConfig(model="tiny", num_kv_blocks=128), model, config)
    assert off.scheduler.mixed_budget is None and off.stats().mixed_prefill_budget == off.config.max_num_batched_tokens
