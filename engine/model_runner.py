"""Scheduled sequences → tensors → model → sampler. Owns the KV tensors."""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.protocol import TokenLogprob
from engine.request import Sequence
from engine.sampler import Sampler
from engine.scheduler import ScheduledSeq


class SampledToken(NamedTuple):
    seq: Sequence
    token_id: int
    logprob: TokenLogprob | None


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
    ):
        self.model = model
        self.config = config
        self.device = device
        self.block_size = block_size
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)
        ]
        self.sampler = Sampler(config.eos_token_ids)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> list[SampledToken]:
        """Run one step; sample for every sequence whose known tokens are now all computed."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        sample_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        max_blocks = 0
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            block_ids = seq.block_ids
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            query_start.append(query_start[-1] + num_new)
            max_blocks = max(max_blocks, len(block_ids))
            if end == seq.num_tokens:
                sample_rows.append(query_start[-1] - 1)
                sampling_seqs.append(seq)

        block_tables = torch.zeros((len(scheduled), max_blocks), dtype=torch.int32)
        for i, (seq, _) in enumerate(scheduled):
            block_tables[i, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)
        dev = self.device
        attn = AttentionMetadata(
            block_tables=block_tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=query_start,
            max_query_len=max(n for _, n in scheduled),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            attn,
            self.kv_caches,
        )
        if not sampling_seqs:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        out = self.sampler(logits, sampling_seqs)
        return [
            SampledToken(seq, tok, lp)
            for seq, tok, lp in zip(sampling_seqs, out.token_ids, out.logprobs)
        ]
