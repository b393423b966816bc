"""The drain scenario's judgement of a run (no Redis, no worker: the starts recorded given)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kombu_delay.message import parse_iso_ms
from kombu_delay.tooling.bench import drain as drain_mod
from kombu_delay.tooling.bench.report import evaluate

ETA = "2030-01-01T00:00:00.000000+00:00"
DUE = parse_iso_ms(ETA)


def test_a_herd_that_did_not_all_run_once_is_counted_and_its_rates_are_over_what_ran() -> None:
    ids = {f"t{i}" for i in range(5)}
    # t0 and t1 once, t2 twice, t3 and t4 never; the last start 2 s after due.
    records = [
        ["t0", ETA, DUE + 100],
        ["t1", ETA, DUE + 500],
        ["t2", ETA, DUE + 1000],
        ["t2", ETA, DUE + 2000],
    ]
    got = drain_mod.outcome(5, ids, records, DUE, cpu_used_s=0.3)
    assert (got["ran"], got["ran_once"], got["ran_more_than_once"], got["lost"]) == (3, 2, 1, 2)
    assert got["duplicates"] == 1 and got["early"] == 0
    assert got["all_ran_once"] is False
    assert got["finish_after_due_s"] == 2.0
    assert got["worker_drain_per_s"] == 2  # 3 tasks ran, in 2 s: not the herd of 5 over 2 s
    assert got["worker_main_cpu_ms_per_task"] == 100.0  # over the 3 that ran, not the 5
    whole = drain_mod.outcome(2, {"t0", "t1"}, records[:2], DUE, cpu_used_s=0.1)
    assert whole["all_ran_once"] is True and whole["lost"] == 0


def variant(n: int, ran_once: int, finish_s: float, **more: Any) -> dict[str, Any]:
    return {
        "tasks": n,
        "worker": "redis://",
        "look_ahead_s": 0,
        "started": ran_once,
        "ran": ran_once,
        "ran_once": ran_once,
        "ran_more_than_once": 0,
        "all_ran_once": ran_once == n,
        "finish_after_due_s": finish_s,
        "worker_drain_per_s": round(ran_once / finish_s),
        "worker_main_cpu_ms_per_task": 0.3,
        "early": 0,
        "duplicates": 0,
        "lost": n - ran_once,
        "worker_exit": None,
        "mover_done_after_due_s": 0.0,
        "on_list_at_due": 0,
        "rss_base_mb": 50.0,
        "rss_growth_mb": 2.0,
        **more,
    }


def test_a_variant_that_lost_tasks_is_failed_not_faster_than_stock(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its worker killed partway: 335 of 1,500 ran, and its table row read 0.37x stock's finish,
    # 2,379 tasks/s, with no target row, and the run reported no failure.
    made = {
        "stock": variant(1500, 1500, 1.7),
        "delay": variant(1500, 335, 0.6, worker_exit=-9),
        "delay-delayredis": variant(1500, 1500, 1.5),
    }
    monkeypatch.setattr(drain_mod, "_variant", lambda ctx, name, url, ahead: dict(made[name]))
    sizes = SimpleNamespace(
        drain=1500, drain_procs=2, drain_prefetch=4, drain_variants="", drain_look_ahead=""
    )
    ctx = SimpleNamespace(sizes=sizes, url="redis://x/0", delay_url="delayredis://x/0", fresh=lambda: None)
    report = drain_mod.drain(ctx)
    variants = report["variants"]
    assert "finish_vs_stock" not in variants["delay"] and "rss_vs_stock" not in variants["delay"]
    assert variants["delay-delayredis"]["finish_vs_stock"] == 0.88
    assert "delay" in report["failed"] and "delay-delayredis" not in report["failed"]
    shown = drain_mod.table(report)
    assert "FAILED delay: 335 of 1,500 tasks ran once, 0 more than once, 1,165 never" in shown
    assert "its worker exited with -9" in shown
    rows = {row["metric"]: row for row in evaluate({"drain": report})}
    assert rows["delay: tasks that ran once"]["met"] is False
    assert rows["delay: tasks that ran once"]["target"] == "all 1,500"
    assert rows["stock: tasks that ran once"]["met"] is True
    assert rows["delay: early starts"]["met"] is True
