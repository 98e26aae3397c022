"""A Hugging Face transformers ``LlamaForCausalLM`` running on our model's own weight tensors.

For reference tests and benchmark peers, so it lives beside the benchmarks, outside the product
packages: both models see exactly the same (dummy or loaded) weights, with no copy.
"""

from __future__ import annotations

import torch

from engine.models.llama import LlamaForCausalLM


def hf_twin(model: LlamaForCausalLM, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A transformers LlamaForCausalLM (eval mode) whose parameters are views of ``model``'s."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = LlamaConfig(**model.config.to_hf(), attn_implementation=attn_implementation)
    state = model.hf_state_dict()
    if model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        twin = HFLlamaForCausalLM(hf_config)
    twin.load_state_dict(state, strict=True, assign=True)
    weight = state["model.embed_tokens.weight"]
    # The RoPE frequencies are a non-persistent buffer: computed, not loaded.
    twin.model.rotary_emb = LlamaRotaryEmbedding(config=hf_config).to(weight.device)
    return twin.eval().requires_grad_(False)
