"""Frozen configuration objects: one per process, validated loudly at start."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a Llama-family decoder."""

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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf(cls, hf: dict, name: str) -> ModelConfig:
        """From a Hugging Face ``config.json`` dict (LlamaConfig / Qwen2-style keys)."""
        eos = hf.get("eos_token_id")
        num_heads = hf["num_attention_heads"]
        return cls(
            name=name,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            # transformers 5 nests it under rope_parameters; older configs keep it at the top
            rope_theta=(hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def to_hf(self) -> dict:
        """Hugging Face ``LlamaConfig`` keyword arguments of this shape (transformers 5 layout)."""
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
    "qwen3-0.6b": ModelConfig(
        name="qwen3-0.6b", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=None, eos_token_ids=(151645,),
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
    data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
    return ModelConfig(**data)


KERNEL_BACKENDS = ("auto", "torch", "triton")
# Enough prompt tokens per step that per-step overhead stays small when short prompts are packed.
CPU_PREFILL_PACK_TOKENS = 256


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine process is started with (CLI flags map 1:1 onto these fields)."""

    model: str
    load_format: str = "auto"
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # A step admits another prompt only while it holds fewer prompt tokens than this. None: the whole
    # budget on CUDA (batched prefill is faster per token there), CPU_PREFILL_PACK_TOKENS on the CPU.
    prefill_pack_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's own
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    # None: 1 GiB on the CPU; on CUDA what gpu_memory_utilization leaves after a profiling run.
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # no CUDA graphs
    enable_prefix_caching: bool = True
    # Cap on exact-position prefix entries (cached partial pages), as a fraction of the KV pool.
    max_partial_entries_fraction: float = 0.25
    kernel_backend: str = "auto"  # auto: triton on CUDA, torch on the CPU
    seed: int = 0
    index_url: str | None = None  # prefix index to publish KV events to (memory:// or redis://)
    replica_id: str = "engine-0"

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.prefill_pack_tokens is not None and self.prefill_pack_tokens <= 0:
            raise ValueError(f"prefill_pack_tokens must be positive, got {self.prefill_pack_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 <= self.max_partial_entries_fraction <= 1:
            raise ValueError(
                f"max_partial_entries_fraction must be in [0, 1], got {self.max_partial_entries_fraction}"
            )
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")

    @property
    def resolved_prefill_pack_tokens(self) -> int:
        if self.prefill_pack_tokens is not None:
            return self.prefill_pack_tokens
        return CPU_PREFILL_PACK_TOKENS if self.device == "cpu" else self.max_num_batched_tokens

    @property
    def resolved_kernel_backend(self) -> str:
        if self.kernel_backend == "auto":
            return "torch" if self.device == "cpu" else "triton"
        return self.kernel_backend
