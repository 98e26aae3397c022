"""The engine on one GPU against its peers, measured in the same run (dummy bf16 weights of real shapes).

Prints one JSON line per measurement (``bench`` names it; ``goal``/``met`` where issue 5 sets one):
  device      copy bandwidth (bytes read + written) and bf16 matmul rate: the ceilings used below
  ttft        (e) first-batch vs steady-state TTFT at 1, 2, 4, 8 concurrent 512-token prompts (8B shape),
              run first, right after warmup, so the first batch is the engine's first request
  decode_b1   (a) batch-1 decode tok/s and fraction of copy bandwidth, Llama-3-8B and SmolLM2 shapes,
              against a gpt-fast-style compiled PyTorch decode of the same weights and HF generate; the
              Qwen3-8B shape (q/k norms) against copy bandwidth alone (the peers are Llama-only)
  cont_batch  (b) 64 requests × 512 in × 256 out, greedy, against HF ``generate_batch`` (sdpa)
  prefill_8k  (d) one 8K-token prompt: TFLOP/s (all matmuls and causal attention) against HF sdpa
  hybrid      Gemma-3-12B shape (5 sliding-window layers of 1024 keys to each global one): decode step
              tok/s at batch 1 and 64 over 8K and 32K contexts, window layers reading only their window,
              against the same model with every layer global (one CUDA graph per case, the pages shared by
              every row so that batch 64 x 32K fits; both read the same bytes per key)
  fp8         Llama-3-8B shape, our bf16 engine against FP8 weights (--quantization fp8) on the same
              weights, then an FP8 KV cache (--kv-cache-dtype fp8_e4m3) against bf16 KV: batch-1 decode
              tok/s (with the fraction of the FP8 byte roofline), one 8K-token prefill, 64 x 512 x 256
              throughput; KV tokens per GiB; greedy agreement with the bf16 engine (20 random prompts), and
              the floor of that measure: the bf16 engine against itself, prompts batched vs one at a time;
              then batch-1 decode and agreement with the LM head in fp8 too (--fp8-lm-head)
  offline     (c) nano-vllm's bench (256 seqs, input and output lengths uniform in [100, 1024], seed 0,
              temperature 0.6) on the Qwen3-0.6B shape *as a Llama* (no q/k norm: our model lacks it),
              with the fraction of a per-step roofline Σ max(bytes/bandwidth, flops/peak)
  served      decode tok/s of the sidecar over HTTP (``python -m engine serve``, driven by the gateway's
              engine client) against the same engine stepped in-process (what ``python -m engine generate``
              runs), Llama-3-8B and SmolLM2 shapes, batch 1 and 64 (128-token prompts, 512 new tokens),
              with each side's engine milliseconds per step and the sidecar's CPU per step; the sidecar's
              engine in its own process and/or a thread of the HTTP process (``--served-engines``)
Engine sections run under each scheduling mode of ``--scheduling`` on the same engine (one record per
mode, the peers of each other): ``sync`` (the synchronous loop: the "before"),
``async`` (overlapped scheduling: the CUDA default) and ``async+budget`` (overlapped, with a 50 ms mixed-prefill
budget learnt from scratch). cont_batch and offline report the fraction of their per-step roofline; decode_b1 the
host's time per step, by phase.
HF peers run on the very tensors our model holds (benchmarks/hf_twin.py), after the engine's KV cache
is freed. Peers that would not fit in --budget-s are skipped with a line saying so.

    python3 benchmarks/gpu_bench.py [--budget-s 420] [--only ttft,decode_b1,...] [--scheduling sync,async]
                                    [--no-peers]
    python3 benchmarks/gpu_bench.py --only fp8 --fp8-dry-run   # the fp8 section on the CPU, tiny
    python3 benchmarks/gpu_bench.py --served-dry-run [--served-engines process,thread]  # served on the CPU, tiny
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.accuracy import agreement, generate
from benchmarks.hf_twin import hf_twin
from engine.attention import AttentionMetadata
from engine.config import EngineConfig, ModelConfig
from engine.core import EngineCore, resolve_dtype
from engine.logs import configure_logging
from engine.mixed_budget import MixedPrefillBudget
from engine.models.fp8 import quantize_fp8, quantize_lm_head
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model
from engine.protocol import GenerateRequest, SamplingParams
from engine.warmup import warmup
from kernels import load_ops
from loadtest.stamp import emit

SECTIONS = ("ttft", "decode_b1", "cont_batch", "prefill_8k", "hybrid", "fp8", "offline", "served")
SCHEDULING = ("sync", "async", "async+budget")
BUDGET_TARGET_MS = 50.0  # async+budget's --mixed-prefill-step-latency-ms
MODELS = ("llama3-8b", "smollm2-135m", "qwen3-8b")
START = time.perf_counter()


def sync_time() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


class Budget:
    def __init__(self, seconds: float, peers: bool = True):
        self.deadline = START + seconds
        self.peers = peers  # False: only our engine runs (its scheduling modes are each other's peers)

    def allows(self, bench: str, peer: str, needed_s: float) -> bool:
        if peer != "ours" and not self.peers:
            emit(bench=bench, peer=peer, skipped="--no-peers")
            return False
        left = self.deadline - time.perf_counter()
        if left < needed_s:
            emit(bench=bench, peer=peer, skipped=f"needs ~{needed_s:.0f} s of the budget, {left:.0f} s left")
            return False
        return True


# --- ceilings ----------------------------------------------------------------------------------


def median_ms(fn: Callable[[], object], reps: int = 10) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_device() -> tuple[float, float]:
    src = torch.randint(0, 255, (4 * 2**30,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / (median_ms(lambda: dst.copy_(src)) * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    peak = 2 * 8192**3 / (median_ms(lambda: a @ b) * 1e-3)
    del a, b
    free_cuda()
    props = torch.cuda.get_device_properties(0)
    emit(
        bench="device", device=props.name, torch=torch.__version__,
        copy_bandwidth_tb_s=round(bandwidth / 1e12, 3), bf16_matmul_tflop_s=round(peak / 1e12, 1),
    )
    return bandwidth, peak


# --- work accounting ---------------------------------------------------------------------------


class Shape:
    """Bytes and FLOPs of a model shape, for rooflines."""

    def __init__(self, config: ModelConfig, element: int = 2):
        c = config
        self.config = c
        self.element = element
        attn = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                + c.num_heads * c.head_dim * c.hidden_size)
        mlp = 3 * c.hidden_size * c.intermediate_size
        self.layer_linear_params = c.num_layers * (attn + mlp)
        self.head_params = c.vocab_size * c.hidden_size
        self.kv_bytes_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * element
        # Weights a step reads: every linear layer and the LM head (the embedding lookup reads rows).
        self.weight_bytes = (self.layer_linear_params + self.head_params) * element

    def attention_flops(self, context_before: int, new: int) -> int:
        pairs = new * context_before + new * (new + 1) // 2
        return 4 * pairs * self.config.num_heads * self.config.head_dim * self.config.num_layers

    def step(self, seqs: list[tuple[int, int, bool]]) -> tuple[int, int]:
        """(bytes, flops) of one step of ``(context_before, new_tokens, sampled)`` sequences."""
        tokens = sum(n for _, n, _ in seqs)
        sampled = sum(s for _, _, s in seqs)
        flops = 2 * tokens * self.layer_linear_params + 2 * sampled * self.head_params
        flops += sum(self.attention_flops(c, n) for c, n, _ in seqs)
        kv = sum((c + n) * self.kv_bytes_per_token for c, n, _ in seqs)
        return self.weight_bytes + kv, flops


# --- driving our engine ------------------------------------------------------------------------


def make_engine(model: str, device: str = "cuda", **settings) -> EngineCore:
    config = EngineConfig(model=model, load_format="dummy", device=device, **settings)
    t0 = time.perf_counter()
    core = EngineCore.from_config(config)
    warmup(core)
    emit(
        bench="engine_start", model=model, seconds=round(time.perf_counter() - t0, 1),
        num_kv_blocks=core.kv.num_blocks, kv_tokens=core.kv.num_blocks * core.kv.block_size,
        cuda_graph_buckets=core.runner.decode_graphs.buckets if core.runner.decode_graphs else [], **settings,
    )
    return core


class Run:
    """Requests run to completion; the time of every request's first and last token. The tag salts
    the prompts: a run never hits the prefix cache another run left (each mode computes its prompts)."""

    def __init__(self, core: EngineCore, prompts: list[list[int]], samplings: list[SamplingParams], tag: str):
        self.ids = [f"{tag}{i}" for i in range(len(prompts))]
        t0 = time.perf_counter()
        for rid, prompt, sampling in zip(self.ids, prompts, samplings):
            core.add_request(GenerateRequest(rid, prompt, sampling, salt=tag))
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.tokens: dict[str, list[int]] = {rid: [] for rid in self.ids}
        while core.has_work():
            frames = core.step()
            now = time.perf_counter() - t0
            for frame in frames:
                if frame.token_ids:
                    self.first.setdefault(frame.request_id, now)
                    self.last[frame.request_id] = now
                    self.tokens[frame.request_id] += frame.token_ids
        self.ended = time.perf_counter()
        self.seconds = self.ended - t0
        self.output_tokens = sum(map(len, self.tokens.values()))


def set_scheduling(core: EngineCore, mode: str) -> None:
    """Switch ``core`` between the modes of SCHEDULING (both are read at every step)."""
    core.async_scheduling = mode != "sync"
    core.scheduler.mixed_budget = MixedPrefillBudget(
        BUDGET_TARGET_MS / 1e3, core.config.max_num_batched_tokens
    ) if mode == "async+budget" else None


class StepTrace:
    """Records every step ``core`` launches, for a per-step roofline Σ max(bytes/bandwidth, flops/peak),
    and when each was launched."""

    def __init__(self, core: EngineCore):
        self.steps: list[list[tuple[int, int, bool]]] = []
        self.launched: list[float] = []
        self.core = core
        self._launch = launch = core.runner.launch

        def traced(scheduled, previous=None):
            self.launched.append(time.perf_counter())
            self.steps.append([(s.num_computed_tokens, n, s.num_computed_tokens + n == s.num_tokens)
                               for s, n in scheduled])
            return launch(scheduled, previous)

        core.runner.launch = traced

    def roofline_s(self, shape: Shape, bandwidth: float, peak: float) -> float:
        floor = 0.0
        for seqs in self.steps:
            nbytes, flops = shape.step(seqs)
            floor += max(nbytes / bandwidth, flops / peak)
        return floor

    def breakdown(self, shape: Shape, bandwidth: float, peak: float, end: float) -> dict[str, dict]:
        """Per kind of step (one with prompt tokens, else decode by batch size): steps, seconds (launch to
        the next launch, the last to ``end``: with overlapped scheduling, the step's share of the run),
        roofline seconds and their ratio."""
        kinds: dict[str, list[float]] = {}
        for i, seqs in enumerate(self.steps):
            if any(n > 1 for _, n, _ in seqs):
                kind = "with_prompt_tokens"
            else:
                kind = next((f"decode_b{lo}-{hi}" for lo, hi in ((1, 16), (17, 64), (65, 128)) if len(seqs) <= hi),
                            "decode_b129+")
            nbytes, flops = shape.step(seqs)
            until = self.launched[i + 1] if i + 1 < len(self.launched) else end
            row = kinds.setdefault(kind, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += until - self.launched[i]
            row[2] += max(nbytes / bandwidth, flops / peak)
        return {kind: dict(steps=n, seconds=round(t, 3), roofline_s=round(r, 3), fraction=round(r / t, 3))
                for kind, (n, t, r) in sorted(kinds.items())}

    def close(self) -> None:
        self.core.runner.launch = self._launch


def random_prompts(n: int, length: int, seed: int, vocab: int = 12000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, vocab) for _ in range(length)] for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# --- (e) TTFT ----------------------------------------------------------------------------------


def bench_ttft(core: EngineCore) -> None:
    seed = 1000
    for k in (1, 2, 4, 8):
        batches = []
        for _ in range(6):
            seed += 1
            run = Run(core, random_prompts(k, 512, seed), [greedy(1)] * k, f"ttft{seed}-")
            batches.append(statistics.mean(run.first.values()) * 1e3)
        steady = statistics.median(batches[1:])
        emit(
            bench="ttft", model=core.model_config.name, concurrent=k, prompt_tokens=512,
            first_batch_ms=round(batches[0], 2), steady_ms=round(steady, 2),
            ratio=round(batches[0] / steady, 3), goal="first batch <= 1.2x steady", met=batches[0] <= 1.2 * steady,
        )


# --- (a) batch-1 decode ------------------------------------------------------------------------


def ours_decode_b1(core: EngineCore, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """Engine decode tok/s at batch 1, and the milliseconds of the batch-1 graph replay alone
    (model, LM head and argmax; the rest of a step is host time: scheduling, input copies,
    reading the token back, postprocess)."""
    rate = 0.0
    for attempt in range(2):
        run = Run(core, random_prompts(1, prompt_len, 7 + attempt), [greedy(new_tokens)], f"b1-{attempt}-")
        rid = run.ids[0]
        rate = (new_tokens - 1) / (run.last[rid] - run.first[rid])
    graphs = core.runner.decode_graphs
    graphs.skip_kv_stores()  # the replays below rerun the last step's inputs
    graph = graphs.graph(1, prompt_len + new_tokens)
    t0 = sync_time()
    for _ in range(100):
        graph.replay()
    return rate, (sync_time() - t0) * 10


def host_phases_b1(core: EngineCore, prompt_len: int, new_tokens: int) -> dict[str, float]:
    """Milliseconds per decode step of a batch-1 run spent on the host in each phase of a step:
    planning, launching (inputs and the graph replay call), waiting for the tokens, recording them."""
    phases = dict(schedule=0.0, launch=0.0, wait=0.0, record=0.0)
    runner, scheduler = core.runner, core.scheduler
    originals = dict(schedule=scheduler.schedule, launch=runner.launch, record=scheduler.record)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] += time.perf_counter() - t0
        return wrapper

    def launch(scheduled, previous=None):
        step = timed("launch", originals["launch"])(scheduled, previous)
        step.resolve = timed("wait", step.resolve)
        return step

    scheduler.schedule, runner.launch = timed("schedule", originals["schedule"]), launch
    scheduler.record = timed("record", originals["record"])
    try:
        Run(core, random_prompts(1, prompt_len, 9), [greedy(new_tokens)], "b1host-")
    finally:
        scheduler.schedule, runner.launch, scheduler.record = (originals["schedule"], originals["launch"],
                                                               originals["record"])
    return {f"{k}_ms": round(v / new_tokens * 1e3, 4) for k, v in phases.items()}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


class CompiledDecode:
    """gpt-fast-style batch-1 decode on our model's weights: a static KV cache, SDPA over the whole
    static length under a position mask, every decoder layer through one ``torch.compile``d
    function (regional compilation: one compilation serves all layers, which keeps compile time
    inside a benchmark's budget), and the whole token step — embedding, layers, head, argmax,
    position increment — in one CUDA graph, as ``mode="reduce-overhead"`` would capture it."""

    def __init__(self, model: LlamaForCausalLM, max_len: int):
        c = model.config
        m = model.model
        self.c, self.max_len = c, max_len
        self.embed = m.embed_tokens.weight
        self.head = m.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        self.norm = m.norm.weight
        self.layers = [
            (layer.input_layernorm.weight, layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
             layer.post_attention_layernorm.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight)
            for layer in m.layers
        ]
        dev, dtype = self.embed.device, self.embed.dtype
        shape = (1, c.num_kv_heads, max_len, c.head_dim)
        self.caches = [(torch.zeros(shape, device=dev, dtype=dtype), torch.zeros(shape, device=dev, dtype=dtype))
                       for _ in m.layers]
        self.cos_sin = m.cos_sin_cache
        self.key_pos = torch.arange(max_len, device=dev)
        self.token = torch.zeros((1, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.compiled_layer = torch.compile(self.layer, dynamic=False, fullgraph=True)
        self.graph: torch.cuda.CUDAGraph | None = None

    def layer(self, h, pos, mask, cos, sin, kc, vc, ln1, wqkv, wo, ln2, w13, w2):
        c = self.c
        t = h.shape[1]
        q, k, v = F.linear(_rms(h, ln1, c.rms_norm_eps), wqkv).split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], dim=-1
        )
        q = q.view(1, t, c.num_heads, c.head_dim)
        k = k.view(1, t, c.num_kv_heads, c.head_dim)

        def rope(x):
            half = c.head_dim // 2
            xf = x.float()
            x1, x2 = xf[..., :half], xf[..., half:]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

        q, k = rope(q).transpose(1, 2), rope(k).transpose(1, 2)
        v = v.view(1, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        kc.index_copy_(2, pos, k)
        vc.index_copy_(2, pos, v)
        y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)
        h = h + F.linear(y.transpose(1, 2).reshape(1, t, -1), wo)
        gate, up = F.linear(_rms(h, ln2, c.rms_norm_eps), w13).chunk(2, -1)
        return h + F.linear(F.silu(gate) * up, w2)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, layer_fn) -> torch.Tensor:
        half = self.c.head_dim // 2
        cs = self.cos_sin.index_select(0, pos)[None, :, None, :]
        cos, sin = cs[..., :half], cs[..., half:]
        mask = (self.key_pos[None, :] <= pos[:, None])[None, None]
        h = F.embedding(tokens, self.embed)
        for (kc, vc), weights in zip(self.caches, self.layers):
            h = layer_fn(h, pos, mask, cos, sin, kc, vc, *weights)
        return F.linear(_rms(h[:, -1], self.norm, self.c.rms_norm_eps), self.head).argmax(-1)

    def step(self) -> None:
        self.token.copy_(self.forward(self.token, self.pos, self.compiled_layer).view(1, 1))
        self.pos.add_(1)

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> None:
        ids = torch.tensor([prompt], device=self.token.device)
        positions = torch.arange(len(prompt), device=self.token.device)
        self.token.copy_(self.forward(ids, positions, self.layer).view(1, 1))
        self.pos.fill_(len(prompt))

    @torch.inference_mode()
    def decode(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        """Tokens per second over ``n`` graph replays, and the first tokens generated."""
        if self.graph is None:
            self.prefill(prompt)
            for _ in range(3):  # compile, autotune and load every kernel before the capture
                self.step()
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.step()
        self.prefill(prompt)
        first = [int(self.token)]
        for _ in range(7):
            self.graph.replay()
            first.append(int(self.token))
        self.prefill(prompt)
        t0 = sync_time()
        for _ in range(n):
            self.graph.replay()
        return n / (sync_time() - t0), first


@torch.inference_mode()
def hf_decode_b1(twin, prompt: list[int], n: int) -> float:
    ids = torch.tensor([prompt], device="cuda")

    def timed(tokens: int) -> float:
        t0 = sync_time()
        twin.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return sync_time() - t0

    timed(2)
    return (n - 1) / (timed(n) - timed(1))


def bench_decode_b1_peers(
    model, shape: Shape, ours: float, replay_ms: float, bandwidth: float, budget: Budget, ours_first: list[int]
) -> None:
    name = shape.config.name
    prompt = random_prompts(1, 128, 7)[0]
    new_tokens = 256
    bytes_per_token = shape.weight_bytes + (128 + new_tokens // 2) * shape.kv_bytes_per_token

    def fraction(rate: float) -> float:
        return round(rate * bytes_per_token / bandwidth, 3)

    compiled = hf = None
    llama = shape.config.architecture == "llama"
    if llama and budget.allows("decode_b1", "torch_compile", 45):
        t0 = time.perf_counter()
        peer = CompiledDecode(model, 128 + new_tokens + 8)
        peer.decode(prompt, 8)
        compile_s = time.perf_counter() - t0
        compiled, first = peer.decode(prompt, new_tokens)
        del peer
        free_cuda()
        emit(bench="decode_b1", model=name, peer="torch_compile", tok_s=round(compiled, 1),
             fraction_of_copy_bandwidth=fraction(compiled), setup_s=round(compile_s, 1),
             first_tokens_agree_with_ours=sum(a == b for a, b in zip(first, ours_first)))
    if llama and budget.allows("decode_b1", "hf_generate", 25):
        twin = hf_twin(model)
        hf = hf_decode_b1(twin, prompt, 32 if name == "llama3-8b" else 64)
        del twin
        free_cuda()
        emit(bench="decode_b1", model=name, peer="hf_generate", tok_s=round(hf, 1),
             fraction_of_copy_bandwidth=fraction(hf))
    summary = dict(
        bench="decode_b1", model=name, ours_tok_s=round(ours, 1), ours_ms_per_token=round(1e3 / ours, 3),
        ours_graph_replay_ms=round(replay_ms, 3),
        bytes_per_token=bytes_per_token, floor_ms_per_token=round(bytes_per_token / bandwidth * 1e3, 3),
        ours_fraction_of_copy_bandwidth=fraction(ours),
        vs_torch_compile=round(ours / compiled, 2) if compiled else None,
        vs_hf_generate=round(ours / hf, 1) if hf else None,
    )
    if name == "llama3-8b":
        summary.update(goal=">= 0.90 of copy bandwidth", met=fraction(ours) >= 0.90)
    elif name == "qwen3-8b":
        summary.update(goal=">= 0.85 of copy bandwidth", met=fraction(ours) >= 0.85)
    else:
        summary.update(goal=">= 2500 tok/s", met=ours >= 2500)
    emit(**summary)


# --- (b) continuous batching and HF generate_batch --------------------------------------------


# No inference_mode here: generate_batch's worker thread updates the cache tensors it creates.
def hf_generate_batch(twin, prompts: list[list[int]], max_new_tokens: int, do_sample: bool) -> tuple[float, int]:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=0.6 if do_sample else None,
        top_p=None, top_k=None,
    )
    t0 = sync_time()
    outputs = twin.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    seconds = sync_time() - t0
    return seconds, sum(len(o.generated_tokens) for o in outputs.values())


def bench_cont_batch_ours(core: EngineCore, shape: Shape, bandwidth: float, peak: float, mode: str) -> float:
    prompts = random_prompts(64, 512, 64)
    trace = StepTrace(core)
    try:
        run = Run(core, prompts, [greedy(256)] * 64, f"cb-{mode}-")
    finally:
        trace.close()
    rate = run.output_tokens / run.seconds
    floor = trace.roofline_s(shape, bandwidth, peak)
    emit(bench="cont_batch", model=shape.config.name, scheduling=mode, requests=64, prompt_tokens=512,
         output_tokens_each=256, ours_output_tok_s=round(rate, 1), steps=len(trace.steps),
         seconds=round(run.seconds, 3), by_step_kind=trace.breakdown(shape, bandwidth, peak, run.ended),
         roofline_s=round(floor, 3), fraction_of_roofline=round(floor / run.seconds, 3),
         goal=">= 0.85 of the per-step roofline", met=floor / run.seconds >= 0.85)
    return rate


def bench_cont_batch_peer(model, name: str, ours: float, budget: Budget, needed_s: float) -> None:
    hf = None
    if budget.allows("cont_batch", "hf_generate_batch", needed_s):
        twin = hf_twin(model)
        try:
            seconds, tokens = hf_generate_batch(twin, random_prompts(64, 512, 64), 256, do_sample=False)
            hf = tokens / seconds
            emit(bench="cont_batch", model=name, peer="hf_generate_batch", output_tok_s=round(hf, 1),
                 output_tokens=tokens, seconds=round(seconds, 1), attn_implementation="sdpa")
        finally:
            del twin
            free_cuda()
    emit(bench="cont_batch", model=name, requests=64, prompt_tokens=512, output_tokens_each=256,
         ours_output_tok_s=round(ours, 1), vs_hf_generate_batch=round(ours / hf, 1) if hf else None,
         goal=">= 20x HF generate_batch", met=bool(hf) and ours >= 20 * hf)


# --- (d) 8K prefill ----------------------------------------------------------------------------


def bench_prefill_ours(core: EngineCore, shape: Shape, length: int) -> tuple[float, int]:
    times = []
    for i in range(3):
        run = Run(core, random_prompts(1, length, 800 + i), [greedy(1)], f"pf{i}-")
        times.append(run.first[run.ids[0]])
    _, flops = shape.step([(0, length, True)])
    return statistics.median(times), flops


@torch.inference_mode()
def bench_prefill_peer(model, shape: Shape, length: int, ours_s: float, flops: int, budget: Budget) -> None:
    hf_s = None
    if budget.allows("prefill_8k", "hf_sdpa", 20):
        twin = hf_twin(model)
        ids = torch.tensor(random_prompts(1, length, 900), device="cuda")
        twin(ids, logits_to_keep=1)
        times = []
        for _ in range(3):
            t0 = sync_time()
            twin(ids, logits_to_keep=1)
            times.append(sync_time() - t0)
        hf_s = statistics.median(times)
        del twin, ids
        free_cuda()
    linear_flops = 2 * length * shape.layer_linear_params
    emit(
        bench="prefill_8k", model=shape.config.name, tokens=length,
        ours_ms=round(ours_s * 1e3, 2), ours_tok_s=round(length / ours_s), ours_tflop_s=round(flops / ours_s / 1e12, 1),
        ours_linear_tflop_s=round(linear_flops / ours_s / 1e12, 1),
        hf_sdpa_ms=round(hf_s * 1e3, 2) if hf_s else None, hf_tflop_s=round(flops / hf_s / 1e12, 1) if hf_s else None,
        goal=">= 600 TFLOP/s", met=flops / ours_s / 1e12 >= 600,
    )


# --- (c) nano-vllm's offline workload ----------------------------------------------------------


def nano_vllm_workload() -> tuple[list[list[int]], list[int]]:
    """nano-vllm bench.py: random.seed(0), 256 prompts of randint(100, 1024) tokens drawn from
    randint(0, 10000), then 256 output lengths randint(100, 1024)."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    return prompts, [rng.randint(100, 1024) for _ in range(256)]


def bench_offline(bandwidth: float, peak: float, budget: Budget, modes: list[str], prefill_graph_tokens: int) -> None:
    prompts, out_lens = nano_vllm_workload()
    core = make_engine(
        "qwen3-0.6b", max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=4096, gpu_memory_utilization=0.9,
        cuda_graph_prefill_tokens=prefill_graph_tokens,
    )
    shape = Shape(core.model_config)
    samplings = [SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True) for n in out_lens]
    ours = 0.0
    for mode in modes:
        set_scheduling(core, mode)
        trace = StepTrace(core)
        try:
            run = Run(core, prompts, samplings, f"nano-{mode}-")
        finally:
            trace.close()
        floor = trace.roofline_s(shape, bandwidth, peak)
        ours = run.output_tokens / run.seconds
        emit(bench="offline", model="qwen3-0.6b shape as Llama (no q/k norm)", scheduling=mode, seqs=256,
             steps=len(trace.steps), output_tokens=sum(out_lens), ours_seconds=round(run.seconds, 2),
             by_step_kind=trace.breakdown(shape, bandwidth, peak, run.ended),
             ours_output_tok_s=round(ours, 1), roofline_s=round(floor, 3),
             fraction_of_roofline=round(floor / run.seconds, 3), goal=">= 0.75 of its roofline",
             met=floor / run.seconds >= 0.75)
    model = core.runner.model
    del core, run
    free_cuda()
    hf = None
    subset = 32
    if budget.allows("offline", "hf_generate_batch", 40):
        twin = hf_twin(model)
        try:
            mean_out = round(statistics.mean(out_lens[:subset]))
            seconds, tokens = hf_generate_batch(twin, prompts[:subset], mean_out, do_sample=True)
            hf = tokens / seconds
            emit(bench="offline", peer="hf_generate_batch", output_tok_s=round(hf, 1), seqs=subset,
                 max_new_tokens=mean_out, seconds=round(seconds, 1),
                 note="first 32 prompts of the workload, each to their mean output length "
                      "(one max_new_tokens per call)")
        finally:
            del twin
            free_cuda()
    emit(
        bench="offline", model="qwen3-0.6b shape as Llama (no q/k norm)", seqs=256, scheduling=modes[-1],
        ours_output_tok_s=round(ours, 1), vs_hf_generate_batch=round(ours / hf, 1) if hf else None,
        goal=">= 20x HF continuous batching", met=bool(hf) and ours >= 20 * hf,
    )


# --- the run -----------------------------------------------------------------------------------


# --- hybrid: sliding-window layers against all-global ---------------------------------------------


class DecodeStep:
    """One decode step of ``batch`` sequences of ``context`` tokens (model, LM head, argmax) in a
    CUDA graph. Every row's block table names the same pages: attention reads each row's keys as it
    would its own (the same bytes, per row), while the pool holds one context."""

    def __init__(self, model, kv_caches, batch: int, context: int, block_size: int):
        dev = torch.device("cuda")
        blocks = -(-context // block_size)
        table = torch.arange(blocks, dtype=torch.int32, device=dev).repeat(batch, 1)
        last = context - 1
        self.attn = AttentionMetadata(
            block_tables=table, seq_lens=torch.full((batch,), context, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((batch,), last, dtype=torch.int64, device=dev),
            seq_lens_cpu=[context] * batch, query_start_loc_cpu=list(range(batch + 1)),
            max_query_len=1, max_seq_len=context,
        )
        self.ids = torch.randint(300, 12000, (batch,), device=dev)
        self.positions = torch.full((batch,), last, dtype=torch.int64, device=dev)
        self.model, self.kv_caches = model, kv_caches
        for _ in range(2):  # compile and autotune every kernel, then capture
            self.forward()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.forward()

    def forward(self) -> torch.Tensor:
        hidden = self.model(self.ids, self.positions, self.attn, self.kv_caches)
        return self.model.compute_logits(hidden).argmax(-1)

    def ms(self) -> float:
        return median_ms(self.graph.replay, reps=20)


def bench_hybrid(budget: Budget) -> None:
    name = "gemma3-12b"
    model, config = load_model(name, "dummy", "cuda", torch.bfloat16, load_ops("triton"))
    block_size = 16
    contexts, batches = (8192, 32768), (1, 64)
    shape = (max(contexts) // block_size, block_size, config.num_kv_heads, config.head_dim)
    kv_caches = [(torch.zeros(shape, dtype=torch.bfloat16, device="cuda"),
                  torch.zeros(shape, dtype=torch.bfloat16, device="cuda")) for _ in range(config.num_layers)]
    attentions = [layer.self_attn for layer in model.model.layers]
    windows = [a.window for a in attentions]
    for context in contexts:
        for batch in batches:
            if not budget.allows("hybrid", f"{context}x{batch}", 20):
                continue
            ms = {}
            for mode in ("window", "all_global"):
                for attention, window in zip(attentions, windows):
                    attention.window = window if mode == "window" else 0
                step = DecodeStep(model, kv_caches, batch, context, block_size)
                ms[mode] = step.ms()
                del step
                free_cuda()
            speedup = ms["all_global"] / ms["window"]
            record = dict(
                bench="hybrid", model=name, context=context, batch=batch,
                window_tok_s=round(batch / ms["window"] * 1e3, 1), window_ms=round(ms["window"], 3),
                all_global_tok_s=round(batch / ms["all_global"] * 1e3, 1), all_global_ms=round(ms["all_global"], 3),
                speedup=round(speedup, 2),
            )
            if context == 32768 and batch == 64:
                record.update(goal="decode >= 1.5x all-global at batch 64, 32K", met=speedup >= 1.5)
            emit(**record)
    for attention, window in zip(attentions, windows):
        attention.window = window
    del model, kv_caches
    free_cuda()


def guarded(name: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception as exc:
        emit(bench=name, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])
        free_cuda()


def bench_model(name: str, settings: dict, sections: set[str], bandwidth: float, peak: float, budget: Budget,
                modes: list[str]) -> None:
    core = make_engine(name, **settings)
    shape = Shape(core.model_config)
    cb_peer_s = {"llama3-8b": 50, "smollm2-135m": 35}.get(name, 0)
    if "ttft" in sections and name == "llama3-8b":
        guarded("ttft", lambda: bench_ttft(core))  # the engine's defaults
    b1 = cb = pf = None
    if "decode_b1" in sections:
        for mode in [m for m in modes if m != "async+budget"] or modes:  # no mixed step at batch 1
            set_scheduling(core, mode)
            b1 = ours_decode_b1(core, 128, 256)
            emit(bench="decode_b1", model=name, scheduling=mode, ours_tok_s=round(b1[0], 1),
                 ours_ms_per_token=round(1e3 / b1[0], 3), ours_graph_replay_ms=round(b1[1], 3),
                 host_ms_per_step=host_phases_b1(core, 128, 128))
        first = Run(core, random_prompts(1, 128, 7), [greedy(8)], "b1first-").tokens["b1first-0"]
    if "cont_batch" in sections:
        for mode in modes:
            set_scheduling(core, mode)
            cb = bench_cont_batch_ours(core, shape, bandwidth, peak, mode)
    if "prefill_8k" in sections and name == "llama3-8b":
        pf = bench_prefill_ours(core, shape, 8190)
    model = core.runner.model
    del core
    free_cuda()
    if b1 is not None:
        guarded("decode_b1", lambda: bench_decode_b1_peers(model, shape, *b1, bandwidth, budget, first))
    if pf is not None:
        guarded("prefill_8k", lambda: bench_prefill_peer(model, shape, 8190, pf[0], pf[1], budget))
    if cb is not None:
        guarded("cont_batch", lambda: bench_cont_batch_peer(model, name, cb, budget, cb_peer_s))
    del model
    free_cuda()


# --- FP8 weights and KV cache ------------------------------------------------------------------

# The fp8 section's sizes; the dry run (CPU, tiny model) shrinks them.
FP8_SIZES = dict(b1_prompt=128, b1_new=256, prefill=8190, cb_requests=64, cb_prompt=512, cb_new=256,
                 agree_prompts=20, agree_prompt=256, agree_new=32)
FP8_DRY_SIZES = dict(b1_prompt=16, b1_new=8, prefill=64, cb_requests=4, cb_prompt=16, cb_new=4,
                     agree_prompts=3, agree_prompt=16, agree_new=4)


def engine_on(model, model_config: ModelConfig, device: str, **settings) -> EngineCore:
    """An engine (warmed up) over an already loaded model."""
    config = EngineConfig(model=model_config.name, load_format="dummy", device=device, **settings)
    core = EngineCore.from_model(config, model, model_config)
    warmup(core)
    return core


def fp8_decode_b1(core: EngineCore, sizes: dict) -> float:
    """Batch-1 decode tok/s."""
    z = sizes
    run = Run(core, random_prompts(1, z["b1_prompt"], 7), [greedy(z["b1_new"])], "f8b1-")
    return (z["b1_new"] - 1) / (run.last[run.ids[0]] - run.first[run.ids[0]])


def fp8_speeds(core: EngineCore, sizes: dict) -> dict:
    """Batch-1 decode tok/s, one long prefill's seconds, and the 64-request throughput."""
    z = sizes
    decode = fp8_decode_b1(core, sizes)
    prefill = statistics.median(
        Run(core, random_prompts(1, z["prefill"], 800 + i), [greedy(1)], f"f8pf{i}-").first[f"f8pf{i}-0"]
        for i in range(3)
    )
    cb = Run(core, random_prompts(z["cb_requests"], z["cb_prompt"], 64), [greedy(z["cb_new"])] * z["cb_requests"],
             "f8cb-")
    return dict(decode_b1_tok_s=decode, prefill_s=prefill, cont_batch_tok_s=cb.output_tokens / cb.seconds)


def bench_fp8(name: str, settings: dict, bandwidth: float, device: str = "cuda", sizes: dict = FP8_SIZES) -> None:
    config = EngineConfig(model=name, load_format="dummy", device=device, **settings)
    model, model_config = load_model(name, "dummy", device, resolve_dtype(config),
                                     load_ops(config.resolved_kernel_backend))
    shape = Shape(model_config)
    z = sizes
    prompts = random_prompts(z["agree_prompts"], z["agree_prompt"], 2000)
    core = engine_on(model, model_config, device, **settings)
    bf16 = fp8_speeds(core, sizes)
    reference = generate(core, prompts, z["agree_new"])
    # the floor of the measure on random weights: the same bf16 engine, each prompt run alone
    # (batch-1 GEMVs instead of batched GEMMs: bf16 rounding differences only)
    floor = agreement(reference, [generate(core, [prompt], z["agree_new"])[0] for prompt in prompts])
    emit(bench="agreement_floor", model=name, peer="the same bf16 engine, prompts batched vs one at a time",
         prompts=len(prompts), new_tokens=z["agree_new"], **floor.record())
    bf16_kv = dict(tokens_per_gib=core.kv_tokens_per_gib, num_kv_blocks=core.kv.num_blocks)
    del core
    free_cuda()

    core = engine_on(model, model_config, device, kv_cache_dtype="fp8_e4m3", **settings)
    kv_agree = agreement(reference, generate(core, prompts, z["agree_new"]))
    ratio = core.kv_tokens_per_gib / bf16_kv["tokens_per_gib"]
    emit(bench="fp8_kv", model=name, peer="bf16 KV, same weights", kv_tokens_per_gib=core.kv_tokens_per_gib,
         peer_kv_tokens_per_gib=bf16_kv["tokens_per_gib"], num_kv_blocks=core.kv.num_blocks,
         peer_num_kv_blocks=bf16_kv["num_kv_blocks"], tokens_per_gib_ratio=round(ratio, 3),
         prompts=len(prompts), new_tokens=z["agree_new"], **kv_agree.record(),
         goal="2x KV tokens per GiB, >= 0.95 greedy agreement", met=ratio >= 2 and kv_agree.agreement >= 0.95)
    del core
    free_cuda()

    quantize_fp8(model)
    free_cuda()
    core = engine_on(model, model_config, device, quantization="fp8", **settings)
    fp8 = fp8_speeds(core, sizes)
    weights_agree = agreement(reference, generate(core, prompts, z["agree_new"]))
    del core
    free_cuda()
    # --fp8-lm-head: the head's bytes halved too
    quantize_lm_head(model)
    free_cuda()
    core = engine_on(model, model_config, device, quantization="fp8", fp8_lm_head=True, **settings)
    head_decode = fp8_decode_b1(core, sizes)
    head_agree = agreement(reference, generate(core, prompts, z["agree_new"]))
    del core
    free_cuda()
    # bytes a decode step reads: fp8 projections, the bf16 LM head, the KV at mid-generation
    kv = (z["b1_prompt"] + z["b1_new"] // 2) * shape.kv_bytes_per_token
    fp8_bytes = shape.layer_linear_params + 2 * shape.head_params + kv
    floor_ms = fp8_bytes / bandwidth * 1e3
    _, prefill_flops = shape.step([(0, z["prefill"], True)])
    ratios = {k: fp8[k] / bf16[k] for k in ("decode_b1_tok_s", "cont_batch_tok_s")}
    ratios["prefill"] = bf16["prefill_s"] / fp8["prefill_s"]
    emit(bench="fp8_weights", model=name, section="decode_b1", peer="our bf16 engine, same weights",
         fp8_tok_s=round(fp8["decode_b1_tok_s"], 1), bf16_tok_s=round(bf16["decode_b1_tok_s"], 1),
         speedup=round(ratios["decode_b1_tok_s"], 3), fp8_bytes_per_token=fp8_bytes,
         fp8_floor_ms_per_token=round(floor_ms, 3),
         fraction_of_fp8_roofline=round(fp8["decode_b1_tok_s"] * floor_ms / 1e3, 3),
         goal=">= 1.8x bf16 (and >= 0.85 of the FP8 byte roofline)", met=ratios["decode_b1_tok_s"] >= 1.8)
    head_floor_ms = (fp8_bytes - shape.head_params) / bandwidth * 1e3
    emit(bench="fp8_weights", model=name, section="decode_b1_fp8_lm_head", peer="our bf16 engine, same weights",
         fp8_tok_s=round(head_decode, 1), bf16_tok_s=round(bf16["decode_b1_tok_s"], 1),
         speedup=round(head_decode / bf16["decode_b1_tok_s"], 3), fp8_bytes_per_token=fp8_bytes - shape.head_params,
         fp8_floor_ms_per_token=round(head_floor_ms, 3),
         fraction_of_fp8_roofline=round(head_decode * head_floor_ms / 1e3, 3), prompts=len(prompts),
         new_tokens=z["agree_new"], **head_agree.record(),
         goal=">= 1.8x bf16 (and >= 0.85 of the FP8 byte roofline)", met=head_decode / bf16["decode_b1_tok_s"] >= 1.8)
    emit(bench="fp8_weights", model=name, section="prefill_8k", peer="our bf16 engine, same weights",
         prompt_tokens=z["prefill"], fp8_s=round(fp8["prefill_s"], 4), bf16_s=round(bf16["prefill_s"], 4),
         fp8_tflop_s_equivalent=round(prefill_flops / fp8["prefill_s"] / 1e12, 1),
         bf16_tflop_s=round(prefill_flops / bf16["prefill_s"] / 1e12, 1), speedup=round(ratios["prefill"], 3),
         goal=">= 1.4x bf16", met=ratios["prefill"] >= 1.4)
    emit(bench="fp8_weights", model=name, section="cont_batch", peer="our bf16 engine, same weights",
         requests=z["cb_requests"], prompt_tokens=z["cb_prompt"], output_tokens_each=z["cb_new"],
         fp8_output_tok_s=round(fp8["cont_batch_tok_s"], 1), bf16_output_tok_s=round(bf16["cont_batch_tok_s"], 1),
         speedup=round(ratios["cont_batch_tok_s"], 3), goal=">= 1.3x bf16", met=ratios["cont_batch_tok_s"] >= 1.3)
    emit(bench="fp8_weights", model=name, section="accuracy", peer="bf16 weights (random, real-shaped)",
         prompts=len(prompts), new_tokens=z["agree_new"], **weights_agree.record())


# --- served: the sidecar over HTTP against the same engine offline -----------------------------

# The served section's sizes (batch, prompt, new tokens, repeats); the dry run (CPU, tiny model) shrinks them.
SERVED_SIZES = dict(batches=(1, 64), prompt=128, new=512, repeats=3)
SERVED_DRY_SIZES = dict(batches=(1, 4), prompt=16, new=16, repeats=2)
# Where the sidecar runs its engine: its own process (the default) or a thread of the HTTP process
# (--no-engine-process, the sidecar before benchmarks/results/served_h200_process.jsonl).
SERVED_ENGINES = ("process", "thread")


def decode_tok_s(first: dict[str, float], last: dict[str, float], new_tokens: int) -> float:
    """A batch's decode throughput: each request's tokens after its first over the time they took, summed."""
    return sum((new_tokens - 1) / (last[rid] - first[rid]) for rid in first)


def step_ms(seconds: float, steps: int) -> float:
    return round(seconds / steps * 1e3, 4) if steps else 0.0


class Sidecar:
    """``python -m engine serve`` on a free loopback port, ready once /health answers, stopped on exit;
    measured through the gateway's own client (gateway/engine_client.py) on one pooled transport."""

    def __init__(self, model: str, device: str, settings: dict, log_level: str = "WARNING"):
        from gateway.spawn import free_port

        port = free_port()
        flags = [f"--{k.replace('_', '-')}={v}" if not isinstance(v, bool) else
                 f"--{'' if v else 'no-'}{k.replace('_', '-')}" for k, v in settings.items()]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", f"--port={port}", f"--model={model}", "--load-format=dummy",
             f"--device={device}", f"--log-level={log_level}", *flags],
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )

    async def wait_ready(self, timeout_s: float = 300) -> None:
        import httpx

        deadline = time.perf_counter() + timeout_s
        async with httpx.AsyncClient() as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"engine serve exited with {self.proc.returncode}")
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"engine serve not ready in {timeout_s:.0f} s")
                try:
                    if (await client.get(self.url + "/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.2)

    async def counters(self) -> tuple[float, int, float, float, float]:
        """(busy seconds, steps) of the engine so far, from /metrics, and the CPU seconds of the
        sidecar's main thread (uvicorn's event loop), of its other threads (the engine's, with
        --no-engine-process) and of its engine process (none with --no-engine-process)."""
        import httpx

        async with httpx.AsyncClient() as client:
            text = (await client.get(self.url + "/metrics")).text
        values = dict(line.split(" ", 1) for line in text.splitlines()
                      if line.startswith("kvgate_engine_step_seconds_"))
        threads = _thread_cpu_seconds(self.proc.pid)
        loop_cpu = threads.pop(self.proc.pid, 0.0)
        engine_cpu = sum(sum(_thread_cpu_seconds(pid).values()) for pid in _spawned(self.proc.pid))
        return (float(values["kvgate_engine_step_seconds_sum"]), int(float(values["kvgate_engine_step_seconds_count"])),
                loop_cpu, sum(threads.values()), engine_cpu)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _thread_cpu_seconds(pid: int) -> dict[int, float]:
    """utime + stime of each thread of ``pid`` (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that just ended
            continue
        seconds[int(task)] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


def _spawned(pid: int) -> list[int]:
    """The processes ``pid`` started through multiprocessing's spawn (an engine process)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except (OSError, ValueError):  # not a process, or one that just ended
            continue
        if parent == pid and spawned:
            found.append(int(entry))
    return found


async def served_run(client, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[dict, dict]:
    """Every prompt sent at once, each on its own stream as the gateway does; the client-side time of
    each request's first and last token."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    t0 = time.perf_counter()

    async def one(rid: str, prompt: list[int]) -> None:
        stream = await client.open(GenerateRequest(rid, prompt, greedy(new_tokens), salt=tag))
        got = 0
        try:
            async for frame in stream.frames():
                if frame.token_ids:
                    now = time.perf_counter() - t0
                    first.setdefault(rid, now)
                    last[rid] = now
                    got += len(frame.token_ids)
                if frame.error is not None:
                    raise RuntimeError(f"{rid}: {frame.error}")
        finally:
            await stream.aclose()
        if got != new_tokens:
            raise RuntimeError(f"{rid}: {got} tokens, not {new_tokens}")

    await asyncio.gather(*(one(f"{tag}{i}", p) for i, p in enumerate(prompts)))
    return first, last


def bench_served(name: str, settings: dict, device: str = "cuda", sizes: dict = SERVED_SIZES,
                 engines: tuple[str, ...] = SERVED_ENGINES[:1]) -> None:
    """Decode tok/s of the sidecar over HTTP against the same engine stepped in-process (what
    ``python -m engine generate`` runs), same model shape, settings and requests, at each batch; the
    sidecar with each of ``engines`` (:data:`SERVED_ENGINES`), the offline peer shared."""
    z = sizes
    prompts = {b: random_prompts(b, z["prompt"], 500 + b) for b in z["batches"]}
    core = make_engine(name, device=device, **settings)
    mode = "async" if core.async_scheduling else "sync"
    offline: dict[int, list[tuple[float, float]]] = {b: [] for b in z["batches"]}
    Run(core, prompts[1][:1], [greedy(z["new"])], "srv-warm-")
    for r in range(z["repeats"]):
        for b in z["batches"]:
            steps, busy = core.counters.steps, core.counters.busy_seconds
            run = Run(core, prompts[b], [greedy(z["new"])] * b, f"srv-off{r}-{b}-")
            offline[b].append((decode_tok_s(run.first, run.last, z["new"]),
                               step_ms(core.counters.busy_seconds - busy, core.counters.steps - steps)))
    del core
    if device == "cuda":
        free_cuda()
    for engine in engines:
        served, cpu = asyncio.run(_served(name, settings, device, prompts, z, engine))
        for b in z["batches"]:
            emit_served(name, b, mode, engine, z, offline[b], served[b], cpu[b])


def emit_served(name: str, b: int, mode: str, engine: str, z: dict, offline: list, served: list, cpu: list) -> None:
    off = statistics.median(rate for rate, _ in offline)
    on = statistics.median(rate for rate, _ in served)
    emit(bench="served", model=name, batch=b, scheduling=mode, served_engine=engine, prompt_tokens=z["prompt"],
         new_tokens=z["new"], peer="offline: the same engine stepped in-process (python -m engine generate)",
         served_tok_s=round(on, 1), offline_tok_s=round(off, 1), ratio=round(on / off, 3),
         served_runs_tok_s=[round(rate, 1) for rate, _ in served],
         offline_runs_tok_s=[round(rate, 1) for rate, _ in offline],
         served_engine_step_ms=[ms for _, ms in served], offline_engine_step_ms=[ms for _, ms in offline],
         served_loop_thread_cpu_ms_per_step=[ms for ms, _, _ in cpu],
         served_other_threads_cpu_ms_per_step=[ms for _, ms, _ in cpu],
         served_engine_process_cpu_ms_per_step=[ms for _, _, ms in cpu],
         goal="served >= 0.95 of offline", met=on / off >= 0.95)


async def _served(name: str, settings: dict, device: str, prompts: dict, z: dict, engine: str) -> tuple[dict, dict]:
    from gateway.engine_client import EngineClient, engine_transport

    sidecar = Sidecar(name, device, {**settings, "engine_process": engine == "process"})
    served: dict[int, list[tuple[float, float]]] = {b: [] for b in z["batches"]}
    cpu: dict[int, list[tuple[float, float, float]]] = {b: [] for b in z["batches"]}
    try:
        await sidecar.wait_ready()
        transport = engine_transport(256)  # the gateway's pool
        client = EngineClient(sidecar.url, transport)
        await served_run(client, prompts[1][:1], z["new"], "srv-warm-")
        for r in range(z["repeats"]):
            for b in z["batches"]:
                before = await sidecar.counters()
                first, last = await served_run(client, prompts[b], z["new"], f"srv-on{r}-{b}-")
                busy, steps, *cpu_seconds = (a - b for a, b in zip(await sidecar.counters(), before))
                served[b].append((decode_tok_s(first, last, z["new"]), step_ms(busy, steps)))
                cpu[b].append(tuple(step_ms(seconds, steps) for seconds in cpu_seconds))
        await transport.aclose()
    finally:
        sidecar.close()
    return served, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=420,
                        help="skip peers that would end past this (default: 420)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated subset of {','.join(MODELS)} for the engine sections")
    parser.add_argument("--scheduling", default=",".join(SCHEDULING),
                        help=f"comma-separated scheduling modes of the engine sections, of {','.join(SCHEDULING)} "
                             "(the peers' comparisons use the last)")
    prefill_tokens = EngineConfig.__dataclass_fields__["cuda_graph_prefill_tokens"].default
    parser.add_argument("--cuda-graph-prefill-tokens", type=int, default=prefill_tokens, metavar="TOKENS",
                        help=f"the engine sections' --cuda-graph-prefill-tokens (default: {prefill_tokens}, the "
                             "engine's; 0: steps with prompt tokens run eagerly)")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip the peers (torch.compile, HF): only our engine's scheduling modes, side by side")
    parser.add_argument("--fp8-dry-run", action="store_true",
                        help="run the fp8 section alone on the CPU with the tiny model and tiny sizes")
    parser.add_argument("--served-dry-run", action="store_true",
                        help="run the served section alone on the CPU with the tiny model and tiny sizes")
    parser.add_argument("--served-engines", default=SERVED_ENGINES[0],
                        help=f"comma-separated subset of {','.join(SERVED_ENGINES)}: where the served section's "
                             f"sidecar runs its engine (default: {SERVED_ENGINES[0]})")
    args = parser.parse_args()
    if args.fp8_dry_run:
        configure_logging("WARNING")
        bench_fp8("tiny", dict(max_num_seqs=8, max_num_batched_tokens=256), bandwidth=1e11, device="cpu",
                  sizes=FP8_DRY_SIZES)
        return
    served_engines = tuple(args.served_engines.split(","))
    if set(served_engines) - set(SERVED_ENGINES):
        sys.exit(f"unknown served engines {sorted(set(served_engines) - set(SERVED_ENGINES))}; choose from "
                 f"{SERVED_ENGINES}")
    if args.served_dry_run:
        configure_logging("WARNING")
        bench_served("tiny", dict(max_num_seqs=8, max_num_batched_tokens=256), device="cpu", sizes=SERVED_DRY_SIZES,
                     engines=served_engines)
        return
    if not torch.cuda.is_available():
        sys.exit("gpu_bench needs a CUDA device")
    sections = set(args.only.split(","))
    unknown = sections - set(SECTIONS)
    if unknown:
        sys.exit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    configure_logging("INFO")  # the engine's JSON logs go to stderr; stdout holds the measurements
    budget = Budget(args.budget_s, peers=not args.no_peers)
    bandwidth, peak = measure_device()
    engine = dict(max_num_seqs=64, max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
                  cuda_graph_prefill_tokens=args.cuda_graph_prefill_tokens)
    models = set(args.models.split(","))
    modes = args.scheduling.split(",")
    if set(modes) - set(SCHEDULING):
        sys.exit(f"unknown scheduling modes {sorted(set(modes) - set(SCHEDULING))}; choose from {SCHEDULING}")

    def run_model(name: str, max_len: int, secs: set[str]) -> None:
        bench_model(name, {**engine, "max_model_len": max_len}, secs, bandwidth, peak, budget, modes)

    if sections & {"ttft", "decode_b1", "cont_batch", "prefill_8k"} and "llama3-8b" in models:
        guarded("llama3-8b", lambda: run_model("llama3-8b", 8192, sections))
    small = "smollm2-135m"
    if sections & {"decode_b1", "cont_batch"} and small in models and budget.allows(small, "ours", 40):
        guarded("smollm2-135m", lambda: run_model(small, 2048, sections))
    if "decode_b1" in sections and "qwen3-8b" in models and budget.allows("qwen3-8b", "ours", 40):
        guarded("qwen3-8b", lambda: run_model("qwen3-8b", 2048, {"decode_b1"}))
    if "fp8" in sections and budget.allows("fp8", "ours", 150):
        guarded("fp8", lambda: bench_fp8("llama3-8b", {**engine, "max_model_len": 8192}, bandwidth))
    if "hybrid" in sections and budget.allows("hybrid", "ours", 60):
        guarded("hybrid", lambda: bench_hybrid(budget))
    if "offline" in sections and budget.allows("offline", "ours", 50):
        guarded("offline", lambda: bench_offline(bandwidth, peak, budget, modes, args.cuda_graph_prefill_tokens))
    for name, max_len in (("llama3-8b", 8192), (small, 2048)):
        if "served" in sections and name in models and budget.allows("served", "ours", 40):
            guarded("served", lambda: bench_served(name, {**engine, "max_model_len": max_len}, engines=served_engines))
    emit(bench="done", seconds=round(time.perf_counter() - START, 1))


if __name__ == "__main__":
    main()
