"""``kombu-delay bench --only drain`` at a tiny size: every variant runs a real worker.

Only what must hold whatever the machine's speed is asserted: every task of the herd
starts, none before its ETA, none twice. Finish times and memory are figures the
benchmark reports, never assertions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import ROOT


@pytest.mark.timeout(900)
def test_drain_runs_stock_and_kombu_delay_workers_without_early_duplicate_or_lost(tmp_path: Path) -> None:
    out = tmp_path / "drain.json"
    args = [sys.executable, "-m", "kombu_delay", "bench", "--only", "drain", "--json-out", str(out)]
    args += ["--plot-out", str(tmp_path / "bench.png"), "--drain", "200", "--drain-look-ahead", "4"]
    args += ["--drain-prefetch", "16"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["errors"] == {}
    variants = report["results"]["drain"]["variants"]
    assert set(variants) == {"stock", "delay", "delay-delayredis", "look-ahead-4s"}
    assert variants["look-ahead-4s"]["look_ahead_s"] == 4
    for name, result in variants.items():
        assert result["tasks"] == 200, name
        assert result["started"] == 200, name
        assert (result["early"], result["duplicates"], result["lost"]) == (0, 0, 0), name
    assert "drain: 200 tasks" in done.stdout
