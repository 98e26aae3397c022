"""Gemma 3's text decoder over the paged KV cache.

Five sliding-window layers to each global one (``ModelConfig.layer_types``), the local layers on
their own RoPE base; q/k norms; RMSNorms of ``(1 + w)`` before and after both attention and the
MLP (we hold ``1 + w``, so the shared RMSNorm serves); a GeGLU MLP (tanh-approximate GELU);
embeddings scaled by sqrt(hidden_size) and tied to the head; attention scaled by
``query_pre_attn_scalar ** -0.5``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.models.layers import CausalLM, Embedding, GatedMLP, QKNormAttention, RMSNorm, rope_tables
from kernels import KernelOps


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., :d]) * x[..., d:]`` for ``x`` of last dimension ``2d`` (gate then up)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, ops: KernelOps, factory: dict) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, ops, factory)
        self.self_attn = QKNormAttention(config, layer, ops, factory)
        self.post_attention_layernorm = RMSNorm(size, eps, ops, factory)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, ops, factory)
        self.mlp = GatedMLP(config, ops, factory)
        self.post_feedforward_layernorm = RMSNorm(size, eps, ops, factory)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # As in Llama, (hidden, residual) pairs flow between layers: each residual add is fused
        # into the norm after it; the post-norms of attention and the MLP take no residual.
        qkv, residual = self.input_layernorm.linear(hidden, residual, self.self_attn.qkv_proj.weight)
        hidden, _ = self.post_attention_layernorm(self.self_attn(positions, qkv, attn, *kv_cache, cos_sin_cache))
        gate_up, residual = self.pre_feedforward_layernorm.linear(hidden, residual, self.mlp.gate_up_proj.weight)
        hidden, _ = self.post_feedforward_layernorm(self.mlp.down_proj(gelu_tanh_and_mul(gate_up)))
        return hidden, residual


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, factory: dict) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, factory)
        # sqrt(hidden_size) rounded to the weights' dtype first, as transformers does
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=factory["dtype"]).item()
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, ops, factory) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, factory)
        full, local = rope_tables(config, factory["device"])
        self.register_buffer("cos_sin_cache", full, persistent=False)
        self.register_buffer("local_cos_sin_cache", local if local is not None else full, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            table = self.local_cos_sin_cache if layer.self_attn.window else self.cos_sin_cache
            hidden, residual = layer(positions, hidden, residual, attn, kv_cache, table)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForCausalLM(CausalLM):
    def __init__(
        self, config: ModelConfig, ops: KernelOps, *, device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(config, ops, device, dtype)
        self.model = Gemma3Model(config, ops, self.factory)
        self._finish()

    def convert_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # Checkpoints hold w of the (1 + w) norms; we hold 1 + w, computed in fp32 as transformers does.
        return tensor.float() + 1.0 if name.endswith("norm.weight") else tensor
