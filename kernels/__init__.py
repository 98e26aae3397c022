"""Kernels: Triton implementations and their torch reference twins (same signatures)."""

from __future__ import annotations

from types import ModuleType

BACKENDS = ("torch", "triton")


def load_ops(backend: str) -> ModuleType:
    """The op set of ``backend``: a module exposing store_kv, paged_attention, decode_attention,
    rms_norm, rope_cos_sin_cache, rotary_embedding, silu_and_mul, linear, norm_linear and argmax."""
    if backend == "torch":
        from kernels import reference

        return reference
    if backend == "triton":
        from kernels import triton_ops

        return triton_ops
    raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
