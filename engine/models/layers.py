"""Layers the model families share, and :class:`CausalLM`, the base of every family's model.

q/k/v and gate/up are fused into one projection each, and each norm into the projection after it
(with the residual add and, for gate/up, SiLU-and-mul: one GEMV launch for a decode batch). Every
op that touches the KV cache or is worth a kernel comes from the ``ops`` set
(``kernels.load_ops``), so the same model runs on the torch reference ops and on the Triton kernels.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.kv_groups import kv_layout
from engine.models.rope import rope_cos_sin_cache
from kernels import KernelOps, QKNorm


# Weights start uninitialized (torch.empty): the loader overwrites every one, and both a random
# init and torch's meta-device skip_init (which imports torch._dynamo) would cost seconds at load.
class Linear(nn.Module):
    """Bias-free ``x @ weight.T``."""

    def __init__(self, in_features: int, out_features: int, ops: KernelOps, factory: dict) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, factory: dict) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, **factory))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelOps, factory: dict) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, **factory))
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)

    def linear(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, gated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm (after the residual add), then the projection ``weight`` (then SiLU-and-mul
        when ``gated``): ``(out, residual)``."""
        return self.ops.norm_linear(x, self.weight, self.eps, residual, weight, gated)


class Attention(nn.Module):
    """Grouped-query attention of one layer over its paged KV cache, with the layer's sliding
    window (0: none) and RoPE table. Families change how the fused qkv rows become q, k and v
    (:meth:`split_heads`: biases) and may norm q and k before RoPE (:meth:`qk_norm`)."""

    def __init__(self, config: ModelConfig, layer: int, ops: KernelOps, factory: dict) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.window = config.layer_window(layer)
        self.kv_group = kv_layout(config).layer_group[layer]  # whose block tables the layer reads
        # qkv_proj is applied by the input norm (RMSNorm.linear)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, ops, factory)
        self.o_proj = Linear(self.q_size, config.hidden_size, ops, factory)
        # An fp8 KV cache's per-kv-head scales (calibrated by engine.kv_quant); other caches ignore them.
        for name in ("k_scale", "v_scale"):
            scale = torch.ones(config.num_kv_heads, dtype=torch.float32, device=factory["device"])
            self.register_buffer(name, scale, persistent=False)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[tokens, q + 2 kv]`` -> q ``[tokens, heads, head_dim]``, k and v ``[tokens, kv_heads, head_dim]``
        (strided views of ``qkv``)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
        )

    def qk_norm(self) -> QKNorm | None:
        """The per-head q/k norms the RoPE op applies first (none here)."""
        return None

    def forward(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        attn: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = qkv.shape[0]
        q, k, v = self.split_heads(qkv)
        attn = attn.group(self.kv_group)
        window = self.window or None
        qk_norm = self.qk_norm()
        if attn.fused_decode:  # the q/k norms, RoPE, the K/V store and attention in one launch
            out = self.ops.decode_attention(
                positions, q, k, v, cos_sin_cache, k_cache, v_cache, attn.slot_mapping,
                attn.block_tables, attn.seq_lens, self.scale, attn.seq_lens_cpu, sliding_window=window,
                k_scale=self.k_scale, v_scale=self.v_scale, qk_norm=qk_norm,
            )
        else:
            q, k = self.ops.rotary_embedding(positions, q, k, cos_sin_cache, qk_norm)
            self.ops.store_kv(k, v, k_cache, v_cache, attn.slot_mapping, self.k_scale, self.v_scale)
            # the new chunks' keys and values are read from k and v (contiguous rows), the prefix from pages
            out = self.ops.paged_attention(
                q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc,
                self.scale, attn.seq_lens_cpu, attn.query_start_loc_cpu, key=k, value=v, sliding_window=window,
                k_scale=self.k_scale, v_scale=self.v_scale,
            )
        return self.o_proj(out.view(num_tokens, self.q_size))


class QKNormAttention(Attention):
    """Attention that normalizes each head of q and k (RMSNorm over head_dim) before RoPE (Qwen3, Gemma 3)."""

    def __init__(self, config: ModelConfig, layer: int, ops: KernelOps, factory: dict) -> None:
        super().__init__(config, layer, ops, factory)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops, factory)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops, factory)

    def qk_norm(self) -> QKNorm:
        return QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)


class GatedMLP(nn.Module):
    """The gated MLP's weights: gate/up is applied by the post-attention norm (RMSNorm.linear)."""

    def __init__(self, config: ModelConfig, ops: KernelOps, factory: dict) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, ops, factory)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, ops, factory)


def rope_tables(config: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global layers' RoPE table and, when sliding layers have their own base, theirs (fp32
    whatever the weights' dtype: rotary_embedding computes in fp32). Local bases are unscaled."""
    full = rope_cos_sin_cache(
        config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, device
    )
    if config.local_rope_theta is None:
        return full, None
    return full, rope_cos_sin_cache(config.head_dim, config.max_position_embeddings, config.local_rope_theta,
                                    None, device)


# The parts of the fused qkv rows: HF name -> (first, last) of the bounds (0, q, q + kv, q + 2 kv).
QKV_PARTS = {"q_proj": (0, 1), "k_proj": (1, 2), "v_proj": (2, 3)}


class CausalLM(nn.Module):
    """The model the runner calls; one subclass per family, built over ``self.model`` with
    ``embed_tokens`` and ``layers``.

    ``forward(input_ids [T], positions [T], attn, kv_caches) -> hidden [T, hidden_size]`` writes
    the new tokens' K/V into ``kv_caches`` (one ``(k_cache, v_cache)`` pair per layer, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]``) at ``attn.slot_mapping`` and mutates
    nothing else. ``compute_logits(hidden [N, hidden_size], out=None) -> fp32 [N, vocab]`` (into
    ``out`` when given): pass only the rows to sample. Weights are uninitialized until
    ``load_weights`` (see ``engine.models.loader``).
    """

    model: nn.Module
    lm_head: Linear | None
    # A transform's whole decode step where it ``fits`` a step (engine.models.cpu.Int8DecoderStack)
    decode_stack = None

    def __init__(self, config: ModelConfig, ops: KernelOps, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.factory = {"device": torch.device(device), "dtype": dtype}

    def projections(self) -> Iterator[Linear]:
        """Every Linear but the LM head: what the weight transforms (FP8, CPU) rewrite."""
        return (m for m in self.modules() if isinstance(m, Linear) and m is not self.lm_head)

    def use_ops(self, ops: KernelOps) -> None:
        """Give this model and every module in it ``ops`` (a transform's op set)."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def _finish(self) -> None:
        self.lm_head = (
            None if self.config.tie_word_embeddings
            else Linear(self.config.hidden_size, self.config.vocab_size, self.ops, self.factory)
        )
        self.requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        if self.decode_stack is not None and self.decode_stack.fits(input_ids, attn, kv_caches):
            return self.decode_stack(input_ids, positions, attn, kv_caches)
        return self.model(input_ids, positions, attn, kv_caches)

    @property
    def logits_dtype(self) -> torch.dtype:
        """The dtype the LM head computes logits in (the activations'): exact there, widened to fp32 by
        ``compute_logits`` unless it writes into a buffer of this dtype."""
        return self.factory["dtype"]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of ``hidden``'s rows: fp32, or written into ``out`` (fp32, or :attr:`logits_dtype`:
        a CUDA graph's static buffer, which the head's product fills with no widening copy)."""
        weight = (self.model.embed_tokens if self.lm_head is None else self.lm_head).weight
        matmul = getattr(weight, "cpu_matmul", None)  # a CPU matmul path's (engine.models.cpu)
        if matmul is not None:
            logits = matmul(hidden)
        elif hasattr(weight, "weight_scale"):  # an fp8 head (engine.models.fp8.quantize_lm_head)
            logits = self.lm_head(hidden)
        elif out is not None and out.dtype == hidden.dtype:
            return torch.mm(hidden, weight.t(), out=out)
        else:
            logits = F.linear(hidden, weight)
        return logits.float() if out is None else out.copy_(logits)

    def fused_parts(self) -> dict[str, dict[str, slice]]:
        """Per layer: our fused parameter's local name -> HF part name -> rows of it."""
        config = self.config
        q, kv, inter = (
            config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size,
        )
        bounds = (0, q, q + kv, q + 2 * kv)
        qkv = {f"self_attn.{n}.weight": slice(bounds[a], bounds[b]) for n, (a, b) in QKV_PARTS.items()}
        return {
            "self_attn.qkv_proj.weight": qkv,
            "mlp.gate_up_proj.weight": {
                "mlp.gate_proj.weight": slice(0, inter),
                "mlp.up_proj.weight": slice(inter, 2 * inter),
            },
        }

    def checkpoint_layout(self) -> dict[str, tuple[str, slice]]:
        """Hugging Face checkpoint name -> (our parameter name, rows of it the tensor fills)."""
        fused = self.fused_parts()
        layout = {}
        for name, _ in self.named_parameters():
            prefix, _, suffix = name.partition(".layers.")
            layer, _, local = suffix.partition(".")
            module, _, attr = local.rpartition(".")
            if local in fused:
                for part, rows in fused[local].items():
                    layout[f"{prefix}.layers.{layer}.{part}"] = (name, rows)
            elif f"{module}.weight" in fused:  # a tensor that goes with a fused weight row by row (fp8 scales)
                for part, rows in fused[f"{module}.weight"].items():
                    layout[f"{prefix}.layers.{layer}.{part.removesuffix('.weight')}.{attr}"] = (name, rows)
            else:
                layout[name] = (name, slice(None))
        return layout

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The inverse of ``load_weights``: Hugging Face-named views of the parameters (no copy),
        so that a transformers model can run on exactly our weights."""
        params = dict(self.named_parameters())
        return {name: params[param][rows] for name, (param, rows) in self.checkpoint_layout().items()}

    def convert_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as our parameter holds it (a family may store it transformed)."""
        return tensor

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy Hugging Face-named tensors into the (fused) parameters, converting dtype/device.

        Copies even when a tensor could be adopted as is: checkpoint readers hand out views of
        memory-mapped files, and a parameter must not depend on the file staying unchanged.
        Raises ``ValueError`` naming the tensor on an unknown name, a repeat or a wrong shape, and
        naming what is missing once ``weights`` is exhausted. Returns the number of tensors copied.
        """
        layout = self.checkpoint_layout()
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still store a copy of the embedding
            if name.endswith("rotary_emb.inv_freq"):
                continue  # older checkpoints persist the RoPE table; ours is computed
            if name not in layout:
                raise ValueError(f"unexpected weight {name!r} for a {type(self).__name__}")
            if name in loaded:
                raise ValueError(f"weight {name!r} appears twice")
            param_name, rows = layout[name]
            target = params[param_name][rows]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(self.convert_weight(name, tensor))
            loaded.add(name)
        missing = sorted(layout.keys() - loaded)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(
                f"checkpoint is missing {len(missing)} weights: {', '.join(missing[:5])}{more}"
            )
        return len(loaded)
