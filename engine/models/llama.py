"""Llama-family decoder (Llama 2/3.x, SmolLM2, Mistral: one shape) over the paged KV cache.

RMSNorm, RoPE (plain, linear, Llama 3 or YaRN scaled), grouped-query attention (every layer
sliding-window for Mistral), SwiGLU, tied or untied head. The Qwen families
(``engine.models.qwen``) are this model with another attention.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.models.layers import Attention, CausalLM, Embedding, GatedMLP, RMSNorm, rope_tables
from kernels import KernelOps


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[Attention] = Attention

    def __init__(self, config: ModelConfig, layer: int, ops: KernelOps, factory: dict) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, factory)
        self.self_attn = self.attention_cls(config, layer, ops, factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, factory)
        self.mlp = GatedMLP(config, ops, factory)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the next norm, and the norm into the projection after it:
        # (hidden, residual) pairs flow between layers.
        qkv, residual = self.input_layernorm.linear(hidden, residual, self.self_attn.qkv_proj.weight)
        hidden = self.self_attn(positions, qkv, attn, *kv_cache, cos_sin_cache)
        act, residual = self.post_attention_layernorm.linear(
            hidden, residual, self.mlp.gate_up_proj.weight, gated=True
        )
        return self.mlp.down_proj(act), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layer_cls: type[LlamaDecoderLayer], ops: KernelOps, factory: dict) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, factory)
        self.layers = nn.ModuleList(layer_cls(config, i, ops, factory) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, factory)
        cos_sin_cache, _ = rope_tables(config, factory["device"])
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, attn, kv_cache, self.cos_sin_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(
        self, config: ModelConfig, ops: KernelOps, *, device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(config, ops, device, dtype)
        self.model = LlamaModel(config, self.layer_cls, ops, self.factory)
        self._finish()
