"""Decode graphs' padded static-buffer path on the CPU (the capture itself is in test_gpu.py),
bucket choice, KV sizing settings and the warmup."""

import pytest
import torch
from paged import peaky_tiny

from engine.__main__ import build_parser, engine_config
from engine.attention import FUSED_DECODE_MAX_CONTEXT
from engine.config import CPU_PREFILL_PACK_TOKENS, EngineConfig
from engine.core import EngineCore
from engine.cuda_graphs import DecodeGraphs, decode_buckets
from engine.protocol import GenerateRequest, SamplingParams
from engine.warmup import warmup


def tiny_core(tiny, **overrides):
    model, config = tiny
    settings = {"max_num_batched_tokens": 32, "num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 6, **overrides}
    return EngineCore.from_model(EngineConfig(model="tiny", **settings), model, config)


def padded_graphs(core: EngineCore) -> DecodeGraphs:
    runner = core.runner
    return DecodeGraphs(
        runner.model, runner.kv_caches, runner.device, runner.block_size, runner.max_blocks_per_seq,
        decode_buckets(core.config.max_num_seqs), capture=False,
    )


def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(100)[-3:] == [80, 96, 100]


@torch.inference_mode()
def test_padded_decode_matches_the_eager_batch(tiny):
    """Three decoding sequences (bucket 4: one padding row) of different lengths on shuffled
    blocks give the eager varlen batch's logits and argmax, and the padding row stores no K/V."""
    core = tiny_core(tiny)
    sampling = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i, length in enumerate([3, 9, 21]):
        core.add_request(GenerateRequest(f"r{i}", list(range(10 + i, 10 + i + length)), sampling))
    for _ in range(5):
        core.step()
    scheduled = core.scheduler.schedule().scheduled
    assert [n for _, n in scheduled] == [1, 1, 1]
    graphs = padded_graphs(core)
    assert graphs.bucket(len(scheduled)) == 4

    eager, rows, seqs = core.runner._run_eager(scheduled)
    eager_logits = core.runner.model.compute_logits(eager)
    caches_before = [tuple(c.clone() for c in layer) for layer in core.runner.kv_caches]
    logits, greedy = graphs.run([seq for seq, _ in scheduled])
    assert rows == [0, 1, 2] and seqs == [seq for seq, _ in scheduled]
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert greedy.tolist() == eager_logits.argmax(-1).tolist()
    for before, after in zip(caches_before, core.runner.kv_caches):
        for b, a in zip(before, after):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_context_bounds_pick_the_graph_and_agree(tiny):
    """Past FUSED_DECODE_MAX_CONTEXT tokens of capacity a bucket has a short-context graph (fused
    decode attention) and an any-context one (the split-K ops): the shortest bound that fits the
    longest context is chosen, and both give the same logits."""
    core = tiny_core(tiny)
    runner = core.runner
    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, runner.device, runner.block_size, 1024, [1, 2, 4], capture=False,
    )
    assert graphs.capacity == 4096 and graphs.context_bounds == [FUSED_DECODE_MAX_CONTEXT, 4096]
    assert graphs.graph_key(3, FUSED_DECODE_MAX_CONTEXT) == (4, FUSED_DECODE_MAX_CONTEXT)
    assert graphs.graph_key(1, FUSED_DECODE_MAX_CONTEXT + 1) == (1, 4096)
    sampling = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i, length in enumerate([3, 21]):
        core.add_request(GenerateRequest(f"r{i}", list(range(10 + i, 10 + i + length)), sampling))
    for _ in range(3):
        core.step()
    seqs = [seq for seq, _ in core.scheduler.schedule().scheduled]
    short = graphs.run(seqs).logits.clone()  # fills the static inputs
    longest = graphs._forward(2, 4096, graphs._np_seq_lens[:2].tolist()).logits
    torch.testing.assert_close(longest, short, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_decode_block_table_rows_follow_their_sequences(tiny):
    """A staging row is rewritten from where its sequence's block list grew, and whole when the
    row holds another sequence or the list was replaced (blocks freed and allocated again)."""
    core = tiny_core(tiny)
    sampling = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i in range(2):
        core.add_request(GenerateRequest(f"r{i}", list(range(10, 17 + 4 * i)), sampling))
    core.step()
    a, b = (seq for seq, _ in core.scheduler.schedule().scheduled)
    graphs = padded_graphs(core)

    def table_rows(n):
        return graphs._tables[0, :n].tolist()

    graphs.run([a, b])
    assert [row[: len(s.block_ids)] for row, s in zip(table_rows(2), (a, b))] == [a.block_ids, b.block_ids]
    a.block_ids.append(63)  # grown in place: only the new entry is written
    graphs.run([a, b])
    assert table_rows(1)[0][: len(a.block_ids)] == a.block_ids
    graphs.run([b, a])  # rows swap sequences
    assert [row[: len(s.block_ids)] for row, s in zip(table_rows(2), (b, a))] == [b.block_ids, a.block_ids]
    a.block_ids = [60 - i for i in range(len(a.block_ids))]  # replaced at the same length, as when
    graphs.run([b, a])  # freed and allocated again
    assert table_rows(2)[1][: len(a.block_ids)] == a.block_ids


def test_engine_tokens_with_padded_decode_graphs(tiny):
    """Tokens of a batch whose size changes as requests finish are the eager engine's: plain
    greedy batches (the graph's argmax) and batches with a seeded sampled row and a penalized
    greedy row (the sampler on the graph's logits)."""
    extras = [{}, {"temperature": 0.8, "seed": 3, "logprobs": 2}, {}, {"repetition_penalty": 1.3}, {}]
    requests = [
        GenerateRequest(
            f"r{i}", list(range(5 * i, 5 * i + 7 + 3 * i)),
            SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True, **{"temperature": 0.0, **extras[i]}),
        )
        for i in range(5)
    ]

    def tokens(core):
        out = {}
        for r in requests:
            core.add_request(GenerateRequest(r.request_id, r.prompt_ids, r.sampling))
        while core.has_work():
            for frame in core.step():
                out.setdefault(frame.request_id, []).extend(frame.token_ids)
        return out

    eager = tokens(tiny_core(tiny))
    core = tiny_core(tiny)
    core.runner.decode_graphs = padded_graphs(core)
    assert tokens(core) == eager
    assert core.check_integrity().used == 0


@torch.inference_mode()
def test_bf16_graphs_keep_the_heads_logits_and_draw_direct_rows():
    """A bf16 model's graphs keep their logits in bf16, written by the head with no widening copy: the
    eager path's fp32 logits to the bit. A batch of greedy and temperature-alone rows (unseeded) takes
    its tokens from the graph's own draw; one with a seeded and a penalized row too samples from the
    graph's logits; either way the tokens are the eager engine's."""
    model, config = peaky_tiny(dtype=torch.bfloat16)
    hidden = torch.randn(3, config.hidden_size, dtype=torch.bfloat16)
    out = torch.empty(3, config.vocab_size, dtype=model.logits_dtype)
    assert model.compute_logits(hidden, out=out) is out and out.dtype == torch.bfloat16
    assert torch.equal(out.float(), model.compute_logits(hidden))
    extras = [{}, {"temperature": 0.7}, {"temperature": 0.8, "seed": 3}, {"repetition_penalty": 1.3}]
    samplings = [SamplingParams(max_tokens=6, ignore_eos=True, **{"temperature": 0.0, **extra}) for extra in extras]

    def tokens(graphed: bool, kinds: int) -> tuple[dict[str, list[int]], list]:
        core = tiny_core((model, config), dtype="bfloat16")
        draws = []
        if graphed:
            graphs = core.runner.decode_graphs = padded_graphs(core)
            run = graphs.run

            def spy(seqs, carried=None, draw=None):
                draws.append(draw)
                return run(seqs, carried, draw)

            graphs.run = spy
        torch.manual_seed(0)  # the unseeded row's noise
        for i, sampling in enumerate(samplings[:kinds]):
            core.add_request(GenerateRequest(f"r{i}", list(range(3 * i, 3 * i + 5 + i)), sampling))
        out: dict[str, list[int]] = {}
        while core.has_work():
            for frame in core.step():
                out.setdefault(frame.request_id, []).extend(frame.token_ids)
        return out, draws

    direct, draws = tokens(graphed=True, kinds=2)
    assert direct == tokens(graphed=False, kinds=2)[0]
    assert len(draws) == 5 and all(d.inv_temperature == [0.0, 1 / 0.7] and d.seed for d in draws)
    mixed, draws = tokens(graphed=True, kinds=4)
    assert mixed == tokens(graphed=False, kinds=4)[0] and draws == [None] * 5


def test_warmup_leaves_no_work_and_no_counts(tiny):
    core = tiny_core(tiny, num_kv_blocks=40)
    warmup(core)
    assert not core.has_work() and core.check_integrity().used == 0
    assert core.counters.steps == 0 and not core.requests


def test_kv_sizing_and_kernel_backend_settings():
    args = build_parser().parse_args(["serve", "--model", "tiny", "--load-format", "dummy", "--device", "cpu"])
    config = engine_config(args)
    assert (config.kernel_backend, config.resolved_kernel_backend) == ("auto", "torch")
    assert (config.gpu_memory_utilization, config.enforce_eager, config.kv_cache_memory_gb) == (0.9, False, None)
    assert EngineConfig(model="m", device="cuda").resolved_kernel_backend == "triton"
    assert EngineConfig(model="m", device="cuda", kernel_backend="torch").resolved_kernel_backend == "torch"
    args = build_parser().parse_args(
        ["generate", "--model", "tiny", "--gpu-memory-utilization", "0.5", "--enforce-eager",
         "--kernel-backend", "triton"]
    )
    assert (args.gpu_memory_utilization, args.enforce_eager, args.kernel_backend) == (0.5, True, "triton")
    for bad in ({"gpu_memory_utilization": 0.0}, {"gpu_memory_utilization": 1.5}, {"kernel_backend": "cuda"},
                {"prefill_pack_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(model="m", **bad)


def test_prefill_pack_tokens_defaults_per_device():
    """CPU: one long prompt per step; CUDA: pack up to the budget, where batched prefill pays."""
    assert EngineConfig(model="m", device="cpu").resolved_prefill_pack_tokens == CPU_PREFILL_PACK_TOKENS
    assert EngineConfig(model="m", device="cuda", max_num_batched_tokens=4096).resolved_prefill_pack_tokens == 4096
    assert EngineConfig(model="m", device="cuda", prefill_pack_tokens=64).resolved_prefill_pack_tokens == 64
    args = build_parser().parse_args(["serve", "--model", "tiny", "--device", "cpu", "--prefill-pack-tokens", "512"])
    assert engine_config(args).resolved_prefill_pack_tokens == 512


def test_cpu_kv_cache_defaults_to_one_gib(tiny):
    core = tiny_core(tiny, num_kv_blocks=None)
    model_config = tiny[1]
    per_block = 2 * model_config.num_layers * 4 * model_config.num_kv_heads * model_config.head_dim * 4
    assert core.kv.num_blocks == 2**30 // per_block
    assert core.runner.kv_caches[0][0].shape[0] == core.kv.num_blocks
