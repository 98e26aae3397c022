"""Every family of the registry against HF transformers: tiny random-weight Qwen2, Qwen3,
Llama 3.1 (llama3 RoPE scaling), YaRN- and linear-scaled Llamas and Mistral (sliding window),
built with transformers' own config classes, saved as safetensors and loaded by kvgate; and the
Llama 3.1 as llama.cpp converts it to GGUF (its RoPE scaling as rope_freqs.weight)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from paged import PagedKV

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.models.loader import ModelLoadError, load_model
from engine.models.rope import inverse_frequencies
from engine.protocol import GenerateRequest, SamplingParams
from kernels import load_ops

VOCAB = 512
ORIGINAL_MAX = 64  # the scaled RoPEs' original_max_position_embeddings: prompts run past it
WINDOW = 24  # Mistral's sliding window: shorter than most prompts
PROMPT_LENGTHS = (5, 40, 150, 97, 230)
MAX_NEW = 8

SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)
FAMILIES = {
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", {"head_dim": 32}),
    "llama3.1": ("Llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX}}),
    "yarn": ("Llama", {"max_position_embeddings": 4 * ORIGINAL_MAX * 4, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX}}),
    "linear": ("Llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "mistral": ("Mistral", {"sliding_window": WINDOW}),
}


def save_hf(path, family: str, **overrides):
    """A small random model of ``family`` saved by transformers as config.json + model.safetensors."""
    import transformers

    prefix, settings = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(**SHAPE | settings | overrides)
    torch.manual_seed(0)
    hf_model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            # Norm weights and biases too, so that a misplaced one cannot hide behind ones or zeros.
            noise = torch.randn_like(param)
            param.copy_(1 + 0.2 * noise if "norm" in name else 0.1 * noise)
    hf_model.save_pretrained(path, safe_serialization=True)
    return hf_model


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """``(name, hf_model, model, config)`` of one family."""
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_hf(path, request.param)
    model, config = load_model(str(path), "auto", "cpu", torch.float32, load_ops("torch"))
    return request.param, hf_model, model, config


def test_config_names_the_family(family):
    name, _, _, config = family
    expected = {"qwen2": "qwen2", "qwen3": "qwen3"}.get(name, "llama")
    assert config.architecture == expected
    scaling = {"llama3.1": "llama3", "yarn": "yarn", "linear": "linear"}.get(name)
    assert (config.rope_scaling and config.rope_scaling.rope_type) == scaling
    assert config.layer_types == (("sliding_attention",) * 2 if name == "mistral" else ())
    assert config.sliding_window == (WINDOW if name == "mistral" else None)


@torch.inference_mode()
def test_logits_match_hf_in_one_chunked_batch(family):
    """All prompts as one varlen batch, the long ones in two chunks: every position's logits
    within 1e-4 of transformers' on each prompt alone."""
    _, hf_model, model, config = family
    kv = PagedKV(config, num_blocks=256, block_size=8)
    batch = prompts()
    first = {i: p[:60] for i, p in enumerate(batch)}
    rest = {i: p[60:] for i, p in enumerate(batch) if len(p) > 60}
    rows = [model.compute_logits(model(*kv.batch(step), kv.kv_caches)) for step in (first, rest)]
    offsets = {0: 0, 1: 0}
    for i, prompt in enumerate(batch):
        parts = []
        for step, (chunks, logits) in enumerate(zip((first, rest), rows)):
            if i in chunks:
                parts.append(logits[offsets[step] : offsets[step] + len(chunks[i])])
                offsets[step] += len(chunks[i])
        ours = torch.cat(parts)
        theirs = hf_model(torch.tensor([prompt])).logits[0]
        assert (ours - theirs).abs().max().item() <= 1e-4, (i, len(prompt))


@torch.inference_mode()
def test_greedy_tokens_match_hf_generate(family):
    """The engine (chunked prefill, batched decode) picks transformers' greedy tokens."""
    _, hf_model, model, config = family
    core = EngineCore.from_model(EngineConfig(model="tiny", max_num_batched_tokens=64, num_kv_blocks=256,
                                              block_size=8), model, config)
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    batch = prompts()
    for i, prompt in enumerate(batch):
        core.add_request(GenerateRequest(f"r{i}", prompt, sampling))
    ours: dict[str, list[int]] = {}
    while core.has_work():
        for frame in core.step():
            ours.setdefault(frame.request_id, []).extend(frame.token_ids)
        core.check_integrity()
    for i, prompt in enumerate(batch):
        theirs = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
        )[0, len(prompt):].tolist()
        assert ours[f"r{i}"] == theirs, i


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("qwen2", {"model_type": "gpt_neox"}, "model_type 'gpt_neox' is not supported"),
        ("llama3.1", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}},
         "RoPE type 'longrope' is not supported"),
        ("yarn", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                      "original_max_position_embeddings": 64, "mystery": 1}},
         "RoPE setting 'mystery' of type 'yarn' is not supported"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0,
                   "layer_types": ["sliding_attention"] * 2}, "use_sliding_window=True is not supported"),
        ("qwen3", {"attention_bias": True}, "attention_bias=True is not supported"),
        ("llama3.1", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ("mistral", {"num_attention_heads": None}, "missing setting 'num_attention_heads'"),
    ],
)
def test_unsupported_settings_are_named(tmp_path, family, change, message):
    save_hf(tmp_path, family)
    config = json.loads((tmp_path / "config.json").read_text())
    config |= change
    config = {k: v for k, v in config.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(tmp_path), "hf", "cpu", torch.float32, load_ops("torch"))


# --- Llama 3.1 as llama.cpp converts it: RoPE scaling as rope_freqs.weight ---------------------


def llama3_rope_factors(head_dim: int, rope: dict) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for a llama3 RoPE."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for freq in (1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)).tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def save_llama3_gguf(path, hf_model, rope_factors: np.ndarray | None = None) -> None:
    """``hf_model`` (a Llama 3.1) as an F32 GGUF written by the gguf package, q and k rows in
    llama.cpp's interleaved order, its RoPE scaling as rope_freqs.weight (``rope_factors``: other
    contents for it)."""
    import gguf

    c = hf_model.config
    rope = FAMILIES["llama3.1"][1]["rope_parameters"]
    head_dim = c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_vocab_size(c.vocab_size)

    def interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    for name, tensor in hf_model.state_dict().items():
        if name in names:
            gguf_name = names[name]
        else:
            _, _, layer, local = name.split(".", 3)
            gguf_name = f"blk.{layer}.{layer_names[local.removesuffix('.weight')]}.weight"
        if gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in gguf_name else c.num_key_value_heads
            tensor = interleaved(tensor, heads)
        writer.add_tensor(gguf_name, tensor.float().numpy())
    factors = llama3_rope_factors(head_dim, rope) if rope_factors is None else rope_factors
    writer.add_tensor("rope_freqs.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@torch.inference_mode()
def test_llama31_gguf_with_rope_freqs_matches_hf(tmp_path):
    """A Llama 3.1 GGUF carrying rope_freqs.weight: the frequencies HF's llama3 scaling gives,
    and logits within 1e-4 of transformers' on prompts past original_max_position_embeddings."""
    hf_model = save_hf(tmp_path, "llama3.1")
    save_llama3_gguf(tmp_path / "llama31.gguf", hf_model)
    model, config = load_model(str(tmp_path / "llama31.gguf"), "gguf", "cpu", torch.float32, load_ops("torch"))
    assert config.rope_scaling.rope_type == "llama3" and config.rope_scaling.factor == 8.0
    _, hf_config = load_model(str(tmp_path), "hf", "cpu", torch.float32, load_ops("torch"))
    ours, _ = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    theirs, _ = inverse_frequencies(config.head_dim, config.rope_theta, hf_config.rope_scaling)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)  # the factors are stored in fp32
    assert not torch.allclose(ours, inverse_frequencies(config.head_dim, config.rope_theta, None)[0])
    for prompt in prompts()[2:]:  # 150, 97 and 230 tokens; the original context is 64
        kv = PagedKV(config, num_blocks=64, block_size=8)
        logits = model.compute_logits(model(*kv.batch({0: prompt}), kv.kv_caches))
        assert (logits - hf_model(torch.tensor([prompt])).logits[0]).abs().max().item() <= 1e-4, len(prompt)


def test_rope_freqs_of_the_wrong_size_are_named(tmp_path):
    save_llama3_gguf(tmp_path / "three.gguf", save_hf(tmp_path, "llama3.1"), np.ones(3, dtype=np.float32))
    with pytest.raises(ModelLoadError, match="'rope_freqs.weight' needs 8 positive factors, got 3"):
        load_model(str(tmp_path / "three.gguf"), "gguf", "cpu", torch.float32, load_ops("torch"))
