"""Admission by work: requests, sequences and prompt tokens in flight, reserved atomically.

Every check and its reservation happen in one synchronous call on the event loop, so no request can
slip in between another's check and its count (the old check-then-await-then-count admitted 21 of 24
requests against a limit of 2). A request takes its slot before anything is awaited (:meth:`Admission.enter`),
its sequences (prompts × n) as soon as its body is parsed and its prompt tokens once they are counted
(:meth:`Ticket.reserve`); :meth:`Ticket.release` gives everything back exactly once, however the request
ends. A request that cannot fit now gets a 503 with a Retry-After from how long admitted requests hold
their reservations; one that could never fit (more sequences or tokens than the whole budget) a 400.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from gateway.errors import APIError, overloaded

HOLD_EWMA_WEIGHT = 0.1  # of the latest request in the mean time a reservation is held
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_requests: int  # --max-in-flight
    max_sequences: int  # --max-sequences-in-flight
    max_prompt_tokens: int  # --max-prompt-tokens-in-flight


class Ticket:
    """One admitted request's reservation. Event loop only."""

    __slots__ = ("_admission", "sequences", "prompt_tokens", "_start", "released")

    def __init__(self, admission: Admission):
        self._admission = admission
        self.sequences = 0
        self.prompt_tokens = 0
        self._start = time.monotonic()
        self.released = False

    def reserve(self, sequences: int = 0, prompt_tokens: int = 0) -> None:
        """Add work to this request's reservation, or raise (400: it can never fit; 503: not now) and
        reserve nothing. Synchronous: the check and the count are one step."""
        self._admission._reserve(self, sequences, prompt_tokens)

    def release(self) -> None:
        """Give everything back; idempotent, so every path may call it."""
        if not self.released:
            self.released = True
            self._admission._release(self)


class Admission:
    """This gateway's work in flight against its limits. Event loop only (no locks: no awaits inside)."""

    def __init__(self, limits: AdmissionLimits):
        self.limits = limits
        self.requests = 0
        self.sequences = 0
        self.prompt_tokens = 0
        self.mean_hold_s = 1.0

    def enter(self) -> Ticket:
        """A request slot, taken before anything about the request is awaited; 503 when none is free."""
        if self.requests >= self.limits.max_requests:
            raise self._busy(f"this gateway is serving its limit of {self.limits.max_requests} requests")
        self.requests += 1
        return Ticket(self)

    def retry_after(self) -> int:
        """Seconds until a reservation is likely to free up: the mean time admitted requests hold one."""
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self.mean_hold_s)))

    def _busy(self, message: str) -> APIError:
        return overloaded(503, f"{message}; retry later", self.retry_after())

    def _reserve(self, ticket: Ticket, sequences: int, prompt_tokens: int) -> None:
        limits = self.limits
        total_sequences = ticket.sequences + sequences
        if total_sequences > limits.max_sequences:
            raise APIError(400, f"this request needs {total_sequences} sequences (prompts × n); this server runs "
                                f"at most {limits.max_sequences} at once", param="n")
        total_tokens = ticket.prompt_tokens + prompt_tokens
        if total_tokens > limits.max_prompt_tokens:
            raise APIError(400, f"this request's prompts hold {total_tokens} tokens; this server takes at most "
                                f"{limits.max_prompt_tokens} at once", param="prompt")
        if self.sequences + sequences > limits.max_sequences:
            raise self._busy(f"this gateway is running {self.sequences} of its {limits.max_sequences} sequences")
        if self.prompt_tokens + prompt_tokens > limits.max_prompt_tokens:
            raise self._busy(f"this gateway holds {self.prompt_tokens} of its {limits.max_prompt_tokens} "
                             "prompt tokens in flight")
        self.sequences += sequences
        self.prompt_tokens += prompt_tokens
        ticket.sequences = total_sequences
        ticket.prompt_tokens = total_tokens

    def _release(self, ticket: Ticket) -> None:
        self.requests -= 1
        self.sequences -= ticket.sequences
        self.prompt_tokens -= ticket.prompt_tokens
        if ticket.sequences:  # requests refused before they ran would make the mean meaningless
            held = time.monotonic() - ticket._start
            self.mean_hold_s += HOLD_EWMA_WEIGHT * (held - self.mean_hold_s)
