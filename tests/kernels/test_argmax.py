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


# ---- sample_argmax: Gumbel-max draws ----

ROW = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 0.3, 1.2, -1.0, 0.8, float("-inf"), -2.0])


def draw_frequencies(sample_argmax, draws: int, device: str = "cpu") -> torch.Tensor:
    """Token frequencies of ``draws`` rows of ROW at temperature 0.5, one seed."""
    logits = ROW.to(device).expand(draws, ROW.numel()).contiguous()
    inv_temperature = torch.full((draws,), 2.0, device=device)
    tokens = sample_argmax(logits, inv_temperature, 2024)
    return torch.bincount(tokens.cpu(), minlength=ROW.numel()).double() / draws


def assert_draws_match_softmax(freq: torch.Tensor, atol: float) -> None:
    want = (ROW / 0.5).double().softmax(-1)
    assert freq[10] == 0  # -inf: never drawn
    torch.testing.assert_close(freq, want, rtol=0, atol=atol)


def test_reference_sample_argmax_draws_from_the_tempered_softmax():
    # 20k draws: the binomial standard error is at most 0.0035; the seed is fixed: no flakes.
    assert_draws_match_softmax(draw_frequencies(reference.sample_argmax, 20_000), atol=0.015)


def test_sample_argmax_draws_from_the_tempered_softmax(ops):
    # 1.5k draws (the interpreter runs one program at a time): standard error at most 0.013, and at
    # temperature 1 instead of 0.5 the likeliest token's probability would be off by 0.2.
    assert_draws_match_softmax(draw_frequencies(ops.sample_argmax, 1_500), atol=0.05)


def test_sample_argmax_rows_at_zero_are_the_argmax_and_a_seed_repeats(ops):
    width = 4096 * 2 + 5  # three chunks: the merge of noisy partials
    logits = torch.randn(6, width, generator=torch.Generator().manual_seed(3))
    inv_temperature = torch.tensor([0.0, 1.0, 0.0, 2.0, 1.0, 0.5])
    for sample_argmax in (ops.sample_argmax, reference.sample_argmax):
        tokens = sample_argmax(logits, inv_temperature, 7)
        greedy = inv_temperature == 0
        assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
        assert torch.equal(sample_argmax(logits, inv_temperature, 7), tokens)
        others = [sample_argmax(logits, inv_temperature, seed)[~greedy] for seed in range(8, 12)]
        assert any(not torch.equal(o, tokens[~greedy]) for o in others)  # the noise moves the draws


def test_sample_argmax_seed_tensor_and_bf16_rows(ops):
    """A one-element int64 seed tensor draws what its value as an int does, and bf16 rows give the
    tokens of their fp32 widening (the kernel widens each value it loads)."""
    width = 4096 + 9
    logits = torch.randn(4, width, generator=torch.Generator().manual_seed(5)).bfloat16()
    inv_temperature = torch.tensor([0.0, 1.0, 2.0, 0.5])
    for sample_argmax in (ops.sample_argmax, reference.sample_argmax):
        for seed in (7, 2**62 + 1):
            tokens = sample_argmax(logits.float(), inv_temperature, seed)
            assert torch.equal(sample_argmax(logits, inv_temperature, torch.tensor([seed])), tokens)


def test_sample_argmax_rejects_bad_inputs(ops):
    logits = torch.randn(2, 16)
    with pytest.raises(ValueError, match="inv_temperature has 3 rows, logits 2"):
        ops.sample_argmax(logits, torch.ones(3), 1)
    with pytest.raises(ValueError, match="inv_temperature must have dtype"):
        ops.sample_argmax(logits, torch.ones(2, dtype=torch.float64), 1)
    with pytest.raises(ValueError, match="seed must be in"):
        ops.sample_argmax(logits, torch.ones(2), -1)
    with pytest.raises(ValueError, match="a seed tensor must hold one int64"):
        ops.sample_argmax(logits, torch.ones(2), torch.tensor([1, 2]))


@gpu
def test_gpu_sample_argmax():
    assert_draws_match_softmax(draw_frequencies(triton_ops.sample_argmax, 20_000, "cuda"), atol=0.015)
    logits = torch.randn(64, 151936, device="cuda")
    inv_temperature = torch.tensor([0.0, 1.7] * 32, device="cuda")
    tokens = triton_ops.sample_argmax(logits, inv_temperature, 2**62 + 1)
    assert torch.equal(tokens[::2], logits.argmax(-1)[::2])
    assert torch.equal(triton_ops.sample_argmax(logits, inv_temperature, 2**62 + 1), tokens)
    seed = torch.tensor([3], device="cuda")
    triton_ops.sample_argmax(logits, inv_temperature, seed)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = triton_ops.sample_argmax(logits, inv_temperature, seed)
    seed.fill_(2**62 + 1)
    graph.replay()
    assert torch.equal(replayed, tokens)  # the seed the tensor holds at replay
