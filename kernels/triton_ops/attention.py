"""paged_attention: a decode kernel (one query token, split-K + reduce) and a prefill/extend
kernel (a tile of query rows, causal inside the new chunk), sharing the paged tile step; and
the tile choices of every attention kernel here and in fused_decode."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.triton_ops._checks import (
    _FLOAT_DTYPES,
    _INDEX_DTYPES,
    _INTERPRETED,
    _check,
    _check_devices,
    _check_kv_cache,
    _check_last_dim_contiguous,
    _check_tensor,
    _kv_scales,
)
from kernels.triton_ops._launch import _DECODE_PROGRAMS_PER_SM, _num_sms

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_LOG2E = math.log2(math.e)
# Split-K decode: at most this many splits (a power of two: the reduce kernel's tile).
_MAX_DECODE_SPLITS = 64


@triton.jit
def _online_softmax(s, m_i, l_i, scale_log2, MAY_SEE_NONE: tl.constexpr):
    """Online-softmax update for raw scores ``s`` (hidden keys at -inf): the probabilities
    (base 2, scaled by the new row maxima), the factor that rescales the old accumulator, and
    the new maxima and sums. The scale is folded into one FMA per score (it is positive)."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    # Causally every row sees a key of its first tile, so m_new is finite from then on; behind a
    # sliding window a row may see none of a tile (MAY_SEE_NONE): it keeps p = alpha = 0, not NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new) if MAY_SEE_NONE else m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s * scale_log2 - m_ref[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _load_kv_tile(
    tile_start, kv_end, kv_head, block_table_row, k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s,
    cache_stride_h, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, kv_start=0,
):
    """The K and V tiles of keys ``tile_start … tile_start + BLOCK_N - 1``, gathered through the
    block table (zeros where masked), with the keys' positions and which of them exist (see
    ``_attend_tile`` for ``MASK``)."""
    tok = tile_start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, DIM_PAD)
    tok_ok = tok < kv_end
    if MASK == "window":  # the pages before kv_start may be freed: never read
        tok_ok = tok_ok & (tok >= kv_start)
    if MASK == "none":
        block = tl.load(block_table_row + tok // BLOCK_SIZE)
    else:
        block = tl.load(block_table_row + tok // BLOCK_SIZE, mask=tok_ok, other=0)
    block = block.to(tl.int64)
    kv_offsets = block * cache_stride_b + (tok % BLOCK_SIZE) * cache_stride_s + kv_head * cache_stride_h
    kv_ptrs = kv_offsets[:, None] + d[None, :]
    # V is loaded with K, before the dot: fewer live registers than loading it after the softmax.
    if MASK == "none" and HEAD_DIM == DIM_PAD:
        k = tl.load(k_cache_ptr + kv_ptrs)
        v = tl.load(v_cache_ptr + kv_ptrs)
    else:
        kv_mask = tok_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
    return k, v, tok, tok_ok


@triton.jit
def _attend_kv(
    q, k, v, acc, m_i, l_i, q_pos, tok, tok_ok, scale_log2, MASK: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, window=0,
):
    """The online-softmax step over a loaded K/V tile (``_load_kv_tile``'s)."""
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    if MASK == "end":
        s = tl.where(tok_ok[None, :], s, float("-inf"))
    elif MASK == "causal":
        s = tl.where(tok[None, :] <= q_pos[:, None], s, float("-inf"))
    elif MASK == "window":
        seen = (tok[None, :] <= q_pos[:, None]) & (tok[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, scale_log2, MASK == "window")
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, q_pos, tile_start, kv_end, kv_head, block_table_row,
    k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s, cache_stride_h, scale_log2,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, kv_start=0, window=0,
):
    """One online-softmax step over keys ``tile_start … tile_start + BLOCK_N - 1``, gathered
    through the block table. ``MASK``: "none" (all of them exist and are visible), "end" (only
    keys ``< kv_end``), "causal" (keys ``< kv_end`` are read; a row sees keys ``<= q_pos``),
    "window" (keys ``kv_start … kv_end - 1`` are read; a row sees keys ``q_pos - window + 1 … q_pos``)."""
    k, v, tok, tok_ok = _load_kv_tile(
        tile_start, kv_end, kv_head, block_table_row, k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s,
        cache_stride_h, HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, MASK, kv_start,
    )
    return _attend_kv(q, k, v, acc, m_i, l_i, q_pos, tok, tok_ok, scale_log2, MASK, DOT_DTYPE, DOT_PRECISION, window)


@triton.jit
def _attend_new_tile(
    q, acc, m_i, l_i, rows, tile_start, key_desc, value_desc, first_token, head_col, scale_log2,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over the new chunk's keys ``tile_start … tile_start + BLOCK_N - 1``
    (chunk coordinates), read by TMA from the step's key/value rows; with ``CAUSAL`` row ``i``
    of the chunk sees keys ``<= i``, which also hides the rows past the chunk (the next
    sequence's, or TMA's zero fill past the last token)."""
    k = key_desc.load([first_token + tile_start, head_col])
    v = value_desc.load([first_token + tile_start, head_col])
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    if CAUSAL:
        s = tl.where(tile_start + tl.arange(0, BLOCK_N)[None, :] <= rows[:, None], s, float("-inf"))
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, scale_log2, False)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _key_scaled(scale_log2, k_scale_ptr, kv_head):
    """The scores' scale for one kv head: an fp8 cache's K scale folds into it (one multiply)."""
    if k_scale_ptr is not None:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
    return scale_log2


@triton.jit
def _value_scaled(out, v_scale_ptr, kv_head):
    """An output of one kv head's fp8 values, scaled once instead of each value."""
    if v_scale_ptr is not None:
        out = out * tl.load(v_scale_ptr + kv_head)
    return out


@triton.jit
def _window_start(seq_len, window):
    """The first key a context of ``seq_len``'s last position sees (window 0: none)."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@triton.jit
def _split_tokens(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split: an even share of the context in whole tiles, at least one tile."""
    share = (seq_len + num_splits - 1) // num_splits
    return tl.maximum((share + BLOCK_N - 1) // BLOCK_N, 1) * BLOCK_N


# The block table's width follows the batch: never specialize on it (nor on the split count or
# the window).
@triton.jit(do_not_specialize=["num_splits", "block_tables_stride", "window"])
def _decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr, scale_log2, num_splits, window,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h,
    cache_stride_b, cache_stride_s, cache_stride_h, block_tables_stride,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (seq, kv head, split): all GROUP query heads of one kv head over one key range,
    so each K/V tile is read once per group. With SPLIT it writes a partial (normalized output
    and log2-sum-exp) for the reduce kernel, else the final output. A window (> 0) drops the
    keys before the last ``window`` positions: the splits share the rest."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = _window_start(seq_len, window)
    tokens_per_split = _split_tokens(seq_len - first_key, num_splits, BLOCK_N)
    start = first_key + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    if q_len != 1:  # longer queries are the prefill kernel's
        return
    if SPLIT:
        if start >= seq_len:  # no keys; the reduce skips this split
            return

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    head = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q_row = q_ptr + q_start.to(tl.int64) * q_stride_t
    q = tl.load(q_row + head[:, None] * q_stride_h + d[None, :], mask=q_mask, other=0.0).to(DOT_DTYPE)
    # The one query sits at the last position: the causal test reduces to key < end.
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (end - 1)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    scale_log2 = _key_scaled(scale_log2, k_scale_ptr, kv_head)
    for tile_start in range(start, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, q_pos, tile_start, end, kv_head, block_table_row,
            k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s, cache_stride_h, scale_log2,
            HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, "causal", DOT_DTYPE, DOT_PRECISION,
        )
    # A context of length 0 (a padding row) leaves l_i = 0: its output is zeros, not NaN.
    out = _value_scaled(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], v_scale_ptr, kv_head)
    if SPLIT:
        partial = (seq * tl.num_programs(1) * GROUP + head) * num_splits + split
        tl.store(partial_lse_ptr + partial, m_i + tl.log2(l_i), mask=g < GROUP)
        tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
    else:
        out_row = out_ptr + q_start.to(tl.int64) * out_stride_t
        tl.store(
            out_row + head[:, None] * out_stride_h + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


@triton.jit(do_not_specialize=["num_splits", "window"])
def _decode_reduce_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr, seq_lens_ptr, query_start_loc_ptr, num_splits, window,
    out_stride_t, out_stride_h,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (seq, head): merge the partials of the splits that had keys. SPLITS_PAD is the
    largest split count, so no split count compiles a new variant."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_keys = seq_len - _window_start(seq_len, window)
    tokens_per_split = _split_tokens(num_keys, num_splits, BLOCK_N)
    num_active = (num_keys + tokens_per_split - 1) // tokens_per_split
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    active = s < num_active
    partial = (seq * tl.num_programs(1) + head) * num_splits + s
    lse = tl.load(partial_lse_ptr + partial, mask=active, other=float("-inf"))
    lse_max = tl.where(num_active > 0, tl.max(lse, 0), 0.0)
    weights = tl.exp2(lse - lse_max)
    mask = active[:, None] & (d < HEAD_DIM)[None, :]
    partial_out = tl.load(partial_out_ptr + partial[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(partial_out * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    out_row = out_ptr + q_start.to(tl.int64) * out_stride_t + head * out_stride_h
    tl.store(out_row + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["block_tables_stride", "window"])
def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, key_desc, value_desc, scale_log2, q_stride_t, q_stride_h, out_stride_t, out_stride_h,
    cache_stride_b, cache_stride_s, cache_stride_h, block_tables_stride, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_Q_LEN: tl.constexpr, SLIDING: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (head, query tile, seq): BLOCK_M new tokens of one sequence against its paged
    prefix and, causally, its new chunk: read by TMA from ``key_desc``/``value_desc`` (the
    step's new K/V rows, when given), else through the block table like the prefix. Sequences
    with fewer than MIN_Q_LEN new tokens exit (the decode kernel takes single-token ones in
    mixed batches). SLIDING: each row sees only the last ``window`` positions up to its own; the
    tile reads, through the block table, the keys from its first row's window start on."""
    # Heads of one kv head run side by side, so their K/V tiles are read from L2.
    head = tl.program_id(0)
    # Later query tiles see more keys: start them first.
    q_tile = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if (q_len < MIN_Q_LEN) | (q_tile * BLOCK_M >= q_len):
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM_PAD)
    q_mask = (rows < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * q_stride_t + head * q_stride_h + d[None, :], mask=q_mask, other=0.0)
    q = q.to(DOT_DTYPE)
    q_pos = prefix_len + rows
    kv_head = head // GROUP
    scale_log2 = _key_scaled(scale_log2, k_scale_ptr, kv_head)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride

    if SLIDING:
        kv_start = tl.maximum(prefix_len + q_tile * BLOCK_M - window + 1, 0)
        causal_end = tl.minimum(seq_len, prefix_len + (q_tile + 1) * BLOCK_M)
        for tile_start in range(kv_start // BLOCK_N * BLOCK_N, causal_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, q_pos, tile_start, causal_end, kv_head, block_table_row,
                k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s, cache_stride_h, scale_log2,
                HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, "window", DOT_DTYPE, DOT_PRECISION, kv_start, window,
            )
        out = _value_scaled(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], v_scale_ptr, kv_head)
        out_ptrs = out_ptr + tokens[:, None] * out_stride_t + head * out_stride_h + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
        return

    # Keys that exist and that every row of the tile sees, in whole tiles: no mask. Without the
    # new rows these run on into the chunk, up to the tile's first query position.
    if key_desc is not None:
        paged_end = prefix_len // BLOCK_N * BLOCK_N
    else:
        paged_end = (prefix_len + q_tile * BLOCK_M) // BLOCK_N * BLOCK_N
    for tile_start in range(0, paged_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, q_pos, tile_start, seq_len, kv_head, block_table_row,
            k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s, cache_stride_h, scale_log2,
            HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, "none", DOT_DTYPE, DOT_PRECISION,
        )
    if key_desc is not None:
        if paged_end < prefix_len:  # the prefix's last, partial tile
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, q_pos, paged_end, prefix_len, kv_head, block_table_row,
                k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s, cache_stride_h, scale_log2,
                HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, "end", DOT_DTYPE, DOT_PRECISION,
            )
        head_col = kv_head * HEAD_DIM
        unmasked_end = q_tile * BLOCK_M // BLOCK_N * BLOCK_N
        for tile_start in range(0, unmasked_end, BLOCK_N):
            acc, m_i, l_i = _attend_new_tile(
                q, acc, m_i, l_i, rows, tile_start, key_desc, value_desc, q_start, head_col, scale_log2,
                BLOCK_N, False, DOT_DTYPE, DOT_PRECISION,
            )
        for tile_start in range(unmasked_end, tl.minimum(q_len, (q_tile + 1) * BLOCK_M), BLOCK_N):
            acc, m_i, l_i = _attend_new_tile(
                q, acc, m_i, l_i, rows, tile_start, key_desc, value_desc, q_start, head_col, scale_log2,
                BLOCK_N, True, DOT_DTYPE, DOT_PRECISION,
            )
    else:
        causal_end = tl.minimum(seq_len, prefix_len + (q_tile + 1) * BLOCK_M)
        for tile_start in range(paged_end, causal_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, q_pos, tile_start, causal_end, kv_head, block_table_row,
                k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s, cache_stride_h, scale_log2,
                HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, "causal", DOT_DTYPE, DOT_PRECISION,
            )
    out = _value_scaled(acc / l_i[:, None], v_scale_ptr, kv_head)
    out_ptrs = out_ptr + tokens[:, None] * out_stride_t + head * out_stride_h + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


class AttentionTiles(NamedTuple):
    block_m: int  # query rows per prefill program (unused by decode)
    block_n: int  # keys per step
    num_warps: int
    num_stages: int
    max_registers: int | None = None  # per thread (ptxas's maxnreg): fewer spill, more programs fit an SM


def attention_tiles(kind: str, head_dim_pad: int, dtype: torch.dtype) -> AttentionTiles:
    """Tile shapes for ``kind`` ("decode", "fused_decode", "fused_decode_one" — a single
    sequence — or "prefill"), sized to stay clear of register spills on sm_90. The interpreter
    gets small tiles so that tiny test shapes still cross tile and page boundaries."""
    if _INTERPRETED:
        return AttentionTiles(block_m=32, block_n=32, num_warps=4, num_stages=1)
    if kind in ("decode", "fused_decode", "fused_decode_one"):
        if dtype == torch.float32 or head_dim_pad > 128:
            return AttentionTiles(block_m=1, block_n=32, num_warps=4, num_stages=2)
        if kind == "decode":  # the split-K kernel runs long contexts: three stages
            return AttentionTiles(block_m=1, block_n=64, num_warps=4, num_stages=3)
        # The fused kernel runs at short contexts (a few tiles a split): two stages. At batch 1,
        # fastest on the H200 in a decoder layer at 128-2K tokens (kernels_bench.py --only
        # decode_layer --sweep): 128-key steps for 64-wide heads (SmolLM2) but 64-key ones, twice
        # the splits, for 128-wide heads (Llama 3 8B: 6.6 us less a layer at 640 tokens).
        if kind == "fused_decode_one":
            return AttentionTiles(block_m=1, block_n=128 if head_dim_pad <= 64 else 64, num_warps=4, num_stages=2)
        return AttentionTiles(block_m=1, block_n=64, num_warps=4, num_stages=2)
    if dtype == torch.float32:  # 3xTF32 dots keep three operand splits in registers
        return AttentionTiles(block_m=32, block_n=32, num_warps=4, num_stages=2)
    if head_dim_pad > 128:
        return AttentionTiles(block_m=64, block_n=64, num_warps=8, num_stages=2)
    if head_dim_pad <= 64:
        return AttentionTiles(block_m=128, block_n=64, num_warps=4, num_stages=3)
    # Fastest on the H200 of BLOCK_M 64/128 x BLOCK_N 64/128 x 2-5 stages, through the block
    # table and by TMA; three stages of 128-key K/V tiles fill 225 of sm_90's 227 KB of shared memory.
    return AttentionTiles(block_m=128, block_n=128, num_warps=8, num_stages=3)


def fused_decode_kind(num_seqs: int) -> str:
    """The ``attention_tiles`` kind of a decode_attention launch over ``num_seqs`` sequences."""
    return "fused_decode_one" if num_seqs == 1 else "fused_decode"


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, num_sms: int) -> int:
    """Splits of each decode context: enough programs to fill the GPU, at least two tiles each.

    Depends on shapes only (``max_context`` is the block table's capacity), so a CUDA graph
    captured once stays correct and well split for any lengths it replays with."""
    wanted = triton.cdiv(_DECODE_PROGRAMS_PER_SM * num_sms, num_seqs * num_kv_heads)
    by_length = triton.cdiv(max_context, 2 * block_n)
    return max(1, min(wanted, by_length, _MAX_DECODE_SPLITS))


def _check_seq_lens_cpu(seq_lens_cpu: list[int] | None, num_seqs: int, capacity: int) -> None:
    if seq_lens_cpu is None:
        return
    _check(
        len(seq_lens_cpu) == num_seqs,
        lambda: f"seq_lens_cpu has {len(seq_lens_cpu)} entries for {num_seqs} sequences",
    )
    _check(
        num_seqs == 0 or max(seq_lens_cpu) <= capacity,
        lambda: f"a sequence length of {max(seq_lens_cpu, default=0)} exceeds the block table's "
        f"capacity of {capacity} tokens",
    )


def _dot_args(dtype: torch.dtype) -> dict:
    """The attention kernels' DOT_DTYPE and DOT_PRECISION for activations of ``dtype``."""
    return dict(
        DOT_DTYPE=tl.float32 if _INTERPRETED else _TL_DTYPES[dtype],
        # fp32 inputs keep fp32 accuracy on the tensor cores (plain tf32 would round them).
        DOT_PRECISION="tf32x3" if dtype == torch.float32 else "tf32",
    )


def _new_rows_descriptors(
    key: torch.Tensor | None, value: torch.Tensor | None, block_n: int, head_dim_pad: int
) -> tuple[TensorDescriptor | None, TensorDescriptor | None]:
    """TMA descriptors of ``key`` and ``value`` as 2-d ``[num_tokens, num_kv_heads * head_dim]``
    row tables with ``[block_n, head_dim]`` boxes, or ``(None, None)`` (the kernel then reads the
    cache) where TMA cannot address them: head_dim not a power of two (the box would take in
    the next head), heads not packed in a row, or rows not 16-byte aligned."""
    if key is None or value is None:
        return None, None
    descriptors = []
    for t in (key, value):
        num_tokens, num_kv_heads, head_dim = t.shape
        if (
            head_dim != head_dim_pad
            or (num_kv_heads > 1 and t.stride(1) != head_dim)
            or t.data_ptr() % 16
            or t.stride(0) * t.element_size() % 16
        ):
            return None, None
        descriptors.append(TensorDescriptor(
            t, shape=[num_tokens, num_kv_heads * head_dim], strides=[t.stride(0), 1],
            block_shape=[block_n, head_dim],
        ))
    return descriptors[0], descriptors[1]


def _dot_pad(n: int) -> int:
    """``n`` rounded up to a power of two, at least 16: tl.dot's smallest operand side."""
    return max(16, triton.next_power_of_2(n))


def _cache_strides(k_cache: torch.Tensor, block_tables: torch.Tensor) -> tuple[int, int, int, int]:
    """The attention kernels' cache_stride_b/s/h and block_tables_stride arguments."""
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0)


def _split_partials(
    num_seqs: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K scratch: each split's normalized output and log2-sum-exp, per (seq, head)."""
    partial_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=device)
    return partial_out, partial_lse


def _check_window(sliding_window: int | None) -> None:
    _check(sliding_window is None or sliding_window > 0,
           lambda: f"sliding_window must be positive, got {sliding_window}")


def _check_attention_heads(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """q's ``[tokens, heads, head_dim]`` against the cache's heads: the same head_dim, and a
    whole group of query heads per kv head."""
    _, num_heads, head_dim = q.shape
    num_kv_heads, cache_head_dim = k_cache.shape[2:]
    _check(head_dim == cache_head_dim, lambda: f"q has head_dim {head_dim} but the KV cache {cache_head_dim}")
    _check(
        num_heads % num_kv_heads == 0,
        lambda: f"q's {num_heads} heads must be a multiple of the cache's {num_kv_heads} kv heads",
    )


def _check_paged_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
    key: torch.Tensor | None, value: torch.Tensor | None,
) -> None:
    _check_tensor("q", q, 3, _FLOAT_DTYPES)
    _check_kv_cache(k_cache, v_cache)
    _check_tensor("block_tables", block_tables, 2, _INDEX_DTYPES)
    _check_tensor("seq_lens", seq_lens, 1, _INDEX_DTYPES)
    _check_tensor("query_start_loc", query_start_loc, 1, _INDEX_DTYPES)
    num_tokens, _, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    _check_attention_heads(q, k_cache)
    _check(
        block_tables.shape[0] == num_seqs,
        lambda: f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences",
    )
    _check(
        query_start_loc.shape[0] == num_seqs + 1,
        lambda: f"query_start_loc must have {num_seqs + 1} entries, got {query_start_loc.shape[0]}",
    )
    _check_last_dim_contiguous("q", q)
    _check_last_dim_contiguous("block_tables", block_tables)
    _check(seq_lens.is_contiguous(), "seq_lens must be contiguous")
    _check(query_start_loc.is_contiguous(), "query_start_loc must be contiguous")
    _check(scale > 0, lambda: f"scale must be positive, got {scale}")
    _check((key is None) == (value is None), "key and value must be given together")
    new_rows = {}
    if key is not None:
        kv_shape = (num_tokens, num_kv_heads, head_dim)
        for name, t in (("key", key), ("value", value)):
            _check_tensor(name, t, 3, (k_cache.dtype,))
            if tuple(t.shape) != kv_shape:
                raise ValueError(f"{name} must have shape {kv_shape}, got {tuple(t.shape)}")
            _check_last_dim_contiguous(name, t)
        new_rows = dict(key=key, value=value)
    _check_devices(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
        query_start_loc=query_start_loc, **new_rows,
    )


def _launch_split_k_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, out: torch.Tensor, window: int,
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> None:
    """The decode kernel over the single-token sequences and, where it splits their keys, the
    reduce kernel that merges the splits."""
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    head_dim_pad = _dot_pad(head_dim)
    capacity = block_tables.shape[1] * block_size
    tiles = attention_tiles("decode", head_dim_pad, q.dtype)
    num_splits = decode_num_splits(num_seqs, num_kv_heads, capacity, tiles.block_n, _num_sms(q.device))
    split = num_splits > 1
    partial_out = partial_lse = out  # unused without split-K
    if split:
        partial_out, partial_lse = _split_partials(num_seqs, num_heads, num_splits, head_dim, q.device)
    group = num_heads // num_kv_heads
    _decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale,
        out, partial_out, partial_lse, scale * _LOG2E, num_splits, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *_cache_strides(k_cache, block_tables),
        GROUP=group, GROUP_PAD=_dot_pad(group),
        HEAD_DIM=head_dim, DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_N=tiles.block_n, SPLIT=split, **_dot_args(q.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, maxnreg=tiles.max_registers,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            partial_out, partial_lse, out, seq_lens, query_start_loc, num_splits, window,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, DIM_PAD=head_dim_pad,
            SPLITS_PAD=_MAX_DECODE_SPLITS, BLOCK_N=tiles.block_n,
            num_warps=4,
        )


def _launch_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, out: torch.Tensor, window: int,
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    key: torch.Tensor | None, value: torch.Tensor | None, max_q_len: int, min_q_len: int,
) -> None:
    """The prefill kernel over the sequences of at least ``min_q_len`` new tokens."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    head_dim_pad = _dot_pad(head_dim)
    tiles = attention_tiles("prefill", head_dim_pad, q.dtype)
    # A window tile reads every key through the block table (see _prefill_attention_kernel).
    key_desc, value_desc = (None, None) if window else _new_rows_descriptors(key, value, tiles.block_n, head_dim_pad)
    _prefill_attention_kernel[(num_heads, triton.cdiv(max_q_len, tiles.block_m), seq_lens.shape[0])](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale, out, key_desc, value_desc,
        scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_cache_strides(k_cache, block_tables), window,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, MIN_Q_LEN=min_q_len, SLIDING=window > 0,
        **_dot_args(q.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, maxnreg=tiles.max_registers,
    )


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
    seq_lens_cpu: list[int] | None = None, query_start_loc_cpu: list[int] | None = None,
    key: torch.Tensor | None = None, value: torch.Tensor | None = None, sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Single-token sequences go to the split-K decode kernel, longer ones to the prefill
    kernel (both launch for a mixed batch). With ``key``/``value`` the prefill kernel reads each
    chunk's own keys from them by TMA (no block-table lookups) where their layout allows it
    (see ``_new_rows_descriptors``), else from the cache; an fp8 cache's chunks are always read
    from the cache, quantized as a later step reads them. The window is a runtime argument: no
    window size compiles a new variant (only window or none does)."""
    k_scale, v_scale = _kv_scales(k_cache, k_scale, v_scale)
    if k_scale is not None:
        key = value = None
    _check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, key, value)
    _check_window(sliding_window)
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]
    _check_seq_lens_cpu(seq_lens_cpu, num_seqs, block_tables.shape[1] * k_cache.shape[1])
    if query_start_loc_cpu is not None:
        _check(
            len(query_start_loc_cpu) == num_seqs + 1,
            lambda: f"query_start_loc_cpu has {len(query_start_loc_cpu)} entries, expected {num_seqs + 1}",
        )
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:
        _check_tensor("out", out, 3, (q.dtype,))
        _check(out.shape == q.shape, lambda: f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
        _check_last_dim_contiguous("out", out)
        _check_devices(q=q, out=out)
    if num_tokens == 0 or num_seqs == 0:
        return out
    starts = query_start_loc_cpu if query_start_loc_cpu is not None else query_start_loc.tolist()
    _check(starts[-1] <= num_tokens, lambda: f"query_start_loc ends at {starts[-1]} past q's {num_tokens} tokens")
    q_lens = [end - start for start, end in zip(starts[:-1], starts[1:])]
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, sliding_window or 0,
            k_scale, v_scale)
    has_decode = 1 in q_lens
    if has_decode:
        _launch_split_k_decode(*args)
    if max(q_lens) > 1:
        _launch_prefill(*args, key, value, max(q_lens), min_q_len=2 if has_decode else 1)
    return out
