"""linear and norm_linear with fp8 weights (per-channel scales) and activations quantized per row:
the Triton ops (up to FP8_GEMV_MAX_ROWS rows by fp8_gemv, more by torch._scaled_mm) against the
reference, and the reference against the unquantized product."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import GPU_ATTENTION_TOL, ULP, assert_close, gpu
from test_gemv import GEMV_SHAPES, gemv_inputs

from engine.models.fp8 import quantize_weight
from kernels import reference, triton_ops
from kernels.triton_ops import fp8

# fp8_gemv: one row, a few, the tensor cores' smallest N, the most; then torch._scaled_mm
FP8_ROWS = [1, 3, 16, fp8.FP8_GEMV_MAX_ROWS, fp8.FP8_GEMV_MAX_ROWS + 1]

def fp8_inputs(rows, n_out, k_in, dtype, gated=False, device="cpu"):
    x, residual, norm_weight, weight = gemv_inputs(rows, n_out, k_in, dtype, gated)
    x[0, :3] = torch.tensor([0.0, 40.0, -1e-4])  # an outlier sets row 0's scale; a tiny value underflows
    weight_fp8, scale = quantize_weight(weight)
    return tuple(t.to(device) for t in (x, residual, norm_weight, weight, weight_fp8, scale))


@pytest.mark.parametrize("k_in", [40, 70], ids=["one_pass", "two_passes"])
def test_quantize_rows_matches_reference_bytes(ops, k_in):
    x = torch.randn(5, k_in) * torch.tensor([1.0, 1e-3, 300.0, 1.0, 0.0])[:, None]
    x_fp8, scale = fp8.quantize_rows(x)
    expected_fp8, expected_scale = reference.quantize_rows(x)
    assert torch.equal(x_fp8.view(torch.uint8), expected_fp8.view(torch.uint8))
    assert torch.equal(scale, expected_scale)
    assert scale[4].item() == 1.0 and not x_fp8[4].float().any()  # an all-zero row


def assert_rms_norm_quantize_is_quantized_rms_norm(x, residual, norm_weight):
    x_fp8, scale, new_residual = fp8.rms_norm_quantize(x, norm_weight, 1e-5, residual)
    normed, expected_residual = triton_ops.rms_norm(x, norm_weight, 1e-5, residual)
    expected_fp8, expected_scale = fp8.quantize_rows(normed)
    assert torch.equal(x_fp8.view(torch.uint8), expected_fp8.view(torch.uint8))
    assert torch.equal(scale, expected_scale) and torch.equal(new_residual, expected_residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quantize_is_quantize_rows_of_rms_norm(ops, dtype, with_residual):
    x, residual, norm_weight, _, _, _ = fp8_inputs(20, 40, 72, dtype)
    assert_rms_norm_quantize_is_quantized_rms_norm(x, residual if with_residual else None, norm_weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", FP8_ROWS)
@pytest.mark.parametrize("n_out, k_in", GEMV_SHAPES[:2])
def test_fp8_linear(ops, dtype, rows, n_out, k_in):
    x, _, _, _, weight, scale = fp8_inputs(rows, n_out, k_in, dtype)
    out = ops.linear(x, weight, scale)
    assert out.shape == (rows, n_out) and out.dtype == dtype
    assert_close(out, reference.linear(x, weight, scale), rtol=2 * ULP[dtype], atol=ULP[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", FP8_ROWS)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fp8_norm_linear(ops, dtype, rows, gated, with_residual):
    x, residual, norm_weight, _, weight, scale = fp8_inputs(rows, 40, 72, dtype, gated)
    residual = residual if with_residual else None
    out, new_residual = ops.norm_linear(x, norm_weight, 1e-5, residual, weight, gated, scale)
    expected, expected_residual = reference.norm_linear(x, norm_weight, 1e-5, residual, weight, gated, scale)
    assert out.shape == (rows, 40) and out.dtype == dtype
    if residual is None:
        assert new_residual is x
    else:
        assert_close(new_residual, expected_residual, rtol=ULP[dtype], atol=0)
    # A normed bf16 value one unit off (the interpreter truncates) may round to the neighbouring
    # fp8 value, one E4M3 step (at most 2^-3 of it) of one product term (|x w| < 1 here).
    atol = 2**-3 if dtype == torch.bfloat16 else 4 * ULP[dtype]
    assert_close(out, expected, rtol=(8 if gated else 4) * ULP[dtype], atol=atol)


def test_one_row_is_quantized_as_in_a_batch(ops):
    x, _, _, _, weight, scale = fp8_inputs(fp8.FP8_GEMV_MAX_ROWS + 1, 40, 72, torch.float32)
    one_row = reference.linear(x[:1], weight, scale)
    # row 0 holds 40.0 and -1e-4: quantized over its scale (40 / 448), -1e-4 underflows to 0
    assert_close(one_row, reference.linear(x, weight, scale)[:1], rtol=2 * ULP[torch.float32], atol=0)
    assert not torch.equal(one_row, torch.nn.functional.linear(x[:1], weight.float()) * scale)
    assert_close(ops.linear(x[:1], weight, scale), one_row, rtol=2 * ULP[torch.float32], atol=ULP[torch.float32])


def test_fp8_gemv_takes_quantized_rows(ops):
    x, _, _, _, weight, scale = fp8_inputs(2, 40, 72, torch.float32)
    with pytest.raises(ValueError, match="fp8_gemv takes up to 64 rows of fp8 x with their x_scale"):
        fp8.fp8_gemv(x, torch.ones(2, 1), weight, scale, 40, torch.float32)


def test_fp8_reference_is_close_to_the_unquantized_product():
    x, _, _, weight, weight_fp8, scale = fp8_inputs(16, 64, 512, torch.float32)
    exact = reference.linear(x, weight)
    out = reference.linear(x, weight_fp8, scale)
    # two fp8 roundings (2^-4 relative each) over 512 random-signed terms: a few percent of the scale
    err = (out - exact).abs().mean() / exact.abs().mean()
    assert 0.005 < err < 0.06


def test_fp8_linear_rejects_a_wrong_scale(ops):
    x, _, _, _, weight, scale = fp8_inputs(1, 40, 72, torch.float32)
    with pytest.raises(ValueError, match=r"weight_scale must be contiguous of shape \(40,\)"):
        ops.linear(x, weight, scale[:20])
    with pytest.raises(ValueError, match="weight must have dtype"):
        ops.linear(x, weight.float(), scale)


@gpu
@pytest.mark.parametrize("rows", [1, 4, 16, 64, 1000])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_gpu_fp8_norm_linear_llama3_8b_shapes(rows, gated):
    n_out = 14336 if gated else 4096
    x, residual, norm_weight, _, weight, scale = fp8_inputs(rows, n_out, 4096, torch.bfloat16, gated, "cuda")
    out, _ = triton_ops.norm_linear(x, norm_weight, 1e-5, residual, weight, gated, scale)
    expected, _ = reference.norm_linear(x, norm_weight, 1e-5, residual, weight, gated, scale)
    # The compiled rms_norm may round a normed value one bf16 unit from the reference's, and that
    # value then to the neighbouring fp8 one: on the H200 309 of 4M outputs (1000 rows), at most 0.31 off.
    assert_rare_fp8_flips(out, expected)


@gpu
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 1000])
def test_gpu_fp8_linear(rows):
    x, _, _, _, weight, scale = fp8_inputs(rows, 4096, 14336, torch.bfloat16, device="cuda")
    # The row quantizer's scale division and the reference's may differ by one unit, moving a value
    # on an fp8 rounding boundary to its neighbour: on the H200 8 of 4M outputs (1000 rows).
    assert_rare_fp8_flips(triton_ops.linear(x, weight, scale), reference.linear(x, weight, scale))


@gpu
@pytest.mark.parametrize("width", [4096, 14336])
def test_gpu_rms_norm_quantize_is_quantize_rows_of_rms_norm(width):
    x, residual, norm_weight, _, _, _ = fp8_inputs(fp8.FP8_GEMV_MAX_ROWS, 8, width, torch.bfloat16,
                                                    device="cuda")
    assert_rms_norm_quantize_is_quantized_rms_norm(x, residual, norm_weight)


@gpu
@pytest.mark.parametrize("rows", [1, 40])
def test_gpu_fp8_gemv_replays_in_a_cuda_graph(rows):
    # split K (its arrival counters reset by each launch) and the residual write, replayed
    x, residual, norm_weight, _, weight, scale = fp8_inputs(rows, 6144, 4096, torch.bfloat16, device="cuda")
    eager = triton_ops.norm_linear(x, norm_weight, 1e-5, residual, weight, False, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_ops.norm_linear(x, norm_weight, 1e-5, residual, weight, False, scale)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])


@gpu
def test_gpu_fp8_chain_replays_in_a_cuda_graph():
    # Each quantization reads the GEMV before it and each GEMV the quantization before it, as a
    # decode layer's do: under PDL each kernel launches early and must wait before it reads.
    x, residual, norm_weight, _, weight, scale = fp8_inputs(1, 4096, 4096, torch.bfloat16, device="cuda")

    def chain():
        h, res = triton_ops.norm_linear(x, norm_weight, 1e-5, residual, weight, False, scale)
        for _ in range(8):
            h = triton_ops.linear(h, weight, scale)
            h, res = triton_ops.norm_linear(h, norm_weight, 1e-5, res, weight, False, scale)
        return h, res

    eager = chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    assert eager[0].isfinite().all() and eager[0].abs().max() > 0


def assert_rare_fp8_flips(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Within bf16 tolerance but for at most 1e-3 of the outputs, each at most one fp8 step of a term off."""
    tol = GPU_ATTENTION_TOL[torch.bfloat16]
    diff = (out.float() - expected.float()).abs()
    assert (diff > tol * (1 + expected.float().abs())).float().mean() <= 1e-3
    assert diff.max() <= 0.5
