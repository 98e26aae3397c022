"""The engine sidecar's Prometheus metrics (one registry per app)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.protocol import EngineStats


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvgate_engine_requests", "Requests by finish reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("kvgate_engine_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter(
            "kvgate_engine_cached_tokens", "Prompt tokens served from the prefix cache", registry=r,
        )
        self.generation_tokens = Counter("kvgate_engine_generation_tokens", "Tokens generated", registry=r)
        self.steps = Counter("kvgate_engine_steps", "Engine steps", registry=r)
        self.running = Gauge("kvgate_engine_num_running", "Running sequences", registry=r)
        self.waiting = Gauge("kvgate_engine_num_waiting", "Waiting sequences", registry=r)
        self.kv_usage = Gauge("kvgate_engine_kv_usage", "Fraction of KV blocks in use or unavailable", registry=r)
        self.step_seconds = Histogram(
            "kvgate_engine_step_seconds", "Duration of one engine step", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.ttft = Histogram(
            "kvgate_engine_time_to_first_token_seconds", "Arrival to first token", registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )

    def add_spec_decode(self, snapshot: Callable[[], EngineStats | None]) -> None:
        """Export the speculative decoding counters of the engine's latest stats, under vLLM's names."""
        self.registry.register(_SpecDecodeCollector(snapshot))


class _SpecDecodeCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineStats | None]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        if snap is None:
            return
        yield CounterMetricFamily("vllm:spec_decode_num_drafts", "Sequence-steps that verified a draft",
                                  value=snap.spec_num_drafts)
        yield CounterMetricFamily("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                  value=snap.spec_num_draft_tokens)
        yield CounterMetricFamily("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                  value=snap.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft", labels=["position"])
        for position, count in enumerate(snap.spec_num_accepted_tokens_per_pos):
            per_pos.add_metric([str(position)], count)
        yield per_pos
