"""The Grafana dashboard in examples/grafana queries only series a real mover exports."""

from __future__ import annotations

import json
import re
import sys
import urllib.request

import pytest

from kombu_delay.tooling.redis_server import free_port
from tests.support.procs import ROOT, wait_until

DASHBOARD = ROOT / "examples" / "grafana" / "kombu-delay-dashboard.json"
#: The series names each metric type puts on the wire (prometheus_client's exposition).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
}


def queried(dashboard: dict) -> set[str]:
    """Every kombu-delay series named in a query of the dashboard (panels and variables)."""
    texts = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    texts += [json.dumps(variable.get("query", "")) for variable in dashboard["templating"]["list"]]
    return {name for text in texts for name in re.findall(r"\bkombu_delay_[a-z_]+", text)}


def exported(port: int) -> set[str] | None:
    """The series names a mover's /metrics exports (from its TYPE lines), or None before it serves."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    names = set()
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        base = family.removesuffix("_total") if kind == "counter" else family
        names.update(base + suffix for suffix in SUFFIXES.get(kind, ("",)))
    return names


def test_every_series_the_grafana_dashboard_queries_is_one_the_mover_exports(r, redis_server, spawn):
    pytest.importorskip("prometheus_client")
    dashboard = json.loads(DASHBOARD.read_text())
    wanted = queried(dashboard)
    assert len(wanted) >= 10, "the dashboard queries the metrics"
    # What only an alert told: dead letters waiting, a Redis that keeps nothing, no mover scraped.
    assert {"kombu_delay_dead_letters_kept", "kombu_delay_redis_persistence_off"} <= wanted
    assert any("up{" in target["expr"] for panel in dashboard["panels"] for target in panel["targets"])
    port = free_port()
    args = [sys.executable, "-m", "kombu_delay", "-b", redis_server.delay_url, "mover"]
    spawn([*args, "--metrics-port", str(port)], name="mover")
    names = wait_until(lambda: exported(port), timeout=90)
    assert isinstance(names, set)
    assert wanted <= names, f"queried but not exported: {sorted(wanted - names)}"
    # Every panel has a unique id and a query, and the data source is a variable, not a uid.
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(panel["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"])
