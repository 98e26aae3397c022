"""Qwen2 and Qwen3: the Llama decoder with another attention. Qwen2 adds a bias to q, k and v;
Qwen3 has none, but normalizes each head of q and k (RMSNorm over head_dim) before RoPE."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.layers import QKV_PARTS, Attention, QKNormAttention
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kernels import KernelOps


class Qwen2Attention(Attention):
    def __init__(self, config: ModelConfig, layer: int, ops: KernelOps, factory: dict) -> None:
        super().__init__(config, layer, ops, factory)
        self.qkv_bias = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, **factory))

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return super().split_heads(qkv + self.qkv_bias)


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = QKNormAttention


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer

    def fused_parts(self) -> dict[str, dict[str, slice]]:
        parts = super().fused_parts()
        qkv = parts["self_attn.qkv_proj.weight"]
        parts["self_attn.qkv_bias"] = {
            f"self_attn.{name}.bias": qkv[f"self_attn.{name}.weight"] for name in QKV_PARTS
        }
        return parts


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
