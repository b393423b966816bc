"""The scale scenario's account of a move that never happened (no Redis: the rounds given)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kombu_delay.tooling.bench import scale as scale_mod
from kombu_delay.tooling.bench.report import evaluate


def round_of(move_cpu_us: float, not_moved: int) -> dict[str, Any]:
    return {
        "publish_server_us": 10.0,
        "publish_pipelined_client_us": 20.0,
        "publish_kombu_us_p50": 300.0,
        "publish_kombu_redis_cpu_us": 12.0,
        "move_server_us_per_msg": move_cpu_us * 0.8,
        "publish_redis_cpu_us": 11.0,
        "move_redis_cpu_us_per_msg": move_cpu_us,
        "moved_all": not not_moved,
        "not_moved": not_moved,
        "publish_bucket_members_mean": 1.0,
    }


def side(rounds: list[dict[str, Any]], mover_exit: int | None) -> dict[str, Any]:
    alive = mover_exit is None
    found = scale_mod.summary(rounds)
    found.update(mover_exit=mover_exit, mover_rss_mb=40.0 if alive else math.nan, used_memory_per_msg=300.0)
    found["inspection_ms"] = dict.fromkeys(("stats", "ls_first_page", "find", "cancel", "health"), 1.0)
    return found


def test_a_move_that_never_happened_is_reported_not_moved_not_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its mover killed: the large size read "move cost large / small 196.21" (the wait's polls),
    # the dead mover's RSS 0.0 MB, and only the JSON said moved_all: false; the run exited 0.
    large_rounds = [round_of(math.nan, 800), round_of(3.0, 0)]
    large = side(large_rounds, mover_exit=-9)
    assert large["not_moved"] == 800 and large["moved_all"] is False
    assert math.isnan(large["move_redis_cpu_us_per_msg"])  # not the median of a move and none
    small = side([round_of(3.0, 0), round_of(3.2, 0)], mover_exit=None)
    assert small["move_redis_cpu_us_per_msg"] == 3.1
    made = iter([small, large])
    monkeypatch.setattr(scale_mod, "_scale_one", lambda ctx, size: next(made))
    sizes = type("Sizes", (), {"scale_small": 10, "scale_large": 20, "scale_middle": 0})
    report = scale_mod.scale(type("Ctx", (), {"sizes": sizes})())  # type: ignore[arg-type]
    assert report["failed"] == (
        "the mover did not move every timed message (large: 800 not moved, its mover exited with -9)"
    )
    rows = {row["metric"]: row for row in evaluate({"scale": report})}
    assert (rows["move cost large / small"]["shown"], rows["move cost large / small"]["met"]) == (
        "not measured",
        False,
    )
    assert rows["timed messages not moved, large"]["met"] is False
    assert rows["timed messages not moved, small"]["met"] is True
    assert rows["mover RSS at large, MB"]["shown"] == "not measured"
