"""Tensor parallelism as a transform over a single-device model (gpt-fast's ``tp.py`` idea).

The family code stays single-device. :func:`shard_model` takes a loaded model and keeps one rank's
part of its weights: the q/k/v rows of the rank's heads and the gate/up rows of its slice of the
MLP (column-parallel: the fused norm+projection ops run unchanged on fewer rows), the matching
columns of o and down (row-parallel: an all-reduce after each, the two per layer), and a
``1/world`` slice of the vocabulary in the embedding (an all-reduce of the rows each rank owns)
and in the LM head (an all-gather of the logits, so that every rank samples from exact full logits).

KV heads are split between ranks as evenly as they go, the larger shares first, each rank taking
whole groups of query heads; with fewer KV heads than ranks, the ranks sharing a KV head each take
an equal part of its query heads and keep a copy of it. Each rank's KV cache holds its own heads
(:func:`local_config`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.models.layers import Attention, CausalLM
from kernels import KernelOps


class HeadSplit(NamedTuple):
    """One rank's heads: query heads ``q`` and KV heads ``kv`` (contiguous ranges of the model's)."""

    q: range
    kv: range


def _share(total: int, world_size: int, rank: int) -> range:
    """Rank ``rank``'s part of ``total`` items cut into ``world_size`` contiguous parts, the larger
    parts first (rank 0 holds the most: its memory budget bounds every rank's)."""
    return range(-(-rank * total // world_size), -(-(rank + 1) * total // world_size))


def head_split(config: ModelConfig, world_size: int, rank: int) -> HeadSplit:
    """Raises ValueError when the heads cannot be split evenly enough for ``world_size`` ranks."""
    heads, kv_heads = config.num_heads, config.num_kv_heads
    group = heads // kv_heads  # query heads per KV head
    if kv_heads >= world_size:
        kv = _share(kv_heads, world_size, rank)
        return HeadSplit(range(kv.start * group, kv.stop * group), kv)
    sharers = world_size // kv_heads  # ranks per KV head
    if world_size % kv_heads or group % sharers:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not divide the model's heads: with {kv_heads} KV heads "
            f"(fewer than the ranks) it must be a multiple of them whose share of each KV head's {group} "
            "query heads is whole"
        )
    kv_head, part = divmod(rank, sharers)
    first = kv_head * group + part * (group // sharers)
    return HeadSplit(range(first, first + group // sharers), range(kv_head, kv_head + 1))


def local_config(config: ModelConfig, world_size: int, rank: int) -> ModelConfig:
    """The shape one rank holds: its heads, KV heads and MLP slice (the vocabulary stays whole:
    the logits are gathered). Raises ValueError as :func:`head_split` and for an MLP too narrow."""
    if config.intermediate_size < world_size:
        raise ValueError(f"intermediate_size {config.intermediate_size} is smaller than tensor_parallel_size "
                         f"{world_size}")
    split = head_split(config, world_size, rank)
    return dataclasses.replace(
        config, num_heads=len(split.q), num_kv_heads=len(split.kv),
        intermediate_size=len(_share(config.intermediate_size, world_size, rank)),
    )


class RowParallelLinear(nn.Module):
    """``x @ weight.T`` over this rank's input columns, summed over the ranks (all-reduce)."""

    def __init__(self, weight: torch.Tensor, ops: KernelOps, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.ops = ops
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ops.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelEmbedding(nn.Module):
    """Rows ``start … start + len(weight)`` of the embedding; other ids give zeros here and their
    row on the rank that holds it (all-reduce: one nonzero term per element, so exact)."""

    def __init__(self, weight: torch.Tensor, start: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        dist.all_reduce(out, group=self.group)
        return out


class TensorParallelLM(nn.Module):
    """One rank's shard of a :class:`CausalLM`, with the same ``forward`` / ``compute_logits``
    contract (``config`` is the rank's :func:`local_config`). ``compute_logits`` is a collective:
    every rank calls it on the same rows and gets the full logits (fp32, or ``out``'s dtype)."""

    def __init__(self, model: CausalLM, config: ModelConfig, vocab_size: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.model = model
        self.config = config
        self.ops = model.ops
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, input_ids, positions, attn, kv_caches) -> torch.Tensor:
        return self.model(input_ids, positions, attn, kv_caches)

    @property
    def logits_dtype(self) -> torch.dtype:
        return self.model.logits_dtype

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        inner = self.model
        head = inner.model.embed_tokens if inner.lm_head is None else inner.lm_head
        local = F.linear(hidden, head.weight)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        logits = torch.cat(parts, dim=-1)[:, : self.vocab_size]  # the last shard's padding rows dropped
        return logits.float() if out is None else out.copy_(logits)


def _rows(weight: torch.Tensor, *ranges: range) -> torch.Tensor:
    return torch.cat([weight[r.start : r.stop] for r in ranges]).contiguous()


def _vocab_shard(weight: torch.Tensor, world_size: int, rank: int) -> tuple[torch.Tensor, int]:
    """This rank's rows of a ``[vocab, hidden]`` table, zero-padded to ``ceil(vocab / world)`` rows
    (equal shards: the logits' all-gather needs equal parts), and the first row's id."""
    per_rank = -(-weight.shape[0] // world_size)
    start = rank * per_rank
    shard = weight.new_zeros(per_rank, weight.shape[1])
    rows = weight[start : start + per_rank]
    shard[: rows.shape[0]] = rows
    return shard, start


def _shard_attention(attn: Attention, config: ModelConfig, split: HeadSplit, group: dist.ProcessGroup) -> None:
    d = config.head_dim
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
    q = range(split.q.start * d, split.q.stop * d)
    k = range(q_size + split.kv.start * d, q_size + split.kv.stop * d)
    v = range(q_size + kv_size + split.kv.start * d, q_size + kv_size + split.kv.stop * d)
    attn.qkv_proj.weight = nn.Parameter(_rows(attn.qkv_proj.weight, q, k, v), requires_grad=False)
    if hasattr(attn, "qkv_bias"):  # Qwen2
        attn.qkv_bias = nn.Parameter(_rows(attn.qkv_bias, q, k, v), requires_grad=False)
    attn.o_proj = RowParallelLinear(attn.o_proj.weight[:, q.start : q.stop].contiguous(), attn.ops, group)
    attn.num_heads, attn.num_kv_heads = len(split.q), len(split.kv)
    attn.q_size, attn.kv_size = len(q), len(k)


@torch.no_grad()
def shard_model(model: CausalLM, world_size: int, rank: int, group: dist.ProcessGroup) -> TensorParallelLM:
    """Keep rank ``rank``'s part of ``model``'s weights (in place: the full tensors are freed as
    they are replaced) and return the rank's model. Raises ValueError as :func:`local_config`."""
    config = model.config
    local = local_config(config, world_size, rank)
    split = head_split(config, world_size, rank)
    mlp_rows = _share(config.intermediate_size, world_size, rank)
    inter = config.intermediate_size
    for layer in model.model.layers:
        _shard_attention(layer.self_attn, config, split, group)
        mlp = layer.mlp
        up_rows = range(inter + mlp_rows.start, inter + mlp_rows.stop)
        mlp.gate_up_proj.weight = nn.Parameter(_rows(mlp.gate_up_proj.weight, mlp_rows, up_rows), requires_grad=False)
        mlp.down_proj = RowParallelLinear(
            mlp.down_proj.weight[:, mlp_rows.start : mlp_rows.stop].contiguous(), model.ops, group
        )
    embed, start = _vocab_shard(model.model.embed_tokens.weight, world_size, rank)
    model.model.embed_tokens = VocabParallelEmbedding(embed, start, group)
    if model.lm_head is not None:
        head, _ = _vocab_shard(model.lm_head.weight, world_size, rank)
        model.lm_head.weight = nn.Parameter(head, requires_grad=False)
    return TensorParallelLM(model, local, config.vocab_size, group)
