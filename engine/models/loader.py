"""Build a model and fill its weights from a GGUF file, a Hugging Face directory or random numbers;
read its tokenizer vocabulary for grammar-constrained output (:func:`load_tokenizer_info`).

``gguf``, ``safetensors``, ``transformers`` and ``xgrammar`` are imported where used: the engine
core imports without them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from engine.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeScaling, dummy_config
from engine.models import build_model, fp8
from engine.models.layers import CausalLM
from engine.protocol import LOAD_FORMATS
from kernels import KernelOps

if TYPE_CHECKING:
    import gguf
    import xgrammar

log = structlog.get_logger("engine.loader")

DUMMY_SEED = 0
DUMMY_STD = 0.02

# llama.cpp tensor names -> Hugging Face names (per layer: blk.N.<key> -> model.layers.N.<value>).
_GGUF_ROPE_FREQS = "rope_freqs.weight"  # Llama 3 RoPE scaling, read into the config
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LLAMA_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_GGUF_LAYER_NAMES = {
    "llama": _GGUF_LLAMA_NAMES,
    "qwen2": _GGUF_LLAMA_NAMES | {f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"},
    "qwen3": _GGUF_LLAMA_NAMES | _GGUF_QK_NORM_NAMES,
    "gemma3": _GGUF_LLAMA_NAMES | _GGUF_QK_NORM_NAMES | {
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
}
# llama.cpp interleaves each head's rotary halves of q and k for these (GPT-J style RoPE); the
# others keep HF's rotate-half (NeoX) order.
_GGUF_INTERLEAVED_ROPE = frozenset({"llama"})
# llama.cpp stores Gemma's (1 + w) norm weights with the 1 added; transformers subtracts it.
_GGUF_NORM_PLUS_ONE = frozenset({"gemma3"})
# Gemma 3 settings llama.cpp does not store but hard-codes: 5 local layers to a global one, and
# the local layers' RoPE base.
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0


class ModelLoadError(ValueError):
    """The model cannot be loaded; the message names the file, setting or tensor at fault."""


def load_model(
    model: str, load_format: str, device: torch.device | str, dtype: torch.dtype, ops: KernelOps
) -> tuple[CausalLM, ModelConfig]:
    """Build the model on ``device`` in ``dtype`` and load its weights; raises ModelLoadError.

    ``load_format``: ``gguf`` (llama.cpp file, dequantized), ``hf`` (config.json + *.safetensors),
    ``dummy`` (a DUMMY_CONFIGS name or JSON config; seeded random weights) or ``auto`` (by path).
    A Hugging Face checkpoint quantized to fp8 (``quantization_config.quant_method`` "fp8") loads
    as it is stored (see ``engine.models.fp8``).
    """
    start = time.perf_counter()
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unknown load format {load_format!r}; expected one of {LOAD_FORMATS}")
    if load_format == "auto":
        load_format = _detect_format(model)
    device = torch.device(device)
    log.info("model_load_start", model=model, load_format=load_format, device=str(device),
             dtype=str(dtype).removeprefix("torch."),
             **({"cpu_threads": torch.get_num_threads()} if device.type == "cpu" else {}))
    if load_format == "gguf":
        net, config = _load_gguf(Path(model), device, dtype, ops)
    elif load_format == "hf":
        net, config = _load_hf(Path(model), device, dtype, ops)
    else:
        net, config = _load_dummy(model, device, dtype, ops)
    net.eval()
    log.info(
        "model_loaded", model=config.name, params=sum(p.numel() for p in net.parameters()),
        seconds=round(time.perf_counter() - start, 2),
    )
    return net, config


def load_tokenizer_info(model: str, load_format: str, config: ModelConfig) -> xgrammar.TokenizerInfo | None:
    """The vocabulary of ``model`` as xgrammar sees it (token strings, their encoding, the logits'
    vocab size and the EOS ids), or None when there is none to read: dummy weights, a GGUF
    tokenizer model other than BPE or sentencepiece, an HF directory without a tokenizer."""
    if load_format == "auto":
        load_format = _detect_format(model)
    if load_format == "gguf":
        from engine.gguf_reader import open_gguf

        info = _gguf_tokenizer_info(open_gguf(Path(model)), config)
    elif load_format == "hf":
        info = _hf_tokenizer_info(Path(model), config)
    else:
        info = None
    if info is None:
        log.warning("no_tokenizer_vocabulary", model=model, load_format=load_format,
                    consequence="structured output is unavailable")
    return info


def _detect_format(model: str) -> str:
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and (path / "config.json").is_file():
        return "hf"
    raise ModelLoadError(
        f"cannot tell the load format of {model!r}: expected a .gguf file or a directory with "
        "config.json (use --load-format dummy for random weights of a named shape)"
    )


def _fill(net: CausalLM, weights: Iterator[tuple[str, torch.Tensor]], source: Path) -> None:
    start = time.perf_counter()
    try:
        count = net.load_weights(weights)
    except ValueError as exc:
        raise ModelLoadError(f"{source}: {exc}") from exc
    log.info("weights_loaded", tensors=count, seconds=round(time.perf_counter() - start, 2))


# --- GGUF ------------------------------------------------------------------------------------


_REQUIRED = object()


def _gguf_field(reader: gguf.GGUFReader, key: str, default=_REQUIRED):
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def _gguf_rope_scaling(reader: gguf.GGUFReader, arch: str, head_dim: int) -> RopeScaling | None:
    """Linear or YaRN from the metadata, or Llama 3's from ``rope_freqs.weight``: llama.cpp's
    convert_hf_to_gguf stores llama3 scaling as one factor per frequency, each inverse frequency
    divided by its factor."""
    from gguf.quants import dequantize

    kind = _gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    freqs = next((t for t in reader.tensors if t.name == _GGUF_ROPE_FREQS), None)
    if freqs is not None:
        if arch != "llama" or kind != "none":
            raise ModelLoadError(f"GGUF tensor {_GGUF_ROPE_FREQS!r} is supported for plain llama RoPE only, "
                                 f"not for {arch!r} with rope.scaling.type {kind!r}")
        factors = dequantize(freqs.data, freqs.tensor_type).reshape(-1).tolist()
        if len(factors) != head_dim // 2 or min(factors) <= 0:
            raise ModelLoadError(f"GGUF tensor {_GGUF_ROPE_FREQS!r} needs {head_dim // 2} positive factors, "
                                 f"got {len(factors)} (smallest {min(factors, default=None)})")
        return RopeScaling("llama3", max(factors), freq_factors=tuple(factors))
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"GGUF {arch}.rope.scaling.type {kind!r} is not supported (expected linear or yarn)")
    return RopeScaling(
        kind, _gguf_field(reader, f"{arch}.rope.scaling.factor"),
        original_max_position_embeddings=_gguf_field(reader, f"{arch}.rope.scaling.original_context_length", None),
    )


def _gguf_config(reader: gguf.GGUFReader, name: str) -> ModelConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in _GGUF_LAYER_NAMES:
        expected = sorted(_GGUF_LAYER_NAMES)
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (expected one of {expected})")
    hidden = _gguf_field(reader, f"{arch}.embedding_length")
    num_heads = _gguf_field(reader, f"{arch}.attention.head_count")
    num_layers = _gguf_field(reader, f"{arch}.block_count")
    head_dim = _gguf_field(reader, f"{arch}.attention.key_length", hidden // num_heads)
    rotary_dim = _gguf_field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ModelLoadError(f"partial rotary embeddings ({rotary_dim} of {head_dim}) are not supported")
    vocab_size = _gguf_field(reader, f"{arch}.vocab_size", None)
    if vocab_size is None:
        vocab_size = len(_gguf_field(reader, "tokenizer.ggml.tokens"))
    eos = (
        _gguf_field(reader, "tokenizer.ggml.eos_token_id", None),
        _gguf_field(reader, "tokenizer.ggml.eot_token_id", None),
    )
    window = _gguf_field(reader, f"{arch}.attention.sliding_window", None)
    sliding = {}
    if arch == "gemma3":
        sliding = dict(
            layer_types=tuple(
                FULL_ATTENTION if (i + 1) % _GEMMA3_SLIDING_PATTERN == 0 else SLIDING_ATTENTION
                for i in range(num_layers)
            ),
            sliding_window=window,
            local_rope_theta=_GEMMA3_LOCAL_ROPE_THETA,
            # as llama.cpp: only Gemma 3 27B (62 layers) scales queries by hidden / heads, not head_dim
            query_pre_attn_scalar=hidden // num_heads if num_layers == 62 else head_dim,
        )
    elif window:
        raise ModelLoadError(f"GGUF {arch}.attention.sliding_window is not supported for {arch!r}")
    return ModelConfig(
        name=name,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=_gguf_field(reader, f"{arch}.feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=_gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        max_position_embeddings=_gguf_field(reader, f"{arch}.context_length"),
        rms_norm_eps=_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_theta=_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
        architecture=arch,
        rope_scaling=_gguf_rope_scaling(reader, arch, head_dim),
        **sliding,
    )


# tokenizer.ggml.token_type: control (3), unknown (2) and unused (5) tokens stand for no text.
_GGUF_TEXTLESS_TOKEN_TYPES = frozenset((2, 3, 5))


def _gguf_tokenizer_info(reader: gguf.GGUFReader, config: ModelConfig) -> xgrammar.TokenizerInfo | None:
    import xgrammar as xgr

    vocab_types = {"gpt2": xgr.VocabType.BYTE_LEVEL, "llama": xgr.VocabType.BYTE_FALLBACK}
    tokenizer_model = _gguf_field(reader, "tokenizer.ggml.model", None)
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens", None)
    if tokenizer_model not in vocab_types or tokens is None:
        return None
    token_types = _gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    # An empty string is a special token to xgrammar: never admitted, except as a stop token.
    encoded = ["" if kind in _GGUF_TEXTLESS_TOKEN_TYPES else token for token, kind in zip(tokens, token_types)]
    return xgr.TokenizerInfo(
        encoded, vocab_types[tokenizer_model], vocab_size=config.vocab_size,
        stop_token_ids=list(config.eos_token_ids) or None,
        add_prefix_space=_gguf_field(reader, "tokenizer.ggml.add_space_prefix", tokenizer_model == "llama"),
    )


def _hf_name(gguf_name: str, arch: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES[arch]:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[arch][parts[2]]}"
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r} for architecture {arch!r}")


def _gguf_weights(reader: gguf.GGUFReader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of the GGUF: dequantized (any type the gguf package reads: F32/F16/BF16,
    Q4_0 … Q8_0, the K-quants), in HF's layout and values."""
    from gguf.quants import dequantize

    arch = config.architecture
    interleaved = arch in _GGUF_INTERLEAVED_ROPE
    rotary_heads = {"attn_q.weight": config.num_heads, "attn_k.weight": config.num_kv_heads}
    for tensor in reader.tensors:
        if tensor.name == _GGUF_ROPE_FREQS:
            continue  # in the config's RoPE scaling
        name = _hf_name(tensor.name, arch)
        weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type))
        if arch in _GGUF_NORM_PLUS_ONE and name.endswith("norm.weight"):
            weight = weight - 1
        heads = rotary_heads.get(tensor.name.split(".", 2)[-1]) if interleaved else None
        if heads:
            # llama.cpp interleaves each head's rotary halves; back to HF's rotate-half order.
            d_out, d_in = weight.shape
            weight = weight.reshape(heads, -1, 2, d_in).transpose(1, 2).reshape(d_out, d_in)
        yield name, weight


def _load_gguf(
    path: Path, device: torch.device, dtype: torch.dtype, ops: KernelOps
) -> tuple[CausalLM, ModelConfig]:
    from engine.gguf_reader import open_gguf

    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    start = time.perf_counter()
    try:
        reader = open_gguf(path)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
    try:
        config = _gguf_config(reader, name=path.stem)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    log.info("gguf_read", path=str(path), tensors=len(reader.tensors),
             seconds=round(time.perf_counter() - start, 2))
    net = build_model(config, ops, device, dtype)
    _fill(net, _gguf_weights(reader, config), path)
    return net, config


# --- Hugging Face directory -------------------------------------------------------------------


def _hf_config(path: Path) -> ModelConfig:
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc
    try:
        return ModelConfig.from_hf(hf, name=path.name)
    except KeyError as exc:
        raise ModelLoadError(f"{path / 'config.json'}: missing setting {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path / 'config.json'}: {exc}") from exc


def _hf_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for index, file in enumerate(files, 1):
        with safe_open(file, framework="pt") as shard:
            for key in shard.keys():
                yield key, shard.get_tensor(key)
        log.info("safetensors_shard_loaded", file=file.name, shard=index, shards=len(files))


def _load_hf(
    path: Path, device: torch.device, dtype: torch.dtype, ops: KernelOps
) -> tuple[CausalLM, ModelConfig]:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{str(path)!r} is not a directory with config.json")
    config = _hf_config(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index names the shards (a directory may hold other copies)
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    net = build_model(config, ops, device, dtype)
    weights = _hf_weights(files)
    quantization = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    if quantization.get("quant_method") == fp8.QUANT_METHOD:
        if quantization.get("weight_block_size"):
            raise ModelLoadError(f"{path}: block-wise fp8 scales (weight_block_size) are not supported")
        weights = fp8.fp8_checkpoint_weights(fp8.prepare_fp8(net), weights)
        log.info("fp8_checkpoint", activation_scheme=quantization.get("activation_scheme"))
    _fill(net, weights, path)
    return net, config


def _hf_tokenizer_info(path: Path, config: ModelConfig) -> xgrammar.TokenizerInfo | None:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        log.warning("hf_tokenizer_unreadable", path=str(path), error=str(exc))
        return None
    # xgrammar detects the encoding; special tokens are then blanked, as in a GGUF, so that no
    # grammar admits their text (a "<|im_start|>" inside a JSON string, say).
    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=config.vocab_size, stop_token_ids=list(config.eos_token_ids) or None
    )
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    encoded = [""] * config.vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < config.vocab_size and i not in special:
            encoded[i] = token
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=config.vocab_size,
                             stop_token_ids=detected.stop_token_ids, add_prefix_space=detected.add_prefix_space)


# --- dummy --------------------------------------------------------------------------------------


def _load_dummy(
    spec: str, device: torch.device, dtype: torch.dtype, ops: KernelOps
) -> tuple[CausalLM, ModelConfig]:
    config = load_dummy_config(spec)
    net = build_model(config, ops, device, dtype)
    fill_dummy(net, DUMMY_SEED)
    log.info("dummy_weights", config=config.name, seed=DUMMY_SEED, std=DUMMY_STD)
    return net, config


def load_dummy_config(spec: str) -> ModelConfig:
    """The shape ``--model`` names for ``--load-format dummy``; raises ModelLoadError."""
    try:
        return dummy_config(spec)
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"bad dummy model config {spec!r}: {exc}") from exc


@torch.no_grad()
def fill_dummy(net: torch.nn.Module, seed: int) -> None:
    """Seeded random weights on the parameters' device: N(0, DUMMY_STD) matrices, norm weights 1, biases 0."""
    generator = torch.Generator(device=next(net.parameters()).device).manual_seed(seed)
    for name, param in net.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:
            param.fill_(1.0)  # norm weights
        else:
            param.normal_(0.0, DUMMY_STD, generator=generator)
