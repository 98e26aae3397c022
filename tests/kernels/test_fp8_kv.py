"""The ops over an fp8 (E4M3) KV cache with per-kv-head scales: the Triton kernels against the
reference (the interpreter on CPU, compiled on the GPU), and the reference against unquantized
attention on the values the cache holds."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import GPU_ATTENTION_TOL, ULP, Batch, assert_close, gpu, make_batch, random_contexts
from test_fused_decode import make_decode_step

from kernels import reference, triton_ops

FP8 = torch.float8_e4m3fn


def scales(num_kv_heads: int, device: str, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct per-head K and V scales (so a wrong head's scale shows)."""
    gen = torch.Generator().manual_seed(seed)
    k_scale, v_scale = (0.005 + 0.02 * torch.rand(2, num_kv_heads, generator=gen)).to(device).unbind()
    return k_scale.contiguous(), v_scale.contiguous()


def quantized(batch: Batch) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """``batch`` with its caches quantized to fp8 by the reference store, and the scales."""
    k_scale, v_scale = scales(batch.k_cache.shape[2], str(batch.q.device))
    caches = [torch.empty(batch.k_cache.shape, dtype=FP8, device=batch.q.device) for _ in "kv"]
    flat = batch.k_cache.shape[0] * batch.k_cache.shape[1]
    slots = torch.arange(flat, device=batch.q.device)
    rows = (flat, *batch.k_cache.shape[2:])
    reference.store_kv(batch.k_cache.view(rows), batch.v_cache.view(rows), *caches, slots, k_scale, v_scale)
    fp8 = Batch(**{**batch.__dict__, "k_cache": caches[0], "v_cache": caches[1]})
    return fp8, k_scale, v_scale


def attention(paged_attention, batch: Batch, k_scale, v_scale, with_new_rows: bool = False) -> torch.Tensor:
    key = value = None
    if with_new_rows:  # unquantized rows, as the model hands them over: an fp8 cache ignores them
        key = torch.randn(batch.q.shape[0], *batch.k_cache.shape[2:], device=batch.q.device).to(batch.q.dtype)
        value = key.clone()
    return paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
        batch.scale, batch.seq_lens_cpu, batch.query_start_loc_cpu, key=key, value=value,
        k_scale=k_scale, v_scale=v_scale,
    )


@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16])
def test_fp8_store_kv_matches_reference_bytes(ops, key_dtype):
    num_tokens, num_kv_heads, head_dim, block_size = 21, 3, 24, 16
    gen = torch.Generator().manual_seed(1)
    key = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 3).to(key_dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(key_dtype)
    key[1, 0, :4] = torch.tensor([1e6, -1e6, 0.0, 1e-9])  # saturates, never NaN; zero; underflow
    slots = torch.randperm(4 * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    k_scale, v_scale = scales(num_kv_heads, "cpu")
    shape = (4, block_size, num_kv_heads, head_dim)
    expected = [torch.zeros(shape, dtype=FP8) for _ in "kv"]
    actual = [torch.zeros(shape, dtype=FP8) for _ in "kv"]
    reference.store_kv(key, value, *expected, slots, k_scale, v_scale)
    ops.store_kv(key, value, *actual, slots, k_scale, v_scale)
    for a, e in zip(actual, expected):
        assert torch.equal(a.view(torch.uint8), e.view(torch.uint8))
    stored = expected[0].view(-1, num_kv_heads, head_dim)[slots[1]].float()
    assert stored[0, :4].tolist() == [448.0, -448.0, 0.0, 0.0]
    # one fp8 rounding of x / scale: within 2^-4 relative (3 mantissa bits) in the normal range
    written = slots >= 0
    deq = expected[0].view(-1, num_kv_heads, head_dim)[slots[written]].float() * k_scale[:, None]
    scaled = key[written].float().abs() / k_scale[:, None]
    normal = (scaled > 2**-6) & (scaled <= 448)
    assert normal.float().mean() > 0.5
    assert_close(deq[normal], key[written].float()[normal], rtol=2**-4, atol=0)


def test_fp8_reference_attention_reads_scaled_values():
    """The reference over an fp8 cache is attention over the dequantized cache, exactly."""
    batch, k_scale, v_scale = quantized(make_batch([17, 40, 64], [1, 40, 9], num_kv_heads=2, group=3))
    dequantized = Batch(**{
        **batch.__dict__,
        "k_cache": batch.k_cache.float() * k_scale[:, None],
        "v_cache": batch.v_cache.float() * v_scale[:, None],
    })
    expected = dequantized.run(reference.paged_attention)
    torch.testing.assert_close(attention(reference.paged_attention, batch, k_scale, v_scale), expected)


@pytest.mark.parametrize("with_new_rows", [False, True], ids=["cache", "new-rows-ignored"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_paged_attention(ops, dtype, with_new_rows):
    # decodes, a fresh prompt, a chunk over a cached prefix (crossing tiles and pages)
    batch, k_scale, v_scale = quantized(
        make_batch([17, 64, 70, 99], [1, 1, 70, 33], num_kv_heads=2, group=3, dtype=dtype)
    )
    out = attention(ops.paged_attention, batch, k_scale, v_scale, with_new_rows)
    expected = attention(reference.paged_attention, batch, k_scale, v_scale)
    rtol = 4 * ULP[dtype]
    assert_close(out, expected, rtol=rtol, atol=rtol)


def fp8_decode_step(context_lens, **kwargs):
    step = make_decode_step(context_lens, **kwargs)
    step.batch, k_scale, v_scale = quantized(step.batch)
    return step, k_scale, v_scale


def check_fp8_decode_step(decode_attention, step, k_scale, v_scale, rtol: float) -> None:
    b = step.batch
    caches = {}
    outs = {}
    for name, fn in (("expected", reference.decode_attention), ("actual", decode_attention)):
        caches[name] = (b.k_cache.clone(), b.v_cache.clone())
        outs[name] = fn(
            step.positions, step.q, step.k, step.v, step.cos_sin_cache, *caches[name], step.slot_mapping,
            b.block_tables, b.seq_lens, b.scale, b.seq_lens_cpu, k_scale=k_scale, v_scale=v_scale,
        )
    assert_close(outs["actual"], outs["expected"], rtol=rtol, atol=rtol)
    for a, e in zip(caches["actual"], caches["expected"]):
        # the new rows: one fp8 rounding of the same rotated value (compiled RoPE may differ by
        # a unit of the activations' dtype, at most one fp8 step)
        diff = (a.float() - e.float()).abs()
        assert (diff <= e.float().abs() * 2**-3 + 2**-9).all()
        assert (a.view(torch.uint8) != e.view(torch.uint8)).sum() <= diff.numel() // 1000 + 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_decode_attention_fused(ops, dtype):
    step, k_scale, v_scale = fp8_decode_step([1, 17, 64, 0, 99], group=3, num_kv_heads=2, dtype=dtype)
    check_fp8_decode_step(ops.decode_attention, step, k_scale, v_scale, 4 * ULP[dtype])


def test_fp8_ops_need_scales(ops):
    batch, _, _ = quantized(make_batch([17], [1]))
    with pytest.raises(ValueError, match="an fp8 KV cache needs k_scale"):
        attention(ops.paged_attention, batch, None, None)
    with pytest.raises(ValueError, match=r"v_scale must have shape \(2,\)"):
        attention(ops.paged_attention, batch, torch.ones(2), torch.ones(3))


@gpu
@pytest.mark.parametrize("kind", ["decode", "mixed", "mixed-new-rows"])
@pytest.mark.parametrize("group, block_size, head_dim", [(4, 16, 128), (3, 64, 64)])
def test_gpu_fp8_paged_attention(kind, group, block_size, head_dim):
    contexts = random_contexts(64, 1, 4096, seed=block_size + group)
    queries = [1] * 64
    if kind != "decode":
        contexts[:3], queries[:3] = [1000, 6144, 77], [1000, 2048, 0]
    batch, k_scale, v_scale = quantized(make_batch(
        contexts, queries, num_kv_heads=8, group=group, head_dim=head_dim, block_size=block_size,
        dtype=torch.bfloat16, device="cuda",
    ))
    out = attention(triton_ops.paged_attention, batch, k_scale, v_scale, kind == "mixed-new-rows")
    expected = attention(reference.paged_attention, batch, k_scale, v_scale)
    rows = batch.query_start_loc_cpu[-1]
    tol = GPU_ATTENTION_TOL[torch.bfloat16]
    assert_close(out[:rows], expected[:rows], rtol=tol, atol=tol / 4)


@gpu
@pytest.mark.parametrize("num_seqs", [1, 64])
def test_gpu_fp8_decode_attention_fused(num_seqs):
    contexts = random_contexts(num_seqs, 1, 2048, seed=num_seqs)
    if num_seqs > 1:
        contexts[:2] = [0, 1]
    step, k_scale, v_scale = fp8_decode_step(
        contexts, group=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda", block_size=16,
    )
    check_fp8_decode_step(triton_ops.decode_attention, step, k_scale, v_scale, GPU_ATTENTION_TOL[torch.bfloat16])


@gpu
def test_gpu_fp8_store_kv_matches_reference_bytes():
    gen = torch.Generator(device="cuda").manual_seed(0)
    key = torch.randn(8192, 8, 128, generator=gen, device="cuda").to(torch.bfloat16) * 4
    value = torch.randn(8192, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(8192 + 256, device="cuda")[:8192]
    k_scale, v_scale = scales(8, "cuda")
    expected = [torch.zeros(8192 // 16 + 16, 16, 8, 128, dtype=FP8, device="cuda") for _ in "kv"]
    actual = [t.clone() for t in expected]
    reference.store_kv(key, value, *expected, slots, k_scale, v_scale)
    triton_ops.store_kv(key, value, *actual, slots, k_scale, v_scale)
    for a, e in zip(actual, expected):
        assert torch.equal(a.view(torch.uint8), e.view(torch.uint8))
