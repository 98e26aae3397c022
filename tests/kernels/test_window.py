"""Sliding-window attention: the reference against dense masked attention, and the Triton
kernels (split-K decode, prefill, fused decode) against the reference, with the pages before
each window poisoned with NaN: a kernel that reads one fails."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import GPU_ATTENTION_TOL, ULP, assert_close, gpu, make_batch

from kernels import reference

# (context length, new tokens): decodes inside and past the window, chunks over a prefix longer
# than the window, a whole prompt longer than it, a chunk crossing it.
CASES = [(5, 1), (40, 1), (130, 1), (100, 30), (90, 90), (70, 12), (200, 64)]


def dense_window_attention(batch, window: int) -> torch.Tensor:
    """Every query against every key of its sequence, masked to ``p - window < key <= p``."""
    out = torch.zeros_like(batch.q, dtype=torch.float32)
    block_size = batch.k_cache.shape[1]
    group = batch.q.shape[1] // batch.k_cache.shape[2]
    for i, ctx in enumerate(batch.seq_lens_cpu):
        start, end = batch.query_start_loc_cpu[i : i + 2]
        pos = torch.arange(ctx, device=batch.q.device)
        blocks = batch.block_tables[i].long()[pos // block_size]
        k = batch.k_cache[blocks, pos % block_size].float().repeat_interleave(group, 1)  # [ctx, heads, dim]
        v = batch.v_cache[blocks, pos % block_size].float().repeat_interleave(group, 1)
        q_pos = torch.arange(ctx - (end - start), ctx, device=batch.q.device)[:, None]
        seen = (pos[None, :] <= q_pos) & (pos[None, :] > q_pos - window)
        scores = torch.einsum("thd,khd->htk", batch.q[start:end].float(), k) * batch.scale
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("htk,khd->thd", probs, v)
    return out


def poison_before_windows(batch, window: int) -> None:
    """Point every table entry of a block wholly before its sequence's first window at a new
    block of NaNs."""
    block_size = batch.k_cache.shape[1]
    nan_block = batch.k_cache.shape[0]
    batch.k_cache = torch.cat([batch.k_cache, torch.full_like(batch.k_cache[:1], float("nan"))])
    batch.v_cache = torch.cat([batch.v_cache, torch.full_like(batch.v_cache[:1], float("nan"))])
    for i, ctx in enumerate(batch.seq_lens_cpu):
        q_len = batch.query_start_loc_cpu[i + 1] - batch.query_start_loc_cpu[i]
        first_seen = max(ctx - q_len - window + 1, 0)
        batch.block_tables[i, : first_seen // block_size] = nan_block


def window_batch(block_size: int, device: str = "cpu", dtype=torch.float32, group: int = 2):
    contexts, queries = zip(*CASES)
    return make_batch(list(contexts), list(queries), group=group, block_size=block_size, device=device, dtype=dtype)


def run(paged_attention, batch, window: int) -> torch.Tensor:
    return paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
        batch.scale, batch.seq_lens_cpu, batch.query_start_loc_cpu, sliding_window=window,
    )


@pytest.mark.parametrize("window", [1, 7, 16, 33, 64])
@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_window_matches_dense(window, block_size):
    batch = window_batch(block_size)
    expected = dense_window_attention(batch, window)
    poison_before_windows(batch, window)
    rows = batch.query_start_loc_cpu[-1]
    out = run(reference.paged_attention, batch, window)
    assert torch.isfinite(out[:rows]).all()
    assert_close(out[:rows], expected[:rows], rtol=1e-5)


def test_reference_window_wider_than_context_is_causal():
    batch = make_batch([40, 30], [40, 1], block_size=8)
    rows = batch.query_start_loc_cpu[-1]
    assert_close(run(reference.paged_attention, batch, 1000)[:rows], batch.reference_fp32()[:rows], rtol=1e-6)


@pytest.mark.parametrize("window", [7, 33])
def test_triton_window_interpreted(ops, window):
    batch = window_batch(16)
    expected = dense_window_attention(batch, window)
    poison_before_windows(batch, window)
    rows = batch.query_start_loc_cpu[-1]
    out = run(ops.paged_attention, batch, window)
    assert_close(out[:rows], expected[:rows], rtol=ULP[torch.float32] * 10)


def decode_inputs(batch, window: int):
    """decode_attention's inputs for a batch of single-token rows (q, k, v before RoPE)."""
    num_seqs = len(batch.seq_lens_cpu)
    head_dim = batch.q.shape[-1]
    num_kv_heads = batch.k_cache.shape[2]
    gen = torch.Generator(device=batch.q.device).manual_seed(3)
    k = torch.randn(num_seqs, num_kv_heads, head_dim, generator=gen, device=batch.q.device).to(batch.q.dtype)
    v = torch.randn(num_seqs, num_kv_heads, head_dim, generator=gen, device=batch.q.device).to(batch.q.dtype)
    block_size = batch.k_cache.shape[1]
    positions = torch.tensor([n - 1 for n in batch.seq_lens_cpu], device=batch.q.device)
    table = batch.block_tables.long()
    slots = table[torch.arange(num_seqs, device=positions.device), positions // block_size] * block_size
    slots += positions % block_size
    cos_sin = reference.rope_cos_sin_cache(head_dim, max(batch.seq_lens_cpu) + 1, 10000.0, device=batch.q.device)
    return positions, k, v, cos_sin, slots


@pytest.mark.parametrize("window", [7, 33])
def test_fused_decode_window_interpreted(ops, window):
    batch = make_batch([5, 40, 130, 64], [1] * 4, group=2, block_size=16)
    poison_before_windows(batch, window)
    positions, k, v, cos_sin, slots = decode_inputs(batch, window)
    caches = [(batch.k_cache.clone(), batch.v_cache.clone()) for _ in range(2)]
    outs = [
        impl.decode_attention(positions, batch.q, k, v, cos_sin, *cache, slots, batch.block_tables,
                              batch.seq_lens, batch.scale, batch.seq_lens_cpu, sliding_window=window)
        for impl, cache in zip((reference, ops), caches)
    ]
    assert torch.isfinite(outs[0]).all()
    assert_close(outs[1], outs[0], rtol=ULP[torch.float32] * 10)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [64, 512, 1024])
def test_window_attention_gpu(dtype, window):
    contexts = [3000, 1025, 700, 4096, 2000, 64]
    queries = [1, 1, 700, 1, 300, 64]
    batch = make_batch(contexts, queries, group=2, head_dim=128, block_size=16, dtype=dtype, device="cuda")
    expected = dense_window_attention(batch, window).to(dtype)
    poison_before_windows(batch, window)
    rows = batch.query_start_loc_cpu[-1]
    from kernels import triton_ops

    out = run(triton_ops.paged_attention, batch, window)
    assert torch.isfinite(out[:rows]).all()
    assert_close(out[:rows], expected[:rows], rtol=GPU_ATTENTION_TOL[dtype], atol=GPU_ATTENTION_TOL[dtype])


@gpu
@pytest.mark.parametrize("num_seqs", [1, 8, 64])
@pytest.mark.parametrize("window", [512, 1024])
def test_fused_decode_window_gpu(num_seqs, window):
    contexts = [int(x) for x in torch.randint(1, 8192, (num_seqs,), generator=torch.Generator().manual_seed(num_seqs))]
    batch = make_batch(contexts, [1] * num_seqs, group=2, head_dim=128, block_size=16, dtype=torch.bfloat16,
                       device="cuda", extra_table_blocks=math.ceil(8192 / 16) - max(contexts) // 16)
    poison_before_windows(batch, window)
    positions, k, v, cos_sin, slots = decode_inputs(batch, window)
    from kernels import triton_ops

    caches = [(batch.k_cache.clone(), batch.v_cache.clone()) for _ in range(2)]
    outs = [
        impl.decode_attention(positions, batch.q, k, v, cos_sin, *cache, slots, batch.block_tables,
                              batch.seq_lens, batch.scale, batch.seq_lens_cpu, sliding_window=window)
        for impl, cache in zip((reference, triton_ops), caches)
    ]
    assert torch.isfinite(outs[1]).all()
    assert_close(outs[1], outs[0], rtol=GPU_ATTENTION_TOL[torch.bfloat16], atol=GPU_ATTENTION_TOL[torch.bfloat16])
