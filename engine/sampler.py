"""Token sampling for one engine step: logit processors, penalties, filters, seeded draws, logprobs.

Per row, in vLLM's order: the grammar mask of a constrained row, then logit_bias, then min_tokens
masking, then the repetition, frequency and presence penalties; then a greedy argmax (temperature
0), or temperature, top-k, top-p, min-p and a draw. Logprobs are those of the logits after the
grammar mask and before the rest (vLLM's default ``raw_logprobs``).

Each feature is vectorized over the rows that use it and skipped when none does. Greedy rows and
unseeded rows with a temperature alone (no top-k, top-p or min-p) take their token from one kernel
that reads the logits once (``KernelOps.sample_argmax``: the argmax, with Gumbel noise drawn inside
it for the random rows); the rest pay for a softmax, the filters and a draw of ``vocab`` uniforms
(from the row's own generator when seeded). Per-token adjustments (bias, masking, penalties) touch
only the tokens concerned, never a dense ``[num_seqs, vocab]`` mask.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch

from engine.protocol import SamplingParams, TokenLogprob
from engine.structured import TokenMasks
from engine.transfer import to_device
from kernels import KernelOps, reference

if TYPE_CHECKING:
    import xgrammar


class SamplingSeq(Protocol):
    """What the sampler reads from a sequence. It changes nothing but the state of ``generator``."""

    sampling: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # tokens generated so far
    generator: torch.Generator | None  # per-request, on the logits' device; None: the default one
    matcher: xgrammar.GrammarMatcher | None  # the grammar of a constrained sequence; read, not advanced


class SamplerOutput(NamedTuple):
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # one per row; None where sampling.logprobs is None


class DirectDraw(NamedTuple):
    """What ``sample_argmax`` needs to pick the tokens of rows that are all direct (greedy, or at a
    temperature alone and unseeded) and raw (nothing applied to their logits, no logprobs)."""

    inv_temperature: list[float]  # one per row; 0: greedy
    seed: int  # of the noise, drawn from torch's default generator; 0 (none drawn) when every row is greedy


class Sampler:
    """Picks one token per row of a step's logits.

    ``logits`` is ``[num_seqs, vocab]``, row ``i`` belonging to ``seqs[i]``: fp32, or the model's
    narrower logits (a CUDA graph's bf16 buffer), which the sampler widens to fp32 first unless every
    row takes its token from them directly (greedy or at a temperature alone, nothing applied
    before). It uses them as scratch space, so their contents are undefined after a call. A row
    with a ``generator`` draws exactly ``vocab`` uniforms from it per call, so a seeded request gets
    the same tokens whatever else is in the batch and wherever its row is; unseeded rows draw from
    torch's default generator (directly, or through the seed of ``sample_argmax``'s noise). Stateless apart from
    the EOS ids and the grammar masks' buffer: one instance may serve any number of steps, one at a
    time. ``ops``: the op set whose ``argmax``/``sample_argmax`` run the direct rows.
    """

    def __init__(self, eos_token_ids: tuple[int, ...], ops: KernelOps = reference):
        self.eos_token_ids = tuple(eos_token_ids)
        self.masks = TokenMasks()
        self.ops = ops

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SamplingSeq]) -> SamplerOutput:
        tokens, logprobs = self.sample(logits, seqs)
        return SamplerOutput(tokens.tolist(), logprobs)

    def sample(
        self, logits: torch.Tensor, seqs: Sequence[SamplingSeq]
    ) -> tuple[torch.Tensor, list[TokenLogprob | None]]:
        """As calling the sampler, the tokens left on the logits' device (``[num_seqs]`` int64): only
        rows that ask for logprobs wait for the device."""
        _check_batch(logits, seqs)
        is_direct = list(map(_is_direct, seqs))
        direct = [i for i, d in enumerate(is_direct) if d]
        drawn = [i for i, d in enumerate(is_direct) if not d]
        if logits.dtype != torch.float32 and (drawn or not all(map(self._raw, seqs))):
            logits = logits.float()
        self.masks.apply(logits, [s.matcher for s in seqs])
        logprob_rows = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
        # Taken before the processors below write into logits.
        raw_logprobs = _rows(logits, logprob_rows).log_softmax(-1) if logprob_rows else None
        self._adjust(logits, seqs)
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        if direct:
            _put(tokens, direct, self._direct(_rows(logits, direct), [seqs[i].sampling for i in direct]))
        if drawn:
            weights = _filtered_probs(_rows(logits, drawn), [seqs[i].sampling for i in drawn])
            _put(tokens, drawn, _draw(weights, [seqs[i].generator for i in drawn]))
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            ks = [seqs[i].sampling.logprobs for i in logprob_rows]
            top = _token_logprobs(raw_logprobs, _rows(tokens, logprob_rows), ks)
            for i, lp in zip(logprob_rows, top):
                logprobs[i] = lp
        return tokens, logprobs

    def plain_greedy(self, seqs: Sequence[SamplingSeq]) -> bool:
        """Whether every row's token is the argmax of its raw logits and no row asks for
        logprobs, so a caller may take an argmax computed elsewhere (inside a CUDA graph)
        instead of calling the sampler."""
        return all(s.sampling.greedy and self._raw(s) for s in seqs)

    def direct_draw(self, seqs: Sequence[SamplingSeq]) -> DirectDraw | None:
        """Where every row is direct and raw, what ``sample_argmax`` needs to pick their tokens as
        ``sample`` would (its seed drawn now, the one draw ``sample`` makes then), so that a caller
        may draw them elsewhere (inside a CUDA graph); else None."""
        if all(_is_direct(s) and self._raw(s) for s in seqs):
            return _direct_draw([s.sampling for s in seqs])
        return None

    def _raw(self, s: SamplingSeq) -> bool:
        """Whether a row's logits reach its draw as they are and it asks for no logprobs: no grammar,
        bias, penalty or min-tokens mask applies."""
        p = s.sampling
        masked = len(s.output_ids) < p.min_tokens and (p.stop_token_ids or not p.ignore_eos and self.eos_token_ids)
        return not (
            s.matcher is not None or p.logprobs is not None or p.logit_bias or masked
            or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        )

    def probs(self, logits: torch.Tensor, seqs: Sequence[SamplingSeq]) -> torch.Tensor:
        """The distribution each row's token would be drawn from, ``[num_seqs, vocab]``.

        Rows sum to 1; greedy rows are one-hot at their argmax. Draws nothing, so generators do not
        advance; uses ``logits`` as scratch like ``__call__``. For rejection sampling and tests.
        """
        _check_batch(logits, seqs)
        self.masks.apply(logits, [s.matcher for s in seqs])
        greedy_rows, random_rows, weights = self._process(logits, seqs)
        out = torch.zeros_like(logits)
        if greedy_rows:
            rows = to_device(greedy_rows, torch.int64, logits.device)
            out[rows, _rows(logits, greedy_rows).argmax(-1)] = 1.0
        if random_rows:
            _put(out, random_rows, weights / weights.sum(-1, keepdim=True))
        return out

    def _direct(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The tokens of rows that are greedy or sample at their temperature alone, in one kernel."""
        draw = _direct_draw(params)
        if not any(draw.inv_temperature):
            return self.ops.argmax(logits)
        inv_temperature = to_device(draw.inv_temperature, torch.float32, logits.device)
        return self.ops.sample_argmax(logits, inv_temperature, draw.seed)

    def _adjust(self, logits: torch.Tensor, seqs: Sequence[SamplingSeq]) -> None:
        """Logit bias, min-tokens masking and penalties, in place."""
        self._apply_logit_bias(logits, seqs)
        self._apply_min_tokens(logits, seqs)
        _apply_penalties(logits, seqs)

    def _process(
        self, logits: torch.Tensor, seqs: Sequence[SamplingSeq]
    ) -> tuple[list[int], list[int], torch.Tensor | None]:
        """Everything before the draw. Returns the greedy rows (their final logits left in
        ``logits``), the random rows, and the random rows' unnormalized sampling probabilities."""
        self._adjust(logits, seqs)
        greedy_rows = [i for i, s in enumerate(seqs) if s.sampling.greedy]
        random_rows = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
        weights = None
        if random_rows:
            params = [seqs[i].sampling for i in random_rows]
            weights = _filtered_probs(_rows(logits, random_rows), params)
        return greedy_rows, random_rows, weights

    def _apply_logit_bias(self, logits: torch.Tensor, seqs: Sequence[SamplingSeq]) -> None:
        rows: list[int] = []
        token_ids: list[int] = []
        biases: list[float] = []
        for i, s in enumerate(seqs):
            for token_id, bias in s.sampling.logit_bias.items():
                rows.append(i)
                token_ids.append(token_id)
                biases.append(bias)
        if rows:
            index = _index(rows, token_ids, logits)
            logits.index_put_(index, _values(biases, logits), accumulate=True)

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: Sequence[SamplingSeq]) -> None:
        rows: list[int] = []
        token_ids: list[int] = []
        for i, s in enumerate(seqs):
            params = s.sampling
            if len(s.output_ids) < params.min_tokens:
                eos = () if params.ignore_eos else self.eos_token_ids
                banned = [*params.stop_token_ids, *eos]
                rows.extend([i] * len(banned))
                token_ids.extend(banned)
        if rows:
            logits[_index(rows, token_ids, logits)] = float("-inf")


def _check_batch(logits: torch.Tensor, seqs: Sequence[SamplingSeq]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(seqs):
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match {len(seqs)} sequences"
        )


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]``; ``t`` itself, not a copy, when ``rows`` is every row."""
    if len(rows) == t.shape[0]:
        return t
    return t.index_select(0, to_device(rows, torch.int64, t.device))


def _put(dst: torch.Tensor, rows: list[int], src: torch.Tensor) -> None:
    """``dst[rows] = src``, the inverse of :func:`_rows` (a no-op when ``src`` is ``dst``)."""
    if len(rows) == dst.shape[0]:
        dst.copy_(src)
    else:
        dst.index_copy_(0, to_device(rows, torch.int64, dst.device), src)


def _index(
    rows: list[int], token_ids: list[int], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) pairs as an advanced index into ``like``."""
    return to_device(rows, torch.int64, like.device), to_device(token_ids, torch.int64, like.device)


def _values(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return to_device(values, like.dtype, like.device)


def _token_index(
    rows: list[int], token_lists: list[list[int]], like: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The (row, token id) pairs of ``token_lists[j]`` in row ``rows[j]``, repeats included, as an
    advanced index into ``like``; and for each pair, its ``j``."""
    lengths = torch.tensor([len(t) for t in token_lists])
    which = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    # numpy reads Python ints several times faster than torch.tensor does.
    flat = np.fromiter(itertools.chain.from_iterable(token_lists), np.int64, int(lengths.sum()))
    device = like.device
    index = (to_device(torch.tensor(rows)[which], torch.int64, device), to_device(flat, torch.int64, device))
    return index, to_device(which, torch.int64, device)


def _apply_penalties(logits: torch.Tensor, seqs: Sequence[SamplingSeq]) -> None:
    """Repetition (HF: over prompt and output, positive logits divided, negative multiplied), then
    presence and frequency (OpenAI: over output tokens only, subtracted)."""
    rows = [i for i, s in enumerate(seqs) if s.sampling.repetition_penalty != 1.0]
    if rows:
        seen_ids = [seqs[i].prompt_ids + seqs[i].output_ids for i in rows]
        index, which = _token_index(rows, seen_ids, logits)
        scales = _values([seqs[i].sampling.repetition_penalty for i in rows], logits)[which]
        # Gathered before writing, so every copy of a repeated token writes the same value.
        seen = logits[index]
        logits[index] = torch.where(seen > 0, seen / scales, seen * scales)
    rows = [
        i
        for i, s in enumerate(seqs)
        if s.sampling.presence_penalty != 0.0 or s.sampling.frequency_penalty != 0.0
    ]
    if rows:
        index, which = _token_index(rows, [seqs[i].output_ids for i in rows], logits)
        presence = _values([seqs[i].sampling.presence_penalty for i in rows], logits)[which]
        frequency = _values([seqs[i].sampling.frequency_penalty for i in rows], logits)[which]
        logits[index] = logits[index] - presence  # once per token: copies write the same value
        logits.index_put_(index, -frequency, accumulate=True)  # once per occurrence


def _is_direct(s: SamplingSeq) -> bool:
    """Whether a row's token comes from ``sample_argmax`` (greedy, or at a temperature alone and
    unseeded) rather than a softmax and a draw."""
    return s.sampling.greedy or s.generator is None and not _filters(s.sampling)


def _direct_draw(params: list[SamplingParams]) -> DirectDraw:
    inv_temperature = [0.0 if p.greedy else 1.0 / p.temperature for p in params]
    return DirectDraw(inv_temperature, int(torch.randint(2**63 - 1, ())) if any(inv_temperature) else 0)


def _filters(params: SamplingParams) -> bool:
    """Whether a random row has a top-k, top-p or min-p (``_filtered_probs``' work beyond a softmax)."""
    return 0 < params.top_k or params.top_p < 1.0 or params.min_p > 0.0


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, then min-p, for rows that sample at random. Returns probabilities
    that min-p leaves unnormalized (the draw does not need them to sum to 1); writes into logits."""
    vocab = logits.shape[1]
    temperatures = [p.temperature for p in params]
    if any(t != 1.0 for t in temperatures):
        logits.div_(_values(temperatures, logits).unsqueeze(1))
    # Sorting is the costly part: only rows with a top-k or top-p take part.
    filtered = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if filtered:
        sub = _rows(logits, filtered)
        _mask_top_k_top_p(
            sub,
            [params[j].top_k if 0 < params[j].top_k < vocab else vocab for j in filtered],
            [params[j].top_p for j in filtered],
        )
        _put(logits, filtered, sub)
    probs = logits.softmax(-1)
    min_p = [p.min_p for p in params]
    if any(min_p):
        threshold = probs.amax(-1, keepdim=True) * _values(min_p, probs).unsqueeze(1)
        probs.masked_fill_(probs < threshold, 0.0)
    return probs


def _mask_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    """Set to -inf, in place, the logits below each row's k-th largest (``top_k`` == vocab: off),
    then those outside the smallest set of likeliest tokens holding ``top_p`` of what is left.
    Ties with the cut-off logit stay in; the likeliest token always does."""
    vocab = logits.shape[1]
    max_k = max(top_k)
    # Best first; when every row has a top-k, only the head up to the largest k is needed.
    if max_k < vocab:
        head = logits.topk(max_k, dim=-1).values
    else:
        head = logits.sort(dim=-1, descending=True).values
    k = to_device(top_k, torch.int64, logits.device).unsqueeze(1)
    num_kept = k
    if any(p < 1.0 for p in top_p):
        positions = torch.arange(head.shape[1], device=logits.device)
        head.masked_fill_(positions >= k, float("-inf"))
        p = _values(top_p, logits).unsqueeze(1)
        mass = head.softmax(-1).cumsum(-1)  # of each token and all likelier ones
        # Token j stays while the likelier ones hold less than top_p: the ones whose running
        # mass is below top_p, plus the one that reaches it.
        in_nucleus = ((mass < p).sum(-1, keepdim=True) + 1).clamp_(max=head.shape[1])
        num_kept = torch.where(p < 1.0, torch.minimum(k, in_nucleus), k)
    cutoff = head.gather(1, num_kept - 1)
    logits.masked_fill_(logits < cutoff, float("-inf"))


def _draw(weights: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row, row ``j`` drawn with probability proportional to ``weights[j]``.
    Writes into ``weights``."""
    uniforms = torch.empty_like(weights)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        uniforms.uniform_()
    else:
        # Exactly one vocab-sized draw per seeded row: its stream advances the same in any batch.
        for j, g in enumerate(generators):
            if g is not None:
                uniforms[j].uniform_(generator=g)
        if unseeded:
            shape = (len(unseeded), weights.shape[1])
            _put(uniforms, unseeded, torch.rand(shape, device=weights.device))
    # Exponential race: with E_i = -log U_i ~ Exp(1), argmax_i w_i / E_i = argmin_i w_i / log U_i
    # is i with probability w_i / sum(w). A zero weight gives 0, which never beats a negative; the
    # clamp keeps log U finite, so a lone candidate always wins. Uniforms cost a quarter of what
    # exponential_() does on CPU.
    uniforms.clamp_(min=torch.finfo(uniforms.dtype).tiny).log_()
    return weights.div_(uniforms).argmin(-1)


def _token_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, ks: list[int]
) -> list[TokenLogprob]:
    """Per row: the logprob of ``tokens[j]`` and the ``ks[j]`` best (token, logprob), best first."""
    sampled = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    top_values, top_ids = logprobs.topk(min(max(ks), logprobs.shape[1]), dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(sampled[j], list(zip(top_ids[j][:k], top_values[j][:k])))
        for j, k in enumerate(ks)
    ]
