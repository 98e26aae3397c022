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
- int8 (``quantize_int8``): weight-only int8 with one scale per output channel (row absolute
  maximum / 127), multiplied by torch's int8 weight-pack kernel over bf16 activations (its fast
  path); the LM head too (the tied embedding keeps its table). Norms, attention and the residual
  stream stay in the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import CausalLM
from kernels import KernelOps

# Products of at most this many rows use the transposed copy (x @ Wt); more rows the oneDNN-packed weight.
TRANSPOSED_MAX_ROWS = 1
# The row count oneDNN packs the weights for: between a decode batch and a prefill chunk (the packed
# product is 1.5-2x F.linear's speed at 8-256 rows whichever of 1, 64 or the exact count it was packed for).
PACK_ROWS = 64


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
    """``x @ w.T`` for int8 ``w [out, in]`` over per-output-channel ``scale``, in ``x``'s dtype."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.weight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scale = scale.to(torch.bfloat16)  # the kernel takes scales in the activations' dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.weight, self.scale)
        return out.to(x.dtype)


class CpuOps:
    """An op set whose ``linear``/``norm_linear`` call a weight's ``cpu_matmul`` when it has one (set
    by the transforms below); every other op, and weights without one (an fp8 transform's, which
    comes with its ``weight_scale``), are the base's."""

    def __init__(self, base: KernelOps) -> None:
        self.base = base

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
        matmul = getattr(weight, "cpu_matmul", None)
        return self.base.linear(x, weight, weight_scale) if matmul is None else matmul(x)

    def norm_linear(
        self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
        weight: torch.Tensor, gated: bool = False, weight_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self.base.rms_norm(x, norm_weight, eps, residual)
        out = self.linear(normed, weight, weight_scale)
        return (self.base.silu_and_mul(out) if gated else out), residual


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
def quantize_int8(model: CausalLM) -> CausalLM:
    """Quantize ``model``'s projections to int8 in place (each original freed as it goes), and give
    the LM head an int8 copy (a tied head's table stays the embedding's)."""
    for module in model.projections():
        matmul = Int8(module.weight)
        module.weight = nn.Parameter(matmul.weight, requires_grad=False)
        module.weight.cpu_matmul = matmul
    _head(model).cpu_matmul = Int8(_head(model))
    _use_cpu_ops(model)
    return model


def cpu_matmuls(model: CausalLM, quantization: str, dtype: torch.dtype) -> str | None:
    """Apply the CPU matmul path of ``quantization`` and ``dtype`` to a loaded single-device CPU
    model: int8 weights, or the transposed layout for fp32 ones; returns which (None: neither)."""
    if quantization == "int8":
        if not is_int8(model):  # quantized before: its weights are int8 already
            quantize_int8(model)
        return "int8"
    if quantization == "none" and dtype == torch.float32:
        transpose_weights(model)
        return "transposed"
    return None


def is_int8(model: CausalLM) -> bool:
    return isinstance(getattr(_head(model), "cpu_matmul", None), Int8)
