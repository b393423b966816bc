"""The bench's table of targets (no Redis: the rows made from given figures)."""

from __future__ import annotations

import json
import math

from kombu_delay.tooling.bench.report import evaluate


def rows_of(results: dict) -> dict[str, dict]:
    return {row["metric"]: row for row in evaluate(results) if row["scenario"] == "burst"}


def test_a_figure_that_could_not_be_measured_misses_its_target() -> None:
    # It read as neither met nor missed (a blank), as a figure with no target does.
    rows = rows_of({"burst": {"moved_per_s": float("nan"), "drain_s": float("nan")}})
    assert rows["moved/s, one mover"]["met"] is False
    assert rows["due -> all on list, s"]["met"] is None  # no target: nothing to miss
    assert rows_of({"burst": {"moved_per_s": 250_000.0}})["moved/s, one mover"]["met"] is True


def test_the_web_pages_and_the_inspect_ls_are_in_the_table() -> None:
    # The web scenario had no rows (its figures only in the JSON), and inspect's rows left out ls.
    page = {"median_ms": 14.25, "p99_ms": 102.0, "max_ms": 102.0, "runs": 100}
    timed = {"median_ms": 26.4, "p99_ms": 60.5, "runs": 20}
    results = {
        "web": {"scheduled": 3000, "pages": {"overview_hours": page}},
        "inspect": {"sizes": {"1000": {"stats": timed, "ls_page_100": timed, "ls_queue_page_100": timed}}},
    }
    shown = {(row["scenario"], row["metric"]): row["shown"] for row in evaluate(results)}
    assert shown[("web", "overview_hours: median server ms, 3,000 scheduled")] == "14.25"
    assert shown[("web", "overview_hours: p99 server ms, 3,000 scheduled")] == "102.00"
    assert shown[("inspect", "ls (a page of 100) median ms at 1,000")] == "26.40"
    assert shown[("inspect", "ls --queue (a page of 100) median ms at 1,000")] == "26.40"
    assert shown[("inspect", "stats median ms at 1,000")] == "26.40"


def test_a_cpu_part_net_of_idle_at_or_below_zero_is_not_measured() -> None:
    # Net of an idle rate measured higher than the move's own, the move read -23.6 µs, and the
    # ratios it entered read "met".
    from kombu_delay.tooling.bench.cpu import _measured

    assert _measured(0.002) == 0.002
    assert math.isnan(_measured(0.0)) and math.isnan(_measured(-0.001))
    rows = {r["metric"]: r for r in evaluate({"cpu": {"delayed_ratio": 0.001 + _measured(-1.0)}})}
    assert rows["delayed (schedule + move) / plain"]["met"] is False


def test_the_json_holds_null_for_a_figure_not_measured() -> None:
    # A bare NaN, which strict JSON readers (Node's JSON.parse) refuse.
    from kombu_delay.tooling.bench import _finite

    assert json.loads(json.dumps(_finite({"a": [math.nan, 1.0, {"b": math.inf}]}), allow_nan=False)) == {
        "a": [None, 1.0, {"b": None}]
    }
