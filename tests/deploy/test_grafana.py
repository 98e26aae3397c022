"""deploy/grafana: every query of the dashboard names metrics that kvgate registers."""

from __future__ import annotations

import json
import re
from pathlib import Path

from engine.metrics import Metrics as EngineMetrics
from gateway.metrics import GatewayMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvgate.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_names() -> set[str]:
    """The series names the gateway's and the engine's registries expose."""
    names = set()
    for registry in (GatewayMetrics().registry, EngineMetrics("kvgate-test").registry):
        for family in registry.collect():
            names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_every_query_names_a_registered_metric():
    exported = exported_names()
    found = queries()
    assert len(found) >= 20
    for title, expr in found:
        names = set(re.findall(r"\bkvgate_[a-z_]+", expr))
        assert names, f"{title}: {expr} names no kvgate metric"
        assert names <= exported, f"{title}: {sorted(names - exported)} is not a registered metric"


def test_the_panels_cover_both_sides():
    used = {name for _, expr in queries() for name in re.findall(r"\bkvgate_[a-z_]+", expr)}
    assert any(n.startswith("kvgate_gateway_") for n in used) and any(n.startswith("kvgate_engine_") for n in used)
    assert "kvgate_gateway_prefix_index_lookup_seconds_bucket" in used  # the index's latency, what scale-out bends
