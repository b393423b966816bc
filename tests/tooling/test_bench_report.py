"""The bench's table of targets (no Redis: the rows made from given figures)."""

from __future__ import annotations

from kombu_delay.tooling.bench.report import evaluate


def rows_of(results: dict) -> dict[str, dict]:
    return {row["metric"]: row for row in evaluate(results) if row["scenario"] == "burst"}


def test_a_figure_that_could_not_be_measured_misses_its_target() -> None:
    # It read as neither met nor missed (a blank), as a figure with no target does.
    rows = rows_of({"burst": {"moved_per_s": float("nan"), "drain_s": float("nan")}})
    assert rows["moved/s, one mover"]["met"] is False
    assert rows["due -> all on list, s"]["met"] is None  # no target: nothing to miss
    assert rows_of({"burst": {"moved_per_s": 250_000.0}})["moved/s, one mover"]["met"] is True
