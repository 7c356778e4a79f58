"""The Grafana dashboard in deploy/grafana is the one tools/gen_dashboard.py writes, and every metric its queries
name is one the daemons export."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from prometheus_client import generate_latest

from gpuppetti.node.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gen_dashboard  # noqa: E402

SUFFIXES = {"counter": ("",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


class _Claims:
    prepared = 0
    missing_specs: Mapping[str, str] = {}


def exported() -> set[str]:
    """Every series name the daemons' registry can export (both front ends' metrics are in one registry)."""
    metrics = Metrics()
    metrics.watch_claims(_Claims())
    names: set[str] = set()
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.update(name + suffix for suffix in SUFFIXES.get(kind, ("",)))
    return names


def test_the_committed_dashboard_is_the_generated_one() -> None:
    assert gen_dashboard.OUT.read_text() == gen_dashboard.rendered(), "run tools/gen_dashboard.py"


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    document = json.loads(gen_dashboard.OUT.read_text())
    queried = {name for panel in document["panels"] for target in panel["targets"]
               for name in re.findall(r"\bgpuppetti_[a-z0-9_]+", target["expr"])}
    assert queried, "the dashboard queries something"
    assert not queried - exported(), f"queried but not exported: {sorted(queried - exported())}"
    # The per-slice figures are what the dashboard is for.
    assert {"gpuppetti_slice_memory_used_bytes", "gpuppetti_slice_memory_budget_bytes",
            "gpuppetti_slice_compute_wait_seconds_total"} <= queried


def test_the_daemonsets_ask_to_be_scraped_where_metrics_are_served() -> None:
    from gpuppetti.commands import manifests
    for mode in ("plugin", "dra"):
        [daemonset] = [o for o in manifests.render(manifests.Options(mode=mode)) if o["kind"] == "DaemonSet"]
        annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
        [port] = daemonset["spec"]["template"]["spec"]["containers"][0]["ports"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port["containerPort"]),
                               "prometheus.io/path": "/metrics"}
