"""Torch reference ops against plain dense math (and HF's RoPE for the convention)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as ops


def dense_causal_attention(q, k, v, scale):
    """q [q_len, heads, dim] at the last q_len positions of k/v [ctx, kv_heads, dim]; fp64 loops."""
    q_len, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = q[:, h].double() @ kh.T * scale
        pos = torch.arange(ctx - q_len, ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos, -math.inf)
        out[:, h] = scores.softmax(-1) @ vh
    return out


def paged_inputs(ctx_lens, q_lens, num_heads, num_kv_heads, head_dim=16, block_size=4, seed=0, shuffle=True):
    """Random per-sequence q/k/v, with k/v scattered into a cache through shuffled block tables (or,
    ``shuffle=False``, tables of consecutive blocks, which the CPU reads in place)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay garbage
    perm = torch.randperm(num_blocks, generator=g).tolist() if shuffle else list(range(num_blocks))[::-1]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    width = max(blocks_per_seq)
    block_tables = torch.full((len(ctx_lens), width), -1, dtype=torch.int32)
    seqs = []
    for i, (ctx, q_len) in enumerate(zip(ctx_lens, q_lens)):
        table = [perm.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        for p in range(ctx):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        seqs.append((torch.randn(q_len, num_heads, head_dim, generator=g), k, v))
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    q = torch.cat([s[0] for s in seqs])
    return q, k_cache, v_cache, block_tables, starts, seqs


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("host_lists", [True, False])
@pytest.mark.parametrize("batched_decode_max_keys", [ops.BATCHED_DECODE_MAX_KEYS, 0])
@pytest.mark.parametrize("shuffle, new_rows", [(True, False), (True, True), (False, False), (False, True)])
def test_paged_attention_mixed_batch_matches_dense(num_heads, num_kv_heads, host_lists, batched_decode_max_keys,
                                                   shuffle, new_rows, monkeypatch):
    # decodes (in one padded call, or one call each), a full prefill, chunked prefills, a
    # zero-length entry; contexts on and around the block boundaries (block_size 4); pages gathered
    # or read in place, the new rows from the cache or from key/value.
    monkeypatch.setattr(ops, "BATCHED_DECODE_MAX_KEYS", batched_decode_max_keys)
    ctx_lens = [1, 4, 5, 17, 12, 9, 8, 6]
    q_lens = [1, 1, 1, 17, 7, 4, 0, 6]
    q, k_cache, v_cache, block_tables, starts, seqs = paged_inputs(
        ctx_lens, q_lens, num_heads, num_kv_heads, shuffle=shuffle
    )
    new = {}
    if new_rows:  # this step's rows, as store_kv wrote them to the cache
        new = {name: torch.cat([x[len(x) - len(qi):] for qi, *kv in seqs for x in kv[i:i + 1]])
               for i, name in enumerate(("key", "value"))}
    scale = 16**-0.5
    out = ops.paged_attention(
        q, k_cache, v_cache, block_tables,
        torch.tensor(ctx_lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32), scale,
        ctx_lens if host_lists else None, starts if host_lists else None, **new,
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    for i, (qi, k, v) in enumerate(seqs):
        if len(qi):
            expected = dense_causal_attention(qi, k, v, scale)
            got = out[starts[i] : starts[i + 1]].double()
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_bf16_cache_and_query():
    q, k_cache, v_cache, block_tables, starts, seqs = paged_inputs([10, 3], [3, 1], 6, 2, seed=1)
    lens = torch.tensor([10, 3], dtype=torch.int32)
    out = ops.paged_attention(
        q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), block_tables, lens,
        torch.tensor(starts, dtype=torch.int32), 0.25,
    )
    assert out.dtype == torch.bfloat16
    for i, (qi, k, v) in enumerate(seqs):
        expected = dense_causal_attention(qi, k, v, 0.25)
        got = out[starts[i] : starts[i + 1]].double()
        torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)


def test_store_kv_writes_slots_and_skips_padding():
    g = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(5, 4, 2, 8)
    v_cache = torch.zeros(5, 4, 2, 8)
    key = torch.randn(6, 2, 8, generator=g)
    value = torch.randn(6, 2, 8, generator=g)
    slots = torch.tensor([13, 0, -1, 7, 19, -1])
    ops.store_kv(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(20, 2, 8), v_cache.view(20, 2, 8)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[row]) and torch.equal(flat_v[slot], value[row])
    untouched = [s for s in range(20) if s not in (13, 0, 7, 19)]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_store_kv_casts_to_cache_dtype():
    k_cache = torch.zeros(2, 4, 1, 4, dtype=torch.bfloat16)
    v_cache = torch.zeros(2, 4, 1, 4, dtype=torch.bfloat16)
    key = torch.randn(2, 1, 4)
    ops.store_kv(key, -key, k_cache, v_cache, torch.tensor([5, 2]))
    assert torch.equal(k_cache.view(8, 1, 4)[5], key[0].bfloat16())
    assert torch.equal(v_cache.view(8, 1, 4)[2], (-key[1]).bfloat16())


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rotary_embedding_is_exact_rotate_half(theta):
    head_dim, half = 32, 16
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 63, 1000, 4095])
    q = torch.randn(6, 3, head_dim, generator=g)
    k = torch.randn(6, 1, head_dim, generator=g)
    cache = ops.rope_cos_sin_cache(head_dim, 4096, theta)
    assert cache.shape == (4096, head_dim) and cache.dtype == torch.float32
    q_rot, k_rot = ops.rotary_embedding(positions, q, k, cache)

    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = positions.double()[:, None, None] * inv_freq  # pairs (i, i + half) rotate by angle_i
    for x, rotated in ((q, q_rot), (k, k_rot)):
        z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(
            torch.ones_like(angle), angle
        )
        expected = torch.cat([z.real, z.imag], -1)
        torch.testing.assert_close(rotated.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(q_rot[0], q[0])  # position 0 is the identity


def test_rotary_embedding_matches_hf_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=100000.0,
                         max_position_embeddings=512)
    head_dim = 64
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([3, 4, 5, 100, 511])
    q = torch.randn(5, 4, head_dim, generator=g)
    k = torch.randn(5, 2, head_dim, generator=g)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_rot, k_rot = ops.rotary_embedding(
        positions, q, k, ops.rope_cos_sin_cache(head_dim, 512, 100000.0)
    )
    # HF builds angles in fp32, so large positions differ in the last few ulps of the angle.
    torch.testing.assert_close(q_rot, hf_q[0].transpose(0, 1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_rot, hf_k[0].transpose(0, 1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).to(dtype)
    residual = torch.randn(5, 64, generator=g).to(dtype)
    weight = (1 + 0.3 * torch.randn(64, generator=g)).to(dtype)
    eps = 1e-6

    def expected(h):
        h = h.double()
        return (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).to(dtype)

    normed, new_residual = ops.rms_norm(x, weight, eps, residual)
    assert torch.equal(new_residual, x + residual) and new_residual.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(normed, expected(x + residual), atol=tol, rtol=tol)

    normed, same = ops.rms_norm(x, weight, eps)
    assert same is x
    torch.testing.assert_close(normed, expected(x), atol=tol, rtol=tol)


def test_silu_and_mul():
    x = torch.randn(3, 2, 10)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(x[..., :5]) * x[..., 5:])
