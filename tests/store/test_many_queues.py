"""A started bucket of many queues: a move call finds the bucket's next due time in the pass
that moves what is due, reading each queue's set once, and the time it gives is exact.

Time is driven through a fake clock (see ``FakeClock``).
"""

from __future__ import annotations

import random

import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import Store, keys
from tests.support.stored import FakeClock, kombu_payload, tags_in

PLAIN = Settings(compress_after_ms=0)


def _fill(store: Store, clock: FakeClock, queues: int, per_queue: int, seed: int) -> tuple[int, dict]:
    """``per_queue`` messages in each of ``queues`` queues, at random times of one bucket that
    starts two minutes ahead, some of them at one millisecond; returns its start and each
    message's due time by task id."""
    rnd = random.Random(seed)
    start = (clock() // 60_000 + 2) * 60_000
    dues = {}
    for q in range(queues):
        for m in range(per_queue):
            dues[f"q{q}-{m}"] = start + 1000 + (rnd.randrange(50_000) if m % 3 else 20_000)
    items = [(Due(due, task_id=tag), tag.split("-")[0], kombu_payload(tag)) for tag, due in dues.items()]
    store.schedule_many(items, PLAIN)
    return start, dues


def _earliest_left(r: redis.Redis, start: int, queues: int) -> int | None:
    heads = [r.zrange(keys.queue_set("", start, f"q{q}"), 0, 0, withscores=True) for q in range(queues)]
    return min((int(head[0][1]) for head in heads if head), default=None)


def _reads(r: redis.Redis) -> int:
    stats = r.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("zcount", "exists", "hgetall"))


def test_a_mover_following_each_next_due_time_moves_every_message_at_it_and_none_early(r) -> None:
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    queues = 40
    start, dues = _fill(store, clock, queues, 5, seed=3)
    clock.ms = start
    calls, delivered = 0, {}
    result = store.move_due(1000)
    while result.next_due_ms is not None and calls < 1000:
        want = _earliest_left(r, start, queues)
        if not result.more:
            assert result.next_due_ms == want  # exact: neither later (late) nor earlier (a wasted call)
        clock.ms = max(clock.ms, result.next_due_ms)
        result = store.move_due(1000)
        calls += 1
        for q in range(queues):
            for tag in tags_in(r, f"q{q}"):
                delivered.setdefault(tag, clock.ms)
    assert delivered.keys() == dues.keys()
    assert all(delivered[tag] == due for tag, due in dues.items())  # at its due time, none before
    assert sum(r.llen(f"q{q}") for q in range(queues)) == len(dues)


def test_a_move_call_reads_each_queue_of_a_started_bucket_once(r) -> None:
    """Before, a call read every queue twice (the visit, then the next due time): a ZCOUNT and
    an EXISTS each, then a ZCOUNT each again, and the meta hash twice."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    queues = 200
    start, dues = _fill(store, clock, queues, 2, seed=5)
    clock.ms = min(dues.values())
    r.config_resetstat()
    result = store.move_due(1000)
    assert result.moved >= 1 and not result.more
    assert result.next_due_ms == _earliest_left(r, start, queues)
    # One ZCOUNT a queue, the meta hash once, and a search (about 20 ZCOUNTs each) of the few
    # queues found to hold a message earlier than those before them.
    assert _reads(r) < queues + 200
