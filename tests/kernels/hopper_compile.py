"""Compile every Triton kernel of the op set for Hopper (sm_90) on a machine without a GPU.

The interpreter runs a kernel as Python: it checks no types, so a kernel can pass every
interpreted test and still fail the GPU compiler (a runtime branch that gives a variable another
type, a dot of shapes the tensor cores lack, an fp8 type sm_90 does not have). Here the op
wrappers run on CPU tensors as they would on an H100: Triton's driver names an sm_90 target, every
launch is turned into a compile (``JITFunction.run`` with ``warmup``: nothing runs), the wrappers'
device checks accept the CPU tensors, and programmatic dependent launch and the multiprocessor
count are the H100's. Each case calls one op in the configurations the engine uses (bf16 and
fp32 activations, fp8 caches and weights, windows, q/k norms, split-K, the batch-1 forms). Prints
the kernels compiled, one line each; any failure raises.

    python tests/kernels/hopper_compile.py      (TRITON_INTERPRET unset)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET: the kernels are compiled, not interpreted")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from kernels import QKNorm, triton_ops
from kernels.triton_ops import _checks, attention, fp8, fused_decode, gemv

H100_SMS = 132
BF16, FP32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn


class OfflineHopper(DriverBase):
    """A driver that names an sm_90 target and launches nothing."""

    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def compile_only() -> list[str]:
    """Install the offline driver and turn launches into compiles; returns the list the compiled
    kernels' names are appended to."""
    compiled: list[str] = []
    run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(kernel.name)
        return kernel

    driver.set_active(OfflineHopper())
    JITFunction.run = compile_instead
    _checks._INTERPRETED = True  # the device checks: CPU tensors stand in for CUDA ones
    gemv._INTERPRETED = True  # the GEMV dispatch, likewise (its tiles were chosen at import: the GPU's)
    for module in (attention, fp8, fused_decode, gemv):
        if hasattr(module, "_pdl_args"):
            module._pdl_args = lambda device: dict(USE_PDL=True, launch_pdl=True)
        if hasattr(module, "_num_sms"):
            module._num_sms = lambda device: H100_SMS
    return compiled


def _t(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.zeros(shape, dtype=FP32).to(dtype)


def _cache(blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """(k_cache, v_cache, k_scale, v_scale): scales for an fp8 cache, else None."""
    scales = (torch.ones(kv_heads), torch.ones(kv_heads)) if dtype == FP8 else (None, None)
    return (*(_t(blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(2)), *scales)


def attention_cases(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                    cache_dtype: torch.dtype, window: int | None) -> None:
    """paged_attention on a decode batch wide enough to split, a mixed batch with the chunks' own
    keys (TMA), and decode_attention at batch 1 and batch 4 (with q/k norms)."""
    k_cache, v_cache, k_scale, v_scale = _cache(256, block_size, kv_heads, head_dim, cache_dtype)
    width = 4096 // block_size
    tables = torch.arange(width, dtype=torch.int32).remainder(256).repeat(4, 1)
    scale = head_dim**-0.5
    for q_lens in ([1, 1, 1, 1], [64, 33, 1, 0]):
        lens = [3000, 900, 70, 20]
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        tokens = starts[-1]
        key, value = _t(tokens, kv_heads, head_dim, dtype=dtype), _t(tokens, kv_heads, head_dim, dtype=dtype)
        new_rows = dict(key=key, value=value) if cache_dtype != FP8 else {}  # an fp8 cache's are read from it
        triton_ops.paged_attention(
            _t(tokens, heads, head_dim, dtype=dtype), k_cache, v_cache, tables,
            torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32), scale, lens, starts,
            sliding_window=window, k_scale=k_scale, v_scale=v_scale, **new_rows,
        )
    cos_sin = triton_ops.rope_cos_sin_cache(head_dim, 4096, 10000.0, dtype=dtype)
    for batch, norm in ((1, None), (4, QKNorm(_t(head_dim, dtype=dtype), _t(head_dim, dtype=dtype), 1e-6))):
        qkv = _t(batch, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
        lens = [700 + i for i in range(batch)]
        triton_ops.decode_attention(
            torch.tensor(lens) - 1, q.view(batch, heads, head_dim), k.view(batch, kv_heads, head_dim),
            v.view(batch, kv_heads, head_dim), cos_sin, k_cache, v_cache, torch.arange(batch, dtype=torch.int64),
            tables[:batch], torch.tensor(lens, dtype=torch.int32), scale, lens, sliding_window=window,
            k_scale=k_scale, v_scale=v_scale, qk_norm=norm,
        )
    triton_ops.store_kv(key, value, k_cache, v_cache, torch.arange(key.shape[0]), k_scale, v_scale)


def layer_cases(hidden: int, inter: int, dtype: torch.dtype) -> None:
    """The norms, RoPE, SiLU-and-mul, and the GEMVs (bf16 and fp8 weights, batch 1 and decode batches)."""
    for rows in (1, 4):
        x = _t(rows, hidden, dtype=dtype)
        norm = _t(hidden, dtype=dtype)
        triton_ops.rms_norm(x, norm, 1e-6)
        triton_ops.rms_norm(x, norm, 1e-6, _t(rows, hidden, dtype=dtype))
        triton_ops.silu_and_mul(_t(rows, 2 * inter, dtype=dtype))
        weight = _t(inter, hidden, dtype=dtype)
        triton_ops.linear(x, weight)
        triton_ops.norm_linear(x, norm, 1e-6, _t(rows, hidden, dtype=dtype), _t(2 * inter, hidden, dtype=dtype),
                               gated=True)
        if dtype == BF16:
            for fp8_rows in (rows, 64):
                y = _t(fp8_rows, hidden)
                triton_ops.linear(y, _t(inter, hidden, dtype=FP8), torch.ones(inter))
                triton_ops.norm_linear(y, norm, 1e-6, _t(fp8_rows, hidden), _t(2 * inter, hidden, dtype=FP8),
                                       gated=True, weight_scale=torch.ones(2 * inter))
            fp8.quantize_rows(_t(300, hidden))
    positions = torch.arange(8)
    q, k = _t(8, 8, 128, dtype=dtype), _t(8, 2, 128, dtype=dtype)
    cos_sin = triton_ops.rope_cos_sin_cache(128, 64, 10000.0, dtype=dtype)
    triton_ops.rotary_embedding(positions, q, k, cos_sin)
    triton_ops.rotary_embedding(positions, q, k, cos_sin, QKNorm(_t(128, dtype=dtype), _t(128, dtype=dtype), 1e-6))


def sampling_cases(dtype: torch.dtype) -> None:
    for rows, vocab in ((1, 49152), (256, 151936), (3, 1000)):
        logits = _t(rows, vocab, dtype=dtype)
        triton_ops.argmax(logits)
        inv_temperature = torch.ones(rows)
        triton_ops.sample_argmax(logits, inv_temperature, 7)
        triton_ops.sample_argmax(logits, inv_temperature, torch.tensor([7]))


CASES: dict[str, Callable[[], None]] = {
    "attention llama3-8b bf16": lambda: attention_cases(32, 8, 128, 16, BF16, BF16, None),
    "attention llama3-8b bf16, fp8 cache": lambda: attention_cases(32, 8, 128, 16, BF16, FP8, None),
    "attention smollm2 fp32": lambda: attention_cases(9, 3, 64, 16, FP32, FP32, None),
    "attention gemma3 bf16, window": lambda: attention_cases(4, 1, 256, 16, BF16, BF16, 512),
    "layer llama3-8b bf16": lambda: layer_cases(4096, 14336, BF16),
    "layer smollm2 fp32": lambda: layer_cases(576, 1536, FP32),
    "sampling bf16": lambda: sampling_cases(BF16),
    "sampling fp32": lambda: sampling_cases(FP32),
}


def main() -> None:
    compiled = compile_only()
    for name, case in CASES.items():
        before = len(compiled)
        case()
        print(f"{name}: {', '.join(sorted(set(compiled[before:])))}", flush=True)


if __name__ == "__main__":
    main()
