"""paged_attention (split-K decode and prefill kernels) against the reference."""

from __future__ import annotations

import pytest
import torch
import triton
from kernel_cases import (
    GPU_ATTENTION_TOL,
    GQA_BLOCKS,
    ULP,
    assert_close,
    check_attention,
    gpu,
    kv_heads_for,
    make_batch,
    random_contexts,
)

from kernels import triton_ops
from kernels.triton_ops import _launch, attention

DECODE_CONTEXTS = [1, 17, 64, 99]  # a single key, block boundaries, an odd multi-block length
# (context length, new tokens): a fresh prompt, chunks over cached prefixes, a decode, an idle row.
MIXED = [(64, 64), (50, 33), (100, 3), (20, 1), (30, 0)]


@pytest.mark.parametrize("group, block_size", GQA_BLOCKS)
def test_decode_attention(ops, group, block_size):
    batch = make_batch(
        DECODE_CONTEXTS, [1] * 4, num_kv_heads=kv_heads_for(group), group=group, block_size=block_size
    )
    check_attention(ops.paged_attention, batch, ULP[torch.float32])


@pytest.mark.parametrize(
    "context_lens, extra_table_blocks, expected_splits",
    [
        ([40, 9], 0, 1),  # a 64-token capacity fits one split
        ([333, 70], 0, 4),  # the short context leaves its last split empty
        ([5, 20], 30, 4),  # splits sized by table capacity: most get no keys
    ],
)
def test_decode_attention_split_k(ops, context_lens, extra_table_blocks, expected_splits):
    batch = make_batch(context_lens, [1, 1], group=4, extra_table_blocks=extra_table_blocks)
    capacity = batch.block_tables.shape[1] * batch.k_cache.shape[1]
    tiles = attention.attention_tiles("decode", 32, torch.float32)
    num_sms = _launch._num_sms(batch.q.device)
    assert attention.decode_num_splits(2, 2, capacity, tiles.block_n, num_sms) == expected_splits
    check_attention(ops.paged_attention, batch, ULP[torch.float32])


@pytest.mark.parametrize("group, block_size", GQA_BLOCKS)
def test_mixed_attention(ops, group, block_size):
    contexts, queries = zip(*MIXED)
    batch = make_batch(
        list(contexts), list(queries), num_kv_heads=kv_heads_for(group), group=group, block_size=block_size
    )
    check_attention(ops.paged_attention, batch, ULP[torch.float32])


@pytest.mark.parametrize("group, block_size", GQA_BLOCKS)
def test_prefill_attention_reads_new_rows(ops, group, block_size):
    """The chunks' own keys come from key/value (by TMA on the GPU), the prefixes from the cache."""
    contexts, queries = zip(*MIXED)
    batch = make_batch(
        list(contexts), list(queries), num_kv_heads=kv_heads_for(group), group=group, block_size=block_size
    )
    key, value = batch.new_rows()
    assert attention._new_rows_descriptors(key, value, 32, 32)[0] is not None
    check_attention(ops.paged_attention, batch, ULP[torch.float32], with_new_rows=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", [[(17, 1), (99, 1)], MIXED[:4]], ids=["decode", "mixed"])
def test_attention_half_precision(ops, layout, dtype):
    contexts, queries = zip(*layout)
    batch = make_batch(list(contexts), list(queries), num_kv_heads=1, group=4, dtype=dtype, seed=1)
    check_attention(ops.paged_attention, batch, ULP[dtype])


@pytest.mark.parametrize("with_new_rows", [False, True], ids=["cache", "new-rows-ignored"])
def test_attention_padded_head_dim(ops, with_new_rows):
    contexts, queries = zip(*MIXED)
    batch = make_batch(list(contexts), list(queries), num_kv_heads=1, group=3, head_dim=24, seed=3)
    # TMA boxes are powers of two: a padded head would take in its neighbour, so the cache serves.
    assert attention._new_rows_descriptors(*batch.new_rows(), 32, 32) == (None, None)
    check_attention(ops.paged_attention, batch, ULP[torch.float32], with_new_rows=with_new_rows)


def test_attention_without_cpu_lists(ops):
    contexts, queries = zip(*MIXED[:4])
    batch = make_batch(list(contexts), list(queries), group=3, block_size=64, seed=2)
    check_attention(ops.paged_attention, batch, ULP[torch.float32], with_cpu_lists=False)


@pytest.mark.parametrize("extra_table_blocks", [0, 10], ids=["one-split", "split-k"])
def test_decode_padding_row_gives_zeros(ops, extra_table_blocks):
    batch = make_batch([0, 21], [1, 1], group=2, extra_table_blocks=extra_table_blocks)
    out = batch.run(ops.paged_attention)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out[1], batch.reference_fp32()[1], rtol=ULP[torch.float32])


def test_attention_writes_into_out(ops):
    """``out`` (a view of a wider buffer, as prefill graphs' static output) receives what a new tensor would."""
    contexts, queries = zip(*MIXED)
    batch = make_batch(list(contexts), list(queries), group=2, seed=4)
    want = batch.run(ops.paged_attention)
    buffer = torch.full((batch.q.shape[0] + 3, batch.q[0].numel()), float("nan"))
    out = buffer[: batch.q.shape[0]].view(batch.q.shape)
    got = ops.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                              batch.query_start_loc, batch.scale, batch.seq_lens_cpu, batch.query_start_loc_cpu,
                              out=out)
    assert got is out
    starts = batch.query_start_loc_cpu
    rows = [t for start, end in zip(starts, starts[1:]) for t in range(start, end)]
    assert torch.equal(got[rows], want[rows]) and buffer[batch.q.shape[0]:].isnan().all()


def test_attention_rejects_bad_inputs(ops):
    batch = make_batch([5, 9], [1, 1], group=2)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, 1.0)
    with pytest.raises(ValueError, match="multiple of the cache's 2 kv heads"):
        ops.paged_attention(batch.q[:, :3], *args)
    with pytest.raises(ValueError, match="head_dim 16 but the KV cache 32"):
        ops.paged_attention(batch.q[..., :16], *args)
    with pytest.raises(ValueError, match="q must have dtype"):
        ops.paged_attention(batch.q.double(), *args)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        ops.paged_attention(batch.q.transpose(0, 2).contiguous().transpose(0, 2), *args)
    with pytest.raises(ValueError, match="k_cache and v_cache must share"):
        ops.paged_attention(batch.q, batch.k_cache, batch.v_cache[:-1], *args[2:])
    with pytest.raises(ValueError, match="exceeds the block table's capacity of 16"):
        ops.paged_attention(batch.q, *args, seq_lens_cpu=[5, 17], query_start_loc_cpu=[0, 1, 2])
    key, value = batch.new_rows()
    with pytest.raises(ValueError, match="key and value must be given together"):
        ops.paged_attention(batch.q, *args, key=key)
    with pytest.raises(ValueError, match="value must have dtype"):
        ops.paged_attention(batch.q, *args, key=key, value=value.double())
    with pytest.raises(ValueError, match=r"key must have shape \(2, 2, 32\)"):
        ops.paged_attention(batch.q, *args, key=key[:1], value=value)
    with pytest.raises(ValueError, match="out must have q's shape"):
        ops.paged_attention(batch.q, *args, out=batch.q[:1].clone())
    with pytest.raises(ValueError, match="out must have dtype"):
        ops.paged_attention(batch.q, *args, out=batch.q.double())


# (query-head group, block size, head dim, dtype): the GQA shapes of SmolLM2 (3), Qwen3-0.6B (2)
# and Llama 3 8B (4) over every block size, MHA and group 8, and the other dtypes once.
GPU_CONFIGS = [
    (1, 16, 128, torch.bfloat16), (2, 16, 128, torch.bfloat16), (3, 64, 64, torch.bfloat16),
    (4, 128, 128, torch.bfloat16), (4, 256, 64, torch.bfloat16), (8, 64, 128, torch.bfloat16),
    (4, 16, 128, torch.float16), (4, 16, 128, torch.float32),
]


@gpu
@pytest.mark.parametrize("group, block_size, head_dim, dtype", GPU_CONFIGS)
@pytest.mark.parametrize("kind", ["decode", "mixed", "mixed-new-rows"])
def test_gpu_attention_batch(kind, group, block_size, head_dim, dtype):
    contexts = random_contexts(64, 1, 4096, seed=block_size + group)
    queries = [1] * 64
    if kind != "decode":  # a fresh prompt, a chunk over a cached prefix, an idle row, decodes
        contexts[:3], queries[:3] = [1000, 6144, 77], [1000, 2048, 0]
    batch = make_batch(
        contexts, queries, num_kv_heads=8, group=group, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device="cuda",
    )
    with_new_rows = kind == "mixed-new-rows"
    check_attention(triton_ops.paged_attention, batch, GPU_ATTENTION_TOL[dtype], with_new_rows=with_new_rows)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("extra_table_blocks", [0, 100])
def test_gpu_attention_long_context_split_k(dtype, block_size, extra_table_blocks):
    batch = make_batch(
        [8191, 16384, 32768], [1, 1, 1], num_kv_heads=8, group=4, head_dim=128,
        block_size=block_size, dtype=dtype, extra_table_blocks=extra_table_blocks, device="cuda",
    )
    check_attention(triton_ops.paged_attention, batch, GPU_ATTENTION_TOL[dtype])


@gpu
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("with_new_rows", [False, True], ids=["cache", "new-rows"])
def test_gpu_attention_long_prefill(block_size, with_new_rows):
    batch = make_batch(
        [8192, 12000], [8192, 1500], num_kv_heads=8, group=4, head_dim=128, block_size=block_size,
        dtype=torch.bfloat16, device="cuda",
    )
    check_attention(
        triton_ops.paged_attention, batch, GPU_ATTENTION_TOL[torch.bfloat16], with_new_rows=with_new_rows
    )


@gpu
def test_gpu_attention_no_recompile_for_new_lengths(monkeypatch):
    def launch(contexts, queries):
        batch = make_batch(
            contexts, queries, num_kv_heads=8, group=4, head_dim=128, dtype=torch.bfloat16, device="cuda"
        )
        batch.run(triton_ops.paged_attention)
        batch.run(triton_ops.paged_attention, with_new_rows=True)

    launch([100, 2000], [1, 1])
    launch([300, 5000], [300, 1])
    compiled = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: compiled.append(kw["repr"]))
    launch([777, 3001], [1, 1])
    launch([513, 4097], [129, 1])
    launch([64, 4096], [17, 1])
    assert compiled == []
