"""Triton kernels against their torch reference twins and the memory roofline, on CUDA.

Prints one JSON line per measurement: first the device's copy bandwidth measured in this run,
then each kernel at Llama-3-8B shapes (32 query heads, 8 kv heads, head_dim 128, hidden 4096,
intermediate 14336, bf16). Times are medians of ``triton.testing.do_bench`` (L2 flushed before
each call); ``roofline_us`` is the bytes the kernel must move at ``--bandwidth`` B/s. The
``fused_decode_attention_graph`` rows time one decode layer's attention (SmolLM2 and Llama-3-8B
shapes) as decode_attention against rotary_embedding + store_kv + paged_attention, inside CUDA
graphs, as the engine replays decode steps; the ``gemv`` rows time the decode projections
(linear, norm_linear) against cuBLAS with the norms and SiLU-and-mul as separate launches; the
``decode_layer`` rows a whole batch-1 decoder layer (the GEMVs and decode_attention). The ``fp8``
rows time fp8 weights against bf16 by path and batch size (see ``bench_fp8``); the ``sampler`` rows
a decode step's draw at a temperature (see ``bench_sampler``).

    python3 benchmarks/kernels_bench.py [--block-size 16] [--sweep] [--only GROUP]

``--sweep`` also times alternative attention tile shapes (and the fused decode's split counts), to tune
``attention_tiles`` and ``decode_num_splits``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import triton
from triton.testing import do_bench

# Run as a script from anywhere: the repository root holds the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models.fp8 import quantize_weight
from engine.protocol import SamplingParams
from engine.sampler import _draw, _filtered_probs
from kernels import reference, triton_ops
from kernels.triton_ops import attention, fused_decode, gemv
from kernels.triton_ops import fp8 as fp8_ops
from loadtest.stamp import emit

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
HIDDEN, INTERMEDIATE = 4096, 14336
DTYPE = torch.bfloat16
ELEMENT = 2  # bytes per bf16
DECODE_BATCHES = (1, 16, 64)
DECODE_CONTEXTS = (512, 4096, 32768)
# decode_attention against the three launches it replaces (rotary_embedding, store_kv,
# paged_attention), batches of single-token sequences of one context length:
# (query heads, kv heads, head_dim, block-table capacity).
FUSED_DECODE_SHAPES = {"smollm2": (9, 3, 64, 2048), "llama3-8b": (32, 8, 128, 8192)}
FUSED_DECODE_BATCHES = (1, 64)
FUSED_DECODE_CONTEXTS = (128, 640, 2048, 8192)  # past a shape's capacity, the table widens to the context
GRAPH_LAYER_CALLS = 10  # calls per captured graph, as a model's layers: the graph launch amortizes
GRAPH_REPLAYS = 1000
# (block_n, num_warps, num_stages[, max_registers])
DECODE_SWEEP = [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2), (64, 4, 2, 128)]
# Split counts the fused decode sweep tries past batch 1. At batch 64 of Llama 3 8B's shape the chosen
# tiles (64 keys, 4 warps, 2 stages) take 160-167 registers (ptxas for sm_90, offline: 3 programs an
# SM) and 2 splits: 1,024 programs, 2.6 waves; 32-key tiles take 128 (4 an SM): 1 split is one wave;
# capped at 128 (DECODE_SWEEP's last) the 64-key tiles spill 92 bytes (kernel_resources_sm90.jsonl's method).
FUSED_DECODE_SWEEP_SPLITS = (1, 2, 4, 8)
PREFILL_SWEEP = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 5), (64, 64, 4, 3)]


def time_us(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def max_abs_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.float() - expected.float()).abs().max().item()


def compare(name: str, bytes_moved: int, bandwidth: float, triton_fn, reference_fn, **fields) -> None:
    """Times both implementations, checks they agree, and prints one measurement."""
    err = max(max_abs_err(a, b) for a, b in zip(_as_tuple(triton_fn()), _as_tuple(reference_fn())))
    triton_us, reference_us = time_us(triton_fn), time_us(reference_fn)
    roofline_us = bytes_moved / bandwidth * 1e6
    emit(
        bench=name, **fields, triton_us=round(triton_us, 2), torch_reference_us=round(reference_us, 2),
        roofline_us=round(roofline_us, 2), bytes=bytes_moved,
        triton_fraction_of_roofline=round(roofline_us / triton_us, 3),
        speedup_vs_reference=round(reference_us / triton_us, 2), max_abs_err=err,
    )


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def paged_batch(context_lens: list[int], query_lens: list[int], block_size: int):
    """Llama-shaped q and a paged KV cache whose blocks are scattered over the pool."""
    num_blocks = sum(math.ceil(n / block_size) for n in context_lens)
    width = max(math.ceil(n / block_size) for n in context_lens)
    physical = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    block_tables = torch.zeros((len(context_lens), width), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(context_lens):
        blocks = math.ceil(n / block_size)
        block_tables[i, :blocks] = physical[used : used + blocks]
        used += blocks
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    q = torch.randn((sum(query_lens), NUM_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    args = (
        q, k_cache, v_cache, block_tables,
        torch.tensor(context_lens, dtype=torch.int32, device="cuda"),
        torch.tensor(starts, dtype=torch.int32, device="cuda"),
        HEAD_DIM**-0.5, list(context_lens), starts,
    )
    return args


def new_rows(args, context_lens: list[int], query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's new K/V rows read back from its cache, laid out as the model hands them to
    store_kv: key contiguous, value a strided view of the fused qkv projection."""
    q, k_cache, v_cache, block_tables = args[:4]
    block_size = k_cache.shape[1]
    qkv = torch.empty((q.shape[0], (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM), dtype=DTYPE, device="cuda")
    value = qkv[:, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM :].view(q.shape[0], NUM_KV_HEADS, HEAD_DIM)
    key = torch.empty_like(value, memory_format=torch.contiguous_format)
    start = 0
    for i, (context, new) in enumerate(zip(context_lens, query_lens)):
        positions = torch.arange(context - new, context, device="cuda")
        blocks = block_tables[i].long()[positions // block_size]
        key[start : start + new] = k_cache[blocks, positions % block_size]
        value[start : start + new] = v_cache[blocks, positions % block_size]
        start += new
    return key, value


def attention_bytes(context_lens: list[int], query_lens: list[int]) -> int:
    """K and V of every context read once, q read and the output written once."""
    kv = sum(context_lens) * NUM_KV_HEADS * HEAD_DIM * ELEMENT * 2
    return kv + sum(query_lens) * NUM_HEADS * HEAD_DIM * ELEMENT * 2


def causal_flops(context_lens: list[int], query_lens: list[int]) -> int:
    """QK^T and PV over the (query, key) pairs the causal mask keeps."""
    pairs = sum(q * (c - q) + q * (q + 1) // 2 for c, q in zip(context_lens, query_lens))
    return 4 * pairs * NUM_HEADS * HEAD_DIM


def patched(name: str, value: object, fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` run with ``name`` set to ``value`` in each Triton op module that looks it up."""

    def run(*args):
        holders = [m for m in (attention, fused_decode, gemv, fp8_ops) if name in vars(m)]
        chosen = [getattr(m, name) for m in holders]
        for m in holders:
            setattr(m, name, value)
        try:
            return fn(*args)
        finally:
            for m, c in zip(holders, chosen):
                setattr(m, name, c)

    return run


def with_tiles(kind: str, tiles: attention.AttentionTiles, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with ``attention_tiles`` answering ``tiles`` for ``kind``."""
    chosen = attention.attention_tiles
    return patched("attention_tiles", lambda k, d, t: tiles if k == kind else chosen(k, d, t), fn)


def bench_copy_bandwidth() -> float:
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src))
    bandwidth = 2 * src.numel() / (us * 1e-6)
    props = torch.cuda.get_device_properties(0)
    emit(
        bench="copy_bandwidth", device=props.name, sms=props.multi_processor_count,
        torch=torch.__version__, triton=triton.__version__, bytes=2 * src.numel(), us=round(us, 2),
        bytes_per_s=round(bandwidth),
    )
    del src, dst
    return bandwidth


def bench_decode(block_size: int, bandwidth: float, sweep: bool) -> None:
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            contexts, queries = [context] * batch, [1] * batch
            args = paged_batch(contexts, queries, block_size)
            capacity = args[3].shape[1] * block_size
            tiles = attention.attention_tiles("decode", HEAD_DIM, DTYPE)
            num_sms = torch.cuda.get_device_properties(0).multi_processor_count
            splits = attention.decode_num_splits(batch, NUM_KV_HEADS, capacity, tiles.block_n, num_sms)
            compare(
                "decode_attention", attention_bytes(contexts, queries), bandwidth,
                lambda: triton_ops.paged_attention(*args), lambda: reference.paged_attention(*args),
                batch=batch, context=context, block_size=block_size, num_splits=splits,
                tiles=list(tiles),
            )
            if sweep:
                for tile in DECODE_SWEEP:
                    alt = attention.AttentionTiles(1, *tile)
                    us = time_us(with_tiles("decode", alt, lambda: triton_ops.paged_attention(*args)))
                    roofline_us = attention_bytes(contexts, queries) / bandwidth * 1e6
                    emit(
                        bench="decode_attention_sweep", batch=batch, context=context, block_size=block_size,
                        tiles=list(alt), triton_us=round(us, 2),
                        triton_fraction_of_roofline=round(roofline_us / us, 3),
                    )
            del args


def graph_us_per_call(fn: Callable[..., object], layers: int = 0, replays: int = GRAPH_REPLAYS) -> float:
    """Microseconds per call of ``fn`` captured GRAPH_LAYER_CALLS times in one CUDA graph and
    replayed ``replays`` times: the launch gaps between kernels count, the host does not. With
    ``layers``, call ``i`` is ``fn(i % layers)`` (weights that L2 cannot hold from call to call)."""
    calls = [(lambda i=i: fn(i % layers)) if layers else fn for i in range(GRAPH_LAYER_CALLS)]
    for call in calls[: max(layers, 1)]:
        call()  # compiles, and allocates what must exist before a capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * GRAPH_LAYER_CALLS)


def decode_cache(batch: int, num_kv_heads: int, head_dim: int, capacity: int, context: int, block_size: int):
    """A decode step's paged KV cache and inputs: ``batch`` sequences of ``context`` tokens (the
    last one new), their blocks scattered over the pool, the block table ``capacity`` wide.
    Returns (k_cache, v_cache, block_tables, slot_mapping, positions, seq_lens)."""
    blocks_per_seq = math.ceil(context / block_size)
    cache_shape = (batch * blocks_per_seq + 1, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(cache_shape, dtype=DTYPE, device="cuda")
    tables = torch.zeros((batch, capacity // block_size), dtype=torch.int32, device="cuda")
    tables[:, :blocks_per_seq] = torch.randperm(batch * blocks_per_seq, device="cuda").view(batch, -1)
    last = context - 1
    slots = (tables[:, last // block_size] * block_size + last % block_size).long()
    positions = torch.full((batch,), last, dtype=torch.int64, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, tables, slots, positions, seq_lens


def bench_fused_decode(block_size: int, bandwidth: float, sweep: bool) -> None:
    """One attention layer of a decode step, both ways, under CUDA graphs; with ``sweep``, the fused
    kernel at each tile shape of DECODE_SWEEP and, past batch 1, each split count of
    FUSED_DECODE_SWEEP_SPLITS, against the bytes of its K/V reads."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape, (num_heads, num_kv_heads, head_dim, max_model_len) in FUSED_DECODE_SHAPES.items():
        for batch in FUSED_DECODE_BATCHES:
            for context in FUSED_DECODE_CONTEXTS:
                capacity = max(max_model_len, context)
                k_cache, v_cache, tables, slots, positions, seq_lens = decode_cache(
                    batch, num_kv_heads, head_dim, capacity, context, block_size
                )
                query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
                qkv = torch.randn((batch, (num_heads + 2 * num_kv_heads) * head_dim), dtype=DTYPE, device="cuda")
                q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
                q = q.view(batch, num_heads, head_dim)
                k, v = (t.view(batch, num_kv_heads, head_dim) for t in (k, v))
                cos_sin = reference.rope_cos_sin_cache(head_dim, capacity, 10000.0, device="cuda")
                scale, lens_cpu, starts_cpu = head_dim**-0.5, [context] * batch, list(range(batch + 1))

                def three_launches():
                    q_rot, k_rot = triton_ops.rotary_embedding(positions, q, k, cos_sin)
                    triton_ops.store_kv(k_rot, v, k_cache, v_cache, slots)
                    return triton_ops.paged_attention(
                        q_rot, k_cache, v_cache, tables, seq_lens, query_start_loc, scale,
                        lens_cpu, starts_cpu, key=k_rot, value=v,
                    )

                def fused():
                    return triton_ops.decode_attention(
                        positions, q, k, v, cos_sin, k_cache, v_cache, slots, tables, seq_lens, scale, lens_cpu,
                    )

                kind = attention.fused_decode_kind(batch)
                tiles = attention.attention_tiles(kind, head_dim, DTYPE)
                splits = attention.decode_num_splits(batch, num_kv_heads, capacity, tiles.block_n, num_sms)
                separate_us, fused_us = graph_us_per_call(three_launches), graph_us_per_call(fused)
                emit(
                    bench="fused_decode_attention_graph", shape=shape, batch=batch, context=context,
                    capacity=capacity, block_size=block_size, num_splits=splits, tiles=list(tiles),
                    separate_launches=3 + (splits > 1), separate_us=round(separate_us, 2),
                    fused_us=round(fused_us, 2), speedup=round(separate_us / fused_us, 2),
                    max_abs_err=max_abs_err(fused(), three_launches()),
                )
                if sweep:
                    kv_us = batch * context * num_kv_heads * head_dim * 2 * ELEMENT / bandwidth * 1e6
                    for tile, alt_splits in itertools.product(
                        DECODE_SWEEP, FUSED_DECODE_SWEEP_SPLITS if batch > 1 else (splits,)
                    ):
                        alt = attention.AttentionTiles(1, *tile)
                        us = graph_us_per_call(with_tiles(kind, alt, patched("decode_num_splits",
                                                                             lambda *_, n=alt_splits: n, fused)))
                        emit(
                            bench="fused_decode_attention_sweep", shape=shape, batch=batch, context=context,
                            tiles=list(alt), num_splits=alt_splits, fused_us=round(us, 2),
                            kv_bytes_fraction=round(kv_us / us, 3),
                        )


def bench_prefill(block_size: int, bandwidth: float, sweep: bool) -> None:
    """Each case twice: the new chunk's keys read through the block table like the prefix
    (``triton_*``), and from the step's key/value rows (``triton_new_rows_*``)."""
    for label, contexts, queries in (
        ("prefill_8k", [8192], [8192]),
        ("extend_2k_over_6k", [8192], [2048]),
        ("prefill_4x2k", [2048] * 4, [2048] * 4),
    ):
        args = paged_batch(contexts, queries, block_size)
        key, value = new_rows(args, contexts, queries)
        flops = causal_flops(contexts, queries)

        def cache_path():
            return triton_ops.paged_attention(*args)

        def new_rows_path():
            return triton_ops.paged_attention(*args, key=key, value=value)

        triton_us, new_rows_us = time_us(cache_path), time_us(new_rows_path)
        reference_us = time_us(lambda: reference.paged_attention(*args))
        expected = reference.paged_attention(*args)
        fields = dict(bench="prefill_attention", case=label, block_size=block_size, tokens=sum(queries))
        peer = {}
        if len(contexts) == 1 and contexts == queries:
            # FlashAttention through torch on contiguous K/V: the strongest dense peer.
            q = args[0].transpose(0, 1)[None]
            k = torch.randn((1, NUM_KV_HEADS, contexts[0], HEAD_DIM), dtype=DTYPE, device="cuda")
            v = torch.randn_like(k)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            peer_us = time_us(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True))
            peer = dict(
                torch_sdpa_dense_causal_us=round(peer_us, 2), torch_sdpa_tflops=round(flops / peer_us / 1e6, 1)
            )
        emit(
            **fields, triton_us=round(triton_us, 2), triton_new_rows_us=round(new_rows_us, 2),
            torch_reference_us=round(reference_us, 2), **peer, flops=flops,
            triton_tflops=round(flops / triton_us / 1e6, 1),
            triton_new_rows_tflops=round(flops / new_rows_us / 1e6, 1),
            speedup_vs_reference=round(reference_us / triton_us, 2),
            max_abs_err=max_abs_err(cache_path(), expected),
            new_rows_max_abs_err=max_abs_err(new_rows_path(), expected),
            tiles=list(attention.attention_tiles("prefill", HEAD_DIM, DTYPE)),
        )
        if sweep:
            for block_m, block_n, num_warps, num_stages in PREFILL_SWEEP:
                alt = attention.AttentionTiles(block_m, block_n, num_warps, num_stages)
                us = time_us(with_tiles("prefill", alt, cache_path))
                alt_new_rows_us = time_us(with_tiles("prefill", alt, new_rows_path))
                emit(
                    bench="prefill_attention_sweep", case=label, block_size=block_size, tiles=list(alt),
                    triton_us=round(us, 2), triton_tflops=round(flops / us / 1e6, 1),
                    triton_new_rows_us=round(alt_new_rows_us, 2),
                    triton_new_rows_tflops=round(flops / alt_new_rows_us / 1e6, 1),
                )
        del args, key, value


def bench_small_ops(block_size: int, bandwidth: float) -> None:
    for tokens in (64, 8192):
        kv_shape = (tokens, NUM_KV_HEADS, HEAD_DIM)
        key, value = (torch.randn(kv_shape, dtype=DTYPE, device="cuda") for _ in range(2))
        num_blocks = math.ceil(tokens / block_size) + 1
        slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
        cache_shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
        caches = {impl: [torch.zeros(cache_shape, dtype=DTYPE, device="cuda") for _ in range(2)]
                  for impl in (triton_ops.store_kv, reference.store_kv)}

        def store(impl):
            impl(key, value, *caches[impl], slots)
            return tuple(caches[impl])

        kv_bytes = 2 * key.numel() * ELEMENT * 2 + tokens * 8
        compare(
            "store_kv", kv_bytes, bandwidth, lambda: store(triton_ops.store_kv), lambda: store(reference.store_kv),
            tokens=tokens, block_size=block_size,
        )

        x, residual = (torch.randn((tokens, HIDDEN), dtype=DTYPE, device="cuda") for _ in range(2))
        weight = torch.randn(HIDDEN, dtype=DTYPE, device="cuda")
        compare(
            "rms_norm_fused_residual", 4 * x.numel() * ELEMENT + HIDDEN * ELEMENT, bandwidth,
            lambda: triton_ops.rms_norm(x, weight, 1e-5, residual),
            lambda: reference.rms_norm(x, weight, 1e-5, residual), tokens=tokens, hidden=HIDDEN,
        )

        qkv = torch.randn((tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM), dtype=DTYPE, device="cuda")
        q = qkv[:, : NUM_HEADS * HEAD_DIM].view(tokens, NUM_HEADS, HEAD_DIM)
        k = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM]
        k = k.view(tokens, NUM_KV_HEADS, HEAD_DIM)
        cos_sin = reference.rope_cos_sin_cache(HEAD_DIM, 131072, 500000.0, device="cuda")
        positions = torch.randint(0, 131072, (tokens,), device="cuda")
        rope_bytes = 2 * (q.numel() + k.numel()) * ELEMENT + tokens * (HEAD_DIM * 4 + 8)
        compare(
            "rotary_embedding", rope_bytes, bandwidth,
            lambda: triton_ops.rotary_embedding(positions, q, k, cos_sin),
            lambda: reference.rotary_embedding(positions, q, k, cos_sin), tokens=tokens,
        )

        gate_up = torch.randn((tokens, 2 * INTERMEDIATE), dtype=DTYPE, device="cuda")
        compare(
            "silu_and_mul", 3 * tokens * INTERMEDIATE * ELEMENT, bandwidth,
            lambda: triton_ops.silu_and_mul(gate_up), lambda: reference.silu_and_mul(gate_up),
            tokens=tokens, intermediate=INTERMEDIATE,
        )


# Decode projections of one layer: (hidden, q + 2 kv heads' width, q width, intermediate).
GEMV_SHAPES = {"smollm2": (576, 960, 576, 1536), "llama3-8b": (4096, 6144, 4096, 14336)}
# The decode_layer_graph rows: one sequence this long (640: decode_profile's; 128-384: gpu_bench's decode_b1)
DECODE_LAYER_CONTEXTS = (128, 640, 2048)
# Their --sweep: decode_attention's batch-1 tiles (block_n, num_warps, num_stages) x merged splits
DECODE_LAYER_SWEEP = [(128, 8, 2), (128, 4, 2), (64, 4, 2), (64, 8, 2)]
DECODE_LAYER_MERGED_SPLITS = (8, 16)
GEMV_ROWS = (1, 2, 4)
GEMV_SWEEP = [
    (2, 1024, 4, 3), (2, 2048, 4, 3), (4, 512, 4, 3), (4, 1024, 2, 3), (4, 1024, 4, 2), (4, 1024, 4, 4),
    (4, 2048, 4, 2), (4, 2048, 8, 2), (8, 512, 4, 4), (8, 1024, 4, 3), (8, 1024, 8, 3), (16, 1024, 4, 2),
]


def with_gemv_tiles(tiles: gemv.GemvTiles, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with the GEMV kernel on ``tiles``."""
    return patched("GEMV_TILES", tiles, fn)


def without_pdl(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with every kernel launched without programmatic dependent launch."""
    return patched("_pdl_args", lambda device: dict(USE_PDL=False), fn)


class LayerWeights(NamedTuple):
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    ln1: torch.Tensor
    ln2: torch.Tensor
    q_width: int

    @classmethod
    def random(cls, hidden: int, qkv_width: int, q_width: int, inter: int) -> LayerWeights:
        qkv, o, gate_up, down = (
            torch.randn(n, k, dtype=DTYPE, device="cuda") / math.sqrt(k)
            for n, k in ((qkv_width, hidden), (hidden, q_width), (2 * inter, hidden), (hidden, inter))
        )
        ln1, ln2 = (torch.rand(hidden, dtype=DTYPE, device="cuda") + 0.5 for _ in range(2))
        return cls(qkv, o, gate_up, down, ln1, ln2, q_width)

    @property
    def numel(self) -> int:
        return sum(w.numel() for w in (self.qkv, self.o, self.gate_up, self.down))


GEMV_EPS = 1e-5


def bench_gemv(bandwidth: float, sweep: bool) -> None:
    """Decode-batch projections under CUDA graphs: linear/norm_linear (one GEMV launch each)
    against the launches they replace (rms_norm, cuBLAS, silu_and_mul), per projection and as a
    layer's chain of four (attention left out), with and without programmatic dependent launch."""
    for shape, (hidden, qkv_width, q_width, inter) in GEMV_SHAPES.items():
        w = LayerWeights.random(hidden, qkv_width, q_width, inter)
        for rows in GEMV_ROWS:
            x, residual = (torch.randn(rows, hidden, dtype=DTYPE, device="cuda") for _ in range(2))
            _bench_projections(shape, w, x, residual, bandwidth, sweep)
            _bench_chain(shape, w, x, residual, bandwidth)


def bench_decode_layer(bandwidth: float, sweep: bool) -> None:
    """A whole batch-1 decoder layer (the four GEMVs and decode_attention) under CUDA graphs, as
    the engine's graphs replay it, at each of DECODE_LAYER_CONTEXTS, with and without programmatic
    dependent launch; the chain of four alone (gemv_layer_chain_graph) comes first: the layer's
    time less the chain's is what attention costs in place. ``sweep``: decode_attention's tiles
    and merged splits too. The weights stay in L2 from call to call (SmolLM2's; Llama 3 8B's do not fit)."""
    for shape, (hidden, qkv_width, q_width, inter) in GEMV_SHAPES.items():
        w = LayerWeights.random(hidden, qkv_width, q_width, inter)
        x, residual = (torch.randn(1, hidden, dtype=DTYPE, device="cuda") for _ in range(2))
        _bench_chain(shape, w, x, residual, bandwidth)
        for context in DECODE_LAYER_CONTEXTS:
            _bench_decode_layer(shape, w, hidden, context, sweep)


def _bench_projections(shape: str, w: LayerWeights, x: torch.Tensor, residual: torch.Tensor, bandwidth: float,
                       sweep: bool) -> None:
    rows = x.shape[0]
    linear, eps = torch.nn.functional.linear, GEMV_EPS
    attn = torch.randn(rows, w.q_width, dtype=DTYPE, device="cuda")
    act = torch.randn(rows, w.down.shape[1], dtype=DTYPE, device="cuda")
    cases = {
        "qkv": (lambda: triton_ops.norm_linear(x, w.ln1, eps, residual, w.qkv)[0],
                lambda: linear(triton_ops.rms_norm(x, w.ln1, eps, residual)[0], w.qkv), w.qkv.numel()),
        "o": (lambda: triton_ops.linear(attn, w.o), lambda: linear(attn, w.o), w.o.numel()),
        "gate_up": (lambda: triton_ops.norm_linear(x, w.ln2, eps, residual, w.gate_up, gated=True)[0],
                    lambda: triton_ops.silu_and_mul(linear(triton_ops.rms_norm(x, w.ln2, eps, residual)[0], w.gate_up)),
                    w.gate_up.numel()),
        "down": (lambda: triton_ops.linear(act, w.down), lambda: linear(act, w.down), w.down.numel()),
    }
    for name, (fused, separate, weights) in cases.items():
        roofline_us = weights * ELEMENT / bandwidth * 1e6
        fused_us, pdl_off_us = graph_us_per_call(fused), graph_us_per_call(without_pdl(fused))
        separate_us = graph_us_per_call(separate)
        emit(
            bench="gemv_graph", shape=shape, proj=name, rows=rows, tiles=list(gemv.GEMV_TILES),
            gemv_us=round(fused_us, 2), gemv_no_pdl_us=round(pdl_off_us, 2), separate_us=round(separate_us, 2),
            roofline_us=round(roofline_us, 2), gemv_of_roofline=round(roofline_us / fused_us, 3),
            speedup=round(separate_us / fused_us, 2),
            max_abs_err=max_abs_err(fused(), separate()),
        )
        if sweep and rows == 1:
            for alt in GEMV_SWEEP:
                tiles = gemv.GemvTiles(*alt)
                alt_us = graph_us_per_call(with_gemv_tiles(tiles, fused))
                emit(bench="gemv_sweep", shape=shape, proj=name, rows=rows, tiles=list(tiles),
                     gemv_us=round(alt_us, 2), gemv_of_roofline=round(roofline_us / alt_us, 3))


def _bench_chain(shape: str, w: LayerWeights, x: torch.Tensor, residual: torch.Tensor, bandwidth: float) -> None:
    linear, eps = torch.nn.functional.linear, GEMV_EPS

    def chain():
        qkv, res = triton_ops.norm_linear(x, w.ln1, eps, residual, w.qkv)
        h = triton_ops.linear(qkv[:, : w.q_width], w.o)
        a, res = triton_ops.norm_linear(h, w.ln2, eps, res, w.gate_up, gated=True)
        return triton_ops.linear(a, w.down)

    def chain_separate():
        normed, res = triton_ops.rms_norm(x, w.ln1, eps, residual)
        h = linear(linear(normed, w.qkv)[:, : w.q_width], w.o)
        normed, res = triton_ops.rms_norm(h, w.ln2, eps, res)
        return linear(triton_ops.silu_and_mul(linear(normed, w.gate_up)), w.down)

    roofline_us = w.numel * ELEMENT / bandwidth * 1e6
    fused_us, pdl_off_us = graph_us_per_call(chain), graph_us_per_call(without_pdl(chain))
    separate_us = graph_us_per_call(chain_separate)
    emit(
        bench="gemv_layer_chain_graph", shape=shape, rows=x.shape[0], gemv_us=round(fused_us, 2),
        gemv_no_pdl_us=round(pdl_off_us, 2), separate_us=round(separate_us, 2), roofline_us=round(roofline_us, 2),
        speedup=round(separate_us / fused_us, 2), max_abs_err=max_abs_err(chain(), chain_separate()),
    )


def _bench_decode_layer(shape: str, w: LayerWeights, hidden: int, context: int, sweep: bool) -> None:
    num_heads, num_kv_heads, head_dim, capacity = FUSED_DECODE_SHAPES[shape]
    k_cache, v_cache, tables, slots, positions, seq_lens = decode_cache(
        1, num_kv_heads, head_dim, capacity, context, 16
    )
    cos_sin = reference.rope_cos_sin_cache(head_dim, capacity, 10000.0, device="cuda")
    x, residual = (torch.randn(1, hidden, dtype=DTYPE, device="cuda") for _ in range(2))
    kv_width = num_kv_heads * head_dim

    def layer():
        qkv, res = triton_ops.norm_linear(x, w.ln1, GEMV_EPS, residual, w.qkv)
        q, k, v = qkv.split([w.q_width, kv_width, kv_width], -1)
        attn = triton_ops.decode_attention(
            positions, q.view(1, num_heads, head_dim), k.view(1, num_kv_heads, head_dim),
            v.view(1, num_kv_heads, head_dim), cos_sin, k_cache, v_cache, slots, tables, seq_lens,
            head_dim**-0.5, [context],
        )
        h = triton_ops.linear(attn.view(1, w.q_width), w.o)
        a, res = triton_ops.norm_linear(h, w.ln2, GEMV_EPS, res, w.gate_up, gated=True)
        return triton_ops.linear(a, w.down)

    tiles = attention.attention_tiles("fused_decode_one", head_dim, DTYPE)
    emit(
        bench="decode_layer_graph", shape=shape, rows=1, context=context, tiles=list(tiles),
        merged_splits=fused_decode._FUSED_DECODE_ONE_MERGED_SPLITS,
        layer_us=round(graph_us_per_call(layer), 2), no_pdl_us=round(graph_us_per_call(without_pdl(layer)), 2),
    )
    if sweep:
        for alt in DECODE_LAYER_SWEEP:
            for merged in DECODE_LAYER_MERGED_SPLITS:
                fn = with_tiles("fused_decode_one", attention.AttentionTiles(1, *alt), layer)
                fn = patched("_FUSED_DECODE_ONE_MERGED_SPLITS", merged, fn)
                emit(bench="decode_layer_sweep", shape=shape, context=context, tiles=[1, *alt],
                     merged_splits=merged, layer_us=round(graph_us_per_call(fn), 2))


# --- FP8 weights -------------------------------------------------------------------------------

# Llama-3-8B layers whose weights are rotated from call to call: 4 x 218 MB of fp8 never stay in L2.
FP8_LAYERS = 4
FP8_BATCH_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FP8_PREFILL_ROWS = (1024, 8192)
# fp8_gemv tiles (block_n, block_k, num_warps, num_stages, programs_per_sm) timed by --sweep at each
# of --fp8-sweep-rows, by the engine's path (norm_linear, gated gate_up); a tile the
# multiprocessor cannot hold is reported as such
FP8_GEMV_SWEEP = [
    (32, 256, 4, 4, 4), (32, 256, 4, 4, 8), (64, 128, 4, 4, 2), (64, 256, 4, 3, 2), (64, 256, 4, 4, 1),
    (64, 256, 4, 4, 2), (64, 256, 4, 4, 4), (64, 512, 4, 3, 2), (128, 128, 4, 4, 1), (128, 128, 4, 4, 2),
    (128, 256, 8, 3, 1), (256, 128, 8, 3, 2), (64, 256, 4, 6, 1), (64, 256, 4, 6, 2), (64, 128, 4, 8, 1),
]
FP8_SWEEP_ROWS = (1, 64)
FP8_REPLAYS = 100
LM_HEAD_ROWS = 128256  # Llama 3's vocabulary


def bench_fp8(bandwidth: float, sweep: bool, sweep_rows: tuple[int, ...] = FP8_SWEEP_ROWS) -> None:
    """fp8 weights (per-channel scales) against bf16 at Llama-3-8B shapes, under CUDA graphs over
    rotated layers: the batch-1 GEMV per projection, as a layer's chain and for the LM head;
    then a layer's four projections at growing batches by each fp8 path (the GEMV; the rows'
    quantization and torch._scaled_mm) against bf16 (GEMV or cuBLAS), which sets the crossover;
    then prefill batches (do_bench, TFLOP/s)."""
    hidden, qkv_width, q_width, inter = GEMV_SHAPES["llama3-8b"]
    bf16 = [LayerWeights.random(hidden, qkv_width, q_width, inter) for _ in range(FP8_LAYERS)]
    fp8 = [{name: quantize_weight(getattr(w, name)) for name in ("qkv", "o", "gate_up", "down")} for w in bf16]
    _fp8_decode(bf16, fp8, bandwidth, sweep_rows if sweep else ())
    _fp8_batches(bf16, fp8)
    _fp8_prefill(bf16[0], fp8[0])


def with_fp8_tiles(tiles: fp8_ops.Fp8GemvTiles, fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` run with fp8_gemv on ``tiles`` for every shape."""
    return patched("FP8_GEMV_TILES", {}, patched("FP8_GEMV_DEFAULT_TILES", tiles, fn))


def _fp8_projection_cases(bf16, fp8, rows: int) -> dict:
    """name -> (bf16 call, fp8 call) by the engine's ops (norm_linear for qkv and gated gate_up);
    each call takes the layer index."""
    x, residual = (torch.randn(rows, HIDDEN, dtype=DTYPE, device="cuda") for _ in range(2))
    attn = torch.randn(rows, bf16[0].q_width, dtype=DTYPE, device="cuda")
    act = torch.randn(rows, INTERMEDIATE, dtype=DTYPE, device="cuda")
    eps = GEMV_EPS
    return {
        "qkv": (lambda i: triton_ops.norm_linear(x, bf16[i].ln1, eps, residual, bf16[i].qkv)[0],
                lambda i: triton_ops.norm_linear(x, bf16[i].ln1, eps, residual, fp8[i]["qkv"][0], False,
                                                 fp8[i]["qkv"][1])[0]),
        "o": (lambda i: triton_ops.linear(attn, bf16[i].o), lambda i: triton_ops.linear(attn, *fp8[i]["o"])),
        "gate_up": (lambda i: triton_ops.norm_linear(x, bf16[i].ln2, eps, residual, bf16[i].gate_up, True)[0],
                    lambda i: triton_ops.norm_linear(x, bf16[i].ln2, eps, residual, fp8[i]["gate_up"][0], True,
                                                     fp8[i]["gate_up"][1])[0]),
        "down": (lambda i: triton_ops.linear(act, bf16[i].down), lambda i: triton_ops.linear(act, *fp8[i]["down"])),
    }


def _fp8_decode(bf16, fp8, bandwidth: float, sweep_rows: tuple[int, ...]) -> None:
    layers = len(bf16)
    cases = _fp8_projection_cases(bf16, fp8, 1)
    for name, (bf16_fn, fp8_fn) in cases.items():
        roofline_us = fp8[0][name][0].numel() / bandwidth * 1e6
        bf16_us = graph_us_per_call(bf16_fn, layers, FP8_REPLAYS)
        fp8_us = graph_us_per_call(fp8_fn, layers, FP8_REPLAYS)
        emit(bench="fp8_gemv", shape="llama3-8b", proj=name, rows=1,
             tiles=list(fp8_ops.fp8_gemv_tiles(fp8[0][name][0], 1)), bf16_us=round(bf16_us, 2),
             fp8_us=round(fp8_us, 2), fp8_roofline_us=round(roofline_us, 2),
             fp8_of_roofline=round(roofline_us / fp8_us, 3), speedup=round(bf16_us / fp8_us, 3),
             max_abs_err=max_abs_err(fp8_fn(0), bf16_fn(0)))
    for rows in sweep_rows:
        for name, (_, fp8_fn) in _fp8_projection_cases(bf16, fp8, rows).items():
            roofline_us = fp8[0][name][0].numel() / bandwidth * 1e6
            for alt in FP8_GEMV_SWEEP:
                try:
                    alt_us = graph_us_per_call(with_fp8_tiles(fp8_ops.Fp8GemvTiles(*alt), fp8_fn), layers,
                                               FP8_REPLAYS)
                except triton.runtime.errors.OutOfResources as e:
                    emit(bench="fp8_gemv_sweep", proj=name, rows=rows, tiles=alt, skipped=str(e))
                    continue
                emit(bench="fp8_gemv_sweep", proj=name, rows=rows, tiles=alt, fp8_us=round(alt_us, 2),
                     fp8_of_roofline=round(roofline_us / alt_us, 3))

    def chain(kind: int):
        def run(i: int):
            for fns in cases.values():
                fns[kind](i)
        return run

    bf16_us, fp8_us = (graph_us_per_call(chain(kind), layers, FP8_REPLAYS) for kind in (0, 1))
    roofline_us = sum(w.numel() for w in fp8[0].values() for w in w[:1]) / bandwidth * 1e6
    emit(bench="fp8_gemv_layer_chain", shape="llama3-8b", rows=1, bf16_us=round(bf16_us, 2), fp8_us=round(fp8_us, 2),
         fp8_roofline_us=round(roofline_us, 2), fp8_of_roofline=round(roofline_us / fp8_us, 3),
         speedup=round(bf16_us / fp8_us, 3))
    head = torch.randn(LM_HEAD_ROWS, HIDDEN, dtype=DTYPE, device="cuda") / math.sqrt(HIDDEN)
    head_fp8 = quantize_weight(head)
    x = torch.randn(1, HIDDEN, dtype=DTYPE, device="cuda")
    bf16_us = graph_us_per_call(lambda: triton_ops.linear(x, head), replays=FP8_REPLAYS)
    fp8_us = graph_us_per_call(lambda: triton_ops.linear(x, *head_fp8), replays=FP8_REPLAYS)
    emit(bench="fp8_gemv_lm_head", rows=1, bf16_us=round(bf16_us, 2), fp8_us=round(fp8_us, 2),
         bf16_roofline_us=round(head.numel() * ELEMENT / bandwidth * 1e6, 2), speedup=round(bf16_us / fp8_us, 3))


def _fp8_batches(bf16, fp8) -> None:
    """A layer's four plain projections (x of the right width) per batch size and path."""
    layers = len(bf16)
    names = ("qkv", "o", "gate_up", "down")
    for rows in FP8_BATCH_ROWS:
        inputs = {n: torch.randn(rows, fp8[0][n][0].shape[1], dtype=DTYPE, device="cuda") for n in names}
        quantized = {x.shape[1]: fp8_ops.quantize_rows(x) for x in inputs.values()}  # by width

        def layer(path):
            def run(i: int):
                for n in names:
                    path(inputs[n], getattr(bf16[i], n), *fp8[i][n])
            return run

        paths = {
            "bf16": lambda x, w, wf, s: triton_ops.linear(x, w),
            "fp8_default": lambda x, w, wf, s: triton_ops.linear(x, wf, s),
            "fp8_scaled_mm": lambda x, w, wf, s: fp8_ops.scaled_linear(x, wf, s),
            "quantize_only": lambda x, w, wf, s: fp8_ops.quantize_rows(x),
        }
        if rows <= fp8_ops.FP8_GEMV_MAX_ROWS:
            paths["fp8_gemv_only"] = lambda x, w, wf, s: fp8_ops.fp8_gemv(*quantized[x.shape[1]], wf, s, wf.shape[0],
                                                                          DTYPE)
        us = {k: round(graph_us_per_call(layer(p), layers, FP8_REPLAYS), 2) for k, p in paths.items()}
        emit(bench="fp8_layer_linears", shape="llama3-8b", rows=rows, **{f"{k}_us": v for k, v in us.items()},
             fp8_default_speedup=round(us["bf16"] / us["fp8_default"], 3))


def _fp8_prefill(bf16: LayerWeights, fp8: dict) -> None:
    for rows in FP8_PREFILL_ROWS:
        for name in ("qkv", "o", "gate_up", "down"):
            w = getattr(bf16, name)
            wf, s = fp8[name]
            x = torch.randn(rows, w.shape[1], dtype=DTYPE, device="cuda")
            x_fp8, x_scale = fp8_ops.quantize_rows(x)
            flops = 2 * rows * w.numel()
            bf16_us = time_us(lambda: torch.nn.functional.linear(x, w))
            fp8_us = time_us(lambda: triton_ops.linear(x, wf, s))
            mm_us, fast_us = (
                time_us(lambda fast=fast: torch._scaled_mm(x_fp8, wf.t(), scale_a=x_scale, scale_b=s.view(1, -1),
                                                           out_dtype=torch.bfloat16, use_fast_accum=fast))
                for fast in (False, True))
            quantize_us = time_us(lambda: fp8_ops.quantize_rows(x))
            emit(bench="fp8_prefill_linear", rows=rows, proj=name, bf16_us=round(bf16_us, 1), fp8_us=round(fp8_us, 1),
                 scaled_mm_only_us=round(mm_us, 1), scaled_mm_fast_accum_us=round(fast_us, 1),
                 quantize_only_us=round(quantize_us, 1), bf16_tflop_s=round(flops / bf16_us / 1e6, 1),
                 fp8_tflop_s=round(flops / fp8_us / 1e6, 1), scaled_mm_tflop_s=round(flops / mm_us / 1e6, 1),
                 speedup=round(bf16_us / fp8_us, 3))


def bench_sampler(bandwidth: float) -> None:
    """A decode step's draw for rows at a temperature alone (unseeded): ``sample_argmax`` (one read of
    the logits, the noise drawn inside) against the sampler's softmax-and-draw path (``_filtered_probs``
    then ``_draw``: what such rows took before) and the plain argmax, at the Llama 3 and Qwen3
    vocabularies. The softmax path writes into its logits: it times a copy too, then the copy alone,
    and reports the difference."""
    for vocab in (128256, 151936):
        for rows in (1, 64, 256):
            logits = torch.randn(rows, vocab, device="cuda") * 3
            params = [SamplingParams(temperature=0.6)] * rows
            inv_temperature = torch.full((rows,), 1 / 0.6, device="cuda")
            work = torch.empty_like(logits)
            copy_us = time_us(lambda: work.copy_(logits))
            softmax_us = time_us(lambda: _draw(_filtered_probs(work.copy_(logits), params), [None] * rows)) - copy_us
            sample_us = time_us(lambda: triton_ops.sample_argmax(logits, inv_temperature, 1234))
            roofline_us = logits.numel() * 4 / bandwidth * 1e6
            argmax_us = time_us(lambda: triton_ops.argmax(logits))
            emit(bench="sampler", rows=rows, vocab=vocab, temperature=0.6, sample_argmax_us=round(sample_us, 2),
                 softmax_and_draw_us=round(softmax_us, 2), argmax_us=round(argmax_us, 2),
                 roofline_us=round(roofline_us, 2), speedup_vs_softmax_and_draw=round(softmax_us / sample_us, 2),
                 sample_argmax_fraction_of_roofline=round(roofline_us / sample_us, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    parser.add_argument("--bandwidth", type=float, default=4.25e12, help="roofline bandwidth, B/s")
    parser.add_argument("--sweep", action="store_true", help="also time alternative attention and GEMV tiles")
    parser.add_argument(
        "--only", choices=("decode", "fused_decode", "prefill", "small_ops", "gemv", "decode_layer", "fp8", "sampler"),
        help="run one group of benchmarks (after the bandwidth measurement)",
    )
    parser.add_argument("--fp8-sweep-rows", default=",".join(map(str, FP8_SWEEP_ROWS)),
                        help="rows at which --sweep times FP8_GEMV_SWEEP's tiles")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_bench needs a CUDA device")
    torch.manual_seed(0)
    bench_copy_bandwidth()
    bandwidth = args.bandwidth
    groups = {
        "decode": lambda: bench_decode(args.block_size, bandwidth, args.sweep),
        "fused_decode": lambda: bench_fused_decode(args.block_size, bandwidth, args.sweep),
        "prefill": lambda: bench_prefill(args.block_size, bandwidth, args.sweep),
        "small_ops": lambda: bench_small_ops(args.block_size, bandwidth),
        "gemv": lambda: bench_gemv(bandwidth, args.sweep),
        "decode_layer": lambda: bench_decode_layer(bandwidth, args.sweep),
        "fp8": lambda: bench_fp8(bandwidth, args.sweep, tuple(int(r) for r in args.fp8_sweep_rows.split(","))),
        "sampler": lambda: bench_sampler(bandwidth),
    }
    for name, run in groups.items():
        if args.only in (None, name):
            run()


if __name__ == "__main__":
    main()
