"""The transformers twin runs on our model's own tensors and computes the same logits."""

import torch
from paged import PagedKV

from benchmarks.hf_twin import hf_twin
from engine.config import DUMMY_CONFIGS
from engine.models.llama import LlamaForCausalLM
from kernels import load_ops


def test_hf_twin_shares_weights_and_matches_logits():
    torch.manual_seed(0)
    config = DUMMY_CONFIGS["tiny"]
    model = LlamaForCausalLM(config, load_ops("torch"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    twin = hf_twin(model)
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    assert (twin.model.layers[1].self_attn.k_proj.weight.data_ptr()
            == qkv[config.num_heads * config.head_dim :].data_ptr())
    ids = list(range(100, 137))
    with torch.inference_mode():
        ours = PagedKV(config).step(model, {0: ids})[0]
        theirs = twin(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
