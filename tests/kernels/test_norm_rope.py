"""rms_norm, rotary_embedding and silu_and_mul against the reference."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, ULP, assert_close, assert_rounded_equal, gpu

from kernels import QKNorm, reference, triton_ops


def rms_norm_inputs(shape, dtype, with_residual, strided, device="cpu"):
    gen = torch.Generator().manual_seed(4)
    width = shape[-1]
    x = torch.randn(*shape[:-1], 2 * width if strided else width, generator=gen).to(dtype)[..., :width]
    residual = torch.randn(shape, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    to = dict(device=device)
    return x.to(**to), weight.to(**to), None if residual is None else residual.to(**to)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape, strided", [((7, 72), False), ((3, 4, 40), True)], ids=["2d", "3d-strided"])
def test_rms_norm(ops, dtype, with_residual, shape, strided):
    x, weight, residual = rms_norm_inputs(shape, dtype, with_residual, strided)
    normed, new_residual = ops.rms_norm(x, weight, 1e-5, residual)
    assert normed.dtype == dtype and normed.shape == x.shape
    if residual is None:
        assert new_residual is x
    else:  # one rounding of the same fp32 sum
        assert_rounded_equal(new_residual, x + residual)
    assert_close(normed, reference.rms_norm(new_residual, weight, 1e-5)[0], rtol=ULP[dtype])


def test_rms_norm_rejects_bad_inputs(ops):
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        ops.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="residual must match x"):
        ops.rms_norm(x, torch.ones(8), 1e-5, x.half())


def rotary_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, cache_dtype, device="cpu"):
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    cache = reference.rope_cos_sin_cache(head_dim, 4096, 10000.0, dtype=cache_dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    to = dict(device=device)
    return positions.to(**to), q.to(**to), k.to(**to), cache.to(**to)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, cache_dtype",
    [(4, 2, 16, torch.float32), (9, 3, 64, torch.float32), (6, 6, 32, torch.bfloat16)],
)
def test_rotary_embedding(ops, dtype, num_heads, num_kv_heads, head_dim, cache_dtype):
    inputs = rotary_inputs(9, num_heads, num_kv_heads, head_dim, dtype, cache_dtype)
    q, k = ops.rotary_embedding(*inputs)
    expected_q, expected_k = reference.rotary_embedding(*inputs)
    assert q.is_contiguous() and k.is_contiguous()
    assert_close(q, expected_q, rtol=ULP[dtype])
    assert_close(k, expected_k, rtol=ULP[dtype])


def qk_norm_for(head_dim: int, dtype: torch.dtype, device: str = "cpu") -> QKNorm:
    gen = torch.Generator().manual_seed(7)
    q_weight, k_weight = (1 + 0.3 * torch.randn(2, head_dim, generator=gen)).to(dtype)
    return QKNorm(q_weight.to(device), k_weight.to(device), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 16), (6, 1, 24)])
def test_rotary_embedding_with_qk_norm(ops, dtype, num_heads, num_kv_heads, head_dim):
    """The per-head q/k norms inside the RoPE launch: each head normed and rounded, then rotated,
    as the reference composes rms_norm and rotary_embedding."""
    inputs = rotary_inputs(9, num_heads, num_kv_heads, head_dim, dtype, torch.float32)
    qk_norm = qk_norm_for(head_dim, dtype)
    q, k = ops.rotary_embedding(*inputs, qk_norm)
    positions, q_in, k_in, cache = inputs
    expected_q, expected_k = reference.rotary_embedding(
        positions, reference.rms_norm(q_in, qk_norm.q_weight, 1e-6)[0],
        reference.rms_norm(k_in, qk_norm.k_weight, 1e-6)[0], cache,
    )
    assert torch.equal(reference.rotary_embedding(*inputs, qk_norm)[0], expected_q)  # the twin composes the same
    # The interpreter truncates the normed bf16 values where the reference rounds them: rotated,
    # a unit in the last place of the inputs' magnitude (below 8) apart.
    atol = 8 * ULP[dtype] if dtype == torch.bfloat16 else 1e-5
    assert_close(q, expected_q, rtol=ULP[dtype], atol=atol)
    assert_close(k, expected_k, rtol=ULP[dtype], atol=atol)
    assert not torch.allclose(q.float(), reference.rotary_embedding(*inputs)[0].float(), rtol=0.1)  # it normed


def test_rotary_embedding_rejects_bad_inputs(ops):
    positions, q, k, cache = rotary_inputs(3, 2, 1, 16, torch.float32, torch.float32)
    with pytest.raises(ValueError, match=r"cos_sin_cache must have shape \(max_position, 16\)"):
        ops.rotary_embedding(positions, q, k, cache[:, :8])
    with pytest.raises(ValueError, match="positions must have dtype"):
        ops.rotary_embedding(positions.float(), q, k, cache)
    with pytest.raises(ValueError, match=r"qk_norm.k_weight must have shape \(16,\)"):
        ops.rotary_embedding(positions, q, k, cache, QKNorm(torch.ones(16), torch.ones(8), 1e-6))
    with pytest.raises(ValueError, match="qk_norm.eps must be > 0"):
        ops.rotary_embedding(positions, q, k, cache, QKNorm(torch.ones(16), torch.ones(16), 0.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 80), (2, 3, 2 * 1100)])
def test_silu_and_mul(ops, dtype, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(6)).to(dtype) * 4
    out = ops.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    assert_close(out, reference.silu_and_mul(x.float()).to(dtype), rtol=ULP[dtype])


def test_silu_and_mul_rejects_odd_width(ops):
    with pytest.raises(ValueError, match="last dim must be even"):
        ops.silu_and_mul(torch.randn(3, 7))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_rms_norm(dtype, with_residual):
    x, weight, residual = rms_norm_inputs((4096, 4096), dtype, with_residual, strided=False, device="cuda")
    normed, new_residual = triton_ops.rms_norm(x, weight, 1e-5, residual)
    expected_normed, expected_residual = reference.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, expected_residual)
    assert_close(normed, expected_normed, rtol=ULP[dtype], atol=1e-4)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_rotary_embedding(dtype):
    inputs = rotary_inputs(8192, 32, 8, 128, dtype, torch.float32, device="cuda")
    q, k = triton_ops.rotary_embedding(*inputs)
    expected_q, expected_k = reference.rotary_embedding(*inputs)
    assert_close(q, expected_q, rtol=ULP[dtype], atol=1e-4)
    assert_close(k, expected_k, rtol=ULP[dtype], atol=1e-4)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_rotary_embedding_with_qk_norm(dtype):
    inputs = rotary_inputs(8192, 32, 8, 128, dtype, torch.float32, device="cuda")
    qk_norm = qk_norm_for(128, dtype, "cuda")
    q, k = triton_ops.rotary_embedding(*inputs, qk_norm)
    expected_q, expected_k = reference.rotary_embedding(*inputs, qk_norm)
    # the norm's sum of squares runs in another order: a normed value rounded a unit apart is
    # rotated, a unit of the inputs' magnitude (below 8) apart
    atol = max(8 * ULP[dtype], 1e-4)
    assert_close(q, expected_q, rtol=ULP[dtype], atol=atol)
    assert_close(k, expected_k, rtol=ULP[dtype], atol=atol)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_silu_and_mul(dtype):
    x = torch.randn(4096, 2 * 14336, device="cuda").to(dtype)
    expected = reference.silu_and_mul(x.float()).to(dtype)
    assert_close(triton_ops.silu_and_mul(x), expected, rtol=ULP[dtype], atol=1e-4)
