"""decode_attention: rotary_embedding (with the q/k norms), store_kv and paged_attention's split-K
decode in one launch, on the paged tile step and tile choices of ``attention``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import QKNorm
from kernels.triton_ops._checks import (
    _FLOAT_DTYPES,
    _INDEX_DTYPES,
    _check,
    _check_devices,
    _check_kv_cache,
    _check_last_dim_contiguous,
    _check_tensor,
    _kv_scales,
)
from kernels.triton_ops._launch import _arrival_counters, _num_sms, _pdl_args
from kernels.triton_ops.attention import (
    _LOG2E,
    _attend_kv,
    _attend_tile,
    _cache_strides,
    _check_attention_heads,
    _check_seq_lens_cpu,
    _check_window,
    _dot_args,
    _dot_pad,
    _key_scaled,
    _load_kv_tile,
    _split_partials,
    _split_tokens,
    _value_scaled,
    _window_start,
    attention_tiles,
    decode_num_splits,
    fused_decode_kind,
)
from kernels.triton_ops.kv_store import _to_cache
from kernels.triton_ops.norm_rope import _check_qk_norm

# The last program merges the partials: a context's keys go to at most this many splits, more
# only past _FUSED_DECODE_LONG_SPLIT_TOKENS keys a split. One sequence (batch 1) takes up to 16,
# merged in one load (16 beat 8 by up to 1.7 us a Llama 3 8B layer at 640-2K tokens on the H200),
# and loads its first tile before waiting on the previous kernel (a GEMV that lets it launch
# early); larger batches keep 8, merged two per load, and load every tile after the wait: with
# the batch-1 choices the nano-vllm workload (batch up to 256) ran 11 % slower (gpu_bench_h200_fusion.jsonl).
_FUSED_DECODE_MERGED_SPLITS = 8
_FUSED_DECODE_MERGE_CHUNK = 2
_FUSED_DECODE_ONE_MERGED_SPLITS = 16
_FUSED_DECODE_LONG_SPLIT_TOKENS = 1024


@triton.jit
def _load_rotated(row_ptr, d, rot_d, mask, cos, signed_sin, norm_ptr, eps, HEAD_DIM: tl.constexpr,
                  HAS_NORM: tl.constexpr):
    """Rotate-half RoPE in fp32 of the vectors at ``row_ptr`` (along the last axis): column ``d``
    is ``x[d] * cos + x[rot_d] * signed_sin`` (``rot_d`` the other half's column, the sine negated
    in the first half), the same products and sums as norm_rope's ``_rotate_heads``; with
    HAS_NORM, of each vector's RMSNorm (times the weight at ``norm_ptr``), rounded to the row's
    dtype first, as there."""
    x = tl.load(row_ptr + d, mask=mask, other=0.0).to(tl.float32)
    x_rot = tl.load(row_ptr + rot_d, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, -1, keep_dims=True) / HEAD_DIM + eps)
        weight = tl.load(norm_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        weight_rot = tl.load(norm_ptr + rot_d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        x = (x * rstd * weight).to(row_ptr.dtype.element_ty).to(tl.float32)
        x_rot = (x_rot * rstd * weight_rot).to(row_ptr.dtype.element_ty).to(tl.float32)
    return x * cos + x_rot * signed_sin


@triton.jit
def _attend_new_key(q, k, v, acc, m_i, l_i, scale_log2):
    """The online-softmax step of one key held in registers (the new token's), in fp32."""
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * scale_log2
    m_new = tl.maximum(m_i, s)  # finite: every row sees this key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    return acc * alpha[:, None] + p[:, None] * v.to(tl.float32)[None, :], m_new, l_i * alpha + p


@triton.jit
def _merge_partials(
    partial_out_ptr, partial_lse_ptr, out_ptr, out_stride_t, out_stride_h, seq, kv_head, num_heads, num_splits,
    num_active, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
):
    """The output of one kv head's GROUP query heads: the ``num_active`` splits' partials merged,
    MERGE_CHUNK of them per load (all of them: one round trip to L2)."""
    g = tl.arange(0, GROUP_P2)
    s = tl.arange(0, MERGE_CHUNK)
    d = tl.arange(0, DIM_PAD)
    head = kv_head * GROUP + g
    g_ok = g < GROUP
    partials = (seq * num_heads + head) * num_splits  # split 0's partial, per head
    m = tl.full([GROUP_P2], float("-inf"), dtype=tl.float32)
    total = tl.zeros([GROUP_P2], dtype=tl.float32)
    merged = tl.zeros([GROUP_P2, DIM_PAD], dtype=tl.float32)
    for first in range(0, num_active, MERGE_CHUNK):
        index = partials[:, None] + (first + s)[None, :]
        ok = g_ok[:, None] & (first + s < num_active)[None, :]
        # .cg: from L2, where the other programs' partials are.
        lse = tl.load(partial_lse_ptr + index, mask=ok, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(
            partial_out_ptr + index[:, :, None] * HEAD_DIM + d[None, None, :],
            mask=ok[:, :, None] & (d < HEAD_DIM)[None, None, :], other=0.0, cache_modifier=".cg",
        )
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # the padding heads see no split
        alpha = tl.exp2(m - m_ref)
        weight = tl.exp2(lse - m_ref[:, None])
        merged = merged * alpha[:, None] + tl.sum(part * weight[:, :, None], 1)
        total = total * alpha + tl.sum(weight, 1)
        m = m_new
    out_ptrs = out_ptr + seq.to(tl.int64) * out_stride_t + head[:, None] * out_stride_h + d[None, :]
    out = merged / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & (d < HEAD_DIM)[None, :])


# The block table's width follows the batch: never specialize on it (nor on the split count or
# the window).
@triton.jit(do_not_specialize=["num_splits", "block_tables_stride", "window"])
def _fused_decode_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
    counters_ptr, q_norm_ptr, k_norm_ptr, norm_eps, scale_log2, num_splits, window,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, cos_sin_stride,
    out_stride_t, out_stride_h, cache_stride_b, cache_stride_s, cache_stride_h, block_tables_stride,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    MERGED_SPLITS: tl.constexpr, MERGE_CHUNK: tl.constexpr, LONG_SPLIT_TOKENS: tl.constexpr,
    PREFETCH_FIRST: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Program (seq, kv head, split): RoPE (after the q/k norms, with HAS_NORM) on the GROUP query
    heads of one kv head, then attention over one key range. Keys before the new token come from
    the pages; the new token (the context's last position) is rotated, stored and attended from
    registers by the split that holds it, so no program waits for another's store. With
    PREFETCH_FIRST the split's first page tile is loaded before waiting on the previous kernel:
    earlier steps wrote it. With more than one split holding keys, each writes a partial
    (normalized output and log2-sum-exp) and counts its arrival; the last to arrive merges the
    partials, MERGE_CHUNK per load, and resets the counter to 0 for the next launch. A window
    (> 0) drops the keys before the last ``window`` positions: the splits share the rest."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = _window_start(seq_len, window)
    num_keys = seq_len - first_key
    # The last program merges the partials: at most MERGED_SPLITS of the splits share the keys
    # (one load each), more only past LONG_SPLIT_TOKENS keys each (a long context needs the programs).
    long_splits = (num_keys + LONG_SPLIT_TOKENS - 1) // LONG_SPLIT_TOKENS
    tokens_per_split = _split_tokens(num_keys, tl.minimum(num_splits, tl.maximum(long_splits, MERGED_SPLITS)), BLOCK_N)
    # A padding row (length 0) keeps one program: it writes the zeros.
    num_active = tl.maximum((num_keys + tokens_per_split - 1) // tokens_per_split, 1)
    if split >= num_active:
        return
    holds_new = split == num_active - 1
    start = first_key + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    paged_end = tl.maximum(tl.where(holds_new, end - 1, end), start)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    loop_start = start
    if PREFETCH_FIRST:
        first_k, first_v, first_tok, first_ok = _load_kv_tile(
            start, paged_end, kv_head, block_table_row, k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s,
            cache_stride_h, HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, "end",
        )
        loop_start = start + BLOCK_N

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
    if USE_PDL:  # what comes before is the step's inputs and older pages; q, k and v are the previous kernel's
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel's weight loads overlap this one
        tl.extra.cuda.gdc_wait()
    q_heads = q_ptr + seq.to(tl.int64) * q_stride_t + head[:, None] * q_stride_h
    q = _load_rotated(q_heads, d[None, :], rot_d[None, :], q_mask, cos[None, :], signed_sin[None, :],
                      q_norm_ptr, norm_eps, HEAD_DIM, HAS_NORM)
    # Rounded to q's dtype, as rotary_embedding returns it.
    q = q.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
    # The new token's k and v, loaded with q (only the split that holds it reads them): rounded as
    # rotary_embedding returns k, then as store_kv writes k and v.
    new_ok = d_ok & holds_new
    k_row = k_ptr + seq.to(tl.int64) * k_stride_t + kv_head * k_stride_h
    v_row = v_ptr + seq.to(tl.int64) * v_stride_t + kv_head * v_stride_h
    k_new = _load_rotated(k_row, d, rot_d, new_ok, cos, signed_sin, k_norm_ptr, norm_eps, HEAD_DIM,
                          HAS_NORM).to(k_ptr.dtype.element_ty)
    v_new = tl.load(v_row + d, mask=new_ok, other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    scale_log2 = _key_scaled(scale_log2, k_scale_ptr, kv_head)
    if PREFETCH_FIRST:
        if start < paged_end:
            acc, m_i, l_i = _attend_kv(
                q, first_k, first_v, acc, m_i, l_i, g, first_tok, first_ok, scale_log2, "end", DOT_DTYPE,
                DOT_PRECISION,
            )
    full_end = start + (paged_end - start) // BLOCK_N * BLOCK_N
    for tile_start in range(loop_start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, g, tile_start, paged_end, kv_head, block_table_row,
            k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s, cache_stride_h, scale_log2,
            HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, "none", DOT_DTYPE, DOT_PRECISION,
        )
    if (full_end >= loop_start) & (full_end < paged_end):  # a last, partial tile (not the prefetched one)
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, g, full_end, paged_end, kv_head, block_table_row,
            k_cache_ptr, v_cache_ptr, cache_stride_b, cache_stride_s, cache_stride_h, scale_log2,
            HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, "end", DOT_DTYPE, DOT_PRECISION,
        )
    if holds_new:
        # New names: a runtime branch may not change a variable's type (fp8 caches store a new dtype).
        if k_scale_ptr is not None:
            k_cached = _to_cache(k_new, tl.load(k_scale_ptr + kv_head), k_cache_ptr)
            v_cached = _to_cache(v_new, tl.load(v_scale_ptr + kv_head), v_cache_ptr)
        else:
            k_cached = _to_cache(k_new, None, k_cache_ptr)
            v_cached = _to_cache(v_new, None, v_cache_ptr)
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        if slot >= 0:
            dst = (slot // BLOCK_SIZE) * cache_stride_b + (slot % BLOCK_SIZE) * cache_stride_s
            dst += kv_head * cache_stride_h + d
            tl.store(k_cache_ptr + dst, k_cached, mask=d_ok)
            tl.store(v_cache_ptr + dst, v_cached, mask=d_ok)
        if seq_len > 0:
            acc, m_i, l_i = _attend_new_key(q, k_cached, v_cached, acc, m_i, l_i, scale_log2)

    # A context of length 0 (a padding row) leaves l_i = 0: its output is zeros, not NaN.
    out = _value_scaled(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], v_scale_ptr, kv_head)
    if SPLIT:
        if num_active > 1:
            num_heads = tl.num_programs(1) * GROUP
            partials = (seq * num_heads + head) * num_splits + split
            tl.store(partial_lse_ptr + partials, m_i + tl.log2(l_i), mask=g < GROUP)
            tl.store(partial_out_ptr + partials[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
            # Every thread's partial is written before the (one-thread) release below.
            tl.debug_barrier()
            counter = counters_ptr + seq * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_active - 1:  # the last: every other partial is visible
                _merge_partials(
                    partial_out_ptr, partial_lse_ptr, out_ptr, out_stride_t, out_stride_h, seq, kv_head, num_heads,
                    num_splits, num_active, GROUP, GROUP_P2, HEAD_DIM, DIM_PAD, MERGE_CHUNK,
                )
                tl.store(counter, 0)  # zeroed for the next launch, and for a CUDA graph's replay
            return
    out_ptrs = out_ptr + seq.to(tl.int64) * out_stride_t + head[:, None] * out_stride_h + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check_decode_inputs(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> None:
    _check_tensor("positions", positions, 1, _INDEX_DTYPES)
    _check_tensor("q", q, 3, _FLOAT_DTYPES)
    _check_tensor("k", k, 3, _FLOAT_DTYPES)
    _check_tensor("v", v, 3, _FLOAT_DTYPES)
    _check_tensor("cos_sin_cache", cos_sin_cache, 2, _FLOAT_DTYPES)
    _check_kv_cache(k_cache, v_cache)
    _check_tensor("slot_mapping", slot_mapping, 1, _INDEX_DTYPES)
    _check_tensor("block_tables", block_tables, 2, _INDEX_DTYPES)
    _check_tensor("seq_lens", seq_lens, 1, _INDEX_DTYPES)
    num_seqs, _, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    _check_attention_heads(q, k_cache)
    _check(head_dim % 2 == 0, lambda: f"head_dim must be even, got {head_dim}")
    kv_shape = (num_seqs, num_kv_heads, head_dim)
    _check(tuple(k.shape) == kv_shape, lambda: f"k must have shape {kv_shape}, got {tuple(k.shape)}")
    _check(tuple(v.shape) == kv_shape, lambda: f"v must have shape {kv_shape}, got {tuple(v.shape)}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping), ("seq_lens", seq_lens)):
        if tuple(t.shape) != (num_seqs,):
            raise ValueError(f"{name} must have shape ({num_seqs},), got {tuple(t.shape)}")
        _check(t.is_contiguous(), f"{name} must be contiguous")
    _check(
        block_tables.shape[0] == num_seqs,
        lambda: f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences",
    )
    _check(
        cos_sin_cache.shape[1] == head_dim,
        lambda: f"cos_sin_cache must have shape (max_position, {head_dim}), got {tuple(cos_sin_cache.shape)}",
    )
    rows = dict(q=q, k=k, v=v, cos_sin_cache=cos_sin_cache, block_tables=block_tables)
    for name, t in rows.items():
        _check_last_dim_contiguous(name, t)
    _check(scale > 0, lambda: f"scale must be positive, got {scale}")
    _check_devices(
        positions=positions, q=q, k=k, v=v, cos_sin_cache=cos_sin_cache, k_cache=k_cache,
        v_cache=v_cache, slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens,
    )


def decode_attention(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    seq_lens_cpu: list[int] | None = None, sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    """One kernel launch, the q/k norms included. The split-K count follows the block table's width, as
    paged_attention's; the splits are merged by the last of them to finish, not by a second
    kernel. No host sync: it may be captured in a CUDA graph once it has run eagerly on the
    device (see _arrival_counters). The window is a runtime argument, as paged_attention's."""
    _check_decode_inputs(
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale
    )
    _check_window(sliding_window)
    q_norm, k_norm, norm_eps = _check_qk_norm(qk_norm, q)
    k_scale, v_scale = _kv_scales(k_cache, k_scale, v_scale)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    capacity = block_tables.shape[1] * block_size
    _check_seq_lens_cpu(seq_lens_cpu, num_seqs, capacity)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    head_dim_pad = _dot_pad(head_dim)
    kind = fused_decode_kind(num_seqs)
    tiles = attention_tiles(kind, head_dim_pad, q.dtype)
    one = kind == "fused_decode_one"
    merged_splits = _FUSED_DECODE_ONE_MERGED_SPLITS if one else _FUSED_DECODE_MERGED_SPLITS
    num_splits = decode_num_splits(num_seqs, num_kv_heads, capacity, tiles.block_n, _num_sms(q.device))
    split = num_splits > 1
    partial_out = partial_lse = counters = out  # unused without split-K
    if split:
        counters = _arrival_counters(q.device, num_seqs * num_kv_heads, "decode_attention")
        partial_out, partial_lse = _split_partials(num_seqs, num_heads, num_splits, head_dim, q.device)
    group = num_heads // num_kv_heads
    _fused_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
        k_scale, v_scale, out, partial_out, partial_lse, counters, q_norm, k_norm, norm_eps, scale * _LOG2E,
        num_splits, sliding_window or 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        out.stride(0), out.stride(1), *_cache_strides(k_cache, block_tables),
        GROUP=group, GROUP_PAD=_dot_pad(group), GROUP_P2=triton.next_power_of_2(group),
        HEAD_DIM=head_dim, DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, BLOCK_N=tiles.block_n, SPLIT=split,
        MERGED_SPLITS=merged_splits, MERGE_CHUNK=merged_splits if one else _FUSED_DECODE_MERGE_CHUNK,
        LONG_SPLIT_TOKENS=_FUSED_DECODE_LONG_SPLIT_TOKENS, PREFETCH_FIRST=one,
        **_dot_args(q.dtype), **_pdl_args(q.device), HAS_NORM=qk_norm is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, maxnreg=tiles.max_registers,
    )
    return out
