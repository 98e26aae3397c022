"""store_kv: one program per token writes its K/V rows into their paged slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
from kernels.triton_ops.fp8 import to_fp8


@triton.jit
def _to_cache(x, scale, cache_ptr):
    """``x`` as a cache of ``cache_ptr``'s type stores it: with a ``scale`` (an fp8 cache), ``x / scale``
    in fp8 (see ``to_fp8``)."""
    if scale is not None:
        y = to_fp8(x, scale)
    else:
        y = x.to(cache_ptr.dtype.element_ty)
    return y


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
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
    k_scale = None
    v_scale = None
    if k_scale_ptr is not None:
        k_scale = tl.load(k_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0)
        v_scale = tl.load(v_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0)
    k = tl.load(key_ptr + token * key_stride_t + h * key_stride_h + d, mask=mask)
    tl.store(k_cache_ptr + dst, _to_cache(k, k_scale, k_cache_ptr), mask=mask)
    v = tl.load(value_ptr + token * value_stride_t + h * value_stride_h + d, mask=mask)
    tl.store(v_cache_ptr + dst, _to_cache(v, v_scale, v_cache_ptr), mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    _check_kv_cache(k_cache, v_cache)
    k_scale, v_scale = _kv_scales(k_cache, k_scale, v_scale)
    _check_tensor("key", key, 3, _FLOAT_DTYPES)
    _check_tensor("value", value, 3, _FLOAT_DTYPES)
    _check_tensor("slot_mapping", slot_mapping, 1, _INDEX_DTYPES)
    num_tokens = key.shape[0]
    kv_shape = (num_tokens, *k_cache.shape[2:])
    _check(tuple(key.shape) == kv_shape, lambda: f"key must have shape {kv_shape}, got {tuple(key.shape)}")
    _check(tuple(value.shape) == kv_shape, lambda: f"value must have shape {kv_shape}, got {tuple(value.shape)}")
    _check(
        tuple(slot_mapping.shape) == (num_tokens,),
        lambda: f"slot_mapping must have shape ({num_tokens},), got {tuple(slot_mapping.shape)}",
    )
    _check_last_dim_contiguous("key", key)
    _check_last_dim_contiguous("value", value)
    _check(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    _check_devices(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        num_warps=4,
    )
