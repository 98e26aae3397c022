"""store_kv against the reference."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import assert_rounded_equal, gpu

from kernels import reference, triton_ops


def run_store_kv(store_kv, num_tokens, num_kv_heads, head_dim, block_size, key_dtype, cache_dtype, device):
    gen = torch.Generator().manual_seed(3)
    num_blocks = math.ceil(num_tokens / block_size) + 2
    width = (2 * num_kv_heads + 1) * head_dim
    kv = torch.randn(num_tokens, width, generator=gen).to(key_dtype)
    # Strided views of a fused projection; every third token is padding (slot -1).
    key = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(cache_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    to = dict(device=device)
    k_cache, v_cache = k_cache.to(**to), v_cache.to(**to)
    store_kv(key.to(**to), value.to(**to), k_cache, v_cache, slots.to(**to))
    assert_rounded_equal(k_cache.cpu(), expected_k)
    assert_rounded_equal(v_cache.cpu(), expected_v)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(
    "key_dtype, cache_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
     (torch.float32, torch.bfloat16)],
)
def test_store_kv(ops, key_dtype, cache_dtype, block_size):
    run_store_kv(ops.store_kv, 21, 3, 24, block_size, key_dtype, cache_dtype, "cpu")


def test_store_kv_rejects_bad_inputs(ops):
    key = torch.randn(4, 2, 8)
    cache = torch.zeros(2, 16, 2, 8)
    with pytest.raises(ValueError, match=r"slot_mapping must have dtype"):
        ops.store_kv(key, key, cache, cache, torch.zeros(4))
    with pytest.raises(ValueError, match=r"value must have shape \(4, 2, 8\)"):
        ops.store_kv(key, key[:, :1], cache, cache, torch.zeros(4, dtype=torch.int64))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_store_kv(dtype, block_size):
    run_store_kv(triton_ops.store_kv, 8192, 8, 128, block_size, dtype, dtype, "cuda")
