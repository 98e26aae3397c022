"""Per-step attention metadata, built by the model runner and passed down to every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Decode steps whose contexts all fit in this many tokens run decode_attention (RoPE, the K/V
# store and split-K attention in one launch); longer ones the three ops it fuses, whose separate
# reduce kernel merges many splits in parallel. On the H200 (kernels_bench.py, per layer, batch
# 1 to 64) the fused op is 1.1-1.4x as fast at 512 tokens, 0.9-1.2x at 2K and 0.5-0.95x at 8K.
FUSED_DECODE_MAX_CONTEXT = 2048


@dataclass(slots=True)
class AttentionMetadata:
    """A flattened varlen batch; layouts as documented in ``kernels/reference.py``."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # With layer groups (engine.kv_groups): each group's metadata (its block tables and slots)
    groups: tuple[AttentionMetadata, ...] = ()

    def group(self, index: int) -> AttentionMetadata:
        """The metadata of layer group ``index`` (this one without groups)."""
        return self.groups[index] if self.groups else self

    @property
    def fused_decode(self) -> bool:
        """Decode-only with every context short enough for decode_attention."""
        return self.max_query_len == 1 and self.max_seq_len <= FUSED_DECODE_MAX_CONTEXT
