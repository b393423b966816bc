"""move.lua's lateness reply: run-length coded in Lua, one value per moved message in Python."""

from __future__ import annotations

import redis

from kombu_delay.config import Settings
from kombu_delay.eta import Due
from kombu_delay.replies import _runs
from kombu_delay.store import Store

from .conftest import wait_until


def test_runs_expand_in_order() -> None:
    assert _runs([]) == []
    assert _runs([3, 0, 5]) == [3, 0, 5]
    assert _runs([-3, 7]) == [7, 7, 7]
    assert _runs([b"1", b"-2", b"4", b"0"]) == [1, 4, 4, 0]


def test_lateness_has_one_value_per_moved_message(r: redis.Redis, prefix: str) -> None:
    store = Store(r, prefix)
    now = store.time_ms()
    # 30 messages share one due time, 5 more each have their own: runs and singles.
    dues = [now + 300] * 30 + [now + 301 + i for i in range(5)]
    items = [(Due(due, task_id=f"t{i}"), f"{prefix}q", f"payload-{i}") for i, due in enumerate(dues)]
    store.schedule_many(items, Settings())
    wait_until(lambda: store.time_ms() > max(dues) + 5)
    result = store.move_due(1000)
    assert result.moved == 35
    assert len(result.lateness_ms) == 35
    late_at = result.now_ms
    assert result.lateness_ms == [late_at - due for due in dues]
    assert r.llen(f"{prefix}q") == 35
