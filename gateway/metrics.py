"""Prometheus metrics of one gateway (its own registry: no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_INDEX_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
_BLOCK_BUCKETS = (0, 1, 4, 16, 64, 256, 1024, 4096)
_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready", "/metrics",
                        "/openapi.json"})


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvgate_gateway_requests", "Requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.latency = Histogram("kvgate_gateway_request_seconds", "Request duration until the last byte",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvgate_gateway_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvgate_gateway_prompt_tokens", "Prompt tokens sent to engines", registry=r)
        self.cached_tokens = Counter("kvgate_gateway_cached_tokens", "Prompt tokens the engines had cached",
                                     registry=r)
        self.completion_tokens = Counter("kvgate_gateway_completion_tokens", "Tokens returned to clients",
                                         registry=r)
        self.in_flight = Gauge("kvgate_gateway_in_flight", "Requests being served", registry=r)
        self.routed = Counter("kvgate_gateway_routed", "Engine requests by replica and routing reason",
                              ["replica", "reason"], registry=r)
        self.replica_ready = Gauge("kvgate_gateway_replica_ready", "1 when the replica is ready", ["replica"],
                                   registry=r)
        self.replica_in_flight = Gauge("kvgate_gateway_replica_in_flight", "This gateway's requests on a replica",
                                       ["replica"], registry=r)
        self.replica_pending_prefill = Gauge(
            "kvgate_gateway_replica_pending_prefill_tokens",
            "Predicted uncached prompt tokens of this gateway's requests on a replica still before their first token",
            ["replica"], registry=r)
        self.replica_utilization = Gauge(
            "kvgate_gateway_replica_utilization",
            "Busy fraction of a replica's engine loop, smoothed over recent health polls", ["replica"], registry=r)
        self.replica_kv_footprint = Gauge(
            "kvgate_gateway_replica_kv_footprint",
            "Share of a replica's KV blocks in use or holding cached prefixes, as of its last health poll "
            "(the router's tie-breaker between equally cached, equally loaded replicas)", ["replica"], registry=r)
        self.replica_breaker = Gauge("kvgate_gateway_replica_breaker_open",
                                     "Circuit breaker of a replica: 0 closed, 0.5 half-open (probing), 1 open",
                                     ["replica"], registry=r)
        self.index_available = Gauge("kvgate_gateway_prefix_index_available",
                                     "1 while the prefix index answers (prefix routing only)", registry=r)
        self.index_lookup = Histogram("kvgate_gateway_prefix_index_lookup_seconds",
                                      "Prefix index lookups that answered in time", buckets=_INDEX_BUCKETS,
                                      registry=r)
        self.matched_blocks = Histogram("kvgate_gateway_prefix_matched_blocks",
                                        "Prompt blocks predicted cached on the chosen replica (prefix routing)",
                                        buckets=_BLOCK_BUCKETS, registry=r)
        self.predicted_cached_tokens = Counter("kvgate_gateway_predicted_cached_tokens",
                                               "Prompt tokens routing predicted cached (compare with cached_tokens)",
                                               registry=r)

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        endpoint = path if path in _ENDPOINTS else "other"  # unknown paths must not grow label sets
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
