"""Triton kernels with the signatures of ``kernels/reference.py`` (layouts documented there).

Each op is a host wrapper that checks shapes, dtypes, strides and devices, then launches one or
two kernels. Lengths (tokens, sequence lengths, query lengths) are runtime values: only head
counts, head dims, the KV block size, tile shapes and power-of-two buckets are compile-time
constants, so a new prompt length never triggers a recompilation.

Under ``TRITON_INTERPRET=1`` (set before triton is first imported) the kernels run on CPU
tensors; the interpreter computes ``tl.dot`` on bf16 storage incorrectly, so there every dot is
done in fp32.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.reference import rope_cos_sin_cache

__all__ = [
    "store_kv",
    "paged_attention",
    "decode_attention",
    "rms_norm",
    "rope_cos_sin_cache",
    "rotary_embedding",
    "silu_and_mul",
    "linear",
    "norm_linear",
    "argmax",
]

# Decided once, exactly as triton.jit decides between compiled and interpreted kernels.
_INTERPRETED = bool(triton.knobs.runtime.interpret)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_LOG2E = math.log2(math.e)

# Split-K decode: aim for this many programs per multiprocessor, at most this many splits
# (a power of two: the reduce kernel's tile).
_DECODE_PROGRAMS_PER_SM = 4
_MAX_DECODE_SPLITS = 64
# decode_attention's last program merges the partials one by one: its keys go to at most this
# many splits (fastest on the H200 at 512 and 2K tokens), more only past this many keys a split.
_FUSED_DECODE_MERGED_SPLITS = 8
_FUSED_DECODE_LONG_SPLIT_TOKENS = 1024
# The interpreter has no multiprocessors; a small count still exercises split-K on tiny shapes.
_INTERPRETER_NUM_SMS = 4
_MAX_HEAD_DIM = 256
_MAX_ROW_WIDTH = 65536


# --------------------------------------------------------------------------------------------
# Host-side checks


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_tensor(name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    _check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    _check(t.dtype in dtypes, f"{name} must have dtype in {dtypes}, got {t.dtype}")


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    _check(
        t.shape[-1] <= 1 or t.stride(-1) == 1,
        f"{name} must be contiguous in its last dim, got strides {t.stride()}",
    )


def _check_devices(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    first_name, device = next(iter(devices.items()))
    for name, other in devices.items():
        _check(other == device, f"{name} is on {other} but {first_name} is on {device}")
    _check(
        device.type == "cuda" or _INTERPRETED,
        f"Triton kernels need CUDA tensors, got {first_name} on {device} "
        "(set TRITON_INTERPRET=1 before importing triton to run them on the CPU)",
    )


def _as_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t[..., n]`` viewed as ``[a, b, n]`` without a copy: row ``(i, j)`` starts at
    ``i * stride(0) + j * stride(1)``, so strided 3-d views (q from a fused qkv) need no copy."""
    _check(t.dim() >= 1, f"{name} must have at least one dim")
    _check_last_dim_contiguous(name, t)
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    try:
        return t.view(-1, *t.shape[-2:])
    except RuntimeError as exc:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as rows"
        ) from exc


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


# --------------------------------------------------------------------------------------------
# store_kv


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    cache_stride_b, cache_stride_s, cache_stride_h,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding row
        return
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = (slot // BLOCK_SIZE) * cache_stride_b + (slot % BLOCK_SIZE) * cache_stride_s + h * cache_stride_h + d
    k = tl.load(key_ptr + token * key_stride_t + h * key_stride_h + d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + token * value_stride_t + h * value_stride_h + d, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _check_tensor("k_cache", k_cache, 4, _FLOAT_DTYPES)
    _check_tensor("v_cache", v_cache, 4, _FLOAT_DTYPES)
    _check(
        k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(),
        f"k_cache and v_cache must share shape and strides, got {tuple(k_cache.shape)} "
        f"{k_cache.stride()} and {tuple(v_cache.shape)} {v_cache.stride()}",
    )
    _check(k_cache.dtype == v_cache.dtype, f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    _check_last_dim_contiguous("k_cache", k_cache)
    _check(k_cache.shape[-1] <= _MAX_HEAD_DIM, f"head_dim must be <= {_MAX_HEAD_DIM}, got {k_cache.shape[-1]}")


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; negative: padding, not stored
) -> None:
    """Write each token's K/V into its paged slot (in place). Slots must lie inside the cache."""
    _check_kv_cache(k_cache, v_cache)
    _check_tensor("key", key, 3, _FLOAT_DTYPES)
    _check_tensor("value", value, 3, _FLOAT_DTYPES)
    _check_tensor("slot_mapping", slot_mapping, 1, _INDEX_DTYPES)
    num_tokens = key.shape[0]
    kv_shape = (num_tokens, *k_cache.shape[2:])
    _check(tuple(key.shape) == kv_shape, f"key must have shape {kv_shape}, got {tuple(key.shape)}")
    _check(tuple(value.shape) == kv_shape, f"value must have shape {kv_shape}, got {tuple(value.shape)}")
    _check(
        tuple(slot_mapping.shape) == (num_tokens,),
        f"slot_mapping must have shape ({num_tokens},), got {tuple(slot_mapping.shape)}",
    )
    _check_last_dim_contiguous("key", key)
    _check_last_dim_contiguous("value", value)
    _check(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    _check_devices(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        num_warps=4,
    )


# --------------------------------------------------------------------------------------------
# paged_attention: a decode kernel (one query token, split-K + reduce) and a prefill/extend
# kernel (a tile of query rows, causal inside the new chunk), sharing the paged tile step.


@triton.jit
def _online_softmax(s, m_i, l_i, scale_log2):
    """Online-softmax update for raw scores ``s`` (hidden keys at -inf): the probabilities
    (base 2, scaled by the new row maxima), the factor that rescales the old accumulator, and
    the new maxima and sums. The scale is folded into one FMA per score (it is positive)."""
    # Every row sees at least one key of its first tile, so m_new is finite from then on.
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, q_pos, tile_start, kv_end, kv_head, block_table_row,
    k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s, cache_stride_h, scale_log2,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys ``tile_start … tile_start + BLOCK_N - 1``, gathered
    through the block table. ``MASK``: "none" (all of them exist and are visible), "end" (only
    keys ``< kv_end``), "causal" (keys ``< kv_end`` are read; a row sees keys ``<= q_pos``)."""
    tok = tile_start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, DIM_PAD)
    tok_ok = tok < kv_end
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
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    if MASK == "end":
        s = tl.where(tok_ok[None, :], s, float("-inf"))
    elif MASK == "causal":
        s = tl.where(tok[None, :] <= q_pos[:, None], s, float("-inf"))
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, scale_log2)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return acc, m_i, l_i


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
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, scale_log2)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _split_tokens(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split: an even share of the context in whole tiles, at least one tile."""
    share = (seq_len + num_splits - 1) // num_splits
    return tl.maximum((share + BLOCK_N - 1) // BLOCK_N, 1) * BLOCK_N


# The block table's width follows the batch: never specialize on it (nor on the split count).
@triton.jit(do_not_specialize=["num_splits", "block_tables_stride"])
def _decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr, scale_log2, num_splits,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h,
    cache_stride_b, cache_stride_s, cache_stride_h, block_tables_stride,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (seq, kv head, split): all GROUP query heads of one kv head over one key range,
    so each K/V tile is read once per group. With SPLIT it writes a partial (normalized output
    and log2-sum-exp) for the reduce kernel, else the final output."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    tokens_per_split = _split_tokens(seq_len, num_splits, BLOCK_N)
    start = split * tokens_per_split
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
    for tile_start in range(start, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, q_pos, tile_start, end, kv_head, block_table_row,
            k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s, cache_stride_h, scale_log2,
            HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, "causal", DOT_DTYPE, DOT_PRECISION,
        )
    # A context of length 0 (a padding row) leaves l_i = 0: its output is zeros, not NaN.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
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


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr, seq_lens_ptr, query_start_loc_ptr, num_splits,
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
    tokens_per_split = _split_tokens(seq_len, num_splits, BLOCK_N)
    num_active = (seq_len + tokens_per_split - 1) // tokens_per_split
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


@triton.jit(do_not_specialize=["block_tables_stride"])
def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    key_desc, value_desc, scale_log2, q_stride_t, q_stride_h, out_stride_t, out_stride_h,
    cache_stride_b, cache_stride_s, cache_stride_h, block_tables_stride,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_Q_LEN: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (head, query tile, seq): BLOCK_M new tokens of one sequence against its paged
    prefix and, causally, its new chunk: read by TMA from ``key_desc``/``value_desc`` (the
    step's new K/V rows, when given), else through the block table like the prefix. Sequences
    with fewer than MIN_Q_LEN new tokens exit (the decode kernel takes single-token ones in
    mixed batches)."""
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
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride

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
    out = acc / l_i[:, None]
    out_ptrs = out_ptr + tokens[:, None] * out_stride_t + head * out_stride_h + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


class AttentionTiles(NamedTuple):
    block_m: int  # query rows per prefill program (unused by decode)
    block_n: int  # keys per step
    num_warps: int
    num_stages: int


def attention_tiles(kind: str, head_dim_pad: int, dtype: torch.dtype) -> AttentionTiles:
    """Tile shapes for ``kind`` ("decode", "fused_decode", "fused_decode_one" — a single
    sequence — or "prefill"), sized to stay clear of register spills on sm_90. The interpreter
    gets small tiles so that tiny test shapes still cross tile and page boundaries."""
    if _INTERPRETED:
        return AttentionTiles(block_m=32, block_n=32, num_warps=4, num_stages=1)
    if kind in ("decode", "fused_decode", "fused_decode_one"):
        if dtype == torch.float32 or head_dim_pad > 128:
            return AttentionTiles(block_m=1, block_n=32, num_warps=4, num_stages=2)
        if kind == "fused_decode_one":
            # A single sequence has few programs: longer steps (and for 64-wide heads, more warps)
            # were up to 1.2x faster on the H200 at 512-2K tokens (kernels_bench.py --sweep).
            return AttentionTiles(block_m=1, block_n=128, num_warps=8 if head_dim_pad <= 64 else 4, num_stages=2)
        # The fused kernel holds more in registers and runs at short contexts (a few tiles a
        # split): two stages beat three there on the H200 (kernels_bench.py --sweep), by up to
        # 1.4x at batch 64; the split-K kernel keeps three for long contexts.
        return AttentionTiles(block_m=1, block_n=64, num_warps=4, num_stages=2 if kind == "fused_decode" else 3)
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
        f"seq_lens_cpu has {len(seq_lens_cpu)} entries for {num_seqs} sequences",
    )
    _check(
        num_seqs == 0 or max(seq_lens_cpu) <= capacity,
        f"a sequence length of {max(seq_lens_cpu, default=0)} exceeds the block table's "
        f"capacity of {capacity} tokens",
    )


def _dot_args(dtype: torch.dtype) -> dict:
    """The attention kernels' DOT_DTYPE and DOT_PRECISION for activations of ``dtype``."""
    return dict(
        DOT_DTYPE=tl.float32 if _INTERPRETED else _TL_DTYPES[dtype],
        # fp32 inputs keep fp32 accuracy on the tensor cores (plain tf32 would round them).
        DOT_PRECISION="tf32x3" if dtype == torch.float32 else "tf32",
    )


def _pdl_args(device: torch.device) -> dict:
    """USE_PDL (and the launch option) of a kernel that waits on its predecessor with
    ``gdc_wait``: programmatic dependent launch, on sm_90 and newer, lets it start (and load what
    does not depend on the previous kernel) while that one finishes. Such a kernel lets the next
    one launch once its own loads are issued: launched earlier (right after the wait), the next
    kernel's waiting programs slowed a SmolLM2 decode layer from 13.6 to 14.4 us on the H200."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return dict(USE_PDL=True, launch_pdl=True)
    return dict(USE_PDL=False)


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


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    seq_lens_cpu: list[int] | None = None,
    query_start_loc_cpu: list[int] | None = None,
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim], as stored by store_kv
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context, as the
    reference. Single-token sequences go to the split-K decode kernel, longer ones to the
    prefill kernel (both launch for a mixed batch). Without ``query_start_loc_cpu`` the query
    lengths are read back from the device (a sync: pass it under CUDA graph capture).
    A sequence with ``seq_lens[i] == 0`` and one query token (a padding row) gets zeros.

    ``key``/``value``, optional, are this step's new K/V rows, already written to the cache:
    the prefill kernel then reads each chunk's own keys from them by TMA (no block-table
    lookups) where their layout allows it (see ``_new_rows_descriptors``), else from the cache.
    """
    _check_tensor("q", q, 3, _FLOAT_DTYPES)
    _check_kv_cache(k_cache, v_cache)
    _check_tensor("block_tables", block_tables, 2, _INDEX_DTYPES)
    _check_tensor("seq_lens", seq_lens, 1, _INDEX_DTYPES)
    _check_tensor("query_start_loc", query_start_loc, 1, _INDEX_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    _check(head_dim == cache_head_dim, f"q has head_dim {head_dim} but the KV cache {cache_head_dim}")
    _check(
        num_heads % num_kv_heads == 0,
        f"q's {num_heads} heads must be a multiple of the cache's {num_kv_heads} kv heads",
    )
    _check(
        block_tables.shape[0] == num_seqs,
        f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences",
    )
    _check(
        query_start_loc.shape[0] == num_seqs + 1,
        f"query_start_loc must have {num_seqs + 1} entries, got {query_start_loc.shape[0]}",
    )
    _check_last_dim_contiguous("q", q)
    _check_last_dim_contiguous("block_tables", block_tables)
    _check(seq_lens.is_contiguous(), "seq_lens must be contiguous")
    _check(query_start_loc.is_contiguous(), "query_start_loc must be contiguous")
    _check(scale > 0, f"scale must be positive, got {scale}")
    _check((key is None) == (value is None), "key and value must be given together")
    new_rows = {}
    if key is not None:
        kv_shape = (num_tokens, num_kv_heads, head_dim)
        for name, t in (("key", key), ("value", value)):
            _check_tensor(name, t, 3, (k_cache.dtype,))
            _check(tuple(t.shape) == kv_shape, f"{name} must have shape {kv_shape}, got {tuple(t.shape)}")
            _check_last_dim_contiguous(name, t)
        new_rows = dict(key=key, value=value)
    _check_devices(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
        query_start_loc=query_start_loc, **new_rows,
    )
    capacity = block_tables.shape[1] * block_size
    _check_seq_lens_cpu(seq_lens_cpu, num_seqs, capacity)
    if query_start_loc_cpu is not None:
        _check(
            len(query_start_loc_cpu) == num_seqs + 1,
            f"query_start_loc_cpu has {len(query_start_loc_cpu)} entries, expected {num_seqs + 1}",
        )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    starts = query_start_loc_cpu if query_start_loc_cpu is not None else query_start_loc.tolist()
    _check(starts[-1] <= num_tokens, f"query_start_loc ends at {starts[-1]} past q's {num_tokens} tokens")
    q_lens = [end - start for start, end in zip(starts[:-1], starts[1:])]
    max_q_len = max(q_lens)
    has_decode = 1 in q_lens

    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    cache_args = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    dot = _dot_args(q.dtype)
    scale_log2 = scale * _LOG2E
    if has_decode:
        tiles = attention_tiles("decode", head_dim_pad, q.dtype)
        num_splits = decode_num_splits(num_seqs, num_kv_heads, capacity, tiles.block_n, _num_sms(q.device))
        split = num_splits > 1
        partial_out = partial_lse = out  # unused without split-K
        if split:
            partial_out = torch.empty(
                (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
            )
            partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        _decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
            out, partial_out, partial_lse, scale_log2, num_splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_args,
            GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim, DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
            BLOCK_N=tiles.block_n, SPLIT=split, **dot,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
        if split:
            _decode_reduce_kernel[(num_seqs, num_heads)](
                partial_out, partial_lse, out, seq_lens, query_start_loc, num_splits,
                out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, DIM_PAD=head_dim_pad,
                SPLITS_PAD=_MAX_DECODE_SPLITS, BLOCK_N=tiles.block_n,
                num_warps=4,
            )
    if max_q_len > 1:
        tiles = attention_tiles("prefill", head_dim_pad, q.dtype)
        key_desc, value_desc = _new_rows_descriptors(key, value, tiles.block_n, head_dim_pad)
        _prefill_attention_kernel[(num_heads, triton.cdiv(max_q_len, tiles.block_m), num_seqs)](
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, key_desc, value_desc,
            scale_log2, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_args,
            GROUP=group, HEAD_DIM=head_dim, DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, MIN_Q_LEN=2 if has_decode else 1, **dot,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    return out


# --------------------------------------------------------------------------------------------
# decode_attention: rotary_embedding, store_kv and paged_attention's split-K decode in one launch


@triton.jit
def _load_rotated(row_ptr, d, rot_d, mask, cos, signed_sin):
    """Rotate-half RoPE in fp32 of the vectors at ``row_ptr``: column ``d`` is
    ``x[d] * cos + x[rot_d] * signed_sin`` (``rot_d`` the other half's column, the sine negated
    in the first half), the same products and sums as ``_rotate_heads``."""
    x = tl.load(row_ptr + d, mask=mask, other=0.0).to(tl.float32)
    x_rot = tl.load(row_ptr + rot_d, mask=mask, other=0.0).to(tl.float32)
    return x * cos + x_rot * signed_sin


@triton.jit
def _attend_new_key(q, k, v, acc, m_i, l_i, scale_log2):
    """The online-softmax step of one key held in registers (the new token's), in fp32."""
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * scale_log2
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    return acc * alpha[:, None] + p[:, None] * v.to(tl.float32)[None, :], m_new, l_i * alpha + p


# The block table's width follows the batch: never specialize on it (nor on the split count).
@triton.jit(do_not_specialize=["num_splits", "block_tables_stride"])
def _fused_decode_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    block_tables_ptr, seq_lens_ptr, out_ptr, partial_out_ptr, partial_lse_ptr, counters_ptr,
    scale_log2, num_splits,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, cos_sin_stride,
    out_stride_t, out_stride_h, cache_stride_b, cache_stride_s, cache_stride_h, block_tables_stride,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    MERGED_SPLITS: tl.constexpr, LONG_SPLIT_TOKENS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (seq, kv head, split): RoPE on the GROUP query heads of one kv head, then
    attention over one key range. Keys before the new token come from the pages; the new token
    (the context's last position) is rotated, stored and attended from registers by the split
    that holds it, so no program waits for another's store. With more than one split holding
    keys, each writes a partial (normalized output and log2-sum-exp) and counts its arrival;
    the last to arrive merges the partials and resets the counter to 0 for the next launch."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The last program merges the partials one by one: at most MERGED_SPLITS of the splits share
    # the keys, more only past LONG_SPLIT_TOKENS keys each (a long context needs the programs).
    long_splits = (seq_len + LONG_SPLIT_TOKENS - 1) // LONG_SPLIT_TOKENS
    tokens_per_split = _split_tokens(seq_len, tl.minimum(num_splits, tl.maximum(long_splits, MERGED_SPLITS)), BLOCK_N)
    # A padding row (length 0) keeps one program: it writes the zeros.
    num_active = tl.maximum((seq_len + tokens_per_split - 1) // tokens_per_split, 1)
    if split >= num_active:
        return
    holds_new = split == num_active - 1
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    paged_end = tl.maximum(tl.where(holds_new, end - 1, end), start)

    position = tl.load(positions_ptr + seq).to(tl.int64)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    rot_d = (d + HEAD_DIM // 2) % HEAD_DIM
    cos_sin_row = cos_sin_ptr + position * cos_sin_stride + d % (HEAD_DIM // 2)
    cos = tl.load(cos_sin_row, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_row + HEAD_DIM // 2, mask=d_ok, other=0.0).to(tl.float32)
    signed_sin = tl.where(d < HEAD_DIM // 2, -sin, sin)
    head = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & d_ok[None, :]
    if USE_PDL:  # what comes before is the step's inputs; q, k and v are the previous kernel's
        tl.extra.cuda.gdc_wait()
    q_heads = q_ptr + seq.to(tl.int64) * q_stride_t + head[:, None] * q_stride_h
    q = _load_rotated(q_heads, d[None, :], rot_d[None, :], q_mask, cos[None, :], signed_sin[None, :])
    # Rounded to q's dtype, as rotary_embedding returns it.
    q = q.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    full_end = start + (paged_end - start) // BLOCK_N * BLOCK_N
    for tile_start in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, g, tile_start, paged_end, kv_head, block_table_row,
            k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s, cache_stride_h, scale_log2,
            HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, "none", DOT_DTYPE, DOT_PRECISION,
        )
    if full_end < paged_end:
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, g, full_end, paged_end, kv_head, block_table_row,
            k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s, cache_stride_h, scale_log2,
            HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, "end", DOT_DTYPE, DOT_PRECISION,
        )
    if holds_new:
        k_row = k_ptr + seq.to(tl.int64) * k_stride_t + kv_head * k_stride_h
        v_row = v_ptr + seq.to(tl.int64) * v_stride_t + kv_head * v_stride_h
        # Rounded as rotary_embedding returns k, then as store_kv writes k and v.
        k_new = _load_rotated(k_row, d, rot_d, d_ok, cos, signed_sin).to(k_ptr.dtype.element_ty)
        k_new = k_new.to(k_cache_ptr.dtype.element_ty)
        v_new = tl.load(v_row + d, mask=d_ok, other=0.0).to(v_cache_ptr.dtype.element_ty)
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        if slot >= 0:
            dst = (slot // BLOCK_SIZE) * cache_stride_b + (slot % BLOCK_SIZE) * cache_stride_s
            dst += kv_head * cache_stride_h + d
            tl.store(k_cache_ptr + dst, k_new, mask=d_ok)
            tl.store(v_cache_ptr + dst, v_new, mask=d_ok)
        if seq_len > 0:
            acc, m_i, l_i = _attend_new_key(q, k_new, v_new, acc, m_i, l_i, scale_log2)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    # A context of length 0 (a padding row) leaves l_i = 0: its output is zeros, not NaN.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + seq.to(tl.int64) * out_stride_t + head[:, None] * out_stride_h + d[None, :]
    if SPLIT:
        if num_active > 1:
            partials = (seq * tl.num_programs(1) * GROUP + head) * num_splits  # split 0's partial
            tl.store(partial_lse_ptr + partials + split, m_i + tl.log2(l_i), mask=g < GROUP)
            tl.store(partial_out_ptr + (partials + split)[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
            # Every thread's partial is written before the (one-thread) release below.
            tl.debug_barrier()
            counter = counters_ptr + seq * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_active - 1:  # the last: every other partial is visible
                m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
                total = tl.zeros([GROUP_PAD], dtype=tl.float32)
                merged = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
                for s in range(0, num_active):
                    # .cg: from L2, where the other programs' partials are.
                    lse = tl.load(partial_lse_ptr + partials + s, mask=g < GROUP, other=0.0, cache_modifier=".cg")
                    part = tl.load(
                        partial_out_ptr + (partials + s)[:, None] * HEAD_DIM + d[None, :],
                        mask=q_mask, other=0.0, cache_modifier=".cg",
                    )
                    m_new = tl.maximum(m, lse)
                    alpha = tl.exp2(m - m_new)
                    weight = tl.exp2(lse - m_new)
                    merged = merged * alpha[:, None] + part * weight[:, None]
                    total = total * alpha + weight
                    m = m_new
                tl.store(out_ptrs, (merged / total[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
                tl.store(counter, 0)  # zeroed for the next launch, and for a CUDA graph's replay
            return
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


# Per device: the arrival counters of the kernels whose last program merges the others' partials
# (split-K decode_attention: one per (seq, kv head); argmax: one per row).
_ARRIVAL_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MIN_ARRIVAL_COUNTERS = 1024


def _arrival_counters(device: torch.device, needed: int, op: str) -> torch.Tensor:
    """The device's arrival counters (``needed`` of them for this launch): zeroed once, then left
    at 0 by every launch (its last program resets them), so no launch needs a memset and CUDA
    graph replays find them ready. There are ``_MIN_ARRIVAL_COUNTERS``, and at least
    ``_DECODE_PROGRAMS_PER_SM * num_sms``: decode_num_splits splits only grids of fewer
    (seq, kv head) pairs. Shared by every launch on the device: two launches must not run at
    once (on two streams)."""
    counters = _ARRIVAL_COUNTERS.get(device)
    if counters is None:
        _check(
            device.type != "cuda" or not torch.cuda.is_current_stream_capturing(),
            f"{op}'s counters would be allocated inside a CUDA graph capture: "
            "call it once on the device before capturing",
        )
        count = max(_MIN_ARRIVAL_COUNTERS, _DECODE_PROGRAMS_PER_SM * _num_sms(device))
        counters = torch.zeros(count, dtype=torch.int32, device=device)
        _ARRIVAL_COUNTERS[device] = counters
    _check(needed <= counters.numel(), f"{op} needs {needed} arrival counters, more than the {counters.numel()} there are")
    return counters


def decode_attention(
    positions: torch.Tensor,  # [num_seqs] int64, each new token's RoPE position
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], before RoPE
    k: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim], before RoPE
    v: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_seqs] int64; negative: a padding row, not stored
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step
    scale: float,
    seq_lens_cpu: list[int] | None = None,
) -> torch.Tensor:
    """rotary_embedding, store_kv and paged_attention of a decode-only step in one kernel
    launch, as the reference (row ``i``: sequence ``i``'s new token, at position
    ``seq_lens[i] - 1``). ``q``/``k``/``v`` may be strided views of a fused qkv projection.
    The split-K count follows the block table's width, as paged_attention's; the splits are
    merged by the last of them to finish, not by a second kernel. No host sync: it may be
    captured in a CUDA graph once it has run eagerly on the device (see _arrival_counters).
    ``seq_lens_cpu``, optional, only lets the lengths be checked against the table's capacity."""
    _check_tensor("positions", positions, 1, _INDEX_DTYPES)
    _check_tensor("q", q, 3, _FLOAT_DTYPES)
    _check_tensor("k", k, 3, _FLOAT_DTYPES)
    _check_tensor("v", v, 3, _FLOAT_DTYPES)
    _check_tensor("cos_sin_cache", cos_sin_cache, 2, _FLOAT_DTYPES)
    _check_kv_cache(k_cache, v_cache)
    _check_tensor("slot_mapping", slot_mapping, 1, _INDEX_DTYPES)
    _check_tensor("block_tables", block_tables, 2, _INDEX_DTYPES)
    _check_tensor("seq_lens", seq_lens, 1, _INDEX_DTYPES)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    _check(head_dim == cache_head_dim, f"q has head_dim {head_dim} but the KV cache {cache_head_dim}")
    _check(head_dim % 2 == 0, f"head_dim must be even, got {head_dim}")
    _check(
        num_heads % num_kv_heads == 0,
        f"q's {num_heads} heads must be a multiple of the cache's {num_kv_heads} kv heads",
    )
    kv_shape = (num_seqs, num_kv_heads, head_dim)
    _check(tuple(k.shape) == kv_shape, f"k must have shape {kv_shape}, got {tuple(k.shape)}")
    _check(tuple(v.shape) == kv_shape, f"v must have shape {kv_shape}, got {tuple(v.shape)}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping), ("seq_lens", seq_lens)):
        _check(tuple(t.shape) == (num_seqs,), f"{name} must have shape ({num_seqs},), got {tuple(t.shape)}")
        _check(t.is_contiguous(), f"{name} must be contiguous")
    _check(
        block_tables.shape[0] == num_seqs,
        f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences",
    )
    _check(
        cos_sin_cache.shape[1] == head_dim,
        f"cos_sin_cache must have shape (max_position, {head_dim}), got {tuple(cos_sin_cache.shape)}",
    )
    rows = dict(q=q, k=k, v=v, cos_sin_cache=cos_sin_cache, block_tables=block_tables)
    for name, t in rows.items():
        _check_last_dim_contiguous(name, t)
    _check(scale > 0, f"scale must be positive, got {scale}")
    _check_devices(
        positions=positions, q=q, k=k, v=v, cos_sin_cache=cos_sin_cache, k_cache=k_cache,
        v_cache=v_cache, slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens,
    )
    capacity = block_tables.shape[1] * block_size
    _check_seq_lens_cpu(seq_lens_cpu, num_seqs, capacity)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    tiles = attention_tiles(fused_decode_kind(num_seqs), head_dim_pad, q.dtype)
    num_splits = decode_num_splits(num_seqs, num_kv_heads, capacity, tiles.block_n, _num_sms(q.device))
    split = num_splits > 1
    partial_out = partial_lse = counters = out  # unused without split-K
    if split:
        counters = _arrival_counters(q.device, num_seqs * num_kv_heads, "decode_attention")
        partial_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    group = num_heads // num_kv_heads
    _fused_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
        out, partial_out, partial_lse, counters, scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, BLOCK_N=tiles.block_n, SPLIT=split,
        MERGED_SPLITS=_FUSED_DECODE_MERGED_SPLITS, LONG_SPLIT_TOKENS=_FUSED_DECODE_LONG_SPLIT_TOKENS,
        **_dot_args(q.dtype), **_pdl_args(q.device), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


# --------------------------------------------------------------------------------------------
# rms_norm, rotary_embedding, silu_and_mul


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
    _check(tuple(weight.shape) == (width,), f"{name} must have shape ({width},), got {tuple(weight.shape)}")
    _check(weight.is_contiguous(), f"{name} must be contiguous")
    if residual is None:
        _check_devices(x=x, **{name: weight})
        return
    _check(
        isinstance(residual, torch.Tensor) and residual.shape == x.shape and residual.dtype == x.dtype,
        f"residual must match x ({tuple(x.shape)}, {x.dtype})",
    )
    _check_devices(x=x, residual=residual, **{name: weight})


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden] (any leading dims; last dim contiguous)
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (or ``x``), then RMSNorm of it in fp32; returns new
    ``(normed, residual)`` tensors (``residual`` is ``x`` itself when none is given)."""
    _check(isinstance(x, torch.Tensor) and x.dtype in _FLOAT_DTYPES, "x must be a float16/bfloat16/float32 tensor")
    rows = _as_rows(x, "x")
    width = x.shape[-1]
    _check(width <= _MAX_ROW_WIDTH, f"rms_norm rows wider than {_MAX_ROW_WIDTH} are not supported, got {width}")
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
    src_ptr, src_stride_h, dst_ptr, cos, sin,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    h = tl.arange(0, HEADS_PAD)[:, None]
    j = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < NUM_HEADS) & (j < HALF)
    src = src_ptr + h * src_stride_h + j
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + h * (2 * HALF) + j
    tl.store(dst, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, cos_sin_stride,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
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
        NUM_HEADS, HEADS_PAD, HALF, HALF_PAD,
    )
    _rotate_heads(
        k_ptr + token * k_stride_t, k_stride_h, k_out_ptr + token * (NUM_KV_HEADS * 2 * HALF), cos, sin,
        NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD,
    )


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE computed in fp32; returns new contiguous q, k. ``q``/``k`` may be
    strided views (of a fused qkv). Positions must lie inside the cache."""
    _check_tensor("positions", positions, 1, _INDEX_DTYPES)
    _check_tensor("q", q, 3, _FLOAT_DTYPES)
    _check_tensor("k", k, 3, _FLOAT_DTYPES)
    _check_tensor("cos_sin_cache", cos_sin_cache, 2, _FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    _check(head_dim % 2 == 0, f"head_dim must be even, got {head_dim}")
    _check(
        k.shape[0] == num_tokens and k.shape[2] == head_dim,
        f"k must have shape ({num_tokens}, num_kv_heads, {head_dim}), got {tuple(k.shape)}",
    )
    _check(
        tuple(positions.shape) == (num_tokens,),
        f"positions must have shape ({num_tokens},), got {tuple(positions.shape)}",
    )
    _check(
        cos_sin_cache.shape[1] == head_dim,
        f"cos_sin_cache must have shape (max_position, {head_dim}), got {tuple(cos_sin_cache.shape)}",
    )
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        _check_last_dim_contiguous(name, t)
    _check(positions.is_contiguous(), "positions must be contiguous")
    _check_devices(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), num_warps=4,
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
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dimension ``2d``, computed in fp32."""
    _check(isinstance(x, torch.Tensor) and x.dtype in _FLOAT_DTYPES, "x must be a float16/bfloat16/float32 tensor")
    _check(x.dim() >= 1 and x.shape[-1] % 2 == 0, f"x's last dim must be even, got shape {tuple(x.shape)}")
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


# --------------------------------------------------------------------------------------------
# linear, norm_linear: decode-batch GEMVs

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
    weight tiles are loaded before waiting on the previous kernel: they do not depend on it.
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
    if USE_PDL:  # the next kernel may launch once every program is here: only the stores remain
        tl.extra.cuda.gdc_launch_dependents()

    # Rounded to the activation dtype, as the product's output, before SiLU-and-mul.
    y = tl.sum(acc, 1).to(out_ptr.dtype.element_ty)
    if GATED:
        gate = y.to(tl.float32)
        up_out = tl.sum(acc_up, 1).to(out_ptr.dtype.element_ty).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate)) * up_out).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + n, y, mask=n_ok)


def _use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.dim() != 2 or x.dtype != weight.dtype or not (x.is_cuda or _INTERPRETED):
        return False
    rows = x.shape[0]
    return rows == 1 or (
        0 < rows <= GEMV_MAX_ROWS and weight.numel() * weight.element_size() <= _GEMV_L2_RESIDENT_BYTES
    )


def _check_gemv_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    _check(isinstance(x, torch.Tensor) and x.dtype in _FLOAT_DTYPES, "x must be a float16/bfloat16/float32 tensor")
    _check_tensor("weight", weight, 2, _FLOAT_DTYPES)
    _check(
        x.dim() >= 1 and x.shape[-1] == weight.shape[1],
        f"x's last dim ({x.shape[-1] if x.dim() else None}) must equal weight's in_features ({weight.shape[1]})",
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
    grid = (triton.cdiv(n_out, GEMV_TILES.block_n), rows)
    _gemv_kernel[grid](
        x, unused if residual is None else residual, unused if norm_weight is None else norm_weight,
        weight, out, residual_out, n_out, k_in, eps,
        x.stride(0), 0 if residual is None else residual.stride(0), weight.stride(0), out.stride(0),
        HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, GATED=gated,
        BLOCK_N=GEMV_TILES.block_n, BLOCK_K=GEMV_TILES.block_k, **_pdl_args(x.device),
        num_warps=GEMV_TILES.num_warps, num_stages=GEMV_TILES.num_stages,
    )
    return out, residual_out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (bias-free); decode batches (one row, or up to GEMV_MAX_ROWS with a weight
    that fits in L2) by the GEMV kernel."""
    _check_gemv_weight(x, weight)
    if not _use_gemv(x, weight):
        return torch.nn.functional.linear(x, weight)
    return _launch_gemv(x, weight, weight.shape[0])[0]


def norm_linear(
    x: torch.Tensor,  # [num_tokens, hidden]
    norm_weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None,
    weight: torch.Tensor,  # [out_features, hidden]; gated: [2 * out_features, hidden]
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm, then ``linear`` of the normed rows, then (``gated``) silu_and_mul; returns
    ``(out, residual)`` as rms_norm does. Decode batches take one GEMV launch for all of it."""
    _check_gemv_weight(x, weight)
    _check(not gated or weight.shape[0] % 2 == 0, f"a gated weight needs an even row count, got {weight.shape[0]}")
    if not _use_gemv(x, weight):
        normed, residual = rms_norm(x, norm_weight, eps, residual)
        out = torch.nn.functional.linear(normed, weight)
        return (silu_and_mul(out) if gated else out), residual
    _check_norm_inputs(x, norm_weight, residual, "norm_weight")
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    return _launch_gemv(x, weight, n_out, residual=residual, norm_weight=norm_weight, eps=eps, gated=gated)


# --------------------------------------------------------------------------------------------
# argmax

_ARGMAX_BLOCK = 4096  # values per program
_ARGMAX_MAX_CHUNKS = 64  # programs per row, merged by the last to finish (vocabularies up to 256K)


@triton.jit(do_not_specialize=["width"])
def _argmax_kernel(
    x_ptr, out_ptr, partial_val_ptr, partial_idx_ptr, counters_ptr, width, x_stride,
    BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr,
):
    """Program (row, chunk): the chunk's largest value and its first index, written as a
    partial; the row's last program to arrive merges the partials (the largest value, then the
    smallest index) and resets the row's counter to 0 for the next launch."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride + cols, mask=cols < width, other=float("-inf"))
    best = tl.max(x, 0)
    best_idx = tl.min(tl.where(x == best, cols, width), 0)
    if num_chunks == 1:
        tl.store(out_ptr + row, best_idx.to(tl.int64))
        return
    partial = row * num_chunks + chunk
    tl.store(partial_val_ptr + partial, best)
    tl.store(partial_idx_ptr + partial, best_idx)
    counter = counters_ptr + row
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == num_chunks - 1:
        c = tl.arange(0, CHUNKS_PAD)
        c_ok = c < num_chunks
        vals = tl.load(partial_val_ptr + row * num_chunks + c, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(partial_idx_ptr + row * num_chunks + c, mask=c_ok, other=0, cache_modifier=".cg")
        top = tl.max(vals, 0)
        tl.store(out_ptr + row, tl.min(tl.where(c_ok & (vals == top), idxs, width), 0).to(tl.int64))
        tl.store(counter, 0)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (the first, on ties), as ``torch.argmax(-1)``, in
    one launch: chunks of a row reduce in parallel and the last to finish merges them. No host
    sync: it may be captured in a CUDA graph once it has run eagerly on the device."""
    _check_tensor("logits", logits, 2, _FLOAT_DTYPES)
    _check_last_dim_contiguous("logits", logits)
    _check_devices(logits=logits)
    rows, width = logits.shape
    _check(width > 0, "logits must have at least one column")
    num_chunks = triton.cdiv(width, _ARGMAX_BLOCK)
    _check(num_chunks <= _ARGMAX_MAX_CHUNKS, f"rows wider than {_ARGMAX_MAX_CHUNKS * _ARGMAX_BLOCK} are not supported")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    counters = _arrival_counters(logits.device, rows, "argmax")
    partial_val = torch.empty((rows, num_chunks), dtype=logits.dtype, device=logits.device)
    partial_idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    _argmax_kernel[(rows, num_chunks)](
        logits, out, partial_val, partial_idx, counters, width, logits.stride(0),
        BLOCK=_ARGMAX_BLOCK, CHUNKS_PAD=triton.next_power_of_2(num_chunks), num_warps=4,
    )
    return out
