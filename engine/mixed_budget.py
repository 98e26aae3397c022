"""The prompt tokens a step may hold beside running decodes, fitted to a target step latency.

A step's time is about ``fixed + per_token × tokens``: the fixed part (weights read once, launches,
the host's share) is paid whatever the step holds, so a budget sized as "what fits the target"
must know both. :class:`MixedPrefillBudget` fits that line by least squares over exponentially
decayed samples (recent steps weigh most, so the fit follows a changing load), keeping the steps
replayed from a CUDA graph apart from the eager ones: a graph step of n tokens costs far less
than an eager one, and mixed steps (a prefill beside decodes) always run eagerly, so only the eager
fit sets the budget. The budget is ``(target − fixed) / per_token`` tokens, never below the
prefill that costs as much as the fixed part (a step spends at least half its time on prompts,
whatever the target) nor below one quantum (a prompt always progresses), and never above the
step's token budget. Until the eager fit exists the budget grows by one quantum per eager step,
which spreads the samples over step sizes; once fitted it drops to the goal at once and grows
towards it by at least one quantum, and up to twice itself, per step.
"""

from __future__ import annotations

from typing import NamedTuple

import structlog

log = structlog.get_logger("engine.mixed_budget")

BUDGET_QUANTUM = 256  # tokens: the first budget, and its least step of growth
SAMPLE_DECAY = 0.9  # a sample's weight, per later sample of its kind
_MIN_SAMPLES = 3


class StepCostLine(NamedTuple):
    fixed_s: float
    per_token_s: float


class DecayedLineFit:
    """Weighted least squares of ``elapsed = fixed + per_token × tokens``, every older sample's
    weight multiplied by ``decay`` when a new one comes."""

    def __init__(self, decay: float = SAMPLE_DECAY):
        self.decay = decay
        self.num_samples = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, tokens: int, elapsed_s: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + tokens
        self._y = self._y * d + elapsed_s
        self._xx = self._xx * d + tokens * tokens
        self._xy = self._xy * d + tokens * elapsed_s
        self.num_samples += 1

    def line(self) -> StepCostLine | None:
        """The fitted line, or None until there are enough samples of distinct sizes and the cost
        rises with the tokens (a flat or falling fit says nothing about a budget)."""
        spread = self._w * self._xx - self._x * self._x
        if self.num_samples < _MIN_SAMPLES or spread <= 1e-9 * self._w * self._xx:
            return None
        per_token = (self._w * self._xy - self._x * self._y) / spread
        if per_token <= 0:
            return None
        fixed = max(0.0, (self._y - per_token * self._x) / self._w)
        return StepCostLine(fixed, per_token)


class MixedPrefillBudget:
    """The scheduler reads ``budget``; the core feeds ``observe`` one sample per step it ran.
    Not thread-safe (the engine loop alone uses it)."""

    def __init__(self, target_s: float, max_tokens: int, quantum: int = BUDGET_QUANTUM):
        if target_s <= 0:
            raise ValueError(f"a mixed-prefill target must be positive, got {target_s}")
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.quantum = min(quantum, max_tokens)
        self.budget = self.quantum
        self.eager = DecayedLineFit()
        self.graphed = DecayedLineFit()

    def observe(self, tokens: int, elapsed_s: float, graphed: bool) -> None:
        """Record that a step of ``tokens`` tokens took ``elapsed_s`` (``graphed``: replayed from a
        CUDA graph), and move the budget."""
        if graphed:
            self.graphed.add(tokens, elapsed_s)
            return
        self.eager.add(tokens, elapsed_s)
        line = self.eager.line()
        if line is None:
            self.budget = min(self.budget + self.quantum, self.max_tokens)
            return
        goal = self.goal(line)
        grown = max(self.budget + self.quantum, 2 * self.budget)
        self.budget = goal if goal <= self.budget else min(goal, grown)
        log.debug("mixed_prefill_fit", fixed_ms=round(line.fixed_s * 1e3, 3),
                  per_token_us=round(line.per_token_s * 1e6, 3), goal=goal, budget=self.budget,
                  samples=self.eager.num_samples)

    def goal(self, line: StepCostLine) -> int:
        """The budget ``line`` asks for: what fits the target, floored and capped."""
        fits = (self.target_s - line.fixed_s) / line.per_token_s
        floor = max(line.fixed_s / line.per_token_s, self.quantum)
        return round(min(max(fits, floor), self.max_tokens))
