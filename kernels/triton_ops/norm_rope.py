"""rms_norm (with the fused residual add), rotary_embedding (with the per-head q/k norms) and
silu_and_mul: one program per row, or per token for RoPE, over any row-strided view."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import QKNorm
from kernels.triton_ops._checks import (
    _FLOAT_DTYPES,
    _INDEX_DTYPES,
    _as_rows,
    _check,
    _check_devices,
    _check_last_dim_contiguous,
    _check_tensor,
)

_MAX_ROW_WIDTH = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps, width, rows_inner,
    x_stride0, x_stride1, residual_stride0, residual_stride1,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    outer = row // rows_inner
    inner = row % rows_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + outer * x_stride0 + inner * x_stride1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + outer * residual_stride0 + inner * residual_stride1
        residual = tl.load(residual_row + cols, mask=mask, other=0.0)
        # Rounded to the activation dtype before the norm, as the reference's ``x + residual``.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * width + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / width + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (xf * rstd * weight).to(out_ptr.dtype.element_ty), mask=mask)


def _check_norm_inputs(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, name: str) -> None:
    """An RMSNorm's weight (``name``) and optional residual, for rows ``x``."""
    width = x.shape[-1]
    _check_tensor(name, weight, 1, _FLOAT_DTYPES)
    _check(tuple(weight.shape) == (width,), lambda: f"{name} must have shape ({width},), got {tuple(weight.shape)}")
    _check(weight.is_contiguous(), lambda: f"{name} must be contiguous")
    if residual is None:
        _check_devices(x=x, **{name: weight})
        return
    _check(
        isinstance(residual, torch.Tensor) and residual.shape == x.shape and residual.dtype == x.dtype,
        lambda: f"residual must match x ({tuple(x.shape)}, {x.dtype})",
    )
    _check_devices(x=x, residual=residual, **{name: weight})


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(isinstance(x, torch.Tensor) and x.dtype in _FLOAT_DTYPES, "x must be a float16/bfloat16/float32 tensor")
    rows = _as_rows(x, "x")
    width = x.shape[-1]
    _check(width <= _MAX_ROW_WIDTH, lambda: f"rms_norm rows wider than {_MAX_ROW_WIDTH} are not supported, got {width}")
    _check_norm_inputs(x, weight, residual, "weight")
    residual_rows = rows if residual is None else _as_rows(residual, "residual")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else x
    num_rows = rows.shape[0] * rows.shape[1]
    if num_rows == 0 or width == 0:
        return out, residual_out
    block = triton.next_power_of_2(width)
    _rms_norm_kernel[(num_rows,)](
        rows, residual_rows, weight, out, residual_out, eps, width, rows.shape[1],
        rows.stride(0), rows.stride(1), residual_rows.stride(0), residual_rows.stride(1),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=max(1, min(8, block // 512)),
    )
    return out, residual_out


@triton.jit
def _rotate_heads(
    src_ptr, src_stride_h, dst_ptr, cos, sin, norm_ptr, eps,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    h = tl.arange(0, HEADS_PAD)[:, None]
    j = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < NUM_HEADS) & (j < HALF)
    src = src_ptr + h * src_stride_h + j
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # each head's RMSNorm, rounded as rms_norm returns it, before the rotation
        rstd = 1.0 / tl.sqrt(tl.sum(x1 * x1 + x2 * x2, 1) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(norm_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
        x1 = (x1 * rstd * w1).to(dst_ptr.dtype.element_ty).to(tl.float32)
        x2 = (x2 * rstd * w2).to(dst_ptr.dtype.element_ty).to(tl.float32)
    dst = dst_ptr + h * (2 * HALF) + j
    tl.store(dst, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr, q_norm_ptr, k_norm_ptr, eps,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, cos_sin_stride,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """Program (token): cos/sin of its position loaded once, applied to all q and k heads."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    j = tl.arange(0, HALF_PAD)[None, :]
    cos_sin = cos_sin_ptr + position * cos_sin_stride + j
    cos = tl.load(cos_sin, mask=j < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin + HALF, mask=j < HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + token * q_stride_t, q_stride_h, q_out_ptr + token * (NUM_HEADS * 2 * HALF), cos, sin,
        q_norm_ptr, eps, NUM_HEADS, HEADS_PAD, HALF, HALF_PAD, HAS_NORM,
    )
    _rotate_heads(
        k_ptr + token * k_stride_t, k_stride_h, k_out_ptr + token * (NUM_KV_HEADS * 2 * HALF), cos, sin,
        k_norm_ptr, eps, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD, HAS_NORM,
    )


def _check_qk_norm(qk_norm: QKNorm | None, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``qk_norm``'s weights and eps for q's heads; without one, q itself in place of the weights
    (never read) and eps 0."""
    if qk_norm is None:
        return q, q, 0.0
    _check(isinstance(qk_norm, QKNorm), lambda: f"qk_norm must be a kernels.QKNorm, got {type(qk_norm).__name__}")
    head_dim = q.shape[-1]
    for name, weight in (("qk_norm.q_weight", qk_norm.q_weight), ("qk_norm.k_weight", qk_norm.k_weight)):
        _check_tensor(name, weight, 1, _FLOAT_DTYPES)
        if tuple(weight.shape) != (head_dim,):
            raise ValueError(f"{name} must have shape ({head_dim},), got {tuple(weight.shape)}")
        _check(weight.is_contiguous(), f"{name} must be contiguous")
        _check_devices(q=q, **{name: weight})
    _check(qk_norm.eps > 0, lambda: f"qk_norm.eps must be > 0, got {qk_norm.eps}")
    return qk_norm.q_weight, qk_norm.k_weight, float(qk_norm.eps)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_tensor("positions", positions, 1, _INDEX_DTYPES)
    _check_tensor("q", q, 3, _FLOAT_DTYPES)
    _check_tensor("k", k, 3, _FLOAT_DTYPES)
    _check_tensor("cos_sin_cache", cos_sin_cache, 2, _FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    _check(head_dim % 2 == 0, lambda: f"head_dim must be even, got {head_dim}")
    _check(
        k.shape[0] == num_tokens and k.shape[2] == head_dim,
        lambda: f"k must have shape ({num_tokens}, num_kv_heads, {head_dim}), got {tuple(k.shape)}",
    )
    _check(
        tuple(positions.shape) == (num_tokens,),
        lambda: f"positions must have shape ({num_tokens},), got {tuple(positions.shape)}",
    )
    _check(
        cos_sin_cache.shape[1] == head_dim,
        lambda: f"cos_sin_cache must have shape (max_position, {head_dim}), got {tuple(cos_sin_cache.shape)}",
    )
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        _check_last_dim_contiguous(name, t)
    _check(positions.is_contiguous(), "positions must be contiguous")
    _check_devices(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    q_norm, k_norm, eps = _check_qk_norm(qk_norm, q)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q_out, k_out, q_norm, k_norm, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), HAS_NORM=qk_norm is not None, num_warps=4,
    )
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, rows_inner, x_stride0, x_stride1, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + (row // rows_inner) * x_stride0 + (row % rows_inner) * x_stride1
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty), mask=mask)


_SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Computed in fp32 and rounded once."""
    _check(isinstance(x, torch.Tensor) and x.dtype in _FLOAT_DTYPES, "x must be a float16/bfloat16/float32 tensor")
    _check(x.dim() >= 1 and x.shape[-1] % 2 == 0, lambda: f"x's last dim must be even, got shape {tuple(x.shape)}")
    rows = _as_rows(x, "x")
    _check_devices(x=x)
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    num_rows = rows.shape[0] * rows.shape[1]
    if num_rows == 0 or d == 0:
        return out
    block = min(_SILU_BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(d, block))](
        rows, out, d, rows.shape[1], rows.stride(0), rows.stride(1), BLOCK=block, num_warps=4,
    )
    return out
