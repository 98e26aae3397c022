"""One engine replica as this gateway sees it: its client, breaker, last /stats, load and utilization.

The pool writes it (polls, breaker reports) and the dispatcher counts its requests on it; routing
policies only read it. It imports nothing of either, so that both can depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.protocol import EngineStats, ModelLimits
from gateway.engine_client import EngineClient
from gateway.health import CircuitBreaker

UTILIZATION_EWMA_WEIGHT = 0.3  # of the latest poll interval in a replica's utilization (1 s polls: ~3 s)
RATE_EWMA_WEIGHT = 0.3  # of the latest poll interval in a replica's tokens per busy second


class Interruptible(Protocol):
    """An engine request on a replica, which the pool ends when the replica is taken out of service."""

    def interrupt(self, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the engines report about the model they serve (GET /stats)."""

    name: str
    limits: ModelLimits
    block_size: int

    @classmethod
    def from_stats(cls, stats: EngineStats) -> ModelInfo:
        return cls(stats.model, ModelLimits(stats.vocab_size, stats.max_model_len), stats.block_size)


@dataclass(slots=True, eq=False)
class Replica:
    """One engine sidecar as this gateway sees it. Mutated only on the event loop."""

    url: str
    client: EngineClient
    ready: bool = False  # routable: its engine answers ready and its circuit breaker is closed
    pending_prefill_tokens: int = 0  # predicted uncached prompt tokens of those without a first token yet
    stats: EngineStats | None = None  # its last /stats the pool accepted
    in_flight_at_poll: int = 0  # in_flight when ``stats`` was taken
    utilization: float = 0.0  # busy fraction of its engine loop, smoothed over polls
    token_rate: float | None = None  # tokens its engine computes per busy second, smoothed; None: not seen yet
    work_sample: tuple[int, float] | None = None  # (total_computed_tokens, total_busy_seconds) at the last poll
    busy_sample: tuple[float, float] | None = None  # (engine's total_busy_seconds, monotonic time) at the last poll
    engine_ready: bool = False  # its last /stats answered 200 with the pool's model
    error: str | None = None  # why it is not ready
    failed_at: float = float("-inf")  # monotonic time of its last reported failure
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    streams: set[Interruptible] = field(default_factory=set)  # this gateway's engine requests on it

    @property
    def replica_id(self) -> str | None:
        """Its id in the prefix index (from /stats)."""
        return self.stats.replica_id if self.stats is not None else None

    @property
    def kv_footprint(self) -> float:
        """Share of its engine's KV blocks in use or holding cached prefixes, as of the last poll (0 before one).

        Free blocks include evictable cached ones, so the larger of the two counts is the surer one."""
        s = self.stats
        if s is None or s.num_total_blocks == 0:
            return 0.0
        return max(s.num_total_blocks - s.num_free_blocks, s.num_cached_blocks) / s.num_total_blocks

    @property
    def in_flight(self) -> int:
        """This gateway's engine requests on it."""
        return len(self.streams)

    @property
    def queued(self) -> int:
        """Requests waiting in the engine's queue, as of the last poll."""
        return self.stats.num_waiting if self.stats is not None else 0

    @property
    def other_requests(self) -> int:
        """Requests on the engine that this gateway did not count (other gateways'), as of the last poll."""
        if self.stats is None:
            return 0
        return max(0, self.stats.num_running + self.stats.num_waiting - self.in_flight_at_poll)

    @property
    def queue_seconds(self) -> float | None:
        """Predicted seconds before a new request starts here: the prompt tokens waiting there at the
        engine's measured rate; None until a rate has been measured. Waiting: the engine's own count as of
        the last poll, or this gateway's requests before their first token when more (they count at once,
        a poll later)."""
        if self.stats is None or self.token_rate is None:
            return None
        return max(self.stats.num_waiting_tokens, self.pending_prefill_tokens) / self.token_rate

    def observe(self, stats: EngineStats, now: float) -> None:
        """A poll's accepted /stats, taken at time ``now``: updates the load figures, ``utilization`` and
        ``token_rate``."""
        self.stats = stats
        self.in_flight_at_poll = self.in_flight
        self.observe_busy(stats.total_busy_seconds, now)
        if self.work_sample is not None:
            tokens = stats.total_computed_tokens - self.work_sample[0]
            busy = stats.total_busy_seconds - self.work_sample[1]
            if tokens > 0 and busy > 0:
                rate = tokens / busy
                self.token_rate = rate if self.token_rate is None else (
                    self.token_rate + RATE_EWMA_WEIGHT * (rate - self.token_rate))
        self.work_sample = (stats.total_computed_tokens, stats.total_busy_seconds)

    def observe_busy(self, busy_seconds: float, now: float) -> None:
        """A poll's ``total_busy_seconds`` counter at time ``now``: updates ``utilization``."""
        if self.busy_sample is not None and now > self.busy_sample[1] and busy_seconds >= self.busy_sample[0]:
            fraction = min(1.0, (busy_seconds - self.busy_sample[0]) / (now - self.busy_sample[1]))
            self.utilization += UTILIZATION_EWMA_WEIGHT * (fraction - self.utilization)
        self.busy_sample = (busy_seconds, now)
