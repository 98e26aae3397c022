"""The Llama model and its loader against HF transformers, and paged execution against itself."""

from __future__ import annotations

import json

import pytest
import torch
from paged import PagedKV

from engine.config import DUMMY_CONFIGS, ModelConfig
from engine.models.loader import ModelLoadError, load_model
from kernels import load_ops

# SmolLM2's chat template applied to one user message ("Explain in two sentences why the sky is
# blue, and what changes at sunset."), tokenized with the GGUF's own tokenizer.
PROMPT = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 36971, 281, 827, 8545, 1701, 260, 6376, 314, 4461, 28, 284,
    732, 1971, 418, 21822, 30, 2, 198, 1, 520, 9531, 198,
]


@torch.inference_mode()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def all_logits(model, config: ModelConfig, chunks: dict, **paged) -> torch.Tensor:
    """Logits of every new token of ``chunks`` run as one batch on a fresh paged cache."""
    kv = PagedKV(config, **paged)
    return model.compute_logits(model(*kv.batch(chunks), kv.kv_caches))


@pytest.mark.slow
def test_smollm2_final_logits_match_hf(smollm2, hf_gguf_model):
    model, config = smollm2
    ours = PagedKV(config).step(model, {0: PROMPT})[0]
    theirs = hf_logits(hf_gguf_model, PROMPT)[-1]
    assert ours.dtype == torch.float32 and ours.shape == (config.vocab_size,)
    assert (ours - theirs).abs().max().item() <= 1e-3
    assert ours.argmax() == theirs.argmax()


def test_smollm2_config_from_gguf_metadata(smollm2):
    _, config = smollm2
    assert config == ModelConfig(
        name="SmolLM2-135M-Instruct.Q4_1", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        max_position_embeddings=8192, rms_norm_eps=config.rms_norm_eps, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    )
    assert config.rms_norm_eps == pytest.approx(1e-5)


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_and_decode_match_full_prefill(smollm2, block_size):
    """Chunks of 7 and 13 tokens, the rest, then decode steps, on shuffled blocks, batched with
    a second sequence, give the logits of one full prefill of the same tokens."""
    model, config = smollm2
    other = PROMPT[::-1][:30]
    kv = PagedKV(config, block_size=block_size, seed=1)
    prefill_steps = [
        {"a": PROMPT[:7], "b": other[:20]},
        {"a": PROMPT[7:20]},
        {"b": other[20:], "a": PROMPT[20:]},
    ]
    tokens = list(PROMPT)
    stepped = []
    for chunks in prefill_steps:
        stepped.append(kv.step(model, chunks)[list(chunks).index("a")])
    for _ in range(3):  # greedy decode, with "b" decoding alongside
        next_token = int(stepped[-1].argmax())
        tokens.append(next_token)
        stepped.append(kv.step(model, {"b": [7], "a": [next_token]})[1])

    full = all_logits(model, config, {"a": tokens}, block_size=block_size, seed=2)
    rows = [6, 19, len(PROMPT) - 1, len(PROMPT), len(PROMPT) + 1, len(PROMPT) + 2]
    # the decode steps' attention is another kernel than the full prefill's (on the CPU kvgate's compiled
    # decode attention once an engine gave the session's model its CPU ops): fp32 rounding apart, which
    # grows with the logits (up to ~25 here: 1.1e-4 seen)
    torch.testing.assert_close(torch.stack(stepped), full[rows], atol=1e-4, rtol=1e-5)


# --- Hugging Face directory ------------------------------------------------------------------


def save_hf_llama(path, tie_word_embeddings: bool, **overrides):
    """A small random Llama saved by transformers as config.json + model.safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=[2, 3], **overrides,
    )
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            # Norm weights too, so a misplaced norm cannot hide behind all-ones.
            noise = torch.randn_like(param)
            param.copy_(1 + 0.2 * noise if "norm" in name else 0.1 * noise)
    hf_model.save_pretrained(path, safe_serialization=True)
    return hf_model


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_hf_directory_matches_transformers(tmp_path, tie_word_embeddings):
    hf_model = save_hf_llama(tmp_path, tie_word_embeddings)
    model, config = load_model(str(tmp_path), "auto", "cpu", torch.float32, load_ops("torch"))
    assert config.rope_theta == 5000.0 and config.rms_norm_eps == 1e-6
    assert config.tie_word_embeddings is tie_word_embeddings and config.eos_token_ids == (2, 3)
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = all_logits(model, config, {0: prompt}, block_size=8)
    assert (ours - hf_logits(hf_model, prompt)).abs().max().item() <= 1e-4


# --- dummy weights --------------------------------------------------------------------------


def test_dummy_tiny_is_deterministic_and_finite():
    ops = load_ops("torch")
    model, config = load_model("tiny", "dummy", "cpu", torch.float32, ops)
    again, _ = load_model("tiny", "dummy", "cpu", torch.float32, ops)
    assert config == DUMMY_CONFIGS["tiny"]
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
    logits = all_logits(model, config, {0: list(range(1, 40))})
    assert logits.shape == (39, config.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0


@pytest.mark.parametrize("style", ["engine", "hf"])
def test_dummy_from_json_config(tmp_path, style):
    if style == "engine":
        spec = json.loads(DUMMY_CONFIGS["tiny"].to_json()) | {"name": "mine", "num_layers": 3}
    else:
        spec = {
            "model_type": "llama", "vocab_size": 1000, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1,
            "eos_token_id": 2,
        }
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(spec))
    model, config = load_model(str(path), "dummy", "cpu", torch.float32, load_ops("torch"))
    assert config.name == "mine" and config.num_layers == 3 and len(model.model.layers) == 3
    assert torch.isfinite(all_logits(model, config, {0: [1, 2, 3, 4, 5]})).all()


# --- errors ---------------------------------------------------------------------------------


def load(model: str, load_format: str = "auto"):
    return load_model(model, load_format, "cpu", torch.float32, load_ops("torch"))


def test_unknown_format_and_undetectable_path(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown load format 'pickle'"):
        load("tiny", "pickle")
    with pytest.raises(ModelLoadError, match="cannot tell the load format of .*missing"):
        load(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="cannot tell the load format"):
        load(str(tmp_path))  # a directory without config.json


def test_bad_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(str(tmp_path / "absent.gguf"), "gguf")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load(str(fake))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no-such-shape", "bad dummy model config 'no-such-shape'"),
        ({"name": "x", "vocab_size": 10}, "missing 7 required"),
        ({**json.loads(DUMMY_CONFIGS["tiny"].to_json()), "num_kv_heads": 3}, "multiple of num_kv_heads"),
        ("{not json", "bad dummy model config"),
    ],
)
def test_bad_dummy_config(tmp_path, spec, message):
    if spec != "no-such-shape":
        path = tmp_path / "bad.json"
        path.write_text(spec if isinstance(spec, str) else json.dumps(spec))
        spec = str(path)
    with pytest.raises(ModelLoadError, match=message):
        load(spec, "dummy")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0}}, "RoPE type 'dynamic'"),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ],
)
def test_hf_directory_unsupported_settings(tmp_path, overrides, message):
    save_hf_llama(tmp_path, tie_word_embeddings=False, **overrides)
    with pytest.raises(ModelLoadError, match=message):
        load(str(tmp_path), "hf")


def test_hf_directory_bad_contents(tmp_path):
    from safetensors.torch import load_file, save_file

    save_hf_llama(tmp_path, tie_word_embeddings=False)
    weights = load_file(tmp_path / "model.safetensors")

    save_file({k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"},
              tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing 1 weights: model.layers.1.mlp.up_proj.weight"):
        load(str(tmp_path), "hf")

    save_file(weights | {"model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 64)},
              tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"k_proj.weight' has shape \(3, 64\), expected \(32, 64\)"):
        load(str(tmp_path), "hf")

    save_file(weights | {"model.layers.0.self_attn.q_norm.weight": torch.ones(16)},
              tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="unexpected weight 'model.layers.0.self_attn.q_norm"):
        load(str(tmp_path), "hf")

    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported"):
        load(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="missing setting 'num_attention_heads'"):
        load(str(tmp_path))
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load(str(tmp_path))
