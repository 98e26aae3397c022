"""Shared cases of the Triton kernel tests: tolerances, the ``gpu`` marker, comparisons and
paged-attention batches.

Without CUDA the kernels run under the Triton interpreter on tiny shapes. ``triton.language``'s
own helpers (``tl.zeros``, ``tl.max``, ...) are jit functions too, so the interpreter must be on
when triton is first imported: this module (imported first, by the conftest) imports it that
way, and the conftest sets ``TRITON_INTERPRET`` again while the tests run. With CUDA, the ``gpu``
tests run the compiled kernels on larger shapes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

INTERPRETED = not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
with pytest.MonkeyPatch.context() as _mp:
    if INTERPRETED:
        _mp.setenv("TRITON_INTERPRET", "1")
    import triton  # noqa: F401

    # the op set decides at import whether its kernels run interpreted
    from kernels import reference, triton_ops  # noqa: F401

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# One unit in the last place of the output dtype: the interpreter computes in fp32 and rounds once.
ULP = {torch.float32: 2e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}
# Compiled attention feeds bf16/fp16 probabilities to the tensor cores and sums in another order.
GPU_ATTENTION_TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def gpu(test):
    """Marks ``test`` as a ``gpu`` test: it runs the compiled kernels, so it needs CUDA."""
    skip = pytest.mark.skipif(INTERPRETED, reason="needs CUDA and compiled (not interpreted) kernels")
    return pytest.mark.gpu(skip(test))


def assert_rounded_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal after one rounding to ``expected``'s dtype; the interpreter truncates fp32 to bf16
    where the GPU rounds to nearest, so there bf16 may differ by one unit in the last place."""
    if INTERPRETED and expected.dtype == torch.bfloat16:
        assert_close(actual, expected, rtol=ULP[torch.bfloat16], atol=0)
    else:
        assert torch.equal(actual, expected)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    scale: float

    def run(self, paged_attention, with_cpu_lists: bool = True, with_new_rows: bool = False) -> torch.Tensor:
        lists = (self.seq_lens_cpu, self.query_start_loc_cpu) if with_cpu_lists else (None, None)
        key, value = self.new_rows() if with_new_rows else (None, None)
        return paged_attention(
            self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
            self.query_start_loc, self.scale, *lists, key=key, value=value,
        )

    def new_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' K/V read back from the cache, as the model hands them to store_kv:
        key contiguous, value a strided view of a fused projection; rows past the batch zero."""
        num_tokens, _, head_dim = self.q.shape
        _, block_size, num_kv_heads, _ = self.k_cache.shape
        fused = torch.zeros(
            (num_tokens, 2, num_kv_heads, head_dim), dtype=self.k_cache.dtype, device=self.q.device
        )
        starts = self.query_start_loc_cpu
        for i, context_len in enumerate(self.seq_lens_cpu):
            q_len = starts[i + 1] - starts[i]
            positions = torch.arange(context_len - q_len, context_len, device=self.q.device)
            blocks = self.block_tables[i].long()[positions // block_size]
            fused[starts[i] : starts[i + 1], 0] = self.k_cache[blocks, positions % block_size]
            fused[starts[i] : starts[i + 1], 1] = self.v_cache[blocks, positions % block_size]
        return fused[:, 0].contiguous(), fused[:, 1]

    def reference_fp32(self) -> torch.Tensor:
        """The reference on the same (rounded) inputs, computed in fp32."""
        return reference.paged_attention(
            self.q.float(), self.k_cache.float(), self.v_cache.float(), self.block_tables,
            self.seq_lens, self.query_start_loc, self.scale,
        )


def make_batch(
    context_lens: list[int],
    query_lens: list[int],
    *,
    num_kv_heads: int = 2,
    group: int = 1,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    extra_table_blocks: int = 0,
    device: str = "cpu",
    seed: int = 0,
) -> Batch:
    """Random q and caches; each sequence's blocks scattered over a pool with spare blocks, so a
    wrong gather reads other data. Unused block-table entries point at a spare block."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    table_width = max(max(blocks_per_seq), 1) + extra_table_blocks
    physical = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    block_tables = torch.full((len(context_lens), table_width), physical[-1], dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor(physical[:n], dtype=torch.int32)
        physical = physical[n:]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    num_heads = num_kv_heads * group
    num_tokens = sum(query_lens)
    # q as a strided view of a fused qkv projection, as the model produces it.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen, device=device)
    q = qkv.to(dtype)[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return Batch(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables.to(device),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens_cpu=list(context_lens), query_start_loc_cpu=starts,
        scale=head_dim**-0.5,
    )


def check_attention(
    paged_attention, batch: Batch, rtol: float, with_cpu_lists: bool = True, with_new_rows: bool = False
) -> None:
    out = batch.run(paged_attention, with_cpu_lists, with_new_rows)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    # Only rows that belong to a sequence are defined (as in the reference).
    rows = batch.query_start_loc_cpu[-1]
    assert_close(out[:rows], batch.reference_fp32()[:rows].to(batch.q.dtype), rtol=rtol, atol=max(rtol / 4, 1e-5))


# (query-head group, block size): every GQA ratio and both block sizes, without the full product.
GQA_BLOCKS = [(1, 16), (3, 64), (4, 16), (8, 64)]


def kv_heads_for(group: int) -> int:
    return 2 if group < 8 else 1  # two kv heads test the head mapping; fewer keep the interpreter quick


def random_contexts(num_seqs: int, low: int, high: int, seed: int) -> list[int]:
    return torch.randint(low, high + 1, (num_seqs,), generator=torch.Generator().manual_seed(seed)).tolist()
