"""Herd control in move.lua: a queue held by delay_max_queue_length is stepped over whole.

A herd waiting for a full list is counted with one ZCOUNT of its destination's sorted set,
not read member by member on every poll; other queues still move, and nothing is lost.
"""

from __future__ import annotations

import redis

from kombu_delay.config import Settings
from kombu_delay.eta import Due
from kombu_delay.store import Store

from .conftest import wait_until
from .delay_helpers import kombu_payload


def test_a_held_herd_is_counted_whole_and_other_queues_still_move(r: redis.Redis, prefix: str) -> None:
    store = Store(r, prefix)
    capped, other = f"{prefix}capped", f"{prefix}other"
    r.rpush(capped, "a", "b")  # already at the cap of 2
    due = store.time_ms() + 5000
    herd = [(Due(due, task_id=f"h{i}"), capped, kombu_payload(f"h{i}")) for i in range(3000)]
    store.schedule_many(herd, Settings())
    # Due just after the herd, in a later bucket (narrower width): for another queue, it
    # must not wait behind the held herd.
    store.schedule_many(
        [(Due(due + 10, task_id="o"), other, kombu_payload("o"))], Settings(bucket_width_ms=7)
    )
    assert store.counts() == {capped: 3000, other: 1}
    wait_until(lambda: store.time_ms() > due + 30)

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
