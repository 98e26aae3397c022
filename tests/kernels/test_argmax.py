"""argmax against the reference."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import gpu

from kernels import reference, triton_ops


@pytest.mark.parametrize("rows, width", [(1, 5), (3, 4096 * 3 + 17)], ids=["one-chunk", "four-chunks"])
def test_argmax(ops, rows, width):
    logits = torch.randn(rows, width, generator=torch.Generator().manual_seed(11))
    assert torch.equal(ops.argmax(logits), reference.argmax(logits))
    logits[:, [7 % width, width - 1]] = 100.0  # a tie, across chunks when there are several: the first wins
    logits[-1] = float("-inf")  # nothing but -inf: index 0, as torch
    assert torch.equal(ops.argmax(logits), reference.argmax(logits))
    assert torch.equal(ops.argmax(logits), reference.argmax(logits))  # the counters were reset


def test_argmax_rejects_bad_inputs(ops):
    with pytest.raises(ValueError, match="logits must have 2 dims"):
        ops.argmax(torch.randn(8))
    with pytest.raises(ValueError, match="rows wider than"):
        ops.argmax(torch.randn(1, 64 * 4096 + 1))


@gpu
@pytest.mark.parametrize("rows, width", [(1, 49152), (64, 128256), (3, 1000)])
def test_gpu_argmax(rows, width):
    logits = torch.randn(rows, width, device="cuda")
    assert torch.equal(triton_ops.argmax(logits), reference.argmax(logits))
    logits[:, [5, width - 1]] = 50.0
    assert torch.equal(triton_ops.argmax(logits), reference.argmax(logits))
