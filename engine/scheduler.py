"""Continuous batching under a per-step token budget, first come first served.

Each step the running sequences go first, in arrival order (a decode costs one token, an
unfinished prefill takes what is left of the budget), then waiting sequences are admitted while
budget, sequence slots and blocks last, each starting after its longest cached prefix (full blocks,
then an exact-position entry), and while the step holds fewer than ``prefill_pack_tokens`` prompt
tokens: on the CPU a prompt that shares a step with another is no cheaper per token than alone, so
packing two long prompts only delays the first one's first token. When the pool runs dry the
latest running sequence is preempted by recompute; the oldest always progresses, so there is no
deadlock.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from engine.kv_cache import KVCacheManager
from engine.request import Sequence, Status


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_new_tokens: int


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Not thread-safe: the engine loop alone calls it."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_pack_tokens: int | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_pack_tokens = prefill_pack_tokens or max_num_batched_tokens  # None: no limit but the budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while self.kv.allocate(seq, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
                continue
            break

        prompt_tokens = sum(n for _, n in scheduled if n > 1)  # decodes schedule one token each
        while (not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and prompt_tokens < self.prefill_pack_tokens):
            seq = self.waiting[0]
            prefix = self.kv.match_prefix(seq)
            num_new = min(seq.num_tokens - prefix.num_tokens, budget)
            if self.kv.allocate(seq, num_new, prefix) is None:
                break
            self.waiting.popleft()
            if not seq.output_ids:  # first admission, not a resumption after preemption
                self.kv.record_prefix_lookup(seq, prefix.num_tokens)
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            prompt_tokens += num_new
        return SchedulerOutput(scheduled, preempted)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of the queues and free its blocks (idempotent)."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
