"""CPU matmul paths as a transform of a loaded single-device model (like ``engine.models.fp8``):
the model code stays as it is; each projection weight, and the LM head's, carries a ``cpu_matmul``
that its op set calls instead of ``F.linear``.

- fp32 (``transpose_weights``): a transposed copy of every weight serves one-row products (batch-1
  decode), where ``x @ Wt`` streams the weights 1.3-1.5x as fast as ``F.linear`` on the same
  cores; more rows go through a oneDNN-packed copy, 1.4-2x ``F.linear``'s speed at 8-2048 rows
  (``benchmarks/cpu_profile.py matmul``). Exact to rounding: fp32 products of the same weights.
  A projection's own weight then lives in its transposed copy (a transposed view: the values
  loaders, transforms and the HF twin read), so the weights take twice their memory, not three
  times; the tied embedding keeps its table (lookups read its rows).
- int8 (``quantize``): weight-only int8 with one scale per output channel (row absolute
  maximum / 127), multiplied by kvgate's int8 GEMV over fp32 rows up to ``GEMV_MAX_ROWS`` rows
  (``engine.models.cpu_kernels``: 2.2x torch's kernel at one row on an AVX2 EPYC,
  cpu_profile_matmul_epyc.jsonl), by torch's int8 weight-pack kernel over bf16 activations (its
  fast path) beyond, and from 64 rows (a prefill chunk) widened to fp32 on CPUs without native
  bf16; the LM head too (the tied embedding keeps its table). Norms, attention and the residual
  stream stay in the model's dtype. An fp32 Llama model's decode steps run in one C call
  (``Int8DecoderStack``).
- int4 (``quantize``): weight-only 4-bit weights in groups of 32 input columns, each group over
  its own scale and minimum (``w = q * scale + min``, ``q`` in 0..15: the form of a GGUF Q4_1
  block), multiplied by torch's int4 weight-pack kernel over bf16 activations; the LM head in int8. Half
  of int8's weight bytes: at one row SmolLM2's 121 matmuls take 6.0 ms against int8's 10.7 and fp32
  ``x @ Wt``'s 19.0 on 2 Xeon cores (``benchmarks/cpu_profile.py matmul``, cpu_profile_matmul_int4.jsonl).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.models import cpu_kernels
from engine.models.layers import Attention, CausalLM
from engine.models.llama import LlamaDecoderLayer
from kernels import KernelOps, QKNorm

# Products of at most this many rows use the transposed copy (x @ Wt); more rows the oneDNN-packed weight.
TRANSPOSED_MAX_ROWS = 1
# The row count oneDNN packs the weights for: between a decode batch and a prefill chunk (the packed
# product is 1.5-2x F.linear's speed at 8-256 rows whichever of 1, 64 or the exact count it was packed for).
PACK_ROWS = 64
# Int8 products of at most this many rows use kvgate's kernel (engine.models.cpu_kernels), where it builds.
GEMV_MAX_ROWS = 8
INT4_GROUP = 32  # input columns per int4 scale and minimum (a GGUF Q4_0/Q4_1 block)
# Where the CPU multiplies bf16 natively (AVX512-BF16, AMX), quantized products of many rows widen the
# weights to bf16 on the way, for torch's bf16 matmul (oneDNN): SmolLM2's 121 matmuls at 512 rows (2 cores
# of a Xeon with AMX; cpu_profile_matmul_int4.jsonl) take int8 133 ms against its weight-pack kernel's 863,
# int4 245 against 785 (the unpacking costs more), fp32's oneDNN-packed product 418. The crossings (gate_up,
# one thread): int8 from 16 rows, int4 from 128. Fewer rows read the packed weights (a decode step: bytes).
NATIVE_BF16 = bool(torch.cpu.get_capabilities().get("avx512_bf16", False))


class Fp32Matmul:
    """``x @ weight.T`` in fp32: through a transposed copy for one row, a oneDNN-packed copy (where
    torch has oneDNN) or ``F.linear`` for more."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.transposed = weight.t().contiguous()
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=PACK_ROWS)
                       if torch.backends.mkldnn.is_available() else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= TRANSPOSED_MAX_ROWS:
            return x @ self.transposed
        if self.packed is None:
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class Int8:
    """``x @ w.T`` for int8 ``w [out, in]`` over per-output-channel ``scale``, in ``x``'s dtype:
    up to ``GEMV_MAX_ROWS`` rows through kvgate's own kernel (``engine.models.cpu_kernels``: fp32
    rows, each row's result whatever the batch), more through torch's (bf16 rows), many widened
    (to bf16 where the CPU multiplies it natively, else fp32 rows to fp32)."""

    widen_min_rows = 16
    # Without native bf16, products of this many rows or more widen the weights to fp32 for oneDNN's fp32
    # matmul instead: SmolLM2's 121 matmuls at 512 rows 1,721 ms against the weight-pack kernel's 3,089 over bf16
    # rows, 407 against 474 at 64 rows, 233 against 116 at 16 (cpu_profile_matmul_widen_epyc.jsonl, 2 EPYC cores).
    widen_fp32_min_rows = 64

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.float().contiguous()  # (a transposed layout's weight is a transposed view; the kernels read rows)
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.weight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scale = scale.to(torch.bfloat16)  # torch's kernel takes scales in the activations' dtype
        self.scale_fp32 = self.scale.float()  # the same values for kvgate's kernel
        self.kernels = cpu_kernels.load()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.shape[0] <= GEMV_MAX_ROWS:
            return self.kernels.int8_gemv(x.float().contiguous(), self.weight, self.scale_fp32).to(x.dtype)
        if NATIVE_BF16 and x.shape[0] >= self.widen_min_rows:
            return (F.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16)) * self.scale).to(x.dtype)
        if not NATIVE_BF16 and x.dtype == torch.float32 and x.shape[0] >= self.widen_fp32_min_rows:
            return F.linear(x, self.weight.float()) * self.scale_fp32
        out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.weight, self.scale)
        return out.to(x.dtype)


class Int4:
    """``x @ w.T`` for ``w [out, in]`` quantized to 4 bits in groups of ``INT4_GROUP`` input
    columns (each over its own scale and minimum), in ``x``'s dtype."""

    widen_min_rows = 128

    def __init__(self, weight: torch.Tensor) -> None:
        out_features, in_features = weight.shape
        if in_features % INT4_GROUP or out_features % 64:
            raise ValueError(f"int4 weights need in-features divisible by {INT4_GROUP} and out-features by 64, "
                             f"got {out_features} x {in_features}")
        groups = weight.float().reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)
        low = groups.amin(-1)
        scale = ((groups.amax(-1) - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        q = q.reshape(out_features, in_features)
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
        # the same values two to a byte in row order, for widened(): the kernel's packing depends on the
        # instruction set torch dispatches to (AVX-512 and AVX2 interleave rows differently)
        self.nibbles = q[:, 0::2] | (q[:, 1::2] << 4)
        # the kernel reads each group as (q - 8) * scale + zero, so zero = min + 8 * scale; [groups, out, 2],
        # in the activations' dtype
        self.scales_and_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().bfloat16()

    def widened(self) -> torch.Tensor:
        """The weights ``[out, in]`` in bf16, as the kernel computes them (``(q - 8) * scale + zero``)."""
        groups, out_features = self.scales_and_zeros.shape[:2]
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1).view(out_features, groups, INT4_GROUP)
        scale, zero = self.scales_and_zeros.transpose(0, 1).unbind(-1)  # [out, groups]
        return ((q.to(torch.bfloat16) - 8) * scale[..., None] + zero[..., None]).view(out_features, -1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if NATIVE_BF16 and x.shape[0] >= self.widen_min_rows:
            return F.linear(x.to(torch.bfloat16), self.widened()).to(x.dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self.weight, INT4_GROUP,
                                                         self.scales_and_zeros)
        return out.to(x.dtype)


class CpuOps:
    """An op set whose ``linear``/``norm_linear`` call a weight's ``cpu_matmul`` when it has one (set
    by the transforms below), and whose ``rms_norm``, ``silu_and_mul`` and ``decode_attention`` on
    fp32 tensors are kvgate's compiled kernels (``engine.models.cpu_kernels``: one call each, where
    torch's eager ops take 4-40 a layer), where they build. Every other op, other dtypes and layouts,
    q/k norms, an fp8 cache, and weights without a ``cpu_matmul`` (an fp8 transform's, which comes
    with its ``weight_scale``), are the base's."""

    def __init__(self, base: KernelOps) -> None:
        self.base = base
        self.kernels = cpu_kernels.load()

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
        matmul = getattr(weight, "cpu_matmul", None)
        return self.base.linear(x, weight, weight_scale) if matmul is None else matmul(x)

    def norm_linear(
        self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
        weight: torch.Tensor, gated: bool = False, weight_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self.rms_norm(x, norm_weight, eps, residual)
        out = self.linear(normed, weight, weight_scale)
        return (self.silu_and_mul(out) if gated else out), residual

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernels is not None and x.dim() == 2 and _fp32_contiguous(x, weight, residual):
            return self.kernels.rms_norm(x, weight, eps, residual)
        return self.base.rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2 and _fp32_contiguous(x):
            return self.kernels.silu_and_mul(x)
        return self.base.silu_and_mul(x)

    def decode_attention(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, seq_lens_cpu: list[int] | None = None,
        sliding_window: int | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        # q/k/v rows of one stride with contiguous heads (views of a fused qkv), fp32 everywhere (the
        # stride of a dimension of size 1 is arbitrary)
        rows = (q.shape[0] == 1 or q.stride(0) == k.stride(0) == v.stride(0)) and all(
            t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2]) for t in (q, k, v))
        if (self.kernels is not None and qk_norm is None and rows and q.dtype == k.dtype == v.dtype == torch.float32
                and _fp32_contiguous(cos_sin_cache, k_cache, v_cache)
                and positions.dtype == slot_mapping.dtype == torch.int64
                and block_tables.dtype == seq_lens.dtype == torch.int32
                and all(t.is_contiguous() for t in (positions, slot_mapping, block_tables, seq_lens))):
            return self.kernels.decode_attention(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                                 block_tables, seq_lens, scale, sliding_window or 0)
        return self.base.decode_attention(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                          block_tables, seq_lens, scale, seq_lens_cpu, sliding_window, k_scale,
                                          v_scale, qk_norm)


class Int8DecoderStack:
    """A decode step of an fp32 Llama model with int8 projections in one call of kvgate's C stack
    (``cpu_kernels.int8_decoder_stack``): the embedding lookup here, then every layer and the final
    norm there, with the kernels ``CpuOps`` calls one by one and in the same order, so the hidden
    states are theirs bit for bit. It takes batches of decode rows that the GEMV kernel takes (up to
    ``GEMV_MAX_ROWS``) over an fp32 cache; the model's own forward runs every other step. A layer's
    ~10 ops each cost a Python module call, a ctypes call (~6 us on an AVX2 EPYC) and a wake-up of the
    OpenMP workers; SmolLM2's 30 layers took ~6 ms of a ~20 ms int8 decode step in them."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self._layers: ctypes.Array | None = None  # the layer array, for the caches of _caches
        self._caches: tuple[int, ...] = ()

    @classmethod
    def build(cls, model: CausalLM) -> Int8DecoderStack | None:
        """The stack for ``model`` (quantized to int8) where its layers are plain Llama layers in
        fp32 over one KV layer group and the kernels build; else None."""
        layers = model.model.layers
        plain = all(type(layer) is LlamaDecoderLayer and type(layer.self_attn) is Attention
                    and layer.self_attn.kv_group == 0 for layer in layers)
        fp32 = model.model.embed_tokens.weight.dtype == torch.float32
        return cls(model) if cpu_kernels.load() is not None and plain and fp32 else None

    def fits(self, input_ids: torch.Tensor, attn: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, ...]]) -> bool:
        """Whether this step is one the stack runs: decode rows the GEMV kernel takes, an fp32 cache."""
        return (attn.fused_decode and input_ids.shape[0] <= GEMV_MAX_ROWS
                and kv_caches[0][0].dtype == torch.float32 and attn.block_tables.is_contiguous())

    def _layer_array(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> ctypes.Array:
        caches = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if caches != self._caches:
            entries = []
            for layer, (k_cache, v_cache) in zip(self.model.model.layers, kv_caches, strict=True):
                attn, mlp = layer.self_attn, layer.mlp
                matmuls = [m.weight.cpu_matmul for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
                entries.append(cpu_kernels.Int8Layer(
                    layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                    *(m.weight.data_ptr() for m in matmuls), *(m.scale_fp32.data_ptr() for m in matmuls),
                    k_cache.data_ptr(), v_cache.data_ptr(), attn.window,
                ))
            self._layers, self._caches = (cpu_kernels.Int8Layer * len(entries))(*entries), caches
        return self._layers

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        model, config = self.model.model, self.model.config
        return cpu_kernels.load().int8_decoder_stack(
            self._layer_array(kv_caches), model.norm.weight, model.norm.eps, model.embed_tokens(input_ids), positions,
            model.cos_sin_cache, attn.slot_mapping, attn.block_tables, attn.seq_lens, model.layers[0].self_attn.scale,
            config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size, kv_caches[0][0].shape[1],
        )


def _fp32_contiguous(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.is_contiguous()) for t in tensors)


def _head(model: CausalLM) -> nn.Parameter:
    return (model.model.embed_tokens if model.lm_head is None else model.lm_head).weight


def _use_cpu_ops(model: CausalLM) -> None:
    if not isinstance(model.ops, CpuOps):  # else transformed before (an engine built twice on one model)
        model.use_ops(CpuOps(model.ops))


@torch.no_grad()
def transpose_weights(model: CausalLM) -> CausalLM:
    """Give every fp32 projection and the LM head its transposed and packed copies; a weight but
    the embedding table becomes a view of its transposed copy."""
    table = model.model.embed_tokens.weight
    for weight in (*(m.weight for m in model.projections()), _head(model)):
        if not hasattr(weight, "cpu_matmul"):
            weight.cpu_matmul = Fp32Matmul(weight)
            if weight is not table:
                weight.data = weight.cpu_matmul.transposed.t()
    _use_cpu_ops(model)
    return model


@torch.no_grad()
def quantize(model: CausalLM, quantization: str) -> CausalLM:
    """Quantize ``model``'s projections to ``quantization`` (int8 or int4) in place (each original
    freed as it goes: the projection's weight becomes the quantized one), and give the LM head a
    quantized copy (a tied head's table stays the embedding's)."""
    projection_type, head_type = QUANTIZED[quantization]
    for module in model.projections():
        matmul = projection_type(module.weight)
        module.weight = nn.Parameter(matmul.weight, requires_grad=False)
        module.weight.cpu_matmul = matmul
    _head(model).cpu_matmul = head_type(_head(model))
    if quantization == "int8":
        model.decode_stack = Int8DecoderStack.build(model)
    _use_cpu_ops(model)
    return model


# quantization -> the matmul types of the projections and of the LM head. With int4 projections the head
# is int8, as in llama.cpp's 4-bit files (SmolLM2's Q4_1 GGUF: Q8_0 embeddings): a 4-bit head cost greedy
# agreement with fp32 on SmolLM2 0.69 -> 0.22 (accuracy_smollm2_int4_cpu.jsonl), its projections being
# closer to fp32 than int8's (0.3 % against 0.9 % relative error on the GGUF's Q4_1 weights).
QUANTIZED = {"int8": (Int8, Int8), "int4": (Int4, Int8)}


def cpu_matmuls(model: CausalLM, quantization: str, dtype: torch.dtype) -> str | None:
    """Apply the CPU matmul path of ``quantization`` and ``dtype`` to a loaded single-device CPU
    model: int8 or int4 weights, or the transposed layout for fp32 ones; returns which (None: neither)."""
    if quantization in QUANTIZED:
        done = quantized_as(model)  # an engine built before on the same model quantized it already
        if done is None:
            quantize(model, quantization)
        elif done != quantization:
            raise ValueError(f"the model's weights are quantized to {done} already, not {quantization}")
        return quantization
    if quantization == "none" and dtype == torch.float32:
        transpose_weights(model)
        return "transposed"
    return None


def quantized_as(model: CausalLM) -> str | None:
    """The CPU quantization ``model``'s weights carry (None: none)."""
    matmul = getattr(next(model.projections()).weight, "cpu_matmul", None)
    return next((name for name, (matmul_type, _) in QUANTIZED.items() if isinstance(matmul, matmul_type)), None)
