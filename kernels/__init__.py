"""Kernels: Triton implementations and their torch reference twins (same signatures)."""

from __future__ import annotations

from types import ModuleType

BACKENDS = ("torch",)


def load_ops(backend: str) -> ModuleType:
    """The op set of ``backend``: a module exposing store_kv, paged_attention, rms_norm,
    rope_cos_sin_cache, rotary_embedding and silu_and_mul."""
    if backend == "torch":
        from kernels import reference

        return reference
    raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
