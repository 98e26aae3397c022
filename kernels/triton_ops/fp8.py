"""FP8 (E4M3) pieces the kernels share: the saturating cast, per-row activation quantization
and the scaled GEMM of ``linear`` with fp8 weights beyond the GEMV's one row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops._checks import _INTERPRETED, _check, _check_devices, _check_last_dim_contiguous

FP8_MAX = tl.constexpr(torch.finfo(torch.float8_e4m3fn).max)
# The interpreter's fp32 -> fp8 conversion rounds ties away and loses the carry of a mantissa
# that rounds up (124.1 becomes 64): there values are rounded to E4M3 first, in fp32.
_ROUND_BEFORE_FP8 = tl.constexpr(_INTERPRETED)


@triton.jit
def _round_to_e4m3(x):
    """fp32 ``x`` (within ±448) rounded to nearest-even E4M3, still in fp32: normals keep 3
    mantissa bits, subnormals (below 2^-6) become multiples of 2^-9; the sign is kept (-0 too)."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    magnitude = (tl.abs(x) + 24576.0) - 24576.0  # 1.5 * 2^14: the sum's unit is 2^-9
    subnormal = (magnitude.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def to_fp8(x, scale):
    """``x / scale`` as E4M3, rounded to nearest and saturated (E4M3 has no infinity: an overflow
    would be NaN); the division exact, as torch's."""
    x = tl.math.div_rn(x.to(tl.float32), scale)
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    if _ROUND_BEFORE_FP8:
        x = _round_to_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def row_scale(amax):
    """The fp8 scale of a row whose absolute maximum is ``amax`` (1 for an all-zero row)."""
    return tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, k_in, x_stride, BLOCK_K: tl.constexpr):
    """Program per row: its absolute maximum, then the row over its scale."""
    row = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k_start in range(0, k_in, BLOCK_K):
        k = k_start + kk
        x = tl.load(x_ptr + row * x_stride + k, mask=k < k_in, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = row_scale(tl.max(amax, 0))
    tl.store(scale_ptr + row, scale)
    for k_start in range(0, k_in, BLOCK_K):
        k = k_start + kk
        x = tl.load(x_ptr + row * x_stride + k, mask=k < k_in, other=0.0)
        tl.store(out_ptr + row * k_in + k, to_fp8(x, scale), mask=k < k_in)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.reference.quantize_rows`` in one launch: ``(x_fp8 [rows, k], scale [rows, 1])``."""
    _check(x.dim() == 2, f"x must have 2 dims, got shape {tuple(x.shape)}")
    _check_last_dim_contiguous("x", x)
    _check_devices(x=x)
    rows, k_in = x.shape
    out = torch.empty((rows, k_in), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, out, scale, k_in, x.stride(0), BLOCK_K=32 if _INTERPRETED else 1024)
    return out, scale


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """fp8 ``linear`` of a batch: the rows quantized, then one ``torch._scaled_mm`` (cuBLASLt on
    Hopper) with the row and channel scales; its output rounded once to ``x``'s dtype."""
    _check_devices(x=x, weight=weight, weight_scale=weight_scale)
    x_fp8, x_scale = quantize_rows(x)
    # row-wise scaling on CUDA writes bf16 only
    out_dtype = torch.bfloat16 if x.is_cuda and x.dtype == torch.bfloat16 else torch.float32
    out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=out_dtype)
    return out.to(x.dtype)
