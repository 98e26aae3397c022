"""linear and norm_linear (the decode-batch GEMVs) against the reference."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import DTYPES, GPU_ATTENTION_TOL, ULP, assert_close, assert_rounded_equal, gpu

from kernels import reference, triton_ops


def gemv_inputs(rows, n_out, k_in, dtype, gated=False, device="cpu", seed=7):
    """x, residual, norm weight and a projection weight (``2 * n_out`` rows when gated)."""
    gen = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(rows, k_in, generator=gen).to(dtype) for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(k_in, generator=gen)).to(dtype)
    weight = (torch.randn((2 if gated else 1) * n_out, k_in, generator=gen) / math.sqrt(k_in)).to(dtype)
    return tuple(t.to(device) for t in (x, residual, norm_weight, weight))


# (n_out, k_in) for the interpreter's 16 x 32 tiles: several column programs and feature tiles,
# one program for three tiles (it writes every residual slice), three programs for one tile.
GEMV_SHAPES = [(40, 72), (16, 72), (40, 32)]
# rows: one, a few (a program per row and column block; the weights are small), past
# GEMV_MAX_ROWS (cuBLAS)
GEMV_ROWS = [1, 3, 20]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", GEMV_ROWS)
@pytest.mark.parametrize("n_out, k_in", GEMV_SHAPES)
def test_linear(ops, dtype, rows, n_out, k_in):
    x, _, _, weight = gemv_inputs(rows, n_out, k_in, dtype)
    out = ops.linear(x, weight)
    assert out.shape == (rows, n_out) and out.dtype == dtype
    assert_close(out, reference.linear(x, weight), rtol=2 * ULP[dtype], atol=ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", GEMV_ROWS)
@pytest.mark.parametrize("n_out, k_in", GEMV_SHAPES)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_linear(ops, dtype, rows, n_out, k_in, gated, with_residual):
    x, residual, norm_weight, weight = gemv_inputs(rows, n_out, k_in, dtype, gated)
    residual = residual if with_residual else None
    out, new_residual = ops.norm_linear(x, norm_weight, 1e-5, residual, weight, gated)
    expected, expected_residual = reference.norm_linear(x, norm_weight, 1e-5, residual, weight, gated)
    assert out.shape == (rows, n_out) and out.dtype == dtype
    if residual is None:
        assert new_residual is x
    else:
        assert_rounded_equal(new_residual, expected_residual)
    # The normed rows are rounded to half precision before the product (the interpreter may round
    # them one unit off), and silu_and_mul's reference rounds twice, the kernels once.
    assert_close(out, expected, rtol=(4 if gated else 2) * ULP[dtype], atol=2 * ULP[dtype])


@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_strided_rows(ops, rows):
    """Row-strided inputs (a slice of a fused projection's output, as q of qkv) need no copy."""
    x, residual, norm_weight, weight = gemv_inputs(rows, 40, 72, torch.float32)
    wide = torch.randn(rows, 100)
    wide[:, 10:82] = x
    strided = wide[:, 10:82]
    assert strided.stride(0) == 100
    assert_close(ops.linear(strided, weight), reference.linear(x, weight), rtol=2 * ULP[torch.float32])
    out, new_residual = ops.norm_linear(strided, norm_weight, 1e-5, residual, weight, gated=True)
    expected, expected_residual = reference.norm_linear(x, norm_weight, 1e-5, residual, weight, gated=True)
    assert_close(out, expected, rtol=4 * ULP[torch.float32])
    assert torch.equal(new_residual, expected_residual)


def test_gemv_rejects_bad_inputs(ops):
    x, residual, norm_weight, weight = gemv_inputs(2, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="must equal weight's in_features"):
        ops.linear(x, weight[:, :16])
    with pytest.raises(ValueError, match="gated weight needs an even row count"):
        ops.norm_linear(x, norm_weight, 1e-5, None, weight[:15], gated=True)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \(32,\)"):
        ops.norm_linear(x, norm_weight[:8], 1e-5, None, weight)
    with pytest.raises(ValueError, match="residual must match x"):
        ops.norm_linear(x, norm_weight, 1e-5, residual.half(), weight)


# Decode projections (n_out, k_in) of SmolLM2 and Llama 3 8B: q/k/v, o, gate/up (per half), down.
GPU_GEMV_SHAPES = [(960, 576), (576, 1536), (6144, 4096), (14336, 4096), (4096, 14336)]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("n_out, k_in", GPU_GEMV_SHAPES)
def test_gpu_norm_linear(dtype, rows, n_out, k_in):
    tol = dict(rtol=GPU_ATTENTION_TOL[dtype], atol=GPU_ATTENTION_TOL[dtype])
    x, residual, norm_weight, weight = gemv_inputs(rows, n_out, k_in, dtype, gated=True, device="cuda")
    assert_close(triton_ops.linear(x, weight[:n_out]), reference.linear(x, weight[:n_out]), **tol)
    for gated in (False, True):
        out, new_residual = triton_ops.norm_linear(x, norm_weight, 1e-5, residual, weight, gated)
        expected, expected_residual = reference.norm_linear(x, norm_weight, 1e-5, residual, weight, gated)
        assert torch.equal(new_residual, expected_residual)
        assert_close(out, expected, **tol)


@gpu
def test_gpu_gemv_chain_in_cuda_graph():
    """A layer's four projections captured in a CUDA graph (programmatic dependent launches on
    sm_90: each kernel starts before the previous one ends) replay what they compute eagerly."""
    x, residual, ln1, w_qkv = gemv_inputs(1, 960, 576, torch.bfloat16, device="cuda")
    _, _, ln2, w_gate_up = gemv_inputs(1, 1536, 576, torch.bfloat16, gated=True, device="cuda", seed=8)
    w_o = gemv_inputs(1, 576, 576, torch.bfloat16, device="cuda", seed=9)[3]
    w_down = gemv_inputs(1, 576, 1536, torch.bfloat16, device="cuda", seed=10)[3]
    static_x = x.clone()

    def layer():
        qkv, res = triton_ops.norm_linear(static_x, ln1, 1e-5, residual, w_qkv)
        h = triton_ops.linear(qkv[:, :576], w_o)
        act, res = triton_ops.norm_linear(h, ln2, 1e-5, res, w_gate_up, gated=True)
        return triton_ops.linear(act, w_down), res

    layer()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = layer()
    for seed in range(3):
        static_x.copy_(gemv_inputs(1, 960, 576, torch.bfloat16, device="cuda", seed=20 + seed)[0])
        graph.replay()
        expected = layer()
        torch.cuda.synchronize()
        for got, want in zip(outs, expected):
            assert torch.equal(got, want)
