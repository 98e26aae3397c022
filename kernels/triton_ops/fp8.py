"""FP8 (E4M3) pieces the kernels share: the saturating cast, per-row activation quantization,
and ``linear``/``norm_linear`` with fp8 weights: a Triton kernel on the tensor cores for decode
batches (one row with its norm and quantization fused in), ``torch._scaled_mm`` for large ones."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton_ops._checks import _INTERPRETED, _check, _check_devices, _check_last_dim_contiguous
from kernels.triton_ops._launch import _pdl_args
from kernels.triton_ops.norm_rope import rms_norm, silu_and_mul

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


class Fp8Tiles(NamedTuple):
    block_n: int  # output columns per program
    block_k: int  # input features per step
    num_warps: int
    num_stages: int


# Batches up to FP8_TRITON_MAX_ROWS rows take the Triton kernel (one row with its rms_norm,
# residual add and quantization fused in; more rows quantized first, the rows of a program
# padded to a power of two, at least 16, for the tensor cores). Its narrow column tiles keep
# every multiprocessor streaming weights; torch._scaled_mm's tiles suit large batches
# (kernels_bench.py --only fp8 --sweep).
FP8_TRITON_MAX_ROWS = 64
FP8_TILES = (
    Fp8Tiles(block_n=16, block_k=32, num_warps=4, num_stages=1) if _INTERPRETED
    else Fp8Tiles(block_n=32, block_k=256, num_warps=4, num_stages=4)
)
# The fused row's first pass (residual add, sum of squares, absolute maximum) reads this many
# features a step: few steps, since it is a serial chain of L2 reads before any product starts.
_PRE_BLOCK_K = 32 if _INTERPRETED else 2048
_MIN_BLOCK_M = 16  # the tensor cores' fewest rows
_DOT_IN_FP32 = tl.constexpr(_INTERPRETED)  # the interpreter's dot takes no fp8


@triton.jit
def _fp8_linear_kernel(
    x_ptr, x_scale_ptr, residual_ptr, norm_weight_ptr, w_ptr, w_scale_ptr, out_ptr, residual_out_ptr,
    m_rows, n_out, k_in, eps, x_stride, residual_stride, w_stride, out_stride,
    X_FP8: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE_BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program per column block: ``out[:, cols] = (q(x) @ w[cols]^T) * x_scale * w_scale[cols]``
    on the tensor cores, fp8 times fp8 accumulated in fp32, rounded once to out's dtype; GATED
    reads the gate rows ``cols`` and the up rows ``n_out + cols`` and writes ``silu(gate) * up``.

    X_FP8: ``x`` holds the quantized rows and ``x_scale`` their scales. Otherwise ``x`` is one row
    of activations: a first pass adds the ``residual`` (the program whose turn it is writes each
    ``PRE_BLOCK_K`` slice of the sum to ``residual_out``), sums the squares for the RMSNorm and
    finds the absolute maximum of the normed row, which sets its scale; the main loop then
    quantizes each tile of the normed row (rounded to x's dtype first, as rms_norm returns it)
    and broadcasts it over the tensor cores' rows. The first weight tiles are loaded before
    waiting on the previous kernel: they do not depend on it."""
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < m_rows
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_stride
    up_rows = w_rows + n_out.to(tl.int64) * w_stride
    w_mask = n_ok[:, None] & (kk < k_in)[None, :]
    w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
    if GATED:
        up = tl.load(up_rows + kk[None, :], mask=w_mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()

    rstd = 1.0
    if X_FP8:
        x_scale = tl.load(x_scale_ptr + m, mask=m_ok, other=1.0)[:, None]
    else:
        pk = tl.arange(0, PRE_BLOCK_K)
        sum_sq = tl.zeros([PRE_BLOCK_K], dtype=tl.float32)
        amax = tl.zeros([PRE_BLOCK_K], dtype=tl.float32)
        for k_start in range(0, k_in, PRE_BLOCK_K):
            k = k_start + pk
            k_ok = k < k_in
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
            if HAS_RESIDUAL:
                residual = tl.load(residual_ptr + k, mask=k_ok, other=0.0)
                x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
                if (k_start // PRE_BLOCK_K) % tl.num_programs(0) == pid:
                    tl.store(residual_out_ptr + k, x, mask=k_ok)
            xf = x.to(tl.float32)
            if HAS_NORM:
                sum_sq += xf * xf
                xf = xf * tl.load(norm_weight_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(xf))
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, 0) / k_in + eps)
        x_scale = row_scale(tl.max(amax, 0) * rstd)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, k_in, BLOCK_K):
        k = k_start + kk
        k_ok = k < k_in
        if k_start > 0:
            w_mask = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)
            if GATED:
                up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
        if X_FP8:
            a = tl.load(x_ptr + m.to(tl.int64)[:, None] * x_stride + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
        else:
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
            if HAS_RESIDUAL:
                residual = tl.load(residual_ptr + k, mask=k_ok, other=0.0)
                x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
            if HAS_NORM:
                weight = tl.load(norm_weight_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                x = (x.to(tl.float32) * rstd * weight).to(x_ptr.dtype.element_ty)
            a = tl.broadcast_to(to_fp8(x, x_scale)[None, :], (BLOCK_M, BLOCK_K))
        if _DOT_IN_FP32:
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)))
            if GATED:
                acc_up += tl.dot(a.to(tl.float32), tl.trans(up.to(tl.float32)))
        else:
            acc = tl.dot(a, tl.trans(w), acc)
            if GATED:
                acc_up = tl.dot(a, tl.trans(up), acc_up)
    if USE_PDL:  # the next kernel may launch once every program is here: only the stores remain
        tl.extra.cuda.gdc_launch_dependents()

    # Rounded to the activation dtype, as the product's output, before SiLU-and-mul.
    y = (acc * x_scale * tl.load(w_scale_ptr + n, mask=n_ok, other=0.0)[None, :]).to(out_ptr.dtype.element_ty)
    if GATED:
        gate = y.to(tl.float32)
        up_out = acc_up * x_scale * tl.load(w_scale_ptr + n_out + n, mask=n_ok, other=0.0)[None, :]
        up_out = up_out.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate)) * up_out).to(out_ptr.dtype.element_ty)
    out = out_ptr + m.to(tl.int64)[:, None] * out_stride + n[None, :]
    tl.store(out, y, mask=m_ok[:, None] & n_ok[None, :])


def _launch(
    x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor, n_out: int,
    dtype: torch.dtype, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float, gated: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, k_in = x.shape
    out = torch.empty((rows, n_out), dtype=dtype, device=x.device)
    residual_out = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    unused = weight_scale  # a pointer argument the kernel's flags leave unread
    tiles = FP8_TILES
    _fp8_linear_kernel[(triton.cdiv(n_out, tiles.block_n),)](
        x, unused if x_scale is None else x_scale, unused if residual is None else residual,
        unused if norm_weight is None else norm_weight, weight, weight_scale, out, residual_out,
        rows, n_out, k_in, eps, x.stride(0), 0 if residual is None else residual.stride(0), weight.stride(0),
        out.stride(0), X_FP8=x_scale is not None, HAS_NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None, GATED=gated, BLOCK_M=max(_MIN_BLOCK_M, triton.next_power_of_2(rows)),
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PRE_BLOCK_K=_PRE_BLOCK_K, **_pdl_args(x.device),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out, residual_out


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *, residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear`` with fp8 weights, after rms_norm (with the ``residual`` add) when ``norm_weight``
    is given and followed by silu_and_mul when ``gated``: ``(out, residual)``, as ``norm_linear``.
    One row: one launch for all of it. Up to FP8_TRITON_MAX_ROWS: rms_norm, the rows' quantization
    and the Triton kernel. Beyond: rms_norm, quantization, ``torch._scaled_mm`` (row-wise scales;
    cuBLASLt/CUTLASS on Hopper), silu_and_mul. Each product rounded once to ``x``'s dtype."""
    _check(x.dim() == 2, f"x must have 2 dims, got shape {tuple(x.shape)}")
    _check_last_dim_contiguous("x", x)
    _check_devices(x=x, weight=weight, weight_scale=weight_scale)
    rows = x.shape[0]
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    if rows == 1:
        if residual is not None:
            _check_last_dim_contiguous("residual", residual)
        return _launch(x, None, weight, weight_scale, n_out, x.dtype, residual, norm_weight, eps, gated)
    if norm_weight is not None:
        x, residual = rms_norm(x, norm_weight, eps, residual)
    else:
        residual = x
    x_fp8, x_scale = quantize_rows(x)
    if 0 < rows <= FP8_TRITON_MAX_ROWS:
        out, _ = _launch(x_fp8, x_scale, weight, weight_scale, n_out, x.dtype, None, None, 0.0, gated)
        return out, residual
    # row-wise scaling on CUDA writes bf16 only
    out_dtype = torch.bfloat16 if x.is_cuda and x.dtype == torch.bfloat16 else torch.float32
    out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=out_dtype)
    out = out.to(x.dtype)
    return (silu_and_mul(out) if gated else out), residual
