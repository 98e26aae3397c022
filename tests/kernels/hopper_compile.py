"""Compile every Triton kernel of the op set for Hopper (sm_90) on a machine without a GPU.

The interpreter runs a kernel as Python: it checks no types, so a kernel can pass every
interpreted test and still fail the GPU compiler (a runtime branch that gives a variable another
type, a dot of shapes the tensor cores lack, an fp8 type sm_90 does not have). Here the op
wrappers run on CPU tensors as they would on an H100: Triton's driver names an sm_90 target, every
launch is turned into a compile (``JITFunction.run`` with ``warmup``: nothing runs), the wrappers'
device checks accept the CPU tensors, and programmatic dependent launch and the multiprocessor
count are the H100's. Each case calls one op in the configurations the engine uses (bf16 and
fp32 activations, fp8 caches and weights, windows, q/k norms, split-K, the batch-1 forms). Prints,
a line per case, the kernels it compiled; any failure raises.

``--resources``: instead, the decode step's kernels at the engine's shapes and batch sizes (see
``RESOURCE_CASES``), one JSON line each (``loadtest.stamp.emit``): registers and spills (ptxas -v),
shared memory, programs an SM holds by each, the launch's programs and the waves they take on 132
SMs. These are what the compiler decides, not timings: where a kernel runs below its roofline with
programs to spare, its occupancy is the first suspect.

    python tests/kernels/hopper_compile.py [--resources]     (TRITON_INTERPRET unset)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import NamedTuple

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET: the kernels are compiled, not interpreted")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from kernels import QKNorm, triton_ops
from kernels.triton_ops import _checks, attention, fp8, fused_decode, gemv
from loadtest.stamp import emit

H100_SMS = 132
SM_REGISTERS, SM_SHARED_BYTES, SM_MAX_WARPS, SM_MAX_PROGRAMS = 65536, 227 * 1024, 64, 32
BF16, FP32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn


class Launch(NamedTuple):
    """A compiled kernel and the grid the wrapper launched it with."""

    kernel: object  # triton's CompiledKernel
    grid: tuple[int, ...]


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


def compile_only() -> list[Launch]:
    """Install the offline driver and turn launches into compiles; returns the list each launch's
    compiled kernel is appended to."""
    compiled: list[Launch] = []
    run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(Launch(kernel, tuple(grid)))
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


def decode_step(shape: str, batch: int, context: int) -> None:
    """One decode step's kernels at a model's shape: the fused decode attention (its tiles and splits
    as the engine picks them, the block table at the shape's max_model_len) and, at batch 1, the
    bf16 and fp8 GEMVs of a layer's four projections."""
    heads, kv_heads, head_dim, hidden, inter, max_model_len = RESOURCE_SHAPES[shape]
    k_cache, v_cache, _, _ = _cache(256, 16, kv_heads, head_dim, BF16)
    tables = torch.zeros(batch, max_model_len // 16, dtype=torch.int32)
    qkv = _t(batch, (heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    lens = [context] * batch
    triton_ops.decode_attention(
        torch.tensor(lens) - 1, q.view(batch, heads, head_dim), k.view(batch, kv_heads, head_dim),
        v.view(batch, kv_heads, head_dim), triton_ops.rope_cos_sin_cache(head_dim, context, 1e6, dtype=BF16),
        k_cache, v_cache, torch.arange(batch), tables, torch.tensor(lens, dtype=torch.int32), head_dim**-0.5, lens,
    )
    if batch == 1:
        for weight_dtype in (BF16, FP8):
            projections(heads * head_dim, kv_heads * head_dim, hidden, inter, weight_dtype)


def projections(q_width: int, kv_width: int, hidden: int, inter: int, weight_dtype: torch.dtype) -> None:
    """A batch-1 layer's four projections as the model runs them (the norms fused into qkv and gate_up)."""
    def weight(rows: int, columns: int) -> dict:
        scale = dict(weight_scale=torch.ones(rows)) if weight_dtype == FP8 else {}
        return dict(weight=_t(rows, columns, dtype=weight_dtype), **scale)

    x, norm = _t(1, hidden), _t(hidden)
    triton_ops.norm_linear(x, norm, 1e-6, _t(1, hidden), **weight(q_width + 2 * kv_width, hidden))
    triton_ops.linear(_t(1, q_width), **weight(hidden, q_width))
    triton_ops.norm_linear(x, norm, 1e-6, _t(1, hidden), gated=True, **weight(2 * inter, hidden))
    triton_ops.linear(_t(1, inter), **weight(hidden, inter))


# heads, kv heads, head_dim, hidden, intermediate, max_model_len (as benchmarks/gpu_bench.py runs them)
RESOURCE_SHAPES = {
    "smollm2-135m": (9, 3, 64, 576, 1536, 2048),
    "qwen3-0.6b": (16, 8, 128, 1024, 3072, 4096),
    "llama3-8b": (32, 8, 128, 4096, 14336, 8192),
}
RESOURCE_CASES = [(shape, batch, 640) for shape in RESOURCE_SHAPES for batch in (1, 64, 256)]


PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")  # Triton's own


def resources(launch: Launch) -> dict:
    """What ptxas decides for a compiled kernel, and what that leaves an SM."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(launch.kernel.asm["ptx"])
        ptx.flush()
        report = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", ptx.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report)[1])
    spill_stores = int(re.search(r"(\d+) bytes spill stores", report)[1])
    warps = launch.kernel.metadata.num_warps
    shared = launch.kernel.metadata.shared
    by_registers = SM_REGISTERS // (-(-registers // 8) * 8 * 32 * warps)
    by_shared = SM_SHARED_BYTES // shared if shared else SM_MAX_PROGRAMS
    per_sm = min(by_registers, by_shared, SM_MAX_WARPS // warps, SM_MAX_PROGRAMS)
    programs = 1
    for size in launch.grid:
        programs *= size
    return dict(kernel=launch.kernel.name, grid=list(launch.grid), num_warps=warps, registers=registers,
                spill_stores=spill_stores, shared_bytes=shared, programs_per_sm_by_registers=by_registers,
                programs_per_sm_by_shared=by_shared, programs_per_sm=per_sm, programs=programs,
                waves=round(programs / (H100_SMS * per_sm), 2))


def main() -> None:
    compiled = compile_only()
    if "--resources" in sys.argv[1:]:
        for shape, batch, context in RESOURCE_CASES:
            before = len(compiled)
            decode_step(shape, batch, context)
            for launch in compiled[before:]:
                emit(bench="kernel_resources", target="sm_90a", triton=triton.__version__, shape=shape, batch=batch,
                     context=context, **resources(launch))
        return
    for name, case in CASES.items():
        before = len(compiled)
        case()
        print(f"{name}: {', '.join(sorted({launch.kernel.name for launch in compiled[before:]}))}", flush=True)


if __name__ == "__main__":
    main()
