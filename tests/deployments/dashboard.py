"""The metric names the operator's Grafana dashboard queries (cluster_configs/grafana)."""

from __future__ import annotations

import json
import pathlib
import re

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "cluster_configs" / "grafana" / "dcut-dashboard.json"


def queried_metrics() -> set[str]:
    """Every dcut_* series name in every panel's queries."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {name for p in panels for t in p["targets"] for name in re.findall(r"\bdcut_[a-z_]+", t["expr"])}


def exported(text: str) -> set[str]:
    """Sample names in a Prometheus text exposition."""
    return set(re.findall(r"^(dcut_[a-z_]+)[{ ]", text, re.M))
