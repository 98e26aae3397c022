"""Torch reference ops: the ``kernels.KernelOps`` contract on any device, in plain torch. The
CPU backend, and the twin the Triton kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import QKNorm

# Decodes whose padded batch holds at most this many keys share one masked sdpa call; longer ones
# take one call each. On the CPU (one thread, 4/2 heads of 64) the shared call is 2-4x as fast at
# 8-64 sequences of 100-300 tokens, but 2-7x as slow from 16K padded keys on (4 x 8K, 16 x 1K,
# 64 x 200), where sdpa leaves its fused kernel.
BATCHED_DECODE_MAX_KEYS = 8192
FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8).max


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x [tokens, kv_heads, dim]`` as ``cache`` stores it: an fp8 cache holds ``x / scale``,
    saturated (E4M3 has no infinity), as raw bytes (CPU index_copy_ takes no fp8)."""
    if cache.dtype != FP8:
        return x.to(cache.dtype)
    return (x.float() / scale[:, None]).clamp(-_FP8_MAX, _FP8_MAX).to(FP8).view(torch.uint8)


def _from_cache(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``[..., kv_heads, dim]`` as values of ``dtype`` (an fp8 cache's times its scale)."""
    if x.dtype != FP8:
        return x.to(dtype)
    return (x.float() * scale[:, None]).to(dtype)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat_shape = (num_blocks * block_size, *k_cache.shape[2:])
    for cache, x, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        rows = _to_cache(x, cache, scale)
        cache.view(rows.dtype).view(flat_shape).index_copy_(0, slot_mapping, rows)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
    seq_lens_cpu: list[int] | None = None, query_start_loc_cpu: list[int] | None = None,
    key: torch.Tensor | None = None, value: torch.Tensor | None = None, sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """On the CPU, a prefill chunk without a window over a non-fp8 cache reads its own keys and values
    from ``key``/``value`` and only the cached prefix from the pages; otherwise they go unread (the
    cache holds the same values or, fp8, the values a later step reads). Consecutive pages are read in
    place, others gathered. With a window, only the blocks holding keys some query sees are read."""
    block_size = k_cache.shape[1]
    lens = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.tolist()
    starts = query_start_loc_cpu if query_start_loc_cpu is not None else query_start_loc.tolist()
    out = torch.empty_like(q) if out is None else out
    decodes = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if len(decodes) > 1 and len(decodes) * max(lens[i] for i in decodes) <= BATCHED_DECODE_MAX_KEYS:
        # one padded, masked sdpa call for all single-token sequences
        _batched_decode(q, k_cache, v_cache, block_tables, lens, starts, decodes, scale, out, sliding_window,
                        k_scale, v_scale)
        decoded = set(decodes)
    else:
        decoded = set()
    for i, ctx_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0 or i in decoded:
            continue
        first_block = 0
        if sliding_window:  # the first query, at ctx_len - q_len, sees keys from this block on
            first_block = max(ctx_len - q_len - sliding_window + 1, 0) // block_size
        num_blocks = (ctx_len + block_size - 1) // block_size
        blocks = block_tables[i, first_block:num_blocks].long()
        first_key = first_block * block_size
        num_keys = ctx_len - first_key
        qi = q[q_start:q_end].transpose(0, 1)[None]
        if key is not None and k_cache.dtype != FP8 and not sliding_window and 1 < q_len and q.device.type == "cpu":
            # this step's keys and values from key/value, only the cached prefix from its pages
            cached = num_keys - q_len
            new_k, new_v = (x[q_start:q_end].to(q.dtype).transpose(0, 1)[None] for x in (key, value))
            if cached == 0:
                attended = F.scaled_dot_product_attention(qi, new_k, new_v, is_causal=True, scale=scale,
                                                          enable_gqa=True)
            else:
                old_k, old_v = (_pages(c, blocks, cached, s, q.dtype).transpose(0, 1)[None]
                                for c, s in ((k_cache, k_scale), (v_cache, v_scale)))
                attended = _chunked_prefill_cpu(qi, old_k, old_v, new_k, new_v, scale)
            out[q_start:q_end] = attended[0].transpose(0, 1)
            continue
        # [1, heads, tokens, dim]: 4-D inputs and enable_gqa (no repeated kv heads) let sdpa pick
        # its fused CPU kernel; 3-D inputs fall back to the unfused math path.
        k = _pages(k_cache, blocks, num_keys, k_scale, q.dtype).transpose(0, 1)[None]
        v = _pages(v_cache, blocks, num_keys, v_scale, q.dtype).transpose(0, 1)[None]
        if sliding_window and first_key + sliding_window < ctx_len:  # some query misses some key
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
            k_pos = torch.arange(first_key, ctx_len, device=q.device)[None, :]
            mask = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)
            attended = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        elif 1 < q_len < num_keys and q.device.type == "cpu":
            cached = num_keys - q_len
            attended = _chunked_prefill_cpu(qi, k[:, :, :cached], v[:, :, :cached], k[:, :, cached:],
                                            v[:, :, cached:], scale)
        else:
            mask = None  # a single new token, or a whole prompt (is_causal), sees all it may see
            if 1 < q_len < num_keys:  # chunked prefill: causal, aligned to the end of the keys
                mask = torch.ones(q_len, num_keys, dtype=torch.bool, device=q.device)
                mask = mask.tril(num_keys - q_len)
            attended = F.scaled_dot_product_attention(
                qi, k, v, attn_mask=mask, is_causal=mask is None and q_len > 1, scale=scale, enable_gqa=True,
            )
        out[q_start:q_end] = attended[0].transpose(0, 1)
    return out


def _pages(
    cache: torch.Tensor, blocks: torch.Tensor, num_keys: int, scale: torch.Tensor | None, dtype: torch.dtype,
) -> torch.Tensor:
    """The first ``num_keys`` rows ``[num_keys, kv_heads, dim]`` of the pages ``blocks`` (int64) of
    ``cache``: a view of the cache when the pages are consecutive (on the CPU; a fresh pool hands
    out runs of them), else gathered."""
    num_pages = -(-num_keys // cache.shape[1])
    blocks = blocks[:num_pages]
    ids = blocks.tolist() if cache.device.type == "cpu" else None  # (a few, on the host: cheaper than tensor ops)
    if ids is not None and ids[0] >= 0 and ids == list(range(ids[0], ids[0] + num_pages)):
        pages = cache[ids[0] : ids[0] + num_pages]
    else:
        pages = cache.index_select(0, blocks)
    return _from_cache(pages.flatten(0, 1)[:num_keys], scale, dtype)


def _chunked_prefill_cpu(
    q: torch.Tensor, old_k: torch.Tensor, old_v: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Chunked prefill on CPU without a mask: q ``[1, heads, q_len, dim]`` over the cached keys and
    values ``old_k``/``old_v`` ``[1, kv_heads, cached, dim]`` and the new ones ``[1, kv_heads, q_len, dim]``.

    The new tokens see every cached key, and the new keys causally: two calls of the fused CPU
    kernel, one unmasked over the cached prefix (each kv head's query group stacked as one long
    query, which only a maskless call allows) and one causal over the square of new tokens, merged
    by their log-sum-exps. A boolean mask instead makes sdpa 1.4-1.8x slower at 1K-2K new tokens
    over 2K-9K of context (one thread).
    """
    _, num_heads, q_len, dim = q.shape
    num_kv_heads = old_k.shape[1]
    group = num_heads // num_kv_heads
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    old_out, old_lse = flash(q.reshape(1, num_kv_heads, group * q_len, dim), old_k, old_v, scale=scale)
    new_k = new_k.repeat_interleave(group, dim=1)
    new_v = new_v.repeat_interleave(group, dim=1)
    new_out, new_lse = flash(q, new_k, new_v, is_causal=True, scale=scale)
    old_lse = old_lse.reshape(1, num_heads, q_len, 1)
    new_lse = new_lse.reshape(1, num_heads, q_len, 1)
    lse = torch.logaddexp(old_lse, new_lse)
    merged = old_out.reshape(1, num_heads, q_len, dim) * (old_lse - lse).exp() + new_out * (new_lse - lse).exp()
    return merged.to(q.dtype)


def _batched_decode(
    q, k_cache, v_cache, block_tables, lens, starts, rows, scale, out, sliding_window, k_scale, v_scale,
) -> None:
    block_size = k_cache.shape[1]
    ctx = [lens[i] for i in rows]
    # each row's keys from the block holding its first visible one (block 0 without a window)
    first = [max(n - sliding_window, 0) // block_size if sliding_window else 0 for n in ctx]
    num_blocks = max((n + block_size - 1) // block_size - f for n, f in zip(ctx, first))
    dev = q.device
    index = torch.tensor(rows, device=dev)
    first_block = torch.tensor(first, device=dev)
    columns = first_block[:, None] + torch.arange(num_blocks, device=dev)[None, :]
    columns = columns.clamp(max=block_tables.shape[1] - 1)
    # table entries past a shorter sequence's end may be padding (-1): read block 0, masked anyway
    blocks = block_tables.index_select(0, index).long().gather(1, columns).flatten().clamp(min=0)
    # [B, kv_heads, keys, dim], padded past each sequence's length and masked out
    # (index_select: several times faster than advanced indexing on CPU)
    shape = (len(rows), num_blocks * block_size, *k_cache.shape[2:])
    k = _from_cache(k_cache.index_select(0, blocks).view(shape), k_scale, q.dtype).transpose(1, 2)
    v = _from_cache(v_cache.index_select(0, blocks).view(shape), v_scale, q.dtype).transpose(1, 2)
    lengths = torch.tensor(ctx, device=dev)[:, None]
    key_pos = first_block[:, None] * block_size + torch.arange(num_blocks * block_size, device=dev)[None, :]
    mask = key_pos < lengths
    if sliding_window:
        mask &= key_pos >= lengths - sliding_window
    q_rows = torch.tensor([starts[i] for i in rows], device=dev)
    attn = F.scaled_dot_product_attention(
        q.index_select(0, q_rows)[:, :, None], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    out[q_rows] = attn[:, :, 0]


def _decode_one(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, num_keys: int, scale: float,
    sliding_window: int | None, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """One sequence's single query ``q [1, heads, dim]`` over its ``num_keys`` keys (the last
    ``sliding_window`` of them with a window: a plain slice, no mask); ``blocks`` its table row."""
    first_key = max(num_keys - sliding_window, 0) if sliding_window else 0
    first_block = first_key // k_cache.shape[1]
    skip = first_key - first_block * k_cache.shape[1]
    blocks = blocks[first_block:].long()
    k, v = (_pages(cache, blocks, num_keys - first_block * cache.shape[1], s, q.dtype)[skip:].transpose(0, 1)[None]
            for cache, s in ((k_cache, k_scale), (v_cache, v_scale)))
    attended = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, scale=scale, enable_gqa=True)
    return attended[0].transpose(0, 1)


def decode_attention(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    seq_lens_cpu: list[int] | None = None, sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    q, k = rotary_embedding(positions, q, k, cos_sin_cache, qk_norm)
    store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_seqs = q.shape[0]
    if num_seqs == 1 and q.device.type == "cpu":  # batch-1 decode: one sdpa call, no per-sequence bookkeeping
        return _decode_one(q, k_cache, v_cache, block_tables[0], int(seq_lens[0]) if seq_lens_cpu is None
                           else seq_lens_cpu[0], scale, sliding_window, k_scale, v_scale)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=q.device)
    return paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
        seq_lens_cpu, list(range(num_seqs + 1)), sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype), residual


def rope_cos_sin_cache(
    head_dim: int, max_position: int, theta: float, device=None, dtype=torch.float32,
) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device=device, dtype=dtype)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if qk_norm is not None:
        q = rms_norm(q, qk_norm.q_weight, qk_norm.eps)[0]
        k = rms_norm(k, qk_norm.k_weight, qk_norm.eps)[0]
    half = q.shape[-1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x [rows, k]`` as fp8 over its own scale (its absolute maximum / 448, rounded
    to nearest): ``(x_fp8, scale [rows, 1] fp32)``. An all-zero row gets scale 1."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / _FP8_MAX, 1.0)
    return (xf / scale).clamp(-_FP8_MAX, _FP8_MAX).to(FP8), scale


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    if weight_scale is None:
        return F.linear(x, weight)
    # fp8 weights: the rows of x quantized too, one fp32 product of the fp8 values, both scales after
    x_fp8, x_scale = quantize_rows(x)
    out = F.linear(x_fp8.float(), weight.float()) * x_scale * weight_scale
    return out.to(x.dtype)


def norm_linear(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
    weight: torch.Tensor, gated: bool = False, weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    normed, residual = rms_norm(x, norm_weight, eps, residual)
    out = linear(normed, weight, weight_scale)
    return (silu_and_mul(out) if gated else out), residual


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def sample_argmax(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int | torch.Tensor) -> torch.Tensor:
    """The noise: torch's generator on the logits' device, seeded with ``seed`` (not Triton's stream).
    A seed tensor is read on the host."""
    generator = torch.Generator(device=logits.device).manual_seed(int(seed))
    u = torch.rand(logits.shape, generator=generator, device=logits.device)
    t = inv_temperature.unsqueeze(1)
    return torch.where(t > 0, logits.float() * t - (-u.log()).log(), logits.float()).argmax(-1)
