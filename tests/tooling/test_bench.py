"""``kombu-delay bench`` end to end at tiny sizes: it runs every scenario (in three groups, side
by side) and writes JSON.

No timing is asserted; only what must hold whatever the machine's speed: nothing
arrives early, nothing is lost, every scenario reports.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kombu_delay.tooling.bench import scenarios
from kombu_delay.tooling.bench.cpu import MAX_HALVES_DIFFER, MAX_SPREAD
from tests.support.procs import ROOT

pytestmark = pytest.mark.slow  # CI runs it (-m slow); the default run leaves it out

TINY = [
    "--publish", "50",
    "--precision", "10",
    "--precision-window", "1",
    "--burst", "500",
    "--memory", "500",
    "--thaw", "500",
    "--scale-small", "200",
    "--scale-large", "2000",
    "--scale-probe", "100",
    "--scale-rounds", "2",
    "--cpu", "300",
    "--backpressure", "1000",
    "--backpressure-rate", "2000",
    "--backpressure-max-len", "200",
    "--backpressure-consume-rate", "2000",
    "--herd", "1000",
    "--herd-short", "0",
    "--e2e-tasks", "100",
    "--e2e-precision", "5",
]  # fmt: skip


#: The scenarios in three groups of about a minute and a half each at these sizes, run side by
#: side (CI runs the slow tests with pytest -n): all of them in one run took four minutes.
GROUPS = ("herd,publish,precision,burst,memory", "scale,cpu,backpressure", "e2e,web,thaw,inspect")


def run_bench(tmp_path: Path, only: str) -> dict[str, Any]:
    """Run ``kombu-delay bench --only <only>`` at tiny sizes; return its results, once it has
    reported each scenario asked for, with no error, as JSON and as a table."""
    out = tmp_path / "bench.json"
    args = [sys.executable, "-m", "kombu_delay", "bench", "--only", only, "--json-out", str(out)]
    args += ["--plot-out", str(tmp_path / "bench.png"), *TINY]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=850)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == set(only.split(","))
    assert report["errors"] == {}
    assert report["meta"]["redis"]
    assert "| scenario | metric |" in done.stdout
    return report


def test_the_groups_hold_every_scenario() -> None:
    every = set(scenarios(with_e2e=True)) - {"drain"}  # drain: test_drain_bench.py
    groups = [set(group.split(",")) for group in GROUPS]
    assert set().union(*groups) == every and sum(map(len, groups)) == len(every)


@pytest.mark.timeout(900)
def test_bench_herd_publish_precision_burst_memory(tmp_path: Path) -> None:
    report = run_bench(tmp_path, GROUPS[0])
    results = report["results"]
    precision = results["precision"]
    # Counted by task id, each push timed by MONITOR: every one once, none before its ETA.
    assert precision["arrived"] == 10 and precision["pushes"] == 10
    assert (precision["early"], precision["lost"], precision["doubled"]) == (0, 0, 0)
    burst = results["burst"]
    assert burst["messages"] == 500 and burst["drain_s"] > 0 and burst["delivered"] == 500
    assert (burst["early"], burst["lost"], burst["doubled"]) == (0, 0, 0)
    memory = results["memory"]
    assert memory["messages"] == 500
    # Due 10-70 min ahead, the default settings store every message compressed; the
    # uncompressed layout is measured on the same messages.
    assert memory["stored_compressed"] == 500 and memory["uncompressed_stored"] == 500
    assert 0 < memory["compressed_member_bytes"] < memory["payload_bytes"]
    # The reference structures are measured in the same run.
    for floor in (
        "plain_list_overhead_per_msg",
        "bare_sorted_set_overhead_per_msg",
        "task_id_sorted_set_per_msg",
    ):
        assert memory[floor] != 0, floor
    herd = results["herd"]["default"]
    assert herd["messages"] == 1000 and herd["on_list"] == 1000
    assert herd["early"] == 0 and herd["lost"] == 0 and herd["doubled"] == 0 and herd["stray"] == 0
    # The move's span is read off the mover's own counter, on Redis's clock.
    assert herd["move_span_ms"] > 0 and herd["move_sample_gap_ms"] > 0
    assert herd["floor_move_per_s"] > 0  # the whole herd moved again by the bare Lua move
    assert {row["scenario"] for row in report["targets"]} >= {"publish", "burst", "memory"}


@pytest.mark.timeout(900)
def test_bench_scale_cpu_backpressure(tmp_path: Path) -> None:
    report = run_bench(tmp_path, GROUPS[1])
    results = report["results"]
    assert results["scale"]["small"]["moved_all"] and results["scale"]["large"]["moved_all"]
    assert [len(results["scale"][size]["rounds"]) for size in ("small", "large")] == [2, 2]
    assert results["scale"]["large"]["layout"] == "spread"
    assert all("publish_bucket_members_mean" in results["scale"][size] for size in ("small", "large"))
    for ramp in ("max_rate", "max_queue_length"):
        held = results["backpressure"][ramp]
        assert held["delivered"] == 1000 and held["delivered_minus_messages"] == 0, held
        assert held["lost"] == 0 and held["doubled"] == 0 and held["still_scheduled"] == 0
    cpu = results["cpu"]
    assert cpu["stored_compressed"] == 300 and cpu["plain_redis_cpu_us"] > 0
    assert cpu["plain_publish_has_eta"] and cpu["move_polls"] > 0
    # Rounds measured (a spread of max / min, finite only with some), and the report's sums
    # and verdict made of its own parts.
    spread = cpu["plain_rounds_spread"]
    assert math.isfinite(spread) and spread >= 1
    assert cpu["steady"] == (
        spread <= MAX_SPREAD and cpu["plain_halves_differ_pct"] / 100 <= MAX_HALVES_DIFFER
    )
    parts = ("schedule_compressed_redis_cpu_us", "thaw_redis_cpu_us", "move_after_thaw_redis_cpu_us")
    assert cpu["compressed_redis_cpu_us"] == pytest.approx(sum(cpu[part] for part in parts))
    for floor in ("floor_lpush_redis_cpu_us", "floor_zadd_redis_cpu_us", "floor_script_zadd_redis_cpu_us"):
        assert cpu[floor] > 0, floor
    assert cpu["floor_script_over_lpush_us"] == pytest.approx(
        cpu["floor_script_zadd_redis_cpu_us"] - cpu["floor_lpush_redis_cpu_us"]
    )
    over = cpu["floor_script_over_lpush_us"] + cpu["floor_move_redis_cpu_us"]
    assert cpu["floor_delayed_ratio"] == pytest.approx(1 + over / cpu["plain_redis_cpu_us_beside_schedule"])
    assert cpu["delayed_redis_cpu_us"] == pytest.approx(
        cpu["schedule_redis_cpu_us"] + cpu["move_redis_cpu_us"]
    )
    assert {row["scenario"] for row in report["targets"]} >= {"scale", "cpu"}


@pytest.mark.timeout(900)
def test_bench_e2e_web_thaw_inspect(tmp_path: Path) -> None:
    report = run_bench(tmp_path, GROUPS[2])
    results = report["results"]
    thaw = results["thaw"]
    assert thaw["stored_cold"] == 500
    # Whether the thaw finished before the due time is a figure of speed, reported, not
    # asserted here; test_cold.py shows the thaw comes ahead, on a driven clock.
    assert thaw["early"] == 0 and thaw["lost"] == 0 and thaw["doubled"] == 0
    assert results["e2e"]["lateness"]["started"] == 5
    assert results["e2e"]["lateness"]["early"] == 0
    # The pending tasks went through delayredis:// and stayed in Redis, none with the worker.
    assert results["e2e"]["delay_not_held_in_redis"] == 0
    assert results["e2e"]["delay_unacked_by_worker"] == 0
    assert results["e2e"]["stock_unacked_by_worker"] == 100
    assert {row["scenario"] for row in report["targets"]} >= {"thaw"}
