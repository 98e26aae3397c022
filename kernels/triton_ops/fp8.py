"""FP8 (E4M3): the saturating cast, per-row activation quantization, ``linear`` with fp8 weights
of rows quantized per row: decode batches by ``fp8_gemv`` (the weights streamed once through the
tensor cores in fp8 x fp8, up to 64 rows), larger ones by ``scaled_linear`` (torch._scaled_mm)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton_ops._checks import _INTERPRETED, _check, _check_devices, _check_last_dim_contiguous
from kernels.triton_ops._launch import _arrival_counters, _num_sms, _pdl_args
from kernels.triton_ops.norm_rope import _MAX_ROW_WIDTH

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
def _pdl_start(USE_PDL: tl.constexpr):
    """A quantization kernel's start under PDL: the GEMV after it may launch at once (it waits for
    this kernel's end before it reads the rows), then this one waits for the kernel before it. On
    an H100 (Llama 3 8B shape, one row) a layer's four quantizations went from 10.4 to 8.4 us and
    batch-1 decode from 257.8 to 274.8 tok/s (benchmarks/results/*_fp8_pdlq_h100.jsonl)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _quantize_rows_kernel(
    x_ptr, out_ptr, scale_ptr, k_in, x_stride, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program per row: its absolute maximum, then the row over its scale. ONE_PASS: the row fits
    in one BLOCK_K, loaded once and kept in registers; otherwise it is read twice, a BLOCK_K at a
    time."""
    row = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    _pdl_start(USE_PDL)
    if ONE_PASS:
        x = tl.load(x_ptr + row * x_stride + kk, mask=kk < k_in, other=0.0)
        scale = row_scale(tl.max(tl.abs(x.to(tl.float32)), 0))
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * k_in + kk, to_fp8(x, scale), mask=kk < k_in)
    else:
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


# quantize_rows keeps a row of up to _QUANTIZE_ONE_PASS_MAX features (Llama 3 8B's 14336 included)
# in registers when there are at most _QUANTIZE_ONE_PASS_MAX_ROWS rows: a decode batch's launch is
# bound by its chain of dependent loads, which one pass halves (H200, a Llama 3 8B layer's four
# quantizations at 64 rows under a CUDA graph: 16.7 -> 11.2 us; 256 rows: 19.6 -> 15.4 us). Larger
# batches keep two passes of BLOCK_K: in one pass, 1024 rows of 4096 took 41 us instead of 11 and
# 8192 rows of 14336 177 us instead of 157. The interpreter's limit is small, so that tests cover
# both paths.
_QUANTIZE_ONE_PASS_MAX = 64 if _INTERPRETED else 16384
_QUANTIZE_ONE_PASS_MAX_ROWS = 256
_QUANTIZE_BLOCK_K = 32 if _INTERPRETED else 1024


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.reference.quantize_rows`` in one launch: ``(x_fp8 [rows, k], scale [rows, 1])``."""
    _check(x.dim() == 2, lambda: f"x must have 2 dims, got shape {tuple(x.shape)}")
    _check_last_dim_contiguous("x", x)
    _check_devices(x=x)
    rows, k_in = x.shape
    out = torch.empty((rows, k_in), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        one_pass = rows <= _QUANTIZE_ONE_PASS_MAX_ROWS and triton.next_power_of_2(k_in) <= _QUANTIZE_ONE_PASS_MAX
        block_k = triton.next_power_of_2(k_in) if one_pass else _QUANTIZE_BLOCK_K
        _quantize_rows_kernel[(rows,)](x, out, scale, k_in, x.stride(0), BLOCK_K=block_k, ONE_PASS=one_pass,
                                       **_pdl_args(x.device), num_warps=max(4, min(16, block_k // 512)))
    return out, scale


@triton.jit
def _rms_norm_quantize_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, scale_ptr, residual_out_ptr, eps, width, x_stride, residual_stride,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program per row: rms_norm's row (norm_rope._rms_norm_kernel's arithmetic, the normed row
    rounded to x's dtype as rms_norm returns it; ``x + residual`` written to ``residual_out``),
    then quantized as _quantize_rows_kernel quantizes it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    dtype = x_ptr.dtype.element_ty
    _pdl_start(USE_PDL)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * width + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / width + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (xf * rstd * weight).to(dtype).to(tl.float32)
    scale = row_scale(tl.max(tl.abs(normed), 0))
    tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * width + cols, to_fp8(normed, scale), mask=mask)


def rms_norm_quantize(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_rows(rms_norm(x, weight, eps, residual)[0])`` in one launch, the normed rows never
    written: ``(x_fp8 [rows, k], scale [rows, 1], residual_out)``, residual_out as rms_norm's (x
    itself without a residual). For decode batches: a program per row, held in registers, as
    quantize_rows' one pass. The caller checks the norm's inputs."""
    _check(x.dim() == 2, lambda: f"x must have 2 dims, got shape {tuple(x.shape)}")
    _check_last_dim_contiguous("x", x)
    rows, width = x.shape
    _check(width <= _MAX_ROW_WIDTH, lambda: f"rms_norm rows wider than {_MAX_ROW_WIDTH} are not supported, got {width}")
    block = triton.next_power_of_2(width)
    out = torch.empty((rows, width), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    residual_out = x
    if residual is not None:
        _check_last_dim_contiguous("residual", residual)
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows:
        _rms_norm_quantize_kernel[(rows,)](
            x, x if residual is None else residual, weight, out, scale, residual_out, eps, width, x.stride(0),
            0 if residual is None else residual.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=block,
            **_pdl_args(x.device),
            num_warps=max(1, min(8, block // 512)),  # rms_norm's, so that the sum of squares is its sum
        )
    return out, scale, residual_out


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """fp8 ``linear`` of a batch: the rows quantized, then one ``torch._scaled_mm`` (cuBLASLt on
    Hopper) with the row and channel scales; its output rounded once to ``x``'s dtype."""
    _check_devices(x=x, weight=weight, weight_scale=weight_scale)
    x_fp8, x_scale = quantize_rows(x)
    # row-wise scaling on CUDA writes bf16 only
    out_dtype = torch.bfloat16 if x.is_cuda and x.dtype == torch.bfloat16 else torch.float32
    out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=out_dtype)
    return out.to(x.dtype)


# --- decode batches: the weights streamed once -------------------------------------------------


class Fp8GemvTiles(NamedTuple):
    block_n: int  # weight rows (output columns) per program: the tensor cores' M
    block_k: int  # input features per step
    num_warps: int
    num_stages: int
    programs_per_sm: int  # K is split until column blocks x splits reach this many per multiprocessor


# The tensor cores take x's rows as their N, padded to tl.dot's smallest (16) or the next power of two.
_FP8_GEMV_MIN_BLOCK_M = 16
# Up to this many rows of quantized x go through fp8_gemv; more go to torch._scaled_mm.
FP8_GEMV_MAX_ROWS = 64
_FP8_GEMV_MAX_SPLITS = 16

# Tiles by the most rows they serve (1 or FP8_GEMV_MAX_ROWS) and weight shape (rows, in_features)
# where one differs from the default: the fastest timed (kernels_bench.py --only fp8 --sweep; Llama
# 3 8B's projections as the engine runs them; 64 rows on the H200, one row on an H100, where the
# default won for qkv, o and down and gate_up's pick is within 0.5 % of it). The interpreter gets
# narrow tiles so that tiny test shapes cross column blocks and split K.
FP8_GEMV_DEFAULT_TILES = Fp8GemvTiles(16, 32, 4, 1, 2) if _INTERPRETED else Fp8GemvTiles(
    block_n=64, block_k=256, num_warps=4, num_stages=4, programs_per_sm=1)
FP8_GEMV_TILES: dict[tuple[int, int, int], Fp8GemvTiles] = {} if _INTERPRETED else {
    # gate_up at one row, gated (an H100: 44.2 us, the default 44.4)
    (1, 28672, 4096): Fp8GemvTiles(block_n=64, block_k=256, num_warps=4, num_stages=4, programs_per_sm=2),
    # gate_up, gated as norm_linear runs it (64 rows: 38.4 us; the plain product's fastest,
    # block_n=128, took 52.1 us gated)
    (FP8_GEMV_MAX_ROWS, 28672, 4096): Fp8GemvTiles(block_n=64, block_k=128, num_warps=4, num_stages=4,
                                                   programs_per_sm=2),
}


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, partial_ptr, counters_ptr, rows, n_out, k_in, k_per_split,
    x_stride, w_stride, out_stride,
    GATED: tl.constexpr, DOT_DTYPE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (column block, K split): ``acc[cols, rows] = w[cols, ks] @ x[rows, ks]^T`` of fp8
    (E4M3) weights and rows quantized per row, on the tensor cores in fp8 x fp8, accumulated in
    fp32: the weight tile is their M and the rows their N ("swap AB"), so the weights are read
    once for all rows, never converted. The row and channel scales are applied to the sums.
    GATED: ``silu(gate) * up`` of the rounded pair (the up rows follow the gate's). SPLIT: the
    program writes its partial sums and counts its arrival; the column block's last merges the
    partials (in split order, so the result does not depend on the order of arrival), writes the
    output and resets the counter for the next launch."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    m = tl.arange(0, BLOCK_M)
    m_ok = m < rows
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_stride
    up_rows = w_rows + n_out.to(tl.int64) * w_stride
    x_rows = x_ptr + m.to(tl.int64)[:, None] * x_stride
    if USE_PDL:
        tl.extra.cuda.gdc_wait()

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_lo = split * k_per_split
    for k_start in range(k_lo, tl.minimum(k_lo + k_per_split, k_in), BLOCK_K):
        k = k_start + kk
        k_ok = k < k_in
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        acc = tl.dot(w.to(DOT_DTYPE), tl.trans(x), acc, input_precision="ieee")
        if GATED:
            up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
            acc_up = tl.dot(up.to(DOT_DTYPE), tl.trans(x), acc_up, input_precision="ieee")
    if USE_PDL:  # the next kernel may launch: only the merge and the stores remain
        tl.extra.cuda.gdc_launch_dependents()

    x_scale = tl.load(x_scale_ptr + m, mask=m_ok, other=1.0)
    if SPLIT:
        num_splits = tl.num_programs(1)
        width = (2 if GATED else 1) * n_out
        partial = partial_ptr + (split * width + n)[:, None].to(tl.int64) * BLOCK_M + m[None, :]
        mask = n_ok[:, None] & m_ok[None, :]
        tl.store(partial, acc, mask=mask)
        if GATED:
            tl.store(partial + n_out * BLOCK_M, acc_up, mask=mask)
        counter = counters_ptr + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            acc = tl.zeros_like(acc)
            acc_up = tl.zeros_like(acc_up)
            for s in range(0, num_splits):
                at = partial + (s - split).to(tl.int64) * width * BLOCK_M
                acc += tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(at + n_out * BLOCK_M, mask=mask, other=0.0, cache_modifier=".cg")
            _fp8_gemv_store(acc, acc_up, x_scale, n, n_ok, m, m_ok, w_scale_ptr, out_ptr, n_out, out_stride, GATED)
            tl.store(counter, 0)  # zeroed for the next launch, and for a CUDA graph's replay
    else:
        _fp8_gemv_store(acc, acc_up, x_scale, n, n_ok, m, m_ok, w_scale_ptr, out_ptr, n_out, out_stride, GATED)


@triton.jit
def _fp8_gemv_store(acc, acc_up, x_scale, n, n_ok, m, m_ok, w_scale_ptr, out_ptr, n_out, out_stride,
                    GATED: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_M]`` (columns n of rows m) times the row and channel scales, rounded
    to the output dtype as the product's output; GATED: ``silu(gate) * up`` of the rounded pair,
    rounded."""
    dtype = out_ptr.dtype.element_ty
    y = (acc * x_scale[None, :] * tl.load(w_scale_ptr + n, mask=n_ok, other=0.0)[:, None]).to(dtype)
    if GATED:
        up_scale = tl.load(w_scale_ptr + n_out + n, mask=n_ok, other=0.0)
        up = (acc_up * x_scale[None, :] * up_scale[:, None]).to(dtype).to(tl.float32)
        gate = y.to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
    tl.store(out_ptr + m.to(tl.int64)[None, :] * out_stride + n[:, None], y, mask=n_ok[:, None] & m_ok[None, :])


def fp8_gemv_tiles(weight: torch.Tensor, rows: int) -> Fp8GemvTiles:
    """The tiles of ``fp8_gemv`` for ``rows`` of x times ``weight``."""
    return FP8_GEMV_TILES.get((1 if rows == 1 else FP8_GEMV_MAX_ROWS, *weight.shape), FP8_GEMV_DEFAULT_TILES)


def fp8_gemv(
    x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, n_out: int,
    out_dtype: torch.dtype, gated: bool = False,
) -> torch.Tensor:
    """``out [rows, n_out]`` (``out_dtype``) of a decode batch of up to FP8_GEMV_MAX_ROWS rows of
    fp8 ``x`` quantized per row (``x_scale [rows, 1]``; quantize_rows, rms_norm_quantize) in one
    launch, SiLU-and-mul fused in when ``gated``. No host sync and a fixed-size scratch: it may
    be captured in a CUDA graph once it has run eagerly on the device."""
    rows, k_in = x.shape
    _check_last_dim_contiguous("x", x)
    _check_devices(x=x, x_scale=x_scale, weight=weight, weight_scale=weight_scale)
    _check(x.dtype == torch.float8_e4m3fn and x_scale.shape == (rows, 1) and rows <= FP8_GEMV_MAX_ROWS,
           lambda: f"fp8_gemv takes up to {FP8_GEMV_MAX_ROWS} rows of fp8 x with their x_scale [rows, 1]")
    out = torch.empty((rows, n_out), dtype=out_dtype, device=x.device)
    if rows == 0:
        return out
    tiles = fp8_gemv_tiles(weight, rows)
    block_m = max(_FP8_GEMV_MIN_BLOCK_M, triton.next_power_of_2(rows))
    n_blocks = triton.cdiv(n_out, tiles.block_n)
    k_steps = triton.cdiv(k_in, tiles.block_k)
    splits = max(1, min(round(tiles.programs_per_sm * _num_sms(x.device) / n_blocks), k_steps, _FP8_GEMV_MAX_SPLITS))
    k_per_split = triton.cdiv(k_steps, splits) * tiles.block_k
    splits = triton.cdiv(k_in, k_per_split)
    partial = counters = out  # unused without split-K
    if splits > 1:
        counters = _arrival_counters(x.device, n_blocks, "fp8 linear")
        partial = torch.empty((splits, (2 if gated else 1) * n_out, block_m), dtype=torch.float32, device=x.device)
    # The interpreter multiplies the fp8 values in fp32 (exact products; only the order of the sums differs).
    _fp8_gemv_kernel[(n_blocks, splits)](
        x, x_scale, weight, weight_scale, out, partial, counters, rows, n_out, k_in, k_per_split, x.stride(0),
        weight.stride(0), out.stride(0), GATED=gated, DOT_DTYPE=tl.float32 if _INTERPRETED else tl.float8e4nv,
        SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **_pdl_args(x.device),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out
