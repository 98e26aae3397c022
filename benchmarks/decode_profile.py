"""Where a decode step's time goes: per-kernel GPU time of the engine's captured decode graphs.

For each shape (dummy bf16 weights), batch bucket and context (each within the shape's
max_model_len), replays the decode graph with every row at that context and prints one JSON
line: the replay time, its bytes roofline (weights plus the KV read, at the copy bandwidth
measured in the same run: the peer every decode step is held to), how many kernels one replay
launches, and the kernels by GPU time (torch.profiler over the replays). The gap between the
replay time and the sum of kernel times is launch latency.

    python3 benchmarks/decode_profile.py [--contexts 640,4096] [--batches 1,64] [--quantization fp8]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import QUANTIZATIONS, EngineConfig
from engine.core import EngineCore
from engine.logs import configure_logging
from loadtest.stamp import emit

REPLAYS = 50
# as in gpu_bench.py (the graphs' split counts); qwen3-0.6b: its offline (nano-vllm) section
MAX_MODEL_LEN = {"smollm2-135m": 2048, "llama3-8b": 8192, "qwen3-0.6b": 4096}


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 2 GiB device-to-device copy."""
    src = torch.empty(2**30, dtype=torch.uint16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 2 * 10 / (time.perf_counter() - t0)


def short_name(kernel: str) -> str:
    """A kernel's name without template arguments and signatures, for grouping."""
    name = re.sub(r"<.*", "", kernel.split("(")[0]).removeprefix("void ")
    return name[:80]


def fake_seqs(core: EngineCore, batch: int, context: int) -> list[SimpleNamespace]:
    """``batch`` decoding sequences at position ``context - 1`` on disjoint blocks."""
    bs = core.kv.block_size
    per_seq = -(-context // bs)
    return [
        SimpleNamespace(
            num_computed_tokens=context - 1, all_token_ids=[7] * context,
            block_ids=list(range(i * per_seq, (i + 1) * per_seq)), group_block_ids=[],
        )
        for i in range(batch)
    ]


def profile_bucket(core: EngineCore, batch: int, context: int, bandwidth: float) -> None:
    graphs = core.runner.decode_graphs
    graphs.run(fake_seqs(core, batch, context))  # fills the static inputs of this bucket
    graph = graphs.graph(batch, context)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    replay_us = (time.perf_counter() - t0) / REPLAYS * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            kernels[short_name(event.name)].append(event.device_time)
    rows = sorted(
        ({"kernel": k, "calls": len(v) // REPLAYS, "us": round(sum(v) / REPLAYS, 1)} for k, v in kernels.items()),
        key=lambda r: -r["us"],
    )
    config = core.model_config
    model = core.runner.model
    # An untied embedding table is not read by a decode step, beyond one row per sequence.
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not (
        n == "model.embed_tokens.weight" and model.lm_head is not None
    ))
    kv = batch * context * 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    emit(
        bench="decode_profile", model=config.name, quantization=core.config.quantization, batch=batch, context=context,
        replay_us=round(replay_us, 1), kernel_us=round(sum(r["us"] for r in rows), 1),
        roofline_us=round((weights + kv) / bandwidth * 1e6, 1),
        kernels_per_replay=sum(r["calls"] for r in rows), kernels=rows[:14],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="640,4096", help="comma-separated context lengths (default: 640,4096)")
    parser.add_argument("--batches", default="1,64", help="comma-separated batch sizes (default: 1,64)")
    parser.add_argument("--models", default="smollm2-135m,llama3-8b",
                        help=f"comma-separated dummy shapes, of {','.join(MAX_MODEL_LEN)}")
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS, help="the engine's --quantization")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_profile needs a CUDA device")
    configure_logging("WARNING")
    bandwidth = copy_bandwidth()
    emit(bench="device", device=torch.cuda.get_device_name(), copy_bandwidth_tb_s=round(bandwidth / 1e12, 3))
    batches = [int(b) for b in args.batches.split(",")]
    for model in args.models.split(","):
        config = EngineConfig(
            model=model, load_format="dummy", device="cuda", max_num_seqs=max(batches),
            max_model_len=MAX_MODEL_LEN[model], gpu_memory_utilization=0.5, quantization=args.quantization,
        )
        core = EngineCore.from_config(config)
        core.runner.capture_decode_graphs()
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in batches:
                if context <= core.max_model_len:
                    profile_bucket(core, batch, context, bandwidth)
        del core
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
