"""Prompt logprobs, computed in the prefill: the log-softmax of the logits at each prompt position,
read at the next prompt token.

A sequence that asks for them (:attr:`engine.request.Sequence.needs_prompt_logprobs`) is served no
cached prefix, so every prompt position passes through the model in some prefill chunk; each chunk
appends the logprobs of the prompt tokens it predicts. A chunk computed again after a preemption
appends only what is still missing. Logprobs are those of the raw logits, as the sampled tokens' are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.protocol import PromptLogprob
from engine.scheduler import ScheduledSeq

ROWS_PER_PASS = 256  # logits of this many positions at a time: [rows, vocab] fp32 stays small


def collect_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            scheduled: list[ScheduledSeq]) -> None:
    """Append to each scheduled sequence that needs them the prompt logprobs this step's rows give.

    ``hidden`` holds one row per scheduled token, sequences in ``scheduled`` order (the eager step's
    layout); called before the scheduler records the step, so ``num_computed_tokens`` is where each
    sequence's chunk starts.
    """
    row = 0
    for seq, num_new in scheduled:
        start = seq.num_computed_tokens
        if seq.needs_prompt_logprobs:
            # The logits at position p predict prompt token p + 1; the list holds tokens 1 .. len.
            first, end = max(start, len(seq.prompt_logprobs)), min(start + num_new, seq.num_prompt_tokens - 1)
            k = seq.sampling.prompt_logprobs
            for lo in range(first, end, ROWS_PER_PASS):
                hi = min(lo + ROWS_PER_PASS, end)
                rows = hidden[row + lo - start: row + hi - start]
                logprobs = compute_logits(rows).float().log_softmax(-1)
                targets = torch.tensor(seq.prompt_ids[lo + 1: hi + 1], device=logprobs.device)
                chosen = logprobs.gather(1, targets[:, None])
                ranks = (logprobs > chosen).sum(-1) + 1
                top_values, top_ids = logprobs.topk(k, -1)
                seq.prompt_logprobs += [
                    PromptLogprob(lp, rank, list(zip(ids, values)))
                    for lp, rank, ids, values in zip(chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(),
                                                     top_values.tolist())
                ]
        row += num_new
