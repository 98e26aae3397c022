"""FP8 (E4M3) pieces the kernels share: the saturating cast, per-row activation quantization
and the scaled GEMMs of ``linear`` with fp8 weights beyond the GEMV's rows: a Triton kernel for
small batches, ``torch._scaled_mm`` (row-wise scales) for large ones."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton_ops._checks import _INTERPRETED, _check, _check_devices, _check_last_dim_contiguous
from kernels.triton_ops._launch import _pdl_args

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


class MmTiles(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Batches up to FP8_TRITON_MM_MAX_ROWS rows (block_m: the rows rounded up to a power of two, at
# least 16) take the Triton GEMM, whose narrow column tiles keep every multiprocessor streaming
# weights; torch._scaled_mm's tiles suit large batches (kernels_bench.py --only fp8 --sweep).
FP8_TRITON_MM_MAX_ROWS = 64
FP8_MM_TILES = (
    MmTiles(block_n=16, block_k=32, num_warps=4, num_stages=1) if _INTERPRETED
    else MmTiles(block_n=32, block_k=128, num_warps=4, num_stages=4)
)


@triton.jit
def _scaled_mm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, m_rows, n_out, k_in, a_stride, b_stride, c_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program per column block (and row block): ``c = (a @ b^T) * a_scale * b_scale`` of fp8
    ``a [m, k]`` and ``b [n, k]``, accumulated in fp32, rounded once to c's dtype. The first
    weight tile is loaded before waiting on the previous kernel: it does not depend on it."""
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    m_ok = m < m_rows
    n_ok = n < n_out
    a_rows = a_ptr + m.to(tl.int64)[:, None] * a_stride
    b_rows = b_ptr + n.to(tl.int64)[:, None] * b_stride
    b = tl.load(b_rows + kk[None, :], mask=n_ok[:, None] & (kk < k_in)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, k_in, BLOCK_K):
        k = k_start + kk
        k_ok = k < k_in
        if k_start > 0:
            b = tl.load(b_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if _INTERPRETED:  # the interpreter's dot takes no fp8
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    acc = acc * tl.load(a_scale_ptr + m, mask=m_ok, other=0.0)[:, None]
    acc = acc * tl.load(b_scale_ptr + n, mask=n_ok, other=0.0)[None, :]
    c = c_ptr + m.to(tl.int64)[:, None] * c_stride + n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _triton_scaled_mm(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype,
) -> torch.Tensor:
    rows, k_in = x_fp8.shape
    n_out = weight.shape[0]
    out = torch.empty((rows, n_out), dtype=dtype, device=x_fp8.device)
    tiles = FP8_MM_TILES
    block_m = max(16, triton.next_power_of_2(rows))
    grid = (triton.cdiv(n_out, tiles.block_n), triton.cdiv(rows, block_m))
    _scaled_mm_kernel[grid](
        x_fp8, x_scale, weight, weight_scale, out, rows, n_out, k_in, x_fp8.stride(0), weight.stride(0),
        out.stride(0), BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **_pdl_args(x_fp8.device),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """fp8 ``linear`` of a batch: the rows quantized, then the Triton GEMM (up to
    FP8_TRITON_MM_MAX_ROWS rows) or one ``torch._scaled_mm`` (cuBLASLt/CUTLASS on Hopper) with the
    row and channel scales; its output rounded once to ``x``'s dtype."""
    _check_devices(x=x, weight=weight, weight_scale=weight_scale)
    x_fp8, x_scale = quantize_rows(x)
    if x.shape[0] <= FP8_TRITON_MM_MAX_ROWS:
        return _triton_scaled_mm(x_fp8, x_scale, weight, weight_scale, x.dtype)
    # row-wise scaling on CUDA writes bf16 only
    out_dtype = torch.bfloat16 if x.is_cuda and x.dtype == torch.bfloat16 else torch.float32
    out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=out_dtype)
    return out.to(x.dtype)
