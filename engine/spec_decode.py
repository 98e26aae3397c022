"""Speculative decoding by n-gram prompt lookup: a proposer per sequence and an exact verifier.

Proposal. The last ``n`` tokens of a sequence (``n`` from ``ngram_max`` down to ``ngram_min``)
are looked up in an index of every earlier n-gram of its prompt and output; the tokens that
followed their most recent earlier occurrence are the draft. The index (:class:`NgramIndex`, one
per sequence) is a dict from n-gram to the position after its latest occurrence, extended by the
tokens committed since the last lookup: a lookup costs ``ngram_max - ngram_min + 1`` dict probes,
never a scan of the history. The draft length adapts: it doubles (up to ``K``) after a fully
accepted draft and drops to one more than the accepted count after a rejection.

Verification. The scheduler gives a decoding sequence with a draft ``d_1 … d_k`` ``1 + k`` query
tokens in the step's varlen batch (its last token and the draft); the runner computes logits for
all ``1 + k`` rows and :func:`verify` turns them into the committed tokens. Row ``j`` is the target
distribution after ``d_1 … d_j``, processed exactly as the sampler would process it had those
tokens been generated: grammar mask (the matcher advanced through ``d_1 … d_j``, then rolled back),
logit_bias, min_tokens, and penalties counting ``d_1 … d_j`` as output.

Rejection sampling with a point-mass draft. Standard speculative sampling accepts a draft token
``x ~ q`` with probability ``min(1, p(x) / q(x))`` and, on rejection, draws from the residual
``norm(max(p - q, 0))``. An n-gram draft is deterministic: ``q = onehot(d)``. So ``d`` is accepted
with probability ``p(d)``, and the residual is ``p`` with ``d`` zeroed, renormalized by
``1 - p(d)``. The committed token's law is exactly ``p``: ``P(d) = p(d)`` and, for ``x != d``,
``P(x) = (1 - p(d)) * p(x) / (1 - p(d)) = p(x)``. After an accepted ``d_j`` the next row's ``p`` is
the target's distribution given ``d_j``, so by induction the whole run has the target's law; after
all ``k`` drafts are accepted, a bonus token is drawn from row ``k``. A greedy row's ``p`` is
one-hot at the processed argmax, so a draft is accepted iff it is that argmax, and the committed
tokens are exactly those of decoding without speculation. A seeded sequence draws ``k`` uniforms
(acceptance) and one vocabulary-sized draw (the final token) from its generator per step: its
tokens depend on its own drafts only, never on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
import xgrammar as xgr

from engine.protocol import SamplingParams, TokenLogprob
from engine.sampler import Sampler, _draw, _token_logprobs

if TYPE_CHECKING:
    from engine.request import Sequence

class NgramIndex:
    """One sequence's n-gram index and adaptive draft length. Not thread-safe."""

    __slots__ = ("ngram_min", "ngram_max", "draft_len", "_next_pos", "_num_indexed")

    def __init__(self, ngram_min: int, ngram_max: int, draft_len: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.draft_len = draft_len
        self._next_pos: dict[tuple[int, ...], int] = {}  # n-gram -> position after its latest occurrence
        self._num_indexed = 0  # tokens whose preceding n-grams are in the map

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """``k`` tokens that followed the most recent earlier occurrence of the longest matching
        suffix of ``tokens`` (the sequence's tokens, only ever appended to), or none."""
        self._extend(tokens)
        end = len(tokens)
        for n in range(min(self.ngram_max, end), self.ngram_min - 1, -1):
            pos = self._next_pos.get(tuple(tokens[end - n : end]))
            if pos is not None:
                # An occurrence overlapping the suffix continues into the draft itself: the
                # text repeats with period end - pos.
                draft = tokens[pos : pos + k]
                period = end - pos
                while len(draft) < k:
                    draft.append(draft[len(draft) - period])
                return draft
        return []

    def _extend(self, tokens: list[int]) -> None:
        # Position i is the follower of the n-grams ending at i - 1; the suffix itself has none yet.
        for i in range(max(self._num_indexed, 1), len(tokens)):
            for n in range(self.ngram_min, min(self.ngram_max, i) + 1):
                self._next_pos[tuple(tokens[i - n : i])] = i
        self._num_indexed = len(tokens)


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # sequence-steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts whose token j was accepted


class NgramProposer:
    """Drafts for decoding sequences, and their acceptance counters. Not thread-safe."""

    def __init__(self, num_speculative_tokens: int, ngram_min: int, ngram_max: int):
        """Settings as validated by EngineConfig."""
        self.num_speculative_tokens = num_speculative_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * num_speculative_tokens)

    def propose(self, seq: Sequence, max_len: int) -> list[int]:
        """A draft of at most ``max_len`` tokens to follow ``seq``'s tokens (possibly empty)."""
        index = seq.ngram
        if index is None:
            index = seq.ngram = NgramIndex(self.ngram_min, self.ngram_max, self.num_speculative_tokens)
        k = min(index.draft_len, max_len)
        return index.propose(seq.all_token_ids, k) if k > 0 else []

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Count a verified draft of ``num_drafts`` tokens whose first ``num_accepted`` were accepted,
        and adapt ``seq``'s draft length."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            stats.accepted_per_pos[j] += 1
        index = seq.ngram
        if num_accepted == num_drafts:
            index.draft_len = min(2 * index.draft_len, self.num_speculative_tokens)
        else:
            index.draft_len = num_accepted + 1


class VerifiedToken(NamedTuple):
    token_id: int
    logprob: TokenLogprob | None


class _DraftRow(NamedTuple):
    """A verification row as the sampler sees it (:class:`engine.sampler.SamplingSeq`)."""

    sampling: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    matcher: None  # the grammar mask is applied before the sampler runs


def _rows_of(seq: Sequence) -> list[_DraftRow]:
    p, drafts = seq.sampling, seq.draft_ids
    # The sampler reads the output for penalties and min_tokens only: without them every row may
    # share the sequence's own list (its length only decides min_tokens, already reached).
    reads_output = (
        p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        or len(seq.output_ids) < p.min_tokens
    )
    return [
        _DraftRow(p, seq.prompt_ids, seq.output_ids + drafts[:j] if reads_output else seq.output_ids,
                  seq.generator, None)
        for j in range(len(drafts) + 1)
    ]


def _apply_draft_grammars(logits: torch.Tensor, seqs: Seq[Sequence], starts: list[int]) -> None:
    """Mask row ``starts[i] + j`` with ``seqs[i]``'s grammar after its first ``j`` drafts. The
    matcher is advanced through the drafts and rolled back; rows after a draft the grammar refuses
    or that completes it stay unmasked (the sequence cannot commit past that draft)."""
    constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not constrained:
        return
    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)
    rows: list[int] = []
    for i in constrained:
        matcher, drafts = seqs[i].matcher, seqs[i].draft_ids
        advanced = 0
        for j in range(len(drafts) + 1):
            if matcher.is_terminated():  # a draft completed the grammar: the sequence ends there
                break
            matcher.fill_next_token_bitmask(bitmask, starts[i] + j)
            rows.append(starts[i] + j)
            if j == len(drafts) or not matcher.accept_token(drafts[j]):
                break
            advanced += 1
        if advanced:
            matcher.rollback(advanced)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab, indices=rows)


def verify(sampler: Sampler, logits: torch.Tensor, seqs: Seq[Sequence]) -> list[list[VerifiedToken]]:
    """The committed tokens of each sequence of a step in which some have drafts.

    ``logits`` ``[rows, vocab]`` fp32 holds, per sequence in order, ``1 + len(seq.draft_ids)`` rows
    (row ``j``: the distribution after the first ``j`` drafts); it is used as scratch. Returns per
    sequence the accepted drafts then one more token (the correction or the bonus). Sequences
    without a draft go through the sampler itself, as in a step without speculation. Advances
    only the generators; each grammar matcher is left in the state it had.
    """
    starts = []
    row = 0
    for seq in seqs:
        starts.append(row)
        row += 1 + len(seq.draft_ids)
    if row != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows for sequences that need {row}")
    if sampler.plain_greedy(seqs):  # each row's token is its raw argmax: one kernel, one sync
        argmax = logits.argmax(-1).tolist()
        runs = [_greedy_run(seq.draft_ids, argmax[start : start + 1 + len(seq.draft_ids)])
                for seq, start in zip(seqs, starts)]
        return [[VerifiedToken(t, None) for t in run] for run in runs]
    out: list[list[VerifiedToken]] = [[] for _ in seqs]
    plain = [i for i, s in enumerate(seqs) if not s.draft_ids]
    if plain:
        index = torch.tensor([starts[i] for i in plain], device=logits.device)
        sampled = sampler(logits.index_select(0, index), [seqs[i] for i in plain])
        for i, tok, lp in zip(plain, sampled.token_ids, sampled.logprobs):
            out[i].append(VerifiedToken(tok, lp))
    spec = [i for i, s in enumerate(seqs) if s.draft_ids]
    if not spec:
        return out
    spec_seqs = [seqs[i] for i in spec]
    spec_rows = [r for i in spec for r in range(starts[i], starts[i] + 1 + len(seqs[i].draft_ids))]
    logits = logits.index_select(0, torch.tensor(spec_rows, device=logits.device))
    local_starts = [0]
    for seq in spec_seqs:
        local_starts.append(local_starts[-1] + 1 + len(seq.draft_ids))
    _apply_draft_grammars(logits, spec_seqs, local_starts)
    rows = [r for seq in spec_seqs for r in _rows_of(seq)]
    logprob_rows = [r for r, v in enumerate(rows) if v.sampling.logprobs is not None]
    raw_logprobs = logits.index_select(0, torch.tensor(logprob_rows, device=logits.device)).log_softmax(-1) \
        if logprob_rows else None
    probs = sampler.probs(logits, rows)

    num_accepted = _accept(probs, spec_seqs, local_starts)
    finals = _final_tokens(probs, spec_seqs, local_starts, num_accepted)
    committed_rows: list[int] = []
    for j, (i, seq) in enumerate(zip(spec, spec_seqs)):
        a = num_accepted[j]
        tokens = [*seq.draft_ids[:a], finals[j]]
        out[i] = [VerifiedToken(t, None) for t in tokens]
        committed_rows.extend(range(local_starts[j], local_starts[j] + a + 1))
    if raw_logprobs is not None:
        _attach_logprobs(out, spec, raw_logprobs, logprob_rows, committed_rows, rows)
    return out


def _greedy_run(drafts: list[int], targets: list[int]) -> list[int]:
    """The drafts up to the first that differs from its row's target, then that row's target."""
    for j, draft in enumerate(drafts):
        if draft != targets[j]:
            return [*drafts[:j], targets[j]]
    return [*drafts, targets[-1]]


def _accept(probs: torch.Tensor, seqs: list[Sequence], starts: list[int]) -> list[int]:
    """How many leading drafts of each sequence are accepted: draft ``d_j`` with probability
    ``p_j(d_j)`` (a greedy row: iff it is the argmax, where ``p`` is exactly 1)."""
    dev = probs.device
    draft_rows = [starts[j] + r for j, s in enumerate(seqs) for r in range(len(s.draft_ids))]
    draft_ids = [t for s in seqs for t in s.draft_ids]
    p_draft = probs[torch.tensor(draft_rows, device=dev), torch.tensor(draft_ids, device=dev)]
    uniforms = []
    for seq in seqs:
        k = len(seq.draft_ids)
        if seq.sampling.greedy:
            uniforms.append(torch.full((k,), 0.5, device=dev))  # p is 0 or 1: any u in (0, 1) decides
        else:
            uniforms.append(torch.rand(k, device=dev, generator=seq.generator))
    accepted = (torch.cat(uniforms) < p_draft).tolist()
    result, pos = [], 0
    for seq in seqs:
        k = len(seq.draft_ids)
        run = accepted[pos : pos + k]
        result.append(run.index(False) if False in run else k)
        pos += k
    return result


def _final_tokens(probs: torch.Tensor, seqs: list[Sequence], starts: list[int], num_accepted: list[int]) -> list[int]:
    """Per sequence, the token after its accepted drafts: from the residual of the first rejected
    row (its draft zeroed), or from the row after the last draft when all were accepted."""
    dev = probs.device
    final_rows = [starts[j] + a for j, a in enumerate(num_accepted)]
    weights = probs.index_select(0, torch.tensor(final_rows, device=dev))
    rejected = [(j, s.draft_ids[a]) for j, (s, a) in enumerate(zip(seqs, num_accepted)) if a < len(s.draft_ids)]
    if rejected:
        rows, tokens = zip(*rejected)
        weights[torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev)] = 0.0
    greedy = [j for j, s in enumerate(seqs) if s.sampling.greedy]
    tokens = torch.empty(len(seqs), dtype=torch.long, device=dev)
    if greedy:
        index = torch.tensor(greedy, device=dev)
        tokens[index] = weights.index_select(0, index).argmax(-1)
    random = [j for j, s in enumerate(seqs) if not s.sampling.greedy]
    if random:
        index = torch.tensor(random, device=dev)
        tokens[index] = _draw(weights.index_select(0, index), [seqs[j].generator for j in random])
    return tokens.tolist()


def _attach_logprobs(
    out: list[list[VerifiedToken]], spec: list[int], raw_logprobs: torch.Tensor, logprob_rows: list[int],
    committed_rows: list[int], rows: list[_DraftRow],
) -> None:
    """Give each committed token of a sequence that asks for logprobs those of its row."""
    position = {r: n for n, r in enumerate(logprob_rows)}
    committed = iter(committed_rows)
    wanted: list[tuple[int, int, int]] = []  # (index into out, token position, logprob row)
    for i in spec:
        for t in range(len(out[i])):
            r = next(committed)
            if r in position:
                wanted.append((i, t, position[r]))
    if not wanted:
        return
    dev = raw_logprobs.device
    sel = raw_logprobs.index_select(0, torch.tensor([w[2] for w in wanted], device=dev))
    tokens = torch.tensor([out[i][t].token_id for i, t, _ in wanted], device=dev)
    ks = [rows[logprob_rows[w[2]]].sampling.logprobs for w in wanted]
    for (i, t, _), lp in zip(wanted, _token_logprobs(sel, tokens, ks)):
        out[i][t] = VerifiedToken(out[i][t].token_id, lp)
