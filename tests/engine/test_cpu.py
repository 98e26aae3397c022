"""The CPU engine's matmul paths (engine.models.cpu) and host (engine.cpu): the transposed fp32
layout against F.linear and the unmodified model, int8 and int4 weights against their dequantized
values and the fp32 engine's greedy tokens, the lazily committed KV pool, the thread governor."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from paged import PagedKV, clone

import engine.cpu
from benchmarks.accuracy import agreement, generate, smollm2_prompts
from engine.config import SLIDING_ATTENTION, EngineConfig
from engine.core import EngineCore
from engine.cpu import GOVERNOR_WINDOW_S, ThreadGovernor, lazy_zeros, resident_bytes
from engine.models import cpu_kernels
from engine.models.cpu import (
    INT4_GROUP,
    NATIVE_BF16,
    CpuOps,
    Fp32Matmul,
    Int4,
    Int8,
    Int8DecoderStack,
    quantize,
    quantized_as,
    transpose_weights,
)
from engine.models.fp8 import quantize_fp8
from engine.models.llama import LlamaForCausalLM
from kernels import QKNorm, load_ops, reference


@pytest.mark.parametrize("rows", [1, 2, 7, 300])
def test_fp32_matmul_is_f_linear(rows):
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(96, 64, generator=g), torch.randn(rows, 64, generator=g)
    torch.testing.assert_close(Fp32Matmul(weight)(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)


# 5 rows go through kvgate's kernel, 12 through torch's packed one, 300 widen the weights to bf16 (where
# the CPU has native bf16; fp32 rows elsewhere widen them to fp32)
@pytest.mark.parametrize("rows", [5, 12, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matmul_is_the_product_of_its_dequantized_weights(dtype, rows):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=g) * torch.rand(96, 1, generator=g)  # rows of different ranges
    x = torch.randn(rows, 64, generator=g).to(dtype)
    matmul = Int8(weight)
    assert matmul.weight.dtype == torch.int8 and matmul.weight.abs().max() == 127  # each row's maximum hits 127
    dequantized = matmul.weight.float() * matmul.scale.float()[:, None]
    assert (dequantized - weight).abs().max() <= weight.abs().amax() / 127  # at most one step off, in bf16 scales
    out = matmul(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), x.bfloat16().float() @ dequantized.T, atol=0.05, rtol=0.02)


@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(1, 96, 64), (3, 98, 72), (8, 7, 13), (2, 4, 576)])
def test_int8_gemv_is_the_fp32_product_and_each_rows_own(rows, out_features, in_features):
    # out-features not a multiple of the kernel's tile of 4 rows, in-features not of its 8 lanes
    kernels = cpu_kernels.load()
    assert kernels is not None, "the box has a C compiler"
    gemv = kernels.int8_gemv
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    scale, x = torch.rand(out_features, generator=g), torch.randn(rows, in_features, generator=g)
    out = gemv(x, w, scale)
    torch.testing.assert_close(out, (x.double() @ (w.double() * scale.double()[:, None]).T).float(),
                               atol=1e-4, rtol=1e-5)
    # a row's result is bit for bit the same alone, in any batch and with any thread count
    alone = torch.cat([gemv(x[i : i + 1], w, scale) for i in range(rows)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(out, alone) and torch.equal(out, gemv(x, w, scale))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 5])
def test_cpu_kernels_norm_and_silu_are_the_reference_ops(rows):
    kernels = cpu_kernels.load()
    g = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(rows, 96, generator=g), torch.randn(rows, 96, generator=g),
                           torch.randn(96, generator=g))
    for res in (None, residual):
        normed, new_residual = kernels.rms_norm(x, weight, 1e-5, res)
        expected, expected_residual = reference.rms_norm(x, weight, 1e-5, res)
        torch.testing.assert_close(normed, expected, atol=2e-6, rtol=1e-6)
        assert torch.equal(new_residual, expected_residual) and (res is not None or new_residual is x)
    gate_up = torch.randn(rows, 2 * 80, generator=g) * 4
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [None, 20])
def test_cpu_kernels_decode_attention_is_the_reference_op(window):
    # three sequences of 37, 1 and 0 (a padding row) keys over scattered pages; q/k/v views of one qkv
    kernels = cpu_kernels.load()
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block, blocks = 6, 2, 16, 8, 20
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=g)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    q, k, v = q.view(3, heads, dim), k.view(3, kv_heads, dim), v.view(3, kv_heads, dim)
    k_cache, v_cache = torch.randn(2, blocks, block, kv_heads, dim, generator=g)
    tables = torch.randperm(blocks, generator=g)[:15].view(3, 5).to(torch.int32)
    lens = torch.tensor([37, 1, 0], dtype=torch.int32)
    slots = torch.tensor([int(tables[0, 36 // block]) * block + 36 % block, int(tables[1, 0]) * block, -1])
    positions = torch.tensor([36, 0, 0])
    cos_sin = reference.rope_cos_sin_cache(dim, 64, 10000.0)
    caches = (k_cache.clone(), v_cache.clone())
    out = kernels.decode_attention(positions, q, k, v, cos_sin, *caches, slots, tables, lens, 0.25, window or 0)
    expected = reference.decode_attention(positions, q, k, v, cos_sin, k_cache, v_cache, slots, tables, lens, 0.25,
                                          sliding_window=window)
    torch.testing.assert_close(out[:2], expected[:2], atol=2e-6, rtol=1e-5)
    assert not out[2].any()  # the padding row
    torch.testing.assert_close(caches[0], k_cache, atol=1e-6, rtol=1e-6)  # the stored keys, after RoPE
    assert torch.equal(caches[1], v_cache)


def test_cpu_ops_use_the_kernels_for_fp32_only(monkeypatch):
    # bf16 rows, q/k norms and an fp8 cache go to the reference ops; fp32 ones to the kernels
    ops = CpuOps(reference)
    called = []
    for name in ("rms_norm", "silu_and_mul", "decode_attention"):
        monkeypatch.setattr(ops.kernels, name, lambda *args, _name=name: called.append(_name))
    x, weight = torch.randn(2, 32), torch.randn(32)
    ops.rms_norm(x.bfloat16(), weight.bfloat16(), 1e-5)
    ops.silu_and_mul(x.bfloat16())
    assert called == []
    ops.rms_norm(x, weight, 1e-5)
    ops.silu_and_mul(x)
    assert called == ["rms_norm", "silu_and_mul"]
    heads, kv_heads, dim = 2, 1, 16
    q, k, v = torch.randn(1, (heads + 2 * kv_heads) * dim).split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    q, k, v = q.view(1, heads, dim), k.view(1, kv_heads, dim), v.view(1, kv_heads, dim)
    cos_sin = reference.rope_cos_sin_cache(dim, 16, 10000.0)
    cache, tables = torch.zeros(4, 4, kv_heads, dim), torch.zeros(1, 1, dtype=torch.int32)
    pos, slots, lens, scale = torch.tensor([0]), torch.tensor([0]), torch.tensor([1], dtype=torch.int32), 0.25
    fp8_cache, scales = cache.to(torch.float8_e4m3fn), torch.ones(kv_heads)
    ops.decode_attention(pos, q, k, v, cos_sin, fp8_cache, fp8_cache.clone(), slots, tables, lens, scale,
                         k_scale=scales, v_scale=scales)
    ops.decode_attention(pos, q, k, v, cos_sin, cache, cache.clone(), slots, tables, lens, scale,
                         qk_norm=QKNorm(torch.ones(dim), torch.ones(dim), 1e-6))
    assert called == ["rms_norm", "silu_and_mul"]
    ops.decode_attention(pos, q, k, v, cos_sin, cache, cache.clone(), slots, tables, lens, scale)
    assert called[-1] == "decode_attention"


def test_int8_matmul_without_a_compiler_uses_torchs_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert cpu_kernels.load.__wrapped__() is None
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(96, 64, generator=g), torch.randn(1, 64, generator=g)
    matmul = Int8(weight)
    assert matmul.kernels is None
    dequantized = matmul.weight.float() * matmul.scale.float()[:, None]
    torch.testing.assert_close(matmul(x), x.bfloat16().float() @ dequantized.T, atol=0.03, rtol=0.01)


@pytest.mark.parametrize("rows", [5, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matmul_is_the_product_of_its_dequantized_weights(dtype, rows):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 128, generator=g) * torch.rand(128, 4, 1, generator=g).repeat_interleave(32, 1)[..., 0]
    x = torch.randn(rows, 128, generator=g).to(dtype)
    matmul = Int4(weight)
    # the weights the packed kernel multiplies by: its products with the identity's rows (rounded to bf16),
    # fewer rows at a time than widen the weights
    eye = torch.eye(128)
    dequantized = torch.cat([matmul(eye[i : i + 16]) for i in range(0, 128, 16)]).float().T
    torch.testing.assert_close(matmul.widened().float(), dequantized, atol=2e-3, rtol=1e-2)  # the unpacking
    groups = weight.reshape(128, 4, INT4_GROUP)
    half_step = ((groups.amax(-1) - groups.amin(-1)) / 30).repeat_interleave(INT4_GROUP, 1)
    # each within half a step of its group (each group's own range), give or take bf16 rounding
    assert ((dequantized - weight).abs() <= half_step * 1.05 + 0.01 * weight.abs()).all()
    out = matmul(x)
    assert out.dtype == dtype
    # the widened weights are rounded to bf16 (the packed kernel's are not), and so is each product (outputs
    # here reach 35); the kernel's AVX2 build sums less exactly than its AVX-512 one (0.057 off at 300 rows)
    used = matmul.widened().float() if NATIVE_BF16 and rows >= Int4.widen_min_rows else dequantized
    torch.testing.assert_close(out.float(), x.bfloat16().float() @ used.T, atol=0.1, rtol=0.01)
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4(torch.randn(64, 48))


def test_transposed_model_gives_the_plain_models_logits(tiny):
    model, config = tiny
    transposed = transpose_weights(clone(model))
    assert isinstance(transposed.ops, CpuOps)
    prompt = {"a": list(range(5, 25)), "b": list(range(40, 47))}
    kv_plain, kv_transposed = PagedKV(config, seed=1), PagedKV(config, seed=1)
    steps = [prompt, {"a": [3], "b": [4]}, {"a": [9]}]  # prefill, then decodes of two rows and of one
    for chunks in steps:
        torch.testing.assert_close(kv_transposed.step(transposed, chunks), kv_plain.step(model, chunks),
                                   atol=1e-4, rtol=1e-4)


def test_fp8_over_the_cpu_op_set(tiny):
    """fp8 weights on a model whose op set is already the CPU one (an engine built twice on it)."""
    model, config = tiny
    fp8 = quantize_fp8(transpose_weights(clone(model)))
    prompt = {0: list(range(5, 45))}
    exact = PagedKV(config).step(model, prompt)
    assert torch.nn.functional.cosine_similarity(exact, PagedKV(config).step(fp8, prompt)).item() > 0.95


@pytest.mark.parametrize(("quantization", "weight_dtype", "least_cosine"), [
    ("int8", torch.int8, 0.95), ("int4", torch.uint8, 0.75),  # int4: 0.84 measured (4 bits of random weights)
])
def test_engine_applies_the_cpu_matmul_path(tiny, quantization, weight_dtype, least_cosine):
    plain = EngineCore.from_model(EngineConfig(model="tiny"), clone(tiny[0]), tiny[1])
    quantized = EngineCore.from_model(EngineConfig(model="tiny", quantization=quantization), clone(tiny[0]), tiny[1])
    assert isinstance(plain.runner.model.ops, CpuOps) and quantized_as(plain.runner.model) is None
    assert quantized_as(quantized.runner.model) == quantization
    layer = quantized.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == weight_dtype and layer.input_layernorm.weight.dtype == torch.float32
    assert quantized.runner.model.model.embed_tokens.weight.dtype == torch.float32  # the tied table (the head: a copy)
    # the quantized model's logits follow the plain one's on a short prompt
    prompt = {0: list(range(5, 45))}
    exact = PagedKV(tiny[1]).step(plain.runner.model, prompt)
    approx = PagedKV(tiny[1]).step(quantized.runner.model, prompt)
    assert torch.nn.functional.cosine_similarity(exact, approx).item() > least_cosine
    with pytest.raises(ValueError, match=f"quantization {quantization} runs on the CPU only"):
        EngineConfig(model="tiny", quantization=quantization, device="cuda")
    other = "int4" if quantization == "int8" else "int8"  # an engine built again on the quantized model
    with pytest.raises(ValueError, match=f"quantized to {quantization} already, not {other}"):
        EngineCore.from_model(EngineConfig(model="tiny", quantization=other), quantized.runner.model, tiny[1])


@pytest.mark.parametrize("window", [0, 6])
def test_int8_decoder_stack_is_the_models_ops_bit_for_bit(tiny, window, monkeypatch):
    model, config = tiny
    if window:  # every layer sliding (Mistral's shape): one KV layer group
        config = dataclasses.replace(config, layer_types=(SLIDING_ATTENTION,) * config.num_layers,
                                     sliding_window=window)
        windowed = LlamaForCausalLM(config, load_ops("torch"))
        windowed.load_state_dict(model.state_dict())
        model = windowed
    quantized = quantize(clone(model), "int8")
    stack = quantized.decode_stack
    assert isinstance(stack, Int8DecoderStack)
    calls = []
    run_stack = cpu_kernels.CpuKernels.int8_decoder_stack
    monkeypatch.setattr(cpu_kernels.CpuKernels, "int8_decoder_stack",
                        lambda self, layers, *args: calls.append(len(layers)) or run_stack(self, layers, *args))
    steps = [{"a": list(range(5, 25)), "b": list(range(40, 47))}]  # a prefill: the model's own ops
    steps += [{"a": [3 + i], "b": [4 + i]} for i in range(8)] + [{"a": [9]}]  # decodes of two rows and of one
    kv_stack, kv_ops = PagedKV(config, seed=1), PagedKV(config, seed=1)
    threads = torch.get_num_threads()
    for chunks in steps:
        with_stack = kv_stack.step(quantized, chunks)
        quantized.decode_stack = None  # the same ops one by one, on one thread
        torch.set_num_threads(1)
        try:
            one_by_one = kv_ops.step(quantized, chunks)
        finally:
            quantized.decode_stack = stack
            torch.set_num_threads(threads)
        assert torch.equal(with_stack, one_by_one)
    assert calls == [config.num_layers] * (len(steps) - 1)
    assert all(torch.equal(a, b) for pair_a, pair_b in zip(kv_stack.kv_caches, kv_ops.kv_caches)
               for a, b in zip(pair_a, pair_b))
    # bf16 models and int4 weights get no stack
    assert quantize(clone(model).to(torch.bfloat16), "int8").decode_stack is None
    assert quantize(clone(model), "int4").decode_stack is None


@pytest.mark.slow
@pytest.mark.parametrize(("quantization", "least_agreement", "most_dlogprob"), [
    # Measured 0.470 (mean |dlogprob| 0.047; benchmarks/results/accuracy_smollm2_cpu.jsonl), most of it the bf16
    # activations (bf16 weights and activations: 0.645); broken scales fall far below.
    ("int8", 0.35, 0.1),
    # Measured 0.692 (0.027; accuracy_smollm2_int4_cpu.jsonl): the projections are the GGUF's Q4_1 weights
    # regrouped (to bf16 scales), the head int8; a 4-bit head measured 0.216 (0.108).
    ("int4", 0.5, 0.05),
])
def test_quantized_weights_greedy_agreement_on_smollm2(smollm2, fp32_reference, quantization, least_agreement,
                                                       most_dlogprob):
    model = quantize(clone(smollm2[0]), quantization)
    core = EngineCore.from_model(EngineConfig(model="smollm2", quantization=quantization), model, smollm2[1])
    result = agreement(fp32_reference, generate(core, smollm2_prompts(), 32))
    print(f"{quantization} weights vs fp32 weights on SmolLM2:", result.record())
    assert result.agreement >= least_agreement and result.mean_abs_dlogprob <= most_dlogprob


def test_lazy_kv_pages_are_zero_and_cost_memory_only_once_written():
    before = resident_bytes()
    pages = lazy_zeros((256, 16, 4, 256), torch.float32)  # 256 MiB
    assert pages.shape == (256, 16, 4, 256) and pages.dtype == torch.float32
    assert resident_bytes() - before < 64 * 2**20
    pages[:8] = 1.0  # 8 MiB written
    assert resident_bytes() - before < 64 * 2**20
    assert pages[8:].count_nonzero() == 0 and pages[:8].sum() == 8 * 16 * 4 * 256
    assert lazy_zeros((4, 2), torch.bfloat16).dtype == torch.bfloat16


class Clocks:
    """What ThreadGovernor reads, advanced by hand: :meth:`run` is ``seconds`` in which this process
    kept ``ours`` cores busy and other processes ``others``."""

    def __init__(self) -> None:
        self.now = self.ours = self.busy = 100.0

    def monotonic(self) -> float:
        return self.now

    def process_time(self) -> float:
        return self.ours

    def run(self, seconds: float, ours: float, others: float) -> None:
        self.now += seconds
        self.ours += seconds * ours
        self.busy += seconds * (ours + others)


@pytest.fixture
def governed(monkeypatch):
    """A governor of 2 threads on 2 cores over :class:`Clocks`; torch's thread count restored after."""
    clocks = Clocks()
    monkeypatch.setattr(engine.cpu, "time", clocks)
    monkeypatch.setattr(engine.cpu, "_busy_cpu_seconds", lambda cpus: clocks.busy)
    threads = torch.get_num_threads()
    governor = ThreadGovernor(2)
    governor._cpus = {0, 1}

    def window(ours: float, others: float, seconds: float = GOVERNOR_WINDOW_S) -> int:
        clocks.run(seconds, ours, others)
        governor.tick()
        return governor.threads

    yield governor, window
    torch.set_num_threads(threads)


def test_governor_gives_a_busy_core_back_and_takes_it_again_once_free(governed):
    governor, window = governed
    assert window(2.0, 0.1) == 2  # a quiet box: every thread
    assert window(0.5, 1.5, seconds=GOVERNOR_WINDOW_S / 2) == 2  # within a window: not measured yet
    assert window(1.2, 0.8) == 2  # others need a core: one window is not enough
    assert window(1.1, 0.9) == 1 and torch.get_num_threads() == 1
    assert window(1.0, 1.0) == 1  # one core each: settled
    assert window(1.0, 0.3) == 1  # they left: one window is not enough
    assert window(2.0, 0.0) == 2 and torch.get_num_threads() == 2


def test_governor_leaves_a_core_to_a_busy_process():
    """On this machine's /proc/stat: a busy-looping process takes a core from a governor that
    started with one thread per core (at least 2)."""
    threads = torch.get_num_threads()
    max_threads = max(len(os.sched_getaffinity(0)), 2)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # running
        governor = ThreadGovernor(max_threads)
        for _ in range(3):
            time.sleep(GOVERNOR_WINDOW_S * 1.1)
            governor.tick()
        assert governor.threads < max_threads
    finally:
        hog.kill()
        hog.wait()
        torch.set_num_threads(threads)


def test_a_cpu_engine_is_governed_only_while_its_workers_spin(tiny, monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def governor():
            return EngineCore.from_model(EngineConfig(model="tiny"), clone(tiny[0]), tiny[1]).thread_governor

        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # as this suite runs: sleeping workers
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        assert governor() is None
        monkeypatch.setenv("GOMP_SPINCOUNT", "100000")  # libgomp: a spin count wins over the policy
        assert governor().max_threads == 2
        monkeypatch.delenv("GOMP_SPINCOUNT")
        monkeypatch.delenv("OMP_WAIT_POLICY")
        core = EngineCore.from_model(EngineConfig(model="tiny"), clone(tiny[0]), tiny[1])
        assert core.thread_governor.max_threads == 2 and core.stats().cpu_threads == 2
        torch.set_num_threads(1)
        assert governor() is None
    finally:
        torch.set_num_threads(threads)
