"""Shared engine fixtures: the real SmolLM2, ours and HF's, each loaded once per session.

Model tests drive models through ``paged.PagedKV`` (a toy paged KV cache with shuffled blocks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from paged import clone, peaky_tiny

from engine.models.loader import load_model, load_tokenizer_info
from engine.protocol import default_model_path
from kernels import load_ops


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return Path(default_model_path())


@pytest.fixture(scope="session")
def smollm2(gguf_path):
    """``(model, config)``: our SmolLM2 from the GGUF, CPU fp32, torch reference ops."""
    return load_model(str(gguf_path), "gguf", "cpu", torch.float32, load_ops("torch"))


@pytest.fixture(scope="session")
def fp32_reference(smollm2):
    """The fp32 engine's greedy tokens and logprobs on benchmarks.accuracy's 20 SmolLM2 prompts (32
    tokens each), from a copy of the session's model (an engine gives its model the CPU ops): what
    quantized variants are measured against."""
    from benchmarks.accuracy import generate, smollm2_prompts
    from engine.config import EngineConfig
    from engine.core import EngineCore

    model, config = smollm2
    return generate(EngineCore.from_model(EngineConfig(model="smollm2"), clone(model), config), smollm2_prompts(), 32)


@pytest.fixture(scope="session")
def smollm2_tokenizer_info(gguf_path, smollm2):
    """xgrammar's view of the SmolLM2 GGUF vocabulary (for structured output)."""
    return load_tokenizer_info(str(gguf_path), "gguf", smollm2[1])


@pytest.fixture(scope="session")
def hf_gguf_model(gguf_path):
    """HF transformers' LlamaForCausalLM from the same GGUF, fp32 (about 30 s to load)."""
    from transformers import AutoModelForCausalLM

    from engine.gguf_reader import transformers_reads_plainly

    with transformers_reads_plainly():
        return AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        ).eval()


@pytest.fixture(scope="session")
def tiny():
    """``(model, config)``: the tiny dummy shape with peaky random weights, CPU fp32."""
    return peaky_tiny()
