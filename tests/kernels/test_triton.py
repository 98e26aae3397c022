"""Triton kernels against their torch reference twins.

Without CUDA the kernels run under the Triton interpreter on tiny shapes. ``triton.language``'s
own helpers (``tl.zeros``, ``tl.max``, ...) are jit functions too, so the interpreter must be on
when triton is first imported: this module imports it that way, and sets ``TRITON_INTERPRET``
only during the import and its own tests. With CUDA, the ``gpu`` tests run the compiled kernels
on larger shapes.
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
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import load_ops, reference, triton_ops

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# One unit in the last place of the output dtype: the interpreter computes in fp32 and rounds once.
ULP = {torch.float32: 2e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}
# Compiled attention feeds bf16/fp16 probabilities to the tensor cores and sums in another order.
GPU_ATTENTION_TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def gpu(test):
    """Marks ``test`` as a ``gpu`` test: it runs the compiled kernels, so it needs CUDA."""
    skip = pytest.mark.skipif(INTERPRETED, reason="needs CUDA and compiled (not interpreted) kernels")
    return pytest.mark.gpu(skip(test))


@pytest.fixture(scope="module", autouse=True)
def interpreter_env():
    """TRITON_INTERPRET=1 while this module's tests run (triton reads it again at first launch)."""
    with pytest.MonkeyPatch.context() as mp:
        if INTERPRETED:
            mp.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture
def ops():
    """The Triton op set, interpreted: its kernels run on CPU tensors."""
    if not INTERPRETED:
        pytest.skip("CUDA is present: the gpu tests run the compiled kernels")
    if not (triton_ops._INTERPRETED and isinstance(triton.language.zeros, InterpretedFunction)):
        pytest.fail(
            "triton was imported before this module could turn the interpreter on; "
            "run pytest with TRITON_INTERPRET=1 in the environment"
        )
    return triton_ops


def assert_rounded_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal after one rounding to ``expected``'s dtype; the interpreter truncates fp32 to bf16
    where the GPU rounds to nearest, so there bf16 may differ by one unit in the last place."""
    if INTERPRETED and expected.dtype == torch.bfloat16:
        assert_close(actual, expected, rtol=ULP[torch.bfloat16], atol=0)
    else:
        assert torch.equal(actual, expected)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------------------------
# Paged attention batches


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
DECODE_CONTEXTS = [1, 17, 64, 99]  # a single key, block boundaries, an odd multi-block length
# (context length, new tokens): a fresh prompt, chunks over cached prefixes, a decode, an idle row.
MIXED = [(64, 64), (50, 33), (100, 3), (20, 1), (30, 0)]


def kv_heads_for(group: int) -> int:
    return 2 if group < 8 else 1  # two kv heads test the head mapping; fewer keep the interpreter quick


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
    tiles = ops.attention_tiles("decode", 32, torch.float32)
    assert ops.decode_num_splits(2, 2, capacity, tiles.block_n, ops._num_sms(batch.q.device)) == expected_splits
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
    assert ops._new_rows_descriptors(key, value, 32, 32)[0] is not None
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
    assert ops._new_rows_descriptors(*batch.new_rows(), 32, 32) == (None, None)
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


# --------------------------------------------------------------------------------------------
# decode_attention: RoPE, store and split-K decode in one launch


@dataclass
class DecodeStep:
    """One decode-only step: sequence ``i``'s new token at position ``seq_lens[i] - 1``; q/k/v
    unrotated strided views of one fused projection, as the model hands them over."""

    positions: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos_sin_cache: torch.Tensor
    batch: Batch  # the caches, block tables and lengths
    slot_mapping: torch.Tensor

    def run(self, decode_attention, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        b = self.batch
        return decode_attention(
            self.positions, self.q, self.k, self.v, self.cos_sin_cache, k_cache, v_cache,
            self.slot_mapping, b.block_tables, b.seq_lens, b.scale, b.seq_lens_cpu,
        )

    def expected(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference composition on copies of the caches (attention in fp32 on the rounded
        rotated q and stored K/V): output, k_cache, v_cache."""
        b = self.batch
        k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
        q, k = reference.rotary_embedding(self.positions, self.q, self.k, self.cos_sin_cache)
        reference.store_kv(k, self.v, k_cache, v_cache, self.slot_mapping)
        out = reference.paged_attention(
            q.float(), k_cache.float(), v_cache.float(), b.block_tables, b.seq_lens,
            b.query_start_loc, b.scale,
        )
        return out.to(self.q.dtype), k_cache, v_cache


def make_decode_step(
    context_lens: list[int], *, group: int, num_kv_heads: int = 2, head_dim: int = 32,
    dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0, **batch,
) -> DecodeStep:
    """Inputs as make_batch's (``batch``: its other settings); a context of length 0 is a
    padding row (slot -1)."""
    b = make_batch(
        context_lens, [1] * len(context_lens), num_kv_heads=num_kv_heads, group=group,
        head_dim=head_dim, dtype=dtype, device=device, seed=seed, **batch,
    )
    num_seqs, num_heads = len(context_lens), num_kv_heads * group
    block_size = b.k_cache.shape[1]
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    qkv = torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen, device=device).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    last = [max(n - 1, 0) for n in context_lens]
    slots = [
        int(b.block_tables[i, p // block_size]) * block_size + p % block_size if n else -1
        for i, (n, p) in enumerate(zip(context_lens, last))
    ]
    return DecodeStep(
        positions=torch.tensor(last, device=device),
        q=q.view(num_seqs, num_heads, head_dim),
        k=k.view(num_seqs, num_kv_heads, head_dim),
        v=v.view(num_seqs, num_kv_heads, head_dim),
        cos_sin_cache=reference.rope_cos_sin_cache(head_dim, max(context_lens) + 1, 10000.0, device=device),
        batch=b,
        slot_mapping=torch.tensor(slots, device=device),
    )


def check_decode_step(
    decode_attention, step: DecodeStep, rtol: float, atol: float | None = None, repeats: int = 1
) -> None:
    """Output and caches against the reference composition; each repeat on fresh cache copies
    (the split counters must be back at 0 after every launch)."""
    expected_out, expected_k, expected_v = step.expected()
    padding = step.batch.seq_lens == 0
    for _ in range(repeats):
        k_cache, v_cache = step.batch.k_cache.clone(), step.batch.v_cache.clone()
        out = step.run(decode_attention, k_cache, v_cache)
        assert out.shape == step.q.shape and out.dtype == step.q.dtype
        assert_close(out, expected_out, rtol=rtol, atol=max(rtol / 4, 1e-5) if atol is None else atol)
        assert not out[padding].any()
        if INTERPRETED:
            assert_rounded_equal(k_cache, expected_k)
        else:  # compiled, the rotation may fuse a multiply-add: a unit in the last place apart
            assert_close(k_cache, expected_k, rtol=ULP[k_cache.dtype], atol=1e-4)
        assert_rounded_equal(v_cache, expected_v)
        for counters in triton_ops._ARRIVAL_COUNTERS.values():
            assert not counters.any()


@pytest.mark.parametrize("group, block_size", GQA_BLOCKS)
def test_decode_attention_fused(ops, group, block_size):
    # a single key, block boundaries, a padding row, an odd multi-block length
    step = make_decode_step(
        [1, 17, 64, 0, 99], group=group, num_kv_heads=kv_heads_for(group), block_size=block_size
    )
    check_decode_step(ops.decode_attention, step, ULP[torch.float32])


@pytest.mark.parametrize(
    "context_lens, extra_table_blocks, expected_splits",
    [
        ([40, 9], 0, 1),  # a 64-token capacity fits one split
        ([333, 70], 0, 4),  # the short context leaves its last split empty
        ([97, 0], 6, 4),  # the new token alone in the last split; a padding row
        ([5, 20], 30, 4),  # splits sized by table capacity: one split holds all keys
    ],
)
def test_decode_attention_fused_split_k(ops, context_lens, extra_table_blocks, expected_splits):
    step = make_decode_step(context_lens, group=3, extra_table_blocks=extra_table_blocks)
    capacity = step.batch.block_tables.shape[1] * step.batch.k_cache.shape[1]
    tiles = ops.attention_tiles("fused_decode", 32, torch.float32)
    assert ops.decode_num_splits(2, 2, capacity, tiles.block_n, ops._num_sms(step.q.device)) == expected_splits
    check_decode_step(ops.decode_attention, step, ULP[torch.float32], repeats=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_attention_fused_half_precision(ops, dtype):
    step = make_decode_step([17, 99], group=4, num_kv_heads=1, dtype=dtype, seed=1)
    # The interpreter truncates the rotated bf16 q where the reference rounds it: outputs of
    # magnitude ~1 may then differ by a unit in the last place.
    check_decode_step(ops.decode_attention, step, ULP[dtype], atol=ULP[dtype] if dtype == torch.bfloat16 else None)


def test_decode_attention_fused_padded_head_dim(ops):
    step = make_decode_step([30, 0, 100], group=3, num_kv_heads=1, head_dim=24, seed=3)
    check_decode_step(ops.decode_attention, step, ULP[torch.float32])


def test_decode_attention_rejects_bad_inputs(ops):
    step = make_decode_step([5, 9], group=2)
    b = step.batch
    caches = (b.k_cache, b.v_cache, step.slot_mapping, b.block_tables, b.seq_lens, 1.0)
    with pytest.raises(ValueError, match=r"k must have shape \(2, 2, 32\)"):
        ops.decode_attention(step.positions, step.q, step.k[:1], step.v, step.cos_sin_cache, *caches)
    with pytest.raises(ValueError, match="v must have dtype"):
        ops.decode_attention(step.positions, step.q, step.k, step.v.double(), step.cos_sin_cache, *caches)
    with pytest.raises(ValueError, match=r"slot_mapping must have shape \(2,\)"):
        ops.decode_attention(
            step.positions, step.q, step.k, step.v, step.cos_sin_cache, b.k_cache, b.v_cache,
            step.slot_mapping[:1], *caches[3:],
        )
    with pytest.raises(ValueError, match=r"cos_sin_cache must have shape \(max_position, 32\)"):
        ops.decode_attention(step.positions, step.q, step.k, step.v, step.cos_sin_cache[:, :16], *caches)
    b.seq_lens_cpu = [5, 17]
    with pytest.raises(ValueError, match="exceeds the block table's capacity of 16"):
        step.run(ops.decode_attention, b.k_cache, b.v_cache)


def test_compiled_kernels_reject_cpu_tensors(ops, monkeypatch):
    monkeypatch.setattr(ops, "_INTERPRETED", False)
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors, got x on cpu"):
        ops.silu_and_mul(torch.randn(4, 8))


# --------------------------------------------------------------------------------------------
# store_kv, rms_norm, rotary_embedding, silu_and_mul


def run_store_kv(store_kv, num_tokens, num_kv_heads, head_dim, block_size, key_dtype, cache_dtype, device):
    gen = torch.Generator().manual_seed(3)
    num_blocks = math.ceil(num_tokens / block_size) + 2
    width = (2 * num_kv_heads + 1) * head_dim
    kv = torch.randn(num_tokens, width, generator=gen).to(key_dtype)
    # Strided views of a fused projection; every third token is padding (slot -1).
    key = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(cache_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    to = dict(device=device)
    k_cache, v_cache = k_cache.to(**to), v_cache.to(**to)
    store_kv(key.to(**to), value.to(**to), k_cache, v_cache, slots.to(**to))
    assert_rounded_equal(k_cache.cpu(), expected_k)
    assert_rounded_equal(v_cache.cpu(), expected_v)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(
    "key_dtype, cache_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
     (torch.float32, torch.bfloat16)],
)
def test_store_kv(ops, key_dtype, cache_dtype, block_size):
    run_store_kv(ops.store_kv, 21, 3, 24, block_size, key_dtype, cache_dtype, "cpu")


def test_store_kv_rejects_bad_inputs(ops):
    key = torch.randn(4, 2, 8)
    cache = torch.zeros(2, 16, 2, 8)
    with pytest.raises(ValueError, match=r"slot_mapping must have dtype"):
        ops.store_kv(key, key, cache, cache, torch.zeros(4))
    with pytest.raises(ValueError, match=r"value must have shape \(4, 2, 8\)"):
        ops.store_kv(key, key[:, :1], cache, cache, torch.zeros(4, dtype=torch.int64))


def rms_norm_inputs(shape, dtype, with_residual, strided, device="cpu"):
    gen = torch.Generator().manual_seed(4)
    width = shape[-1]
    x = torch.randn(*shape[:-1], 2 * width if strided else width, generator=gen).to(dtype)[..., :width]
    residual = torch.randn(shape, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    to = dict(device=device)
    return x.to(**to), weight.to(**to), None if residual is None else residual.to(**to)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape, strided", [((7, 72), False), ((3, 4, 40), True)], ids=["2d", "3d-strided"])
def test_rms_norm(ops, dtype, with_residual, shape, strided):
    x, weight, residual = rms_norm_inputs(shape, dtype, with_residual, strided)
    normed, new_residual = ops.rms_norm(x, weight, 1e-5, residual)
    assert normed.dtype == dtype and normed.shape == x.shape
    if residual is None:
        assert new_residual is x
    else:  # one rounding of the same fp32 sum
        assert_rounded_equal(new_residual, x + residual)
    assert_close(normed, reference.rms_norm(new_residual, weight, 1e-5)[0], rtol=ULP[dtype])


def test_rms_norm_rejects_bad_inputs(ops):
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        ops.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="residual must match x"):
        ops.rms_norm(x, torch.ones(8), 1e-5, x.half())


def rotary_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, cache_dtype, device="cpu"):
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    cache = reference.rope_cos_sin_cache(head_dim, 4096, 10000.0, dtype=cache_dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    to = dict(device=device)
    return positions.to(**to), q.to(**to), k.to(**to), cache.to(**to)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, cache_dtype",
    [(4, 2, 16, torch.float32), (9, 3, 64, torch.float32), (6, 6, 32, torch.bfloat16)],
)
def test_rotary_embedding(ops, dtype, num_heads, num_kv_heads, head_dim, cache_dtype):
    inputs = rotary_inputs(9, num_heads, num_kv_heads, head_dim, dtype, cache_dtype)
    q, k = ops.rotary_embedding(*inputs)
    expected_q, expected_k = reference.rotary_embedding(*inputs)
    assert q.is_contiguous() and k.is_contiguous()
    assert_close(q, expected_q, rtol=ULP[dtype])
    assert_close(k, expected_k, rtol=ULP[dtype])


def test_rotary_embedding_rejects_bad_inputs(ops):
    positions, q, k, cache = rotary_inputs(3, 2, 1, 16, torch.float32, torch.float32)
    with pytest.raises(ValueError, match=r"cos_sin_cache must have shape \(max_position, 16\)"):
        ops.rotary_embedding(positions, q, k, cache[:, :8])
    with pytest.raises(ValueError, match="positions must have dtype"):
        ops.rotary_embedding(positions.float(), q, k, cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 80), (2, 3, 2 * 1100)])
def test_silu_and_mul(ops, dtype, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(6)).to(dtype) * 4
    out = ops.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    assert_close(out, reference.silu_and_mul(x.float()).to(dtype), rtol=ULP[dtype])


def test_silu_and_mul_rejects_odd_width(ops):
    with pytest.raises(ValueError, match="last dim must be even"):
        ops.silu_and_mul(torch.randn(3, 7))


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


def model_step(model, caches, tables: list[list[int]], starts: list[int], chunks: list[list[int]], block_size: int):
    """One varlen step of ``model`` over the chunks (sequence ``i`` resumes at ``starts[i]`` on
    block table ``tables[i]``): fp32 logits of each chunk's last token."""
    from engine.attention import AttentionMetadata

    ids, positions, slots, seq_lens, query_start = [], [], [], [], [0]
    for table, start, chunk in zip(tables, starts, chunks):
        ids += chunk
        positions += range(start, start + len(chunk))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + len(chunk))]
        seq_lens.append(start + len(chunk))
        query_start.append(query_start[-1] + len(chunk))
    width = max(map(len, tables))
    attn = AttentionMetadata(
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        slot_mapping=torch.tensor(slots), seq_lens_cpu=seq_lens, query_start_loc_cpu=query_start,
        max_query_len=max(map(len, chunks)), max_seq_len=max(seq_lens),
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(positions), attn, caches)
        return model.compute_logits(hidden[torch.tensor(query_start[1:]) - 1])


def test_model_on_triton_ops_matches_torch_ops(ops):
    """The tiny model on the Triton ops (cuBLAS with the norm and SiLU kernels for a prefill,
    the GEMVs and decode_attention for decode rows) gives the torch ops' logits step by step."""
    from engine.config import DUMMY_CONFIGS
    from engine.models.llama import LlamaForCausalLM

    config, block_size = DUMMY_CONFIGS["tiny"], 16
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(config, reference)
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ours = LlamaForCausalLM(config, ops)
    ours.load_state_dict(theirs.state_dict())
    shape = (8, block_size, config.num_kv_heads, config.head_dim)
    caches = {m: [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)] for m in (ours, theirs)}
    tables = [[3, 0], [5]]
    prompts = [list(range(100, 120)), list(range(300, 309))]
    steps = [([0, 0], prompts)]  # a prefill of both (29 rows), then decode steps of both (2 rows) and of one
    steps += [([20 + i, 9 + i], [[7 + i], [8 + i]]) for i in range(3)]
    for starts, chunks in steps + [([23], [[11]])]:
        rows = tables[: len(chunks)]
        expected = model_step(theirs, caches[theirs], rows, starts, chunks, block_size)
        torch.testing.assert_close(model_step(ours, caches[ours], rows, starts, chunks, block_size), expected,
                                   rtol=1e-4, atol=1e-4)


def test_load_ops_triton():
    ops = load_ops("triton")
    assert ops is triton_ops
    names = (
        "store_kv", "paged_attention", "decode_attention", "rms_norm", "rope_cos_sin_cache",
        "rotary_embedding", "silu_and_mul", "linear", "norm_linear", "argmax",
    )
    for name in names:
        assert callable(getattr(ops, name)), name
    assert ops.rope_cos_sin_cache is reference.rope_cos_sin_cache


# --------------------------------------------------------------------------------------------
# GPU: the compiled kernels on larger shapes


def random_contexts(num_seqs: int, low: int, high: int, seed: int) -> list[int]:
    return torch.randint(low, high + 1, (num_seqs,), generator=torch.Generator().manual_seed(seed)).tolist()


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


# (query-head group, kv heads, head dim, block-table capacity): SmolLM2 and Llama 3 8B.
GPU_DECODE_SHAPES = {"smollm2": (3, 3, 64, 2048), "llama3-8b": (4, 8, 128, 8192)}


def gpu_decode_step(shape: str, context_lens: list[int], dtype: torch.dtype, seed: int = 0) -> DecodeStep:
    group, num_kv_heads, head_dim, capacity = GPU_DECODE_SHAPES[shape]
    block_size = 16
    return make_decode_step(
        context_lens, group=group, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
        block_size=block_size, device="cuda", seed=seed,
        extra_table_blocks=capacity // block_size - math.ceil(max(context_lens) / block_size),
    )


@gpu
@pytest.mark.parametrize("shape", list(GPU_DECODE_SHAPES))
@pytest.mark.parametrize("num_seqs, dtype", [(1, torch.bfloat16), (64, torch.bfloat16), (64, torch.float32)])
def test_gpu_decode_attention_fused(shape, num_seqs, dtype):
    capacity = GPU_DECODE_SHAPES[shape][3]
    contexts = random_contexts(num_seqs, 1, capacity, seed=num_seqs)
    if num_seqs > 1:  # padding rows, a single key, a full table
        contexts[:3] = [0, 1, capacity]
    step = gpu_decode_step(shape, contexts, dtype)
    check_decode_step(triton_ops.decode_attention, step, GPU_ATTENTION_TOL[dtype])


@gpu
def test_gpu_decode_attention_cuda_graph_replays_other_lengths(monkeypatch):
    """Captured once after an eager call, replayed with new lengths and inputs: the merge stays
    right, the counters are back at 0, and nothing compiles for new lengths."""
    capacity = GPU_DECODE_SHAPES["llama3-8b"][3]
    step = gpu_decode_step("llama3-8b", [capacity] * 3 + [0], torch.bfloat16)
    k_cache, v_cache = step.batch.k_cache.clone(), step.batch.v_cache.clone()
    step.run(triton_ops.decode_attention, k_cache, v_cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step.run(triton_ops.decode_attention, k_cache, v_cache)
    compiled = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: compiled.append(kw["repr"]))
    block_size = k_cache.shape[1]
    for seed in range(3):
        contexts = random_contexts(3, 1, capacity, seed) + [0]
        last = [max(n - 1, 0) for n in contexts]
        tables = step.batch.block_tables.tolist()
        slots = [tables[i][p // block_size] * block_size + p % block_size if n else -1
                 for i, (n, p) in enumerate(zip(contexts, last))]
        step.positions.copy_(torch.tensor(last))
        step.slot_mapping.copy_(torch.tensor(slots))
        step.batch.seq_lens.copy_(torch.tensor(contexts))
        step.batch.seq_lens_cpu = contexts
        for t in (step.q, step.k, step.v):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))
        k_cache.copy_(step.batch.k_cache)
        v_cache.copy_(step.batch.v_cache)
        graph.replay()
        expected_out, expected_k, expected_v = step.expected()
        tol = GPU_ATTENTION_TOL[torch.bfloat16]
        assert_close(out, expected_out, rtol=tol, atol=tol / 4)
        assert_close(k_cache, expected_k, rtol=ULP[torch.bfloat16], atol=1e-4)
        assert torch.equal(v_cache, expected_v)
        assert not triton_ops._ARRIVAL_COUNTERS[out.device].any()
        eager = step.run(triton_ops.decode_attention, k_cache.clone(), v_cache.clone())
        assert_close(eager, expected_out, rtol=tol, atol=tol / 4)
    assert compiled == []


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_store_kv(dtype, block_size):
    run_store_kv(triton_ops.store_kv, 8192, 8, 128, block_size, dtype, dtype, "cuda")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_rms_norm(dtype, with_residual):
    x, weight, residual = rms_norm_inputs((4096, 4096), dtype, with_residual, strided=False, device="cuda")
    normed, new_residual = triton_ops.rms_norm(x, weight, 1e-5, residual)
    expected_normed, expected_residual = reference.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, expected_residual)
    assert_close(normed, expected_normed, rtol=ULP[dtype], atol=1e-4)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_rotary_embedding(dtype):
    inputs = rotary_inputs(8192, 32, 8, 128, dtype, torch.float32, device="cuda")
    q, k = triton_ops.rotary_embedding(*inputs)
    expected_q, expected_k = reference.rotary_embedding(*inputs)
    assert_close(q, expected_q, rtol=ULP[dtype], atol=1e-4)
    assert_close(k, expected_k, rtol=ULP[dtype], atol=1e-4)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_silu_and_mul(dtype):
    x = torch.randn(4096, 2 * 14336, device="cuda").to(dtype)
    expected = reference.silu_and_mul(x.float()).to(dtype)
    assert_close(triton_ops.silu_and_mul(x), expected, rtol=ULP[dtype], atol=1e-4)


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


@gpu
@pytest.mark.parametrize("rows, width", [(1, 49152), (64, 128256), (3, 1000)])
def test_gpu_argmax(rows, width):
    logits = torch.randn(rows, width, device="cuda")
    assert torch.equal(triton_ops.argmax(logits), reference.argmax(logits))
    logits[:, [5, width - 1]] = 50.0
    assert torch.equal(triton_ops.argmax(logits), reference.argmax(logits))
