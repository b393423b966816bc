"""Herd control in move.lua: a queue held by delay_max_queue_length is stepped over whole.

A herd waiting for a full list is counted with one ZCOUNT of its destination's sorted set,
not read member by member on every poll; other queues still move, and nothing is lost.
"""

from __future__ import annotations

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import Store

from .delay_helpers import FakeClock, kombu_payload


def test_a_held_herd_is_counted_whole_and_other_queues_still_move(r: redis.Redis, prefix: str) -> None:
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    capped, other = f"{prefix}capped", f"{prefix}other"
    r.rpush(capped, "a", "b")  # already at the cap of 2
    due = clock() + 5000
    herd = [(Due(due, task_id=f"h{i}"), capped, kombu_payload(f"h{i}")) for i in range(3000)]
    store.schedule_many(herd, Settings())
    # Due just after the herd, in a later bucket (narrower width): for another queue, it
    # must not wait behind the held herd.
    store.schedule_many(
        [(Due(due + 10, task_id="o"), other, kombu_payload("o"))], Settings(bucket_width_ms=7)
    )
    assert store.counts() == {capped: 3000, other: 1}
    clock.ms = due + 31

    result = store.move_due(10, max_queue_length=2)
    # Every due message of the held queue is counted, though the limit is 10: its sorted set
    # was skipped whole (one ZCOUNT), not read.
    assert (result.moved, result.held, result.wrongtype) == (1, 3000, 0)
    assert r.llen(other) == 1
    assert store.counts() == {capped: 3000}

    r.delete(capped)
    moved = 0
    while True:
        step = store.move_due(1000, max_queue_length=500)
        moved += step.moved
        if step.moved == 0:
            break
        r.delete(capped)  # a worker drained it
    assert moved == 3000
    assert store.counts() == {}
    assert all(store.find(f"h{i}") == [] for i in range(0, 3000, 97))


@pytest.mark.parametrize("block", ["held", "wrongtype"])
def test_more_blocked_buckets_than_one_call_visits_do_not_starve_the_buckets_behind_them(
    r: redis.Redis, prefix: str, block: str
) -> None:
    """Buckets whose due messages all wait cost no move budget, so a call could visit nothing
    but them; the next call goes on after the last one it visited."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    busy, free = f"{prefix}busy", f"{prefix}free"
    narrow = Settings(bucket_width_ms=10)
    base = clock() + 1000
    store.schedule_many(
        [(Due(base + 10 * i, task_id=f"b{i}"), busy, kombu_payload(f"b{i}")) for i in range(25)], narrow
    )
    store.schedule(Due(base + 300, task_id="f"), free, kombu_payload("f"), narrow)
    if block == "held":
        r.rpush(busy, "x")  # at the cap of 1
    else:
        r.set(busy, "not a list")
    clock.ms = base + 401

    results = [store.move_due(10, max_queue_length=1) for _ in range(3)]
    # 25 blocked buckets, 10 visits per call: the third call reaches the free queue's.
    assert [x.moved for x in results] == [0, 0, 1]
    assert [x.scan_after is not None for x in results] == [True, True, False]
    assert all(x.more for x in results[:2])
    assert r.lrange(free, 0, -1) == [kombu_payload("f").encode()]
    blocked = [x.held if block == "held" else x.wrongtype for x in results]
    assert blocked == [10, 10, 5]
    # The next call scans from the first bucket again, and nothing left its sorted set.
    again = store.move_due(10, max_queue_length=1)
    assert again.moved == 0 and again.scan_after is not None
    assert store.counts() == {busy: 25}
