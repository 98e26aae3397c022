"""Replica health: one circuit breaker per replica, fed by the active /stats probes and by requests.

- **closed**: the replica takes requests. Failures in a row (``failure_threshold``) open the breaker;
  a refused connection opens it at once (nothing listens on the port: there is nothing to wait for).
  Any success resets the count.
- **open**: no requests and no probes for ``cooldown_s``; the cooldown doubles at each failed probe
  up to ``max_cooldown_s``, so a dead replica costs a probe every half minute, not every second.
- **half-open**: the next health poll is the probe. Success closes the breaker (and resets the
  cooldown); failure opens it again.

Probes are the pool's /stats polls, never client requests: a replica coming back is tried on a
request only after it answered a probe.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

FAILURE_THRESHOLD = 3
BASE_COOLDOWN_S = 1.0
MAX_COOLDOWN_S = 30.0


class BreakerState(enum.Enum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"


@dataclass(slots=True)
class CircuitBreaker:
    """Not thread-safe: used on the gateway's event loop only."""

    failure_threshold: int = FAILURE_THRESHOLD
    base_cooldown_s: float = BASE_COOLDOWN_S
    max_cooldown_s: float = MAX_COOLDOWN_S
    clock: Callable[[], float] = time.monotonic
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0  # in a row
    cooldown_s: float = field(init=False)
    _opened_at: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        if not 0 < self.base_cooldown_s <= self.max_cooldown_s:
            raise ValueError("cooldowns must satisfy 0 < base_cooldown_s <= max_cooldown_s")
        self.cooldown_s = self.base_cooldown_s

    @property
    def closed(self) -> bool:
        return self.state is BreakerState.CLOSED

    def probe_due(self) -> bool:
        """Whether the health poll should probe now; an open breaker past its cooldown turns half-open."""
        if self.state is BreakerState.OPEN and self.clock() >= self._opened_at + self.cooldown_s:
            self.state = BreakerState.HALF_OPEN
        return self.state is not BreakerState.OPEN

    def record_success(self) -> None:
        self.failures = 0
        if self.state is not BreakerState.CLOSED:
            self.state = BreakerState.CLOSED
            self.cooldown_s = self.base_cooldown_s

    def record_failure(self, refused: bool = False) -> None:
        """One failed request or probe; ``refused``: the connection was refused (opens at once)."""
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN:
            self.cooldown_s = min(2 * self.cooldown_s, self.max_cooldown_s)
            self._open()
        elif self.state is BreakerState.CLOSED and (refused or self.failures >= self.failure_threshold):
            self._open()

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self._opened_at = self.clock()
