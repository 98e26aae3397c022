"""linear and norm_linear: decode-batch GEMVs, with rms_norm, the residual add and
silu_and_mul fused in; other batches go to cuBLAS and the norm_rope kernels."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton_ops._checks import (
    _FLOAT_DTYPES,
    _INTERPRETED,
    _check,
    _check_devices,
    _check_last_dim_contiguous,
    _check_tensor,
)
from kernels.triton_ops._launch import _pdl_args
from kernels.triton_ops.fp8 import FP8_GEMV_MAX_ROWS, fp8_gemv, quantize_rows, rms_norm_quantize, scaled_linear
from kernels.triton_ops.norm_rope import _check_norm_inputs, rms_norm, silu_and_mul

# One activation row goes through the GEMV kernel, and so do up to GEMV_MAX_ROWS rows when the
# weight fits in L2 (the programs of the rows after the first find it there): on the H200, two or
# four rows of SmolLM2's projections (at most 3.5 MB) ran faster than cuBLAS, of Llama 3 8B's
# (32-117 MB) half as fast. Other batches go to cuBLAS (and the rms_norm/silu_and_mul kernels).
GEMV_MAX_ROWS = 4
_GEMV_L2_RESIDENT_BYTES = 8 << 20


class GemvTiles(NamedTuple):
    block_n: int  # output columns per program
    block_k: int  # input features per step
    num_warps: int
    num_stages: int


# Few columns and long steps keep many loads in flight on every multiprocessor: the fastest of
# those timed on the H200 for SmolLM2's and Llama 3 8B's projections (kernels_bench.py --only
# gemv --sweep). The interpreter gets small tiles so that tiny test shapes cross tile boundaries.
GEMV_TILES = (
    GemvTiles(block_n=16, block_k=32, num_warps=4, num_stages=1) if _INTERPRETED
    else GemvTiles(block_n=4, block_k=1024, num_warps=4, num_stages=3)
)


@triton.jit
def _gemv_x_tile(
    x_row, residual_row, norm_weight_ptr, k, k_ok, rstd, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """Features ``k`` of one row of the GEMV's input: ``x`` (+ ``residual``), normalized by
    ``rstd`` and rounded to x's dtype, as rms_norm returns it."""
    x = tl.load(x_row + k, mask=k_ok, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_row + k, mask=k_ok, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_row.dtype.element_ty)
    if HAS_NORM:
        weight = tl.load(norm_weight_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * rstd * weight).to(x_row.dtype.element_ty)
    return x


@triton.jit
def _gemv_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, w_ptr, out_ptr, residual_out_ptr,
    n_out, k_in, eps, x_stride, residual_stride, w_stride, out_stride,
    HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (column block, row): ``out[row, cols] = f(x[row]) @ w[cols]^T`` in fp32, f the
    optional ``residual`` add and RMSNorm; GATED reads the gate rows ``cols`` and the up rows
    ``n_out + cols`` and writes ``silu(gate) * up``. With a residual, the row's program whose
    turn it is writes each ``BLOCK_K`` slice of ``x + residual`` to ``residual_out``. The first
    weight tiles are loaded before waiting on the previous kernel: they do not depend on it; once
    they are issued the next kernel may launch and start loading its own.
    The rows of a batch stream the same weights at once: the second row on finds them in L2."""
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_stride
    up_rows = w_rows + n_out.to(tl.int64) * w_stride
    w_mask = n_ok[:, None] & (kk < k_in)[None, :]
    w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
    if GATED:
        up = tl.load(up_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x_row = x_ptr + row * x_stride
    residual_row = residual_ptr + row * residual_stride

    rstd = 0.0
    if HAS_NORM:
        sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k_start in range(0, k_in, BLOCK_K):
            k = k_start + kk
            k_ok = k < k_in
            x = _gemv_x_tile(x_row, residual_row, norm_weight_ptr, k, k_ok, rstd, False, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                if (k_start // BLOCK_K) % tl.num_programs(0) == pid:
                    tl.store(residual_out_ptr + row * k_in + k, x, mask=k_ok)
            xf = x.to(tl.float32)
            sum_sq += xf * xf
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, 0) / k_in + eps)

    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k_start in range(0, k_in, BLOCK_K):
        k = k_start + kk
        k_ok = k < k_in
        if k_start > 0:
            w_mask = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
            if GATED:
                up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        x = _gemv_x_tile(x_row, residual_row, norm_weight_ptr, k, k_ok, rstd, HAS_NORM, HAS_RESIDUAL)
        x = x.to(tl.float32)[None, :]
        acc += w.to(tl.float32) * x
        if GATED:
            acc_up += up.to(tl.float32) * x

    # Rounded to the activation dtype, as the product's output, before SiLU-and-mul.
    y = tl.sum(acc, 1).to(out_ptr.dtype.element_ty)
    if GATED:
        gate = y.to(tl.float32)
        up_out = tl.sum(acc_up, 1).to(out_ptr.dtype.element_ty).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate)) * up_out).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + n, y, mask=n_ok)


def _use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.dim() != 2 or not (x.is_cuda or _INTERPRETED):
        return False
    rows = x.shape[0]
    if weight.dtype == torch.float8_e4m3fn:
        return 0 < rows <= FP8_GEMV_MAX_ROWS
    return x.dtype == weight.dtype and (rows == 1 or (
        0 < rows <= GEMV_MAX_ROWS and weight.numel() * weight.element_size() <= _GEMV_L2_RESIDENT_BYTES
    ))


def _check_gemv_weight(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> None:
    _check(isinstance(x, torch.Tensor) and x.dtype in _FLOAT_DTYPES, "x must be a float16/bfloat16/float32 tensor")
    if weight_scale is None:
        _check_tensor("weight", weight, 2, _FLOAT_DTYPES)
    else:
        _check_tensor("weight", weight, 2, (torch.float8_e4m3fn,))
        _check_tensor("weight_scale", weight_scale, 1, (torch.float32,))
        _check(weight_scale.shape[0] == weight.shape[0] and weight_scale.is_contiguous(),
               lambda: f"weight_scale must be contiguous of shape ({weight.shape[0]},), got "
                       f"{tuple(weight_scale.shape)}")
    _check(
        x.dim() >= 1 and x.shape[-1] == weight.shape[1],
        lambda: f"x's last dim ({x.shape[-1] if x.dim() else None}) must equal weight's in_features "
                f"({weight.shape[1]})",
    )
    _check_last_dim_contiguous("weight", weight)


def _launch_gemv(
    x: torch.Tensor, weight: torch.Tensor, n_out: int, *, residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, k_in = x.shape
    _check_last_dim_contiguous("x", x)
    _check_devices(x=x, weight=weight)
    out = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    residual_out = x
    if residual is not None:
        _check_last_dim_contiguous("residual", residual)
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    unused = x  # a pointer argument the kernel's flags leave unread
    tiles = GEMV_TILES
    grid = (triton.cdiv(n_out, tiles.block_n), rows)
    _gemv_kernel[grid](
        x, unused if residual is None else residual, unused if norm_weight is None else norm_weight,
        weight, out, residual_out, n_out, k_in, eps,
        x.stride(0), 0 if residual is None else residual.stride(0), weight.stride(0), out.stride(0),
        HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, GATED=gated,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        **_pdl_args(x.device), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out, residual_out


def _batch_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> torch.Tensor:
    if weight_scale is None:
        return torch.nn.functional.linear(x, weight)
    return scaled_linear(x, weight, weight_scale)


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode batches (one row, or up to GEMV_MAX_ROWS with a weight that fits in L2) by the GEMV
    kernel, others by cuBLAS. fp8 weights: the rows quantized, then up to FP8_GEMV_MAX_ROWS rows by
    ``fp8_gemv``, more by ``scaled_linear`` (torch._scaled_mm)."""
    _check_gemv_weight(x, weight, weight_scale)
    if not _use_gemv(x, weight):
        return _batch_linear(x, weight, weight_scale)
    if weight_scale is not None:
        x_fp8, x_scale = quantize_rows(x)
        return fp8_gemv(x_fp8, x_scale, weight, weight_scale, weight.shape[0], x.dtype)
    return _launch_gemv(x, weight, weight.shape[0])[0]


def norm_linear(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
    weight: torch.Tensor, gated: bool = False, weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode batches take one GEMV launch for all of it (fp8 weights: rms_norm_quantize, then
    ``fp8_gemv`` with SiLU-and-mul fused in)."""
    _check_gemv_weight(x, weight, weight_scale)
    _check(not gated or weight.shape[0] % 2 == 0,
           lambda: f"a gated weight needs an even row count, got {weight.shape[0]}")
    if not _use_gemv(x, weight):
        normed, residual = rms_norm(x, norm_weight, eps, residual)
        out = _batch_linear(normed, weight, weight_scale)
        return (silu_and_mul(out) if gated else out), residual
    _check_norm_inputs(x, norm_weight, residual, "norm_weight")
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    if weight_scale is None:
        return _launch_gemv(x, weight, n_out, residual=residual, norm_weight=norm_weight, eps=eps, gated=gated)
    x_fp8, x_scale, residual = rms_norm_quantize(x, norm_weight, eps, residual)
    return fp8_gemv(x_fp8, x_scale, weight, weight_scale, n_out, x.dtype, gated), residual
