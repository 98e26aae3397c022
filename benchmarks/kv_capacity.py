"""KV capacity of a sliding-window model's hybrid pool against the same memory laid out for every
layer global: how many tokens of context fit, counted by the KV managers themselves.

For the Gemma-3-12B shape (bf16) and a fixed KV memory, each pool is sized by the engine's own
bytes per block (``kv_bytes_per_block``: a page holds one layer group's block) and filled with
sequences of 8K and 32K tokens, prefilled in 8K-token chunks as the scheduler would, until an
allocation fails. Pure bookkeeping (no tensors): it runs anywhere, in a second. One JSON line per
context length:

    python3 benchmarks/kv_capacity.py [--kv-gib 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import DUMMY_CONFIGS
from engine.kv_cache import KVCacheManager
from engine.kv_groups import HybridKVCacheManager, kv_layout
from engine.model_runner import kv_bytes_per_block
from engine.protocol import SamplingParams
from engine.request import Sequence
from loadtest.stamp import emit

BLOCK_SIZE = 16
CHUNK = 8192


def sequences_that_fit(kv, context: int) -> int:
    """Admit sequences of ``context`` distinct tokens, chunk by chunk, until one cannot get its blocks."""
    live: list[Sequence] = []
    while True:
        # distinct tokens per sequence: no prefix is shared
        tokens = [len(live) * context + i for i in range(context)]
        seq = Sequence(f"s{len(live)}", 0, tokens, SamplingParams(max_tokens=1), None, [], None)
        live.append(seq)
        prefix = kv.match_prefix(seq)
        while seq.num_computed_tokens < context:
            num_new = min(CHUNK, context - seq.num_computed_tokens)
            first = not seq.block_ids
            if kv.allocate(seq, num_new, prefix if first else None) is None:
                kv.check_integrity(live)
                return len(live) - 1
            seq.num_computed_tokens += num_new
            kv.cache_computed_blocks(seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-gib", type=float, default=64.0, help="KV cache memory of both pools (default: 64)")
    args = parser.parse_args()
    config = DUMMY_CONFIGS["gemma3-12b"]
    all_global = dataclasses.replace(config, layer_types=(), sliding_window=None)
    budget = int(args.kv_gib * 2**30)
    hybrid_blocks = budget // kv_bytes_per_block(config, BLOCK_SIZE, torch.bfloat16)
    global_blocks = budget // kv_bytes_per_block(all_global, BLOCK_SIZE, torch.bfloat16)
    for context in (8192, 32768):
        hybrid = HybridKVCacheManager(hybrid_blocks, BLOCK_SIZE, kv_layout(config), enable_prefix_caching=False)
        flat = KVCacheManager(global_blocks, BLOCK_SIZE, enable_prefix_caching=False)
        n_hybrid, n_global = sequences_that_fit(hybrid, context), sequences_that_fit(flat, context)
        record = dict(
            bench="kv_capacity", model=config.name, kv_gib=args.kv_gib, context=context,
            hybrid_blocks=hybrid_blocks, all_global_blocks=global_blocks,
            hybrid_sequences=n_hybrid, hybrid_tokens=n_hybrid * context,
            all_global_sequences=n_global, all_global_tokens=n_global * context,
            ratio=round(n_hybrid / n_global, 2) if n_global else None,
        )
        if context == 32768:
            record.update(goal=">= 4x the context capacity at 32K", met=n_hybrid >= 4 * n_global)
        emit(**record)


if __name__ == "__main__":
    main()
