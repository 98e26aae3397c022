"""An engine's /stats for the routing suites (a module, not conftest, so test files can import it)."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.protocol import EngineStats

IDLE = EngineStats(
    model="tiny", replica_id="engine-0", block_size=16, max_model_len=1024, vocab_size=49152, num_running=0,
    num_waiting=0, num_free_blocks=64, num_total_blocks=64, kv_usage=0.0, num_cached_blocks=0, prefix_hit_rate=0.0,
    num_position_entries=0, num_preemptions=0, max_num_batched_tokens=512, prefill_pack_tokens=512,
    max_num_seqs=8, total_busy_seconds=0.0, num_waiting_tokens=0, total_computed_tokens=0,
    kv_cache_dtype="float32", kv_tokens_per_gib=46811, spec_num_drafts=0, spec_num_draft_tokens=0,
    spec_num_accepted_tokens=0, spec_num_accepted_tokens_per_pos=[],
)


def engine_stats(**fields: Any) -> EngineStats:
    """An idle engine's /stats, with ``fields`` changed."""
    return dataclasses.replace(IDLE, **fields)
