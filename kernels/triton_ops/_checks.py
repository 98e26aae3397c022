"""Host-side checks of the Triton op wrappers: each raises ValueError naming the argument."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

# Decided once, exactly as triton.jit decides between compiled and interpreted kernels.
_INTERPRETED = bool(triton.knobs.runtime.interpret)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KV_DTYPES = (*_FLOAT_DTYPES, torch.float8_e4m3fn)  # fp8 pages hold x / scale (see kernels.KernelOps)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_HEAD_DIM = 256


def _check(condition: bool, message: str | Callable[[], str]) -> None:
    """A message that formats values comes as a callable: the wrappers check every launch, and formatting
    shapes, strides and dtypes each time cost an eager step's launches several milliseconds."""
    if not condition:
        raise ValueError(message() if callable(message) else message)


def _check_tensor(name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    _check(isinstance(t, torch.Tensor), lambda: f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check(t.dim() == ndim, lambda: f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    _check(t.dtype in dtypes, lambda: f"{name} must have dtype in {dtypes}, got {t.dtype}")


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    _check(
        t.shape[-1] <= 1 or t.stride(-1) == 1,
        lambda: f"{name} must be contiguous in its last dim, got strides {t.stride()}",
    )


def _check_devices(**tensors: torch.Tensor) -> None:
    (first_name, first), *others = tensors.items()
    device = first.device
    for name, t in others:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {device}")
    _check(
        device.type == "cuda" or _INTERPRETED,
        lambda: f"Triton kernels need CUDA tensors, got {first_name} on {device} "
        "(set TRITON_INTERPRET=1 before importing triton to run them on the CPU)",
    )


def _as_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t[..., n]`` viewed as ``[a, b, n]`` without a copy: row ``(i, j)`` starts at
    ``i * stride(0) + j * stride(1)``, so strided 3-d views (q from a fused qkv) need no copy."""
    _check(t.dim() >= 1, lambda: f"{name} must have at least one dim")
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


def _check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _check_tensor("k_cache", k_cache, 4, _KV_DTYPES)
    _check_tensor("v_cache", v_cache, 4, _KV_DTYPES)
    _check(
        k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(),
        lambda: f"k_cache and v_cache must share shape and strides, got {tuple(k_cache.shape)} "
        f"{k_cache.stride()} and {tuple(v_cache.shape)} {v_cache.stride()}",
    )
    _check(k_cache.dtype == v_cache.dtype, lambda: f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    _check_last_dim_contiguous("k_cache", k_cache)
    _check(k_cache.shape[-1] <= _MAX_HEAD_DIM, lambda: f"head_dim must be <= {_MAX_HEAD_DIM}, got {k_cache.shape[-1]}")


def _kv_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The per-kv-head scales an fp8 cache needs (checked), or ``(None, None)`` for a cache
    that holds values as they are (its kernels then compile without them)."""
    if k_cache.dtype != torch.float8_e4m3fn:
        return None, None
    num_kv_heads = k_cache.shape[2]
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check(t is not None, f"an fp8 KV cache needs {name}")
        _check_tensor(name, t, 1, (torch.float32,))
        if tuple(t.shape) != (num_kv_heads,):
            raise ValueError(f"{name} must have shape ({num_kv_heads},), got {tuple(t.shape)}")
        _check(t.is_contiguous(), f"{name} must be contiguous")
    _check_devices(k_cache=k_cache, k_scale=k_scale, v_scale=v_scale)
    return k_scale, v_scale
