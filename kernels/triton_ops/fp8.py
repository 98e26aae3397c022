"""FP8 (E4M3): the saturating cast, per-row activation quantization, ``linear`` with fp8 weights
for decode batches (``fp8_gemv``: the weights streamed once through the tensor cores in fp8 x fp8,
up to 64 rows) and for larger ones (``scaled_linear``: torch._scaled_mm)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import FP8_GEMV_MAX_ROWS, FP8_X_GROUP
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
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, k_in, x_stride, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    """Program per row: its absolute maximum, then the row over its scale. ONE_PASS: the row fits
    in one BLOCK_K, loaded once and kept in registers; otherwise it is read twice, a BLOCK_K at a
    time."""
    row = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
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
    _check(x.dim() == 2, f"x must have 2 dims, got shape {tuple(x.shape)}")
    _check_last_dim_contiguous("x", x)
    _check_devices(x=x)
    rows, k_in = x.shape
    out = torch.empty((rows, k_in), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        one_pass = rows <= _QUANTIZE_ONE_PASS_MAX_ROWS and triton.next_power_of_2(k_in) <= _QUANTIZE_ONE_PASS_MAX
        block_k = triton.next_power_of_2(k_in) if one_pass else _QUANTIZE_BLOCK_K
        _quantize_rows_kernel[(rows,)](x, out, scale, k_in, x.stride(0), BLOCK_K=block_k, ONE_PASS=one_pass,
                                       num_warps=max(4, min(16, block_k // 512)))
    return out, scale


@triton.jit
def _rms_norm_quantize_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, scale_ptr, residual_out_ptr, eps, width, x_stride, residual_stride,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program per row: rms_norm's row (norm_rope._rms_norm_kernel's arithmetic, the normed row
    rounded to x's dtype as rms_norm returns it; ``x + residual`` written to ``residual_out``),
    then quantized as _quantize_rows_kernel quantizes it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    dtype = x_ptr.dtype.element_ty
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
    _check(x.dim() == 2, f"x must have 2 dims, got shape {tuple(x.shape)}")
    _check_last_dim_contiguous("x", x)
    rows, width = x.shape
    _check(width <= _MAX_ROW_WIDTH, f"rms_norm rows wider than {_MAX_ROW_WIDTH} are not supported, got {width}")
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
    block_k: int  # input features per step; up to FP8_GEMV_MAX_ROWS rows, x's quantization group
    num_warps: int
    num_stages: int
    programs_per_sm: int  # K is split until column blocks x splits reach this many per multiprocessor


# The tensor cores take x's rows as their N, padded to tl.dot's smallest (16); more rows take the
# next power of two, up to FP8_GEMV_QUANTIZED_MAX_ROWS.
_FP8_GEMV_MIN_BLOCK_M = 16
# Rows past kernels.FP8_GEMV_MAX_ROWS (quantized per row, as for torch._scaled_mm) and up to this
# many go through the same kernel with x quantized beforehand; more go to torch._scaled_mm.
FP8_GEMV_QUANTIZED_MAX_ROWS = 64
_FP8_GEMV_MAX_SPLITS = 16
# With PDL each program prefetches this many steps of its weight rows into L2 before it waits on
# the previous kernel (0: none).
_FP8_GEMV_PREFETCH_TILES = 4

# Tiles by the most rows they serve (1, FP8_GEMV_MAX_ROWS quantized in the kernel,
# FP8_GEMV_QUANTIZED_MAX_ROWS quantized beforehand), then by weight shape (rows, in_features)
# where one differs: the fastest timed on the H200 (kernels_bench.py --only fp8 --sweep; Llama 3
# 8B's projections). Up to FP8_GEMV_MAX_ROWS rows a step is one quantization group of x
# (block_k == FP8_X_GROUP). The interpreter gets narrow tiles so that tiny test shapes cross
# column blocks and split K.
FP8_GEMV_DEFAULT_TILES: dict[int, Fp8GemvTiles] = {
    1: Fp8GemvTiles(16, FP8_X_GROUP, 4, 1, 2) if _INTERPRETED else Fp8GemvTiles(
        block_n=128, block_k=FP8_X_GROUP, num_warps=4, num_stages=4, programs_per_sm=2),
    FP8_GEMV_MAX_ROWS: Fp8GemvTiles(16, FP8_X_GROUP, 4, 1, 2) if _INTERPRETED else Fp8GemvTiles(
        block_n=64, block_k=FP8_X_GROUP, num_warps=4, num_stages=4, programs_per_sm=2),
    FP8_GEMV_QUANTIZED_MAX_ROWS: Fp8GemvTiles(16, 32, 4, 1, 2) if _INTERPRETED else Fp8GemvTiles(
        block_n=64, block_k=256, num_warps=4, num_stages=4, programs_per_sm=1),
}
FP8_GEMV_TILES: dict[tuple[int, int, int], Fp8GemvTiles] = {} if _INTERPRETED else {
    # gate_up, gated as norm_linear runs it (64 rows: 38.4 us; the plain product's fastest,
    # block_n=128, took 52.1 us gated)
    (FP8_GEMV_QUANTIZED_MAX_ROWS, 28672, 4096): Fp8GemvTiles(
        block_n=64, block_k=128, num_warps=4, num_stages=4, programs_per_sm=2),
}


@triton.jit
def _prefetch_l2(rows, nbytes):
    """Each of ``rows`` (pointers, 16-byte aligned) and the ``nbytes`` after it (a multiple of 16)
    into L2, by the bulk copy engine; nothing waits on it."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [rows, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fp8_gemv_finish(
    acc, acc_up, x_scale, sum_sq, pid_n, split, n, n_ok, m, m_ok, w_scale_ptr, out_ptr, partial_ptr, counters_ptr,
    n_out, k_in, eps, out_stride, HAS_NORM: tl.constexpr, GATED: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Writes ``acc [BLOCK_N, BLOCK_M]`` (columns n of rows m) times the row and channel scales
    (HAS_NORM: the row's scale times its 1/rms, from the sums of squares ``sum_sq``), rounded to
    the output dtype as the product's output; GATED: ``silu(gate) * up`` of the rounded pair,
    rounded. SPLIT: the program writes its partial sums (and its column block's sums of squares)
    and counts its arrival; the column block's last merges the partials (in split order, so the
    result does not depend on the order of arrival), writes the output and resets the counter for
    the next launch."""
    if SPLIT:
        num_splits = tl.num_programs(1)
        products = (2 if GATED else 1) * n_out
        width = products + tl.num_programs(0)  # the products' partials, then each column block's squares
        split_at = partial_ptr + split.to(tl.int64) * width * BLOCK_M
        partial = split_at + n.to(tl.int64)[:, None] * BLOCK_M + m[None, :]
        squares = split_at + (products + pid_n) * BLOCK_M + m
        mask = n_ok[:, None] & m_ok[None, :]
        tl.store(partial, acc, mask=mask)
        if GATED:
            tl.store(partial + n_out * BLOCK_M, acc_up, mask=mask)
        if HAS_NORM:
            tl.store(squares, sum_sq, mask=m_ok)
        counter = counters_ptr + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            acc = tl.zeros_like(acc)
            acc_up = tl.zeros_like(acc_up)
            sum_sq = tl.zeros_like(sum_sq)
            for s in range(0, num_splits):
                offset = (s - split).to(tl.int64) * width * BLOCK_M
                acc += tl.load(partial + offset, mask=mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(partial + offset + n_out * BLOCK_M, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_NORM:
                    sum_sq += tl.load(squares + offset, mask=m_ok, other=0.0, cache_modifier=".cg")
            if HAS_NORM:
                x_scale = x_scale / tl.sqrt(sum_sq / k_in + eps)
            _fp8_gemv_store(acc, acc_up, x_scale, n, n_ok, m, m_ok, w_scale_ptr, out_ptr, n_out, out_stride, GATED)
            tl.store(counter, 0)  # zeroed for the next launch, and for a CUDA graph's replay
    else:
        if HAS_NORM:
            x_scale = x_scale / tl.sqrt(sum_sq / k_in + eps)
        _fp8_gemv_store(acc, acc_up, x_scale, n, n_ok, m, m_ok, w_scale_ptr, out_ptr, n_out, out_stride, GATED)


@triton.jit
def _fp8_gemv_store(acc, acc_up, x_scale, n, n_ok, m, m_ok, w_scale_ptr, out_ptr, n_out, out_stride,
                    GATED: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    y = (acc * x_scale[None, :] * tl.load(w_scale_ptr + n, mask=n_ok, other=0.0)[:, None]).to(dtype)
    if GATED:
        up_scale = tl.load(w_scale_ptr + n_out + n, mask=n_ok, other=0.0)
        up = (acc_up * x_scale[None, :] * up_scale[:, None]).to(dtype).to(tl.float32)
        gate = y.to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
    tl.store(out_ptr + m.to(tl.int64)[None, :] * out_stride + n[:, None], y, mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, x_scale_ptr, residual_ptr, norm_weight_ptr, w_ptr, w_scale_ptr, out_ptr, residual_out_ptr,
    partial_ptr, counters_ptr, rows, n_out, k_in, k_per_split, eps, x_stride, residual_stride, w_stride,
    out_stride,
    HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, X_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr,
):
    """Program (column block, K split): ``acc[cols, rows] = w[cols, ks] @ x[rows, ks]^T`` on the
    tensor cores in fp8 (E4M3) x fp8, accumulated in fp32: the weight tile is their M ("swap AB"),
    so the weights are read once for all rows and never converted. X_FP8: x comes quantized per
    row, its scales applied with the channels'. Otherwise each step quantizes its BLOCK_K
    features of each row (one group of FP8_X_GROUP) over the group's own scale and adds the
    step's products times that scale: f(x), the optional residual add (rounded to x's dtype, as
    rms_norm adds it) and RMSNorm's weight, then the row's 1/rms (from the sums of squares
    gathered on the way) applied to the sums, so x is read once. With a residual, one program
    per BLOCK_K slice writes ``x + residual`` to ``residual_out``. With PDL, the program asks L2
    for the first PREFETCH_K bytes of its weight rows (within its split) before it waits on the
    previous kernel. See _fp8_gemv_finish for SPLIT."""
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
    residual_rows = residual_ptr + m.to(tl.int64)[:, None] * residual_stride
    k_lo = split * k_per_split
    if USE_PDL:
        if PREFETCH_K > 0:  # the first weight tiles stream into L2 while the previous kernel finishes
            first = w_ptr + tl.minimum(n, n_out - 1).to(tl.int64) * w_stride + k_lo
            nbytes = tl.full([BLOCK_N], tl.minimum(PREFETCH_K, tl.minimum(k_per_split, k_in - k_lo)), tl.int32)
            _prefetch_l2(first, nbytes)
            if GATED:
                _prefetch_l2(first + n_out.to(tl.int64) * w_stride, nbytes)
        tl.extra.cuda.gdc_wait()

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k_start in range(k_lo, tl.minimum(k_lo + k_per_split, k_in), BLOCK_K):
        k = k_start + kk
        k_ok = k < k_in
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        if GATED:
            up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        x_mask = m_ok[:, None] & k_ok[None, :]
        if X_FP8:
            x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0).to(DOT_DTYPE)
            acc = tl.dot(w.to(DOT_DTYPE), tl.trans(x), acc, input_precision="ieee")
            if GATED:
                acc_up = tl.dot(up.to(DOT_DTYPE), tl.trans(x), acc_up, input_precision="ieee")
        else:
            x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
            if HAS_RESIDUAL:
                residual = tl.load(residual_rows + k[None, :], mask=x_mask, other=0.0)
                x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
                if (k_start // BLOCK_K) % tl.num_programs(0) == pid_n:
                    tl.store(residual_out_ptr + m.to(tl.int64)[:, None] * k_in + k[None, :], x, mask=x_mask)
            xf = x.to(tl.float32)
            if HAS_NORM:
                sum_sq += tl.sum(xf * xf, 1)
                xf = xf * tl.load(norm_weight_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            group_scale = row_scale(tl.max(tl.abs(xf), 1))
            xq = tl.trans(to_fp8(xf, group_scale[:, None]).to(DOT_DTYPE))
            acc += tl.dot(w.to(DOT_DTYPE), xq, input_precision="ieee") * group_scale[None, :]
            if GATED:
                acc_up += tl.dot(up.to(DOT_DTYPE), xq, input_precision="ieee") * group_scale[None, :]
    if USE_PDL:  # the next kernel may launch: only the merge and the stores remain
        tl.extra.cuda.gdc_launch_dependents()

    x_scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if X_FP8:
        x_scale = tl.load(x_scale_ptr + m, mask=m_ok, other=1.0)
    _fp8_gemv_finish(acc, acc_up, x_scale, sum_sq, pid_n, split, n, n_ok, m, m_ok, w_scale_ptr, out_ptr, partial_ptr,
                     counters_ptr, n_out, k_in, eps, out_stride, HAS_NORM, GATED, SPLIT, BLOCK_M)


def fp8_gemv_tiles(weight: torch.Tensor, rows: int) -> Fp8GemvTiles:
    """The tiles of ``fp8_gemv`` for ``rows`` of x."""
    most_rows = next(r for r in (1, FP8_GEMV_MAX_ROWS, FP8_GEMV_QUANTIZED_MAX_ROWS) if rows <= r)
    return FP8_GEMV_TILES.get((most_rows, *weight.shape), FP8_GEMV_DEFAULT_TILES[most_rows])


def fp8_gemv(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, n_out: int, *,
    residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
    gated: bool = False, x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, residual_out)`` of a decode batch (up to FP8_GEMV_QUANTIZED_MAX_ROWS rows) in one
    launch: up to ``kernels.FP8_GEMV_MAX_ROWS`` rows quantized in the kernel by groups of
    FP8_X_GROUP features (with the optional residual add and RMSNorm fused in); more rows come
    quantized per row (no norm: ``norm_linear`` norms and quantizes them by rms_norm_quantize,
    then passes fp8 ``x`` with its ``x_scale [rows, 1]`` and ``out_dtype``), or are quantized
    here. No host sync and a fixed-size scratch: it may be captured in a CUDA graph once it has
    run eagerly on the device."""
    rows, k_in = x.shape
    _check_last_dim_contiguous("x", x)
    _check_devices(x=x, weight=weight, weight_scale=weight_scale)
    x_fp8 = rows > FP8_GEMV_MAX_ROWS
    _check(not x_fp8 or norm_weight is None, f"norm_linear fuses its norm only up to {FP8_GEMV_MAX_ROWS} rows")
    quantized = x_scale is not None
    _check(quantized == (x.dtype == torch.float8_e4m3fn), "fp8 x comes with its x_scale, and only fp8 x")
    _check(not quantized or (x_fp8 and residual is None and out_dtype is not None),
           f"quantized x: more than {FP8_GEMV_MAX_ROWS} rows, no residual, an out_dtype")
    out = torch.empty((rows, n_out), dtype=out_dtype or x.dtype, device=x.device)
    residual_out = x
    if residual is not None:
        _check_last_dim_contiguous("residual", residual)
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows == 0:
        return out, residual_out
    tiles = fp8_gemv_tiles(weight, rows)
    _check(x_fp8 or tiles.block_k == FP8_X_GROUP, f"up to {FP8_GEMV_MAX_ROWS} rows a step is x's quantization "
           f"group of {FP8_X_GROUP} features, got tiles {tiles}")
    block_m = max(_FP8_GEMV_MIN_BLOCK_M, triton.next_power_of_2(rows))
    n_blocks = triton.cdiv(n_out, tiles.block_n)
    k_steps = triton.cdiv(k_in, tiles.block_k)
    splits = max(1, min(round(tiles.programs_per_sm * _num_sms(x.device) / n_blocks), k_steps, _FP8_GEMV_MAX_SPLITS))
    k_per_split = triton.cdiv(k_steps, splits) * tiles.block_k
    splits = triton.cdiv(k_in, k_per_split)
    partial = counters = out  # unused without split-K
    if splits > 1:
        counters = _arrival_counters(x.device, n_blocks, "fp8 linear")
        partial = torch.empty((splits, (2 if gated else 1) * n_out + n_blocks, block_m), dtype=torch.float32,
                              device=x.device)
    if x_fp8 and not quantized:
        x, x_scale = quantize_rows(x)
    # the bulk prefetch takes 16-byte units at 16-byte aligned addresses
    aligned = k_in % 16 == 0 and weight.stride(0) % 16 == 0 and weight.data_ptr() % 16 == 0
    prefetch_k = _FP8_GEMV_PREFETCH_TILES * tiles.block_k if aligned else 0
    unused = x  # a pointer argument the kernel's flags leave unread
    # The interpreter multiplies the fp8 values in fp32 (exact products; only the order of the sums differs).
    _fp8_gemv_kernel[(n_blocks, splits)](
        x, unused if x_scale is None else x_scale, unused if residual is None else residual,
        unused if norm_weight is None else norm_weight, weight, weight_scale, out, residual_out, partial, counters,
        rows, n_out, k_in, k_per_split, eps, x.stride(0), 0 if residual is None else residual.stride(0),
        weight.stride(0), out.stride(0), HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
        GATED=gated, X_FP8=x_fp8, DOT_DTYPE=tl.float32 if _INTERPRETED else tl.float8e4nv, SPLIT=splits > 1,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **_pdl_args(x.device),
        PREFETCH_K=prefetch_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out, residual_out
