"""decode_attention (RoPE, store and split-K decode in one launch) against the reference composition."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import triton
from kernel_cases import (
    GPU_ATTENTION_TOL,
    GQA_BLOCKS,
    INTERPRETED,
    ULP,
    Batch,
    assert_close,
    assert_rounded_equal,
    gpu,
    kv_heads_for,
    make_batch,
    random_contexts,
)

from kernels import QKNorm, reference, triton_ops
from kernels.triton_ops import _launch, attention, fused_decode


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
    qk_norm: QKNorm | None = None

    def run(self, decode_attention, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        b = self.batch
        return decode_attention(
            self.positions, self.q, self.k, self.v, self.cos_sin_cache, k_cache, v_cache,
            self.slot_mapping, b.block_tables, b.seq_lens, b.scale, b.seq_lens_cpu, qk_norm=self.qk_norm,
        )

    def expected(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference composition on copies of the caches (attention in fp32 on the rounded
        rotated q and stored K/V): output, k_cache, v_cache."""
        b = self.batch
        k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
        q, k = reference.rotary_embedding(self.positions, self.q, self.k, self.cos_sin_cache, self.qk_norm)
        reference.store_kv(k, self.v, k_cache, v_cache, self.slot_mapping)
        out = reference.paged_attention(
            q.float(), k_cache.float(), v_cache.float(), b.block_tables, b.seq_lens,
            b.query_start_loc, b.scale,
        )
        return out.to(self.q.dtype), k_cache, v_cache


def make_decode_step(
    context_lens: list[int], *, group: int, num_kv_heads: int = 2, head_dim: int = 32,
    dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0, qk_norm: bool = False, **batch,
) -> DecodeStep:
    """Inputs as make_batch's (``batch``: its other settings); a context of length 0 is a
    padding row (slot -1). ``qk_norm``: with per-head q/k norms of random weights (Qwen3's)."""
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
        qk_norm=QKNorm(*(1 + 0.3 * torch.randn(2, head_dim, generator=gen, device=device)).to(dtype), 1e-6)
        if qk_norm else None,
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
        if step.qk_norm is not None:  # its sum of squares runs in another order: a normed value
            # rounded a unit apart is rotated, a unit of the inputs' magnitude (below 8) apart
            assert_close(k_cache, expected_k, rtol=ULP[k_cache.dtype], atol=max(8 * ULP[k_cache.dtype], 1e-4))
        elif INTERPRETED:
            assert_rounded_equal(k_cache, expected_k)
        else:  # compiled, the rotation may fuse a multiply-add: a unit in the last place apart
            assert_close(k_cache, expected_k, rtol=ULP[k_cache.dtype], atol=1e-4)
        assert_rounded_equal(v_cache, expected_v)
        for counters in _launch._ARRIVAL_COUNTERS.values():
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
    tiles = attention.attention_tiles("fused_decode", 32, torch.float32)
    num_sms = _launch._num_sms(step.q.device)
    assert attention.decode_num_splits(2, 2, capacity, tiles.block_n, num_sms) == expected_splits
    check_decode_step(ops.decode_attention, step, ULP[torch.float32], repeats=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_attention_fused_half_precision(ops, dtype):
    step = make_decode_step([17, 99], group=4, num_kv_heads=1, dtype=dtype, seed=1)
    # The interpreter truncates the rotated bf16 q where the reference rounds it: outputs of
    # magnitude ~1 may then differ by a unit in the last place.
    check_decode_step(ops.decode_attention, step, ULP[dtype], atol=ULP[dtype] if dtype == torch.bfloat16 else None)


@pytest.mark.parametrize("head_dim, context_lens", [(32, [1, 17, 0, 99]), (24, [30, 0, 100])])
def test_decode_attention_fused_with_qk_norm(ops, head_dim, context_lens):
    """Each head of q and k normed in the launch, before RoPE (a padding row still gives zeros)."""
    step = make_decode_step(context_lens, group=3, num_kv_heads=1, head_dim=head_dim, seed=4, qk_norm=True)
    check_decode_step(ops.decode_attention, step, ULP[torch.float32])
    plain = reference.decode_attention(
        step.positions, step.q, step.k, step.v, step.cos_sin_cache, step.batch.k_cache.clone(),
        step.batch.v_cache.clone(), step.slot_mapping, step.batch.block_tables, step.batch.seq_lens, step.batch.scale,
    )
    assert not torch.allclose(plain, step.expected()[0], rtol=0.01)  # the norms changed the output


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


# (query-head group, kv heads, head dim, block-table capacity): SmolLM2, Llama 3 8B and Qwen3 8B
# (Llama 3 8B's attention shape, with q/k norms).
GPU_DECODE_SHAPES = {"smollm2": (3, 3, 64, 2048), "llama3-8b": (4, 8, 128, 8192), "qwen3-8b": (4, 8, 128, 8192)}


def gpu_decode_step(shape: str, context_lens: list[int], dtype: torch.dtype, seed: int = 0) -> DecodeStep:
    group, num_kv_heads, head_dim, capacity = GPU_DECODE_SHAPES[shape]
    block_size = 16
    return make_decode_step(
        context_lens, group=group, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
        block_size=block_size, device="cuda", seed=seed, qk_norm=shape.startswith("qwen3"),
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
        assert not _launch._ARRIVAL_COUNTERS[out.device].any()
        eager = step.run(triton_ops.decode_attention, k_cache.clone(), v_cache.clone())
        assert_close(eager, expected_out, rtol=tol, atol=tol / 4)
    assert compiled == []


@pytest.mark.parametrize("context, extra_table_blocks", [(1, 0), (17, 3), (97, 6), (333, 2)])
def test_decode_attention_fused_one_sequence(ops, context, extra_table_blocks):
    """A single sequence: its splits load their first tile before the wait and are merged in one load."""
    step = make_decode_step([context], group=3, extra_table_blocks=extra_table_blocks)
    check_decode_step(ops.decode_attention, step, ULP[torch.float32], repeats=2)


@pytest.mark.parametrize("context_lens", [[333], [333, 70, 0]])
def test_decode_attention_fused_merges_in_several_loads(ops, monkeypatch, context_lens):
    """More splits hold keys than one merge load takes: the last program merges them in turns."""
    monkeypatch.setattr(fused_decode, "_FUSED_DECODE_ONE_MERGED_SPLITS", 2)
    monkeypatch.setattr(fused_decode, "_FUSED_DECODE_LONG_SPLIT_TOKENS", 32)
    step = make_decode_step(context_lens, group=3, extra_table_blocks=2)
    check_decode_step(ops.decode_attention, step, ULP[torch.float32], repeats=2)
