"""Continuous batching under a per-step token budget, first come first served.

Each step the running sequences go first, in arrival order (a decode costs one token, an
unfinished prefill takes what is left of the budget), then waiting sequences are admitted while
budget, sequence slots and blocks last, each starting after its longest cached prefix (full blocks,
then an exact-position entry), and while the step holds fewer than ``prefill_pack_tokens`` prompt
tokens: on the CPU a prompt that shares a step with another is no cheaper per token than alone, so
packing two long prompts only delays the first one's first token. When the pool runs dry the
latest running sequence is preempted by recompute; the oldest always progresses, so there is no
deadlock.

With a proposer (speculative decoding), a decoding sequence also gets a draft
(``seq.draft_ids``, see :mod:`engine.spec_decode`) when the budget and the pool have room for it:
its step computes ``1 + len(draft)`` tokens, never more than its ``max_tokens`` and the context
length allow. Only committed tokens advance ``num_computed_tokens`` and reach the KV manager's
block hashes and entries; the blocks past them (rejected drafts) go back to the pool.

With a mixed-prefill budget (:mod:`engine.mixed_budget`), a step that holds a decode holds at
most ``mixed_budget.budget`` prompt tokens, so that a long prompt does not stall the decoders.

Overlapped scheduling plans a step while the previous one still runs: the previous step's
sequences are already advanced (:meth:`Scheduler.advance`), and each that sampled has its token
pending (``seq.num_pending_tokens``), so it is planned as one more decode, unless that token
finishes it by length for sure (then its slot counts as free). A sequence that turns out finished
is masked when the step's result comes (:meth:`Scheduler.record` skips it).

The scheduler also records what each step did (:meth:`Scheduler.update`: computed tokens, cached
blocks, sampled tokens, grammar matchers advanced, finishes). It is the one writer of queue state:
a request's sequences enter through :meth:`Scheduler.add_request` and leave through
:meth:`Scheduler.finish`, aborts included.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

import structlog

from engine.kv_cache import KVCacheManager
from engine.mixed_budget import MixedPrefillBudget
from engine.protocol import TokenLogprob
from engine.request import Sequence, Status
from engine.spec_decode import NgramProposer

log = structlog.get_logger("engine.scheduler")


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_new_tokens: int


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledSeq]


class SampledToken(NamedTuple):
    seq: Sequence
    token_id: int
    logprob: TokenLogprob | None


class Scheduler:
    """Not thread-safe: the engine loop alone calls it. ``eos_token_ids`` and ``max_model_len``
    are the finish rules :meth:`update` applies besides each request's own; ``proposer`` (None:
    no speculation) drafts tokens for decoding sequences; ``mixed_budget`` (None: the whole token
    budget) caps the prompt tokens of a step that holds a decode."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_pack_tokens: int | None = None, *, eos_token_ids: Iterable[int] = (),
                 max_model_len: int = sys.maxsize, proposer: NgramProposer | None = None,
                 mixed_budget: MixedPrefillBudget | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_pack_tokens = prefill_pack_tokens or max_num_batched_tokens  # None: no limit but the budget
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.proposer = proposer
        self.mixed_budget = mixed_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, list[Sequence]] = {}  # n > 1: siblings admitted once sequence 0 has prefilled
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(map(len, self.held.values()))

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def add_request(self, seqs: list[Sequence]) -> None:
        """Queue a request's first sequence and hold the others until its prompt is computed, so
        that they start from its cached prefix rather than compute the same prompt again."""
        self.add(seqs[0])
        if len(seqs) > 1:
            self.held[seqs[0].request_id] = seqs[1:]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        prompt_room = budget  # prompt tokens this step may still take
        if self.mixed_budget is not None and any(s.num_tokens - s.num_computed_tokens == 1 for s in self.running):
            prompt_room = self.mixed_budget.budget
        scheduled: list[ScheduledSeq] = []
        num_preemptions = self.num_preemptions
        num_finishing = 0  # running, but their pending token ends them: their slots are free
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            i += 1
            if seq.num_pending_tokens and self._finishes_by_length(seq):
                num_finishing += 1
                continue
            remaining = seq.num_tokens - seq.num_computed_tokens
            num_new = min(remaining, budget) if remaining == 1 else min(remaining, budget, prompt_room)
            if num_new == 0:
                continue
            drafts = self._propose(seq, budget) if num_new == 1 else []
            if drafts and self.kv.allocate(seq, 1 + len(drafts)) is not None:
                seq.draft_ids = drafts
                num_new += len(drafts)
            elif not (num_new := self._reserve(seq, num_new)):  # no room for a draft never preempts anyone
                break
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            if remaining > 1:
                prompt_room -= num_new

        preempted = self.num_preemptions > num_preemptions
        prompt_tokens = sum(n for s, n in scheduled if n - len(s.draft_ids) > 1)  # decodes: one token and a draft
        while (not preempted and self.waiting and budget > 0 and prompt_room > 0
               and len(self.running) - num_finishing < self.max_num_seqs and prompt_tokens < self.prefill_pack_tokens):
            seq = self.waiting[0]
            prefix = self.kv.match_prefix(seq)
            num_new = min(seq.num_tokens - prefix.num_tokens, budget, prompt_room)
            while (allocated := self.kv.allocate(seq, num_new, prefix)) is None and not self.running and num_new > 1:
                num_new //= 2  # alone, nothing will free blocks: a smaller chunk needs fewer window blocks
            if allocated is None:
                break
            self.waiting.popleft()
            if not seq.output_ids:  # first admission, not a resumption after preemption
                self.kv.record_prefix_lookup(seq, prefix.num_tokens)
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            prompt_room -= num_new
            prompt_tokens += num_new
        return SchedulerOutput(scheduled)

    def update(self, scheduled: list[ScheduledSeq], sampled: list[SampledToken]) -> list[Sequence]:
        """Record a step's whole result: :meth:`advance`, then :meth:`record`."""
        self.advance(scheduled)
        return self.record(scheduled, sampled)

    def advance(self, scheduled: list[ScheduledSeq]) -> None:
        """The part of a step's result known before its tokens: advance each scheduled sequence's
        computed tokens (not its draft's) and cache its full blocks, release held siblings, and
        count the token of each sequence that sampled as pending. Skips the sequences finished
        since the step was planned."""
        for seq, num_new in scheduled:
            if seq.status is not Status.RUNNING:
                continue
            seq.num_computed_tokens += num_new - len(seq.draft_ids)
            self.kv.cache_computed_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.num_pending_tokens = 1
            if seq.index == 0 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                for sibling in self.held.pop(seq.request_id, ()):
                    self.add(sibling)

    def record(self, scheduled: list[ScheduledSeq], sampled: list[SampledToken]) -> list[Sequence]:
        """The rest, once the tokens are on the host (after :meth:`advance`): append the sampled
        tokens (each accepted first by the sequence's grammar matcher, if any) and finish the
        sequences that met a finish rule (their blocks are freed). A sequence that verified a
        draft has its committed tokens in ``sampled``, in order (the accepted drafts, then one
        more); a finish among them drops the rest. A sequence finished or aborted since the step
        was planned is masked: its token is dropped. One preempted since keeps its token (it was
        sampled from the sequence's state before). Returns the sequences that got a token, once
        each, in ``sampled`` order; the finished ones have ``finish_reason`` set."""
        masked = set()
        for seq, _ in scheduled:
            seq.num_pending_tokens = 0
            if seq.status is Status.FINISHED:
                masked.add(seq.key)
        num_committed: dict[tuple[str, int], int] = {}
        outputs: list[Sequence] = []
        for seq, token_id, logprob in sampled:
            if seq.key in masked:
                continue
            if seq.key not in num_committed:
                outputs.append(seq)
            num_committed[seq.key] = num_committed.get(seq.key, 0) + 1
            if seq.status is Status.FINISHED:
                continue  # finished earlier in its accepted run
            # the last token is an accepted draft: its KV is this step's
            if seq.status is Status.RUNNING and seq.num_computed_tokens < seq.num_tokens:
                seq.num_computed_tokens += 1
                self.kv.cache_computed_blocks(seq)
            if seq.matcher is not None and not seq.matcher.accept_token(token_id):
                # The mask admitted only what the matcher accepts: a bug, not a request to serve on.
                seq.error = f"sampled token {token_id} is outside the grammar"
                log.error("grammar_rejected_token", request_id=seq.request_id, index=seq.index, token_id=token_id)
                self.finish(seq, "error")
                continue
            seq.append_token(token_id)
            if logprob is not None:
                seq.pending_logprobs.append(logprob)
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
        for seq, _ in scheduled:
            if seq.draft_ids:
                self.proposer.record(seq, len(seq.draft_ids), num_committed[seq.key] - 1)
                seq.draft_ids = []
                if seq.status is Status.RUNNING:
                    self.kv.rollback(seq)
        return outputs

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of the queues (or the held siblings) and free its blocks (idempotent)."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self._release_held(seq)
        self.kv.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.matcher = None

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        p = seq.sampling
        num_out = len(seq.output_ids)
        if seq.matcher is not None and seq.matcher.is_terminated():  # a complete grammar took a stop token
            return "stop"
        if num_out >= p.min_tokens and (
            token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids)
        ):
            return "stop"
        if num_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finishes_by_length(self, seq: Sequence) -> bool:
        """Whether ``seq``'s pending token will finish it by length (the rule of :meth:`_finish_reason`)."""
        num_out = len(seq.output_ids) + seq.num_pending_tokens
        return num_out >= seq.sampling.max_tokens or seq.num_tokens >= self.max_model_len

    def _propose(self, seq: Sequence, budget: int) -> list[int]:
        """A draft for decoding ``seq`` that fits the step's ``budget``, its ``max_tokens`` and the
        context length (its last token is the bonus one), or none."""
        if self.proposer is None:
            return []
        room = min(budget, seq.sampling.max_tokens - len(seq.output_ids), self.max_model_len - seq.num_tokens) - 1
        return self.proposer.propose(seq, room) if room > 0 else []

    def _reserve(self, seq: Sequence, num_new_tokens: int) -> int:
        """Allocate running ``seq``'s next tokens, preempting the latest running sequences until
        they fit; a prompt chunk of ``seq`` running alone halves instead (preempting itself would
        free nothing for anyone else). Returns the tokens allocated, 0 if ``seq`` itself had to go."""
        while self.kv.allocate(seq, num_new_tokens) is None:
            if len(self.running) == 1 and num_new_tokens > 1:
                num_new_tokens //= 2  # a smaller chunk needs fewer blocks (window groups: far fewer)
                continue
            victim = self.running.pop()
            self._preempt(victim)
            if victim is seq:
                return 0
        return num_new_tokens

    def _release_held(self, seq: Sequence) -> None:
        siblings = self.held[seq.request_id]
        siblings.remove(seq)
        if not siblings:
            del self.held[seq.request_id]

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
