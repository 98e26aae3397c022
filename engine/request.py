"""Per-sequence state inside the engine."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from engine.protocol import PromptLogprob, SamplingParams, TokenLogprob
from prefix_index.hashing import BlockHash, block_hashes

if TYPE_CHECKING:
    import xgrammar

    from engine.spec_decode import NgramIndex


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One generated sequence. A request with ``n > 1`` becomes ``n`` sequences sharing its id.

    Token accounting is unified: ``all_token_ids = prompt + output``; each step computes the KV of
    ``all_token_ids[num_computed_tokens : num_computed_tokens + k]``. A decode is the case k == 1;
    a preempted sequence resumes by recomputing prompt and output together.

    A constrained sequence (``sampling.structured``) has a grammar ``matcher`` that has accepted
    exactly ``output_ids``; the scheduler drops it when the sequence finishes.

    With speculative decoding, ``draft_ids`` are the proposed tokens a step verifies after
    ``all_token_ids`` (scheduled as extra new tokens; empty between steps) and ``ngram`` is the
    proposer's index of this sequence's tokens. Only committed tokens ever enter ``all_token_ids``.

    With overlapped scheduling (:mod:`engine.core`), a step's sampled token may still be on the device
    when the next step is planned: ``num_pending_tokens`` (0 or 1) counts it in ``num_tokens`` (the
    next step computes its KV, reading the id on the device) until the scheduler records it.

    Sequence 0 of a request with ``sampling.prompt_logprobs`` collects them in ``prompt_logprobs``
    (the model runner appends each prefill chunk's) and is served no cached prefix until it has them
    all (:attr:`needs_prompt_logprobs`): cached KV holds no logits.
    """

    __slots__ = (
        "request_id", "index", "prompt_ids", "output_ids", "all_token_ids", "sampling", "salt",
        "cache_boundaries", "generator", "status", "num_computed_tokens", "num_cached_tokens",
        "block_ids", "group_block_ids", "block_hashes", "finish_reason", "error", "pending_logprobs",
        "num_sent_tokens", "matcher", "prompt_logprobs", "draft_ids", "ngram", "num_pending_tokens",
    )

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_ids: list[int],
        sampling: SamplingParams,
        salt: str | None,
        cache_boundaries: list[int],
        generator: torch.Generator | None,
        matcher: xgrammar.GrammarMatcher | None = None,
    ):
        self.request_id = request_id
        self.index = index
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.all_token_ids = list(prompt_ids)
        self.sampling = sampling
        self.salt = salt
        self.cache_boundaries = sorted(cache_boundaries)  # the KV manager handles them in order
        self.generator = generator
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_pending_tokens = 0
        # Only extended while the blocks are held; freeing them replaces the list (DecodeGraphs
        # copies a row of its block table only from where the list it knows grew).
        self.block_ids: list[int] = []
        self.group_block_ids: list[list[int]] = []  # the other layer groups' tables (engine.kv_groups)
        self.block_hashes: list[BlockHash] = []
        self.finish_reason: str | None = None
        self.error: str | None = None  # why, when finish_reason is "error"
        self.pending_logprobs: list[TokenLogprob] = []
        self.num_sent_tokens = 0  # output tokens already streamed out
        self.matcher = matcher
        self.prompt_logprobs: list[PromptLogprob] = []  # of prompt tokens 1, 2, ... (the first has none)
        self.draft_ids: list[int] = []
        self.ngram: NgramIndex | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        return (self.sampling.prompt_logprobs is not None and self.index == 0
                and len(self.prompt_logprobs) < len(self.prompt_ids) - 1)

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hashes of every full block of tokens (prompt and output) known so far."""
        self.block_hashes = block_hashes(
            self.all_token_ids, block_size, self.salt, prefix=self.block_hashes
        )
        return self.block_hashes

    def reset_for_recompute(self) -> None:
        """Preempted: drop the KV; prompt and output tokens are recomputed on resumption. The
        output tokens stay, so the grammar matcher, which accepted exactly them, stays valid: the
        next token is sampled under the mask of the state it left."""
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.block_ids = []
        self.group_block_ids = []
