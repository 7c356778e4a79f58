"""Write deploy/grafana/gpuppetti.json, a Grafana dashboard over the daemons' /metrics.

tests/unit/test_dashboard.py fails when the committed file differs from what this writes, or when a query names a
metric the daemons do not export.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "deploy" / "grafana" / "gpuppetti.json"
HOLDER = "{{namespace}}/{{pod}}/{{container}} {{gpu}} {{unit}}"

# (title, unit, [(PromQL, legend)], width): one panel each, in rows of 24 columns.
PANELS: list[tuple[str, str, list[tuple[str, str]], int]] = [
    ("Slice memory used of budget", "percentunit",
     [("gpuppetti_slice_memory_used_bytes / (gpuppetti_slice_memory_budget_bytes > 0)", HOLDER)], 12),
    ("Slice memory used", "bytes", [("gpuppetti_slice_memory_used_bytes", HOLDER)], 12),
    ("Compute wait (share of wall time)", "percentunit",
     [("rate(gpuppetti_slice_compute_wait_seconds_total[5m])", HOLDER)], 12),
    ("Slices enforced (1) or not (0)", "none", [("gpuppetti_slices_enforced", "{{instance}}")], 12),
    ("GPUs by health", "none", [("sum by (model, health) (gpuppetti_gpus)", "{{model}} {{health}}")], 8),
    ("Units by health", "none", [("sum by (resource, health) (gpuppetti_units)", "{{resource}} {{health}}")], 8),
    ("GPU utilisation", "percent", [("gpuppetti_gpu_utilization_percent", "{{gpu}} {{model}}")], 8),
    ("Allocate calls", "ops", [("sum by (resource, result) (rate(gpuppetti_allocate_requests_total[5m]))",
                                "{{resource}} {{result}}")], 8),
    ("Allocate latency (p99)", "s", [("histogram_quantile(0.99, sum by (le, resource) "
                                      "(rate(gpuppetti_allocate_duration_seconds_bucket[5m])))", "{{resource}}")], 8),
    ("DRA claims prepared", "none", [("gpuppetti_dra_prepared_claims", "{{instance}}"),
                                     ("gpuppetti_dra_claims_missing_cdi_spec", "missing CDI spec {{instance}}")], 8),
    ("DRA prepare latency (p99)", "s", [("histogram_quantile(0.99, sum by (le) "
                                         "(rate(gpuppetti_dra_prepare_duration_seconds_bucket[5m])))", "p99")], 12),
    ("Registrations and restarts", "none",
     [("sum by (resource) (increase(gpuppetti_registrations_total[1h]))", "registrations {{resource}}"),
      ("sum by (resource) (increase(gpuppetti_plugin_restarts_total[1h]))", "restarts {{resource}}")], 12),
]


def dashboard() -> dict[str, Any]:
    panels = []
    x = y = 0
    for number, (title, unit, queries, width) in enumerate(PANELS, start=1):
        if x + width > 24:
            x, y = 0, y + 8
        panels.append({
            "id": number, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"x": x, "y": y, "w": width, "h": 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
                        for i, (expr, legend) in enumerate(queries)],
        })
        x += width
    return {
        "title": "gpuppetti: GPU slices", "uid": "gpuppetti-slices", "schemaVersion": 39, "version": 1,
        "tags": ["gpuppetti", "gpu"], "timezone": "browser", "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "panels": panels,
    }


def rendered() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(rendered())
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
