"""The engine sidecar's Prometheus metrics (one registry per app).

Each is also served under vLLM's name (:data:`VLLM_NAMES`, with vLLM's ``model_name`` label), so that
dashboards, autoscalers and the Gateway API Inference Extension's endpoint picker, written for vLLM,
read kvgate engines unchanged. Requests in vLLM's gauges are sequences here (a request with n > 1 is n).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from engine.protocol import EngineStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
REQUEST_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self, model_name: str) -> None:
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
            buckets=LATENCY_BUCKETS,
        )
        self.inter_token_latency = Histogram(
            "kvgate_engine_inter_token_latency_seconds", "Time between two tokens of a sequence", registry=r,
            buckets=TOKEN_LATENCY_BUCKETS,
        )
        self.queue_time = Histogram(
            "kvgate_engine_request_queue_time_seconds", "Arrival to the first step that runs the request",
            registry=r, buckets=LATENCY_BUCKETS,
        )
        self.e2e_latency = Histogram(
            "kvgate_engine_e2e_request_latency_seconds", "Arrival to the last frame", registry=r,
            buckets=REQUEST_LATENCY_BUCKETS,
        )
        r.register(VLLMNames({
            "vllm:num_requests_running": self.running,
            "vllm:num_requests_waiting": self.waiting,
            "vllm:kv_cache_usage_perc": self.kv_usage,
            "vllm:prefix_cache_queries": self.prompt_tokens,
            "vllm:prefix_cache_hits": self.cached_tokens,
            "vllm:time_to_first_token_seconds": self.ttft,
            "vllm:inter_token_latency_seconds": self.inter_token_latency,
            "vllm:e2e_request_latency_seconds": self.e2e_latency,
            "vllm:request_queue_time_seconds": self.queue_time,
        }, model_name))
        self.model_name = model_name

    def add_spec_decode(self, snapshot: Callable[[], EngineStats | None]) -> None:
        """Export the speculative decoding counters of the engine's latest stats, under vLLM's names."""
        self.registry.register(_SpecDecodeCollector(snapshot, self.model_name))


class VLLMNames(Collector):
    """kvgate metrics again under vLLM's names (a view: the values are kvgate's, read at scrape time)."""

    def __init__(self, aliases: dict[str, MetricWrapperBase], model_name: str):
        self.aliases = aliases
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for name, metric in self.aliases.items():
            for family in metric.collect():
                alias = Metric(name, family.documentation, family.type)
                for s in family.samples:
                    alias.add_sample(name + s.name[len(family.name):], {**s.labels, "model_name": self.model_name},
                                     s.value, s.timestamp, s.exemplar)
                yield alias


class _SpecDecodeCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineStats | None], model_name: str):
        self.snapshot = snapshot
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        if snap is None:
            return
        for name, documentation, value in (
            ("vllm:spec_decode_num_drafts", "Sequence-steps that verified a draft", snap.spec_num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", snap.spec_num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", snap.spec_num_accepted_tokens),
        ):
            family = CounterMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft",
                                      labels=["model_name", "position"])
        for position, count in enumerate(snap.spec_num_accepted_tokens_per_pos):
            per_pos.add_metric([self.model_name, str(position)], count)
        yield per_pos
