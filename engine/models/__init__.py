"""The model families, by ``ModelConfig.architecture`` (see engine.config.ARCHITECTURES)."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.layers import CausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from kernels import KernelOps

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def build_model(
    config: ModelConfig, ops: KernelOps, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> CausalLM:
    """The (uninitialized) model of ``config``'s architecture."""
    return MODEL_CLASSES[config.architecture](config, ops, device=device, dtype=dtype)
