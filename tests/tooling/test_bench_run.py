"""``kombu-delay bench`` around its scenarios: how a run ends, on the test's own Redis (the
scenarios here are stand-ins, so that no figure is measured)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import kombu_delay.tooling.bench as bench_mod
from kombu_delay.tooling.redis_server import RedisServer


def run_with(
    monkeypatch: pytest.MonkeyPatch, server: RedisServer, tmp_path: Path, **found: Any
) -> tuple[Any, dict[str, Any]]:
    """Run the bench command on ``server`` with the scenarios ``found``; return its result
    and the JSON it wrote."""
    monkeypatch.setattr(bench_mod, "scenarios", lambda *args: found)
    out = tmp_path / "bench.json"
    args = ["--broker", server.url, "--only", ",".join(found), "--json-out", str(out)]
    args += ["--plot-out", str(tmp_path / "bench.png")]
    result = CliRunner().invoke(bench_mod.bench, args)
    return result, json.loads(out.read_text()) if out.exists() else {}


def test_a_scenario_that_reports_a_failure_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, server: RedisServer, tmp_path: Path
) -> None:
    # A drain variant that lost most of its tasks was a row in a table, and the run exited 0.
    def failing(ctx: Any) -> dict[str, Any]:
        return {"failed": "not every task ran exactly once, none early: delay"}

    result, report = run_with(monkeypatch, server, tmp_path, drain=failing, burst=lambda ctx: {"ok": 1})
    assert result.exit_code == 1, result.output
    assert "scenario(s) failed: drain" in result.output
    assert report["errors"] == {"drain": "not every task ran exactly once, none early: delay"}
    assert report["results"]["drain"]["failed"] and report["results"]["burst"] == {"ok": 1}


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "--prefix", "myapp:"],
        ["--prefix", "myapp:", "bench"],
        ["bench", "-o", "delay_bucket_width=1"],
        ["-o", "delay_bucket_width=1", "bench"],
    ],
)
def test_bench_refuses_a_prefix_or_transport_options(args: list[str]) -> None:
    # They were taken and ignored: the run used the prefix '' and the default settings, unsaid.
    from kombu_delay.cli import main

    result = CliRunner().invoke(main, [*args, "--only", "no-such-scenario"])
    assert result.exit_code == 2, result.output
    assert "bench does not take --prefix or -o" in result.output
