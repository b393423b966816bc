"""The mover: the move script on seeded buckets (table-driven), the id-index clean-up, the
the mover as a real process: boundaries, several movers at once, kill -9, a Redis outage,
signals."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.errors import RedisRefused, RedisUnavailable, WrongTypeKey
from kombu_delay.message import Due
from kombu_delay.mover import pacing
from kombu_delay.mover.loop import Mover
from kombu_delay.mover.pacing import Repeats, failure_kind
from kombu_delay.mover.tally import LOG_EVERY_S, Tally
from kombu_delay.store import Store, keys, replies, scripts
from kombu_delay.store.replies import MoveResult, Scheduled
from kombu_delay.tooling.redis_server import RedisServer, free_port
from tests.support.faults import consistency
from tests.support.procs import joined, wait_until
from tests.support.stored import ORDINARY, FakeClock, calls, expires_at, kombu_payload, stored, tags_in

# -- the move script on seeded buckets ---------------------------------------------------


@dataclass
class Case:
    """Seeds are ``(due offset ms from a bucket boundary, destination)``; the tag of
    seed ``i`` is ``m<i>``, also its task id. Offsets of an hour or more are "not due"."""

    seeds: list[tuple[int, str]]
    #: destination -> seed indexes in the order a worker takes them (BRPOP).
    moved: dict[str, list[int]]
    #: seed indexes still scheduled afterwards.
    left: list[int] = field(default_factory=list)
    limit: int = 1000
    width_ms: int = 500
    max_len: int = 0
    #: run after seeding: (client, prefix, boundary_ms) -> None
    setup: Callable[[redis.Redis, str, int], None] | None = None
    wrongtype: bool = False
    held: bool = False


HOUR = 3_600_000


def wrong_type(client: redis.Redis, prefix: str, boundary: int) -> None:
    client.set(f"{prefix}bad", "a string")


def full_list(client: redis.Redis, prefix: str, boundary: int) -> None:
    client.rpush(f"{prefix}full", kombu_payload("x1"), kombu_payload("x2"))


CASES = {
    "one-bucket-due-order": Case([(30, "q"), (10, "q"), (20, "q")], {"q": [1, 2, 0]}),
    "bucket-boundary": Case(
        [(0, "q"), (-1, "q"), (499, "q"), (500, "q"), (-500, "q"), (1, "q")], {"q": [4, 1, 0, 5, 2, 3]}
    ),
    "several-buckets-two-queues": Case(
        [(-700, "q1"), (260, "q2"), (-30, "q2"), (900, "q1"), (520, "q1"), (-1100, "q2")],
        {"q1": [0, 4, 3], "q2": [5, 2, 1]},
    ),
    "future-stays": Case([(HOUR, "q"), (0, "q"), (HOUR + 1, "q")], {"q": [1]}, left=[0, 2]),
    "same-millisecond-keeps-publish-order": Case([(5, "q")] * 5, {"q": [0, 1, 2, 3, 4]}),
    "limit-below-due-count-loops": Case(
        [(i * 7 % 11, "q") for i in range(9)], {"q": sorted(range(9), key=lambda i: (i * 7 % 11, i))}, limit=2
    ),
    "wrong-type-destination-stays": Case(
        [(0, "bad"), (1, "q"), (2, "bad"), (3, "q")],
        {"q": [1, 3]},
        left=[0, 2],
        setup=wrong_type,
        wrongtype=True,
    ),
    "held-by-max-queue-length": Case(
        [(0, "full"), (1, "q")], {"q": [1]}, left=[0], max_len=2, setup=full_list, held=True
    ),
    # A herd due at one millisecond is read without scores (batches of `limit`).
    "one-millisecond-herd-in-batches": Case([(5, "q")] * 7 + [(6, "q")], {"q": list(range(8))}, limit=3),
    "one-millisecond-herd-steps-over-a-held-queue": Case(
        [(0, "full"), (0, "q"), (0, "q"), (0, "full"), (0, "q")],
        {"q": [1, 2]},  # then q is at max_len too
        left=[0, 3, 4],
        limit=2,
        max_len=2,
        setup=full_list,
        held=True,
    ),
}


def run_case(client: redis.Redis, prefix: str, case: Case) -> tuple[list[MoveResult], int, Store, FakeClock]:
    """Seed ``case``, move until nothing more is due; return the results, the boundary, and the
    store with the clock that drives it."""
    clock = FakeClock(client)
    store = Store(client, prefix, clock=clock)
    settings = Settings(compress_after_ms=0, bucket_width_ms=case.width_ms)
    now = clock()
    lead = 700 + max(0, -min(offset for offset, _ in case.seeds))  # the earliest is >= 0.7 s ahead
    boundary = keys.bucket_start(now + lead, case.width_ms) + case.width_ms
    seeds = [
        (Due(boundary + offset, task_id=f"m{i}"), f"{prefix}{dest}", kombu_payload(f"m{i}"))
        for i, (offset, dest) in enumerate(case.seeds)
    ]
    assert {r.outcome for r in store.schedule_many(seeds, settings)} == {Scheduled.STORED}
    if case.setup is not None:
        case.setup(client, prefix, boundary)
    last_due = max(boundary + offset for offset, _ in case.seeds if offset < HOUR)
    first_due = min(boundary + offset for offset, _ in case.seeds)
    clock.ms = first_due - 1
    early = store.move_due(case.limit, case.max_len)  # nothing is due yet
    assert early.moved == 0 and early.now_ms < first_due
    clock.ms = last_due
    results = []
    while True:
        result = store.move_due(case.limit, case.max_len)
        results.append(result)
        if not result.more:
            return results, boundary, store, clock
        assert len(results) < 100


@pytest.mark.parametrize("name", list(CASES))
def test_move_script_table(r, prefix, name):
    case = CASES[name]
    results, boundary, store, clock = run_case(r, prefix, case)

    for dest, order in case.moved.items():
        assert tags_in(r, f"{prefix}{dest}") == [f"m{i}" for i in order], dest
    moved = sum(len(order) for order in case.moved.values())
    assert sum(res.moved for res in results) == moved
    lateness = [ms for res in results for ms in res.lateness_ms]
    # (Never before due: each case names what is due, moved, and what is not, left. The move
    # reports a lateness of at least 0 whatever it moves, so its sign tells nothing.)
    assert len(lateness) == moved
    left = stored(r, prefix)
    assert sorted(s.message["properties"]["delivery_tag"] for s in left) == sorted(f"m{i}" for i in case.left)
    assert r.exists(keys.dead(prefix)) == 0  # the v2 layout never dead-letters
    assert any(res.wrongtype for res in results) == case.wrongtype
    assert any(res.held for res in results) == case.held
    # Bookkeeping: counts, the id index and the bucket index describe what is left.
    expected_counts = Counter(s.envelope.dest for s in left)
    assert store.counts() == dict(expected_counts)
    moved_ids = {f"m{i}" for order in case.moved.values() for i in order}
    left_ids = {f"m{i}" for i in case.left}
    for task_id in moved_ids:  # a moved message's ref may linger, but find() sees through it
        assert store.find(task_id) == [], task_id
    for i in case.left:
        (found,) = store.find(f"m{i}")
        assert found.dest == f"{prefix}{case.seeds[i][1]}"
        assert found.due_ms == boundary + case.seeds[i][0]
    ids = {k.decode() for k in r.hkeys(keys.ids(prefix))}
    assert left_ids <= ids <= left_ids | moved_ids
    index = {int(m) for m in r.zrange(keys.index(prefix), 0, -1)}
    assert index == {s.start_ms for s in left}
    totals = r.hgetall(keys.totals(prefix))
    assert int(totals.get(b"moved", 0)) == moved
    assert int(totals.get(b"dead", 0)) == 0
    if case.left:
        assert results[-1].next_due_ms == min(s.due_ms for s in left)
    else:
        assert results[-1].next_due_ms is None
    assert consistency(r, prefix)["stored"] == len(case.left)

    # The clean-up: once a drained bucket's end has passed, a move call drops its refs and
    # deletes its task-id list and meta hash. A bucket still holding messages keeps its refs.
    start_of = [keys.bucket_start(boundary + offset, case.width_ms) for offset, _ in case.seeds]
    kept = {start_of[i] for i in case.left}
    drained = {start_of[i] for i in range(len(case.seeds))} - kept
    # Drained buckets wait in gc until their end (those already ended may be cleaned up).
    assert {int(m) for m in r.zrange(keys.drained(prefix), 0, -1)} <= drained
    if drained:
        clock.ms = max(clock(), max(drained) + case.width_ms + 1)
    for _ in range(100):
        result = store.move_due(case.limit, case.max_len)
        assert result.moved == 0
        if not result.more:
            break
    else:
        raise AssertionError("the clean-up did not finish in 100 move calls")
    ids = {k.decode() for k in r.hkeys(keys.ids(prefix))}
    assert ids == {f"m{i}" for i in range(len(case.seeds)) if start_of[i] in kept}
    for start in drained:
        assert r.exists(keys.task_ids(prefix, start), keys.meta(prefix, start)) == 0, start
    assert r.zcard(keys.drained(prefix)) == 0
    assert consistency(r, prefix)["stale_refs"] == len(ids) - len(case.left)


@pytest.mark.parametrize(
    ("apart", "limit"), [(13, 1000), (1, 1000), (1, 2), (0, 2)], ids=["13ms", "1ms", "1ms-limit2", "same-ms"]
)
def test_nothing_is_moved_before_its_millisecond(r, apart, limit):
    """Step the clock a millisecond at a time while sub-second due times pass: each move takes
    exactly the messages due by then, never one a millisecond early, never a rounded second.
    With due times a millisecond apart a batch's tail and a run's end lie right after what is
    due (13 ms apart, a batch read a millisecond too far moved nothing early); a limit of 2
    takes the path of a run at one millisecond larger than the batch."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    now = clock()
    dues = [now + 200 + (i // 3 if apart == 0 else apart * i) for i in range(40)]  # 0: runs of 3
    seeds = [(Due(d, task_id=f"id{i}"), "q", kombu_payload(f"m{i}")) for i, d in enumerate(dues)]
    assert {x.outcome for x in store.schedule_many(seeds, ORDINARY)} == {Scheduled.STORED}
    moved_total = 0
    for at in range(now + 190, dues[-1] + 2):
        clock.ms = at
        while True:  # as many calls as this millisecond needs, each one at most ``limit``
            result = store.move_due(limit)
            moved_total += result.moved
            assert moved_total <= sum(1 for d in dues if d <= at), at  # never early
            if result.moved == 0:
                break
        assert moved_total == sum(1 for d in dues if d <= at), at  # and all that is due
    assert tags_in(r, "q") == [f"m{i}" for i in range(len(dues))]


def with_id(tag: str, task_id: str, queue: str = "celery") -> str:
    """A message whose delivery tag is ``tag`` and whose id (a header, as Celery's) is ``task_id``."""
    message = json.loads(kombu_payload(tag, queue))
    message["headers"] = {"id": task_id}
    return json.dumps(message)


@pytest.mark.parametrize("offsets", [(0, 1, 2), (0, 0, 0)], ids=["apart", "one-millisecond"])
def test_a_task_id_used_more_than_once_finds_only_its_unmoved_message(r, prefix, offsets):
    """A retry reuses its task id: the id index then holds several refs under one id. After
    a move of two of them (in one batch here), find and cancel reach only the one still
    scheduled, though the moved ones' refs stay until their bucket's clean-up. Due at one
    millisecond, the batch is read without scores."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    q = f"{prefix}q"
    width = 1000
    settings = Settings(compress_after_ms=0, bucket_width_ms=width)
    due = clock() + 300
    items = [
        (Due(due + offsets[0], task_id="again"), q, with_id("first", "again")),
        (Due(due + HOUR, task_id="again"), q, with_id("later", "again")),
        (Due(due + offsets[1], task_id="again"), q, with_id("second", "again")),
        (Due(due + offsets[2], task_id="once"), q, with_id("once", "once")),
    ]
    assert {res.outcome for res in store.schedule_many(items, settings)} == {Scheduled.STORED}
    later = next(s for s in stored(r, prefix) if s.due_ms == due + HOUR)
    ref = replies.Stored(later.start_ms, later.score, later.envelope.dest, later.envelope.payload).ref
    clock.ms = due + 3
    assert store.move_due(3).moved == 3
    assert tags_in(r, q) == ["first", "second", "once"]
    assert store.find("once") == []
    assert [s.due_ms for s in store.find("again")] == [due + HOUR]
    assert ref in r.hget(keys.ids(prefix), "again").decode().split()
    assert store.cancel("again") == 1 and store.find("again") == []
    # The cancel dropped its own ref; the moved ones' go once their bucket has ended.
    assert ref not in (r.hget(keys.ids(prefix), "again") or b"").decode().split()
    ends = {keys.bucket_start(due + o, width) + width for o in offsets}
    clock.ms = max(ends) + 1
    assert store.move_due(1000).moved == 0
    assert r.hlen(keys.ids(prefix)) == 0
    assert r.zcard(keys.drained(prefix)) == 1  # the cancelled one's bucket, until its end


def test_clean_up_drops_refs_only_after_a_drained_bucket_has_ended(r, prefix):
    """Moving leaves the id index alone; find() sees through the stale refs at once. The
    refs, the task-id list and the meta hash go with the first move call after the end of
    the drained bucket. A bucket that drains and then gets a new message before its end
    comes back into the index, delivers it, and is cleaned up after it drains again."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    q = f"{prefix}q"
    width = 4000
    settings = Settings(compress_after_ms=0, bucket_width_ms=width)
    start = keys.bucket_start(clock() + 500, width) + width  # a bucket wholly ahead
    end = start + width
    tags = [f"a{i}" for i in range(5)]
    items = [(Due(start + 50 + i, task_id=tag), q, kombu_payload(tag)) for i, tag in enumerate(tags)]
    assert {res.outcome for res in store.schedule_many(items, settings)} == {Scheduled.STORED}
    assert r.lrange(keys.task_ids(prefix, start), 0, -1) == [t.encode() for t in tags]

    clock.ms = start + 61
    first = store.move_due(1000)
    assert first.moved == 5 and tags_in(r, q) == tags
    for tag in tags:
        assert store.find(tag) == []
    # Drained, not ended: out of the index, waiting in gc; refs, t: and m: linger.
    assert r.zscore(keys.index(prefix), start) is None
    assert r.zscore(keys.drained(prefix), start) == end
    assert set(r.hkeys(keys.ids(prefix))) == {t.encode() for t in tags}
    assert r.exists(keys.task_ids(prefix, start), keys.meta(prefix, start)) == 2
    assert consistency(r, prefix)["stale_refs"] == 5

    # A new message for the same bucket, before its end: back in the index, delivered.
    due_b = clock() + 300
    assert keys.bucket_start(due_b, width) == start
    assert (
        store.schedule(Due(due_b, task_id="b"), q, kombu_payload("b"), settings).outcome is Scheduled.STORED
    )
    assert r.zscore(keys.index(prefix), start) == start
    assert [s.due_ms for s in store.find("b")] == [due_b]
    assert all(store.find(tag) == [] for tag in tags)
    assert set(r.hkeys(keys.ids(prefix))) == {t.encode() for t in [*tags, "b"]}
    clock.ms = due_b + 1
    second = store.move_due(1000)
    assert second.moved == 1 and tags_in(r, q) == [*tags, "b"]
    assert second.lateness_ms == [1]
    assert store.find("b") == []
    assert r.zscore(keys.index(prefix), start) is None
    assert r.zscore(keys.drained(prefix), start) == end
    assert r.hlen(keys.ids(prefix)) == 6  # still lingering: the bucket has not ended

    clock.ms = end + 1
    assert store.move_due(1000).moved == 0
    assert r.hlen(keys.ids(prefix)) == 0
    assert r.exists(keys.task_ids(prefix, start), keys.meta(prefix, start)) == 0
    assert r.zcard(keys.drained(prefix)) == 0
    assert consistency(r, prefix) == {"stored": 0, "stale_refs": 0, **store.totals()}


# -- the mover as a real process ---------------------------------------------------------


def test_clean_up_of_thousands_of_retried_ids_keeps_their_live_refs(r):
    """A clean-up chunk of 4,500 task ids that all have a ref in a later bucket (each task
    retried itself) rewrites 4,500 fields: more values than one Lua call can take at once."""
    clock = FakeClock(r)
    store, n = Store(r, clock=clock), 4500
    narrow = Settings(compress_after_ms=0, bucket_width_ms=1000)
    now = clock()
    due = now - now % 1000 + 4000 + 100
    first = [(Due(due, task_id=f"t{i}"), "q", with_id(f"first-{i}", f"t{i}", "q")) for i in range(n)]
    assert all(x.outcome is Scheduled.STORED for x in store.schedule_many(first, narrow))
    clock.ms = due + 1
    moved = 0
    while moved < n:
        moved += store.move_due(5000).moved
    later = clock() + 600_000
    retries = [(Due(later + i, task_id=f"t{i}"), "q", with_id(f"retry-{i}", f"t{i}", "q")) for i in range(n)]
    assert all(x.outcome is Scheduled.STORED for x in store.schedule_many(retries, narrow))
    clock.ms = due - due % 1000 + 1000 + 1  # the first bucket ended
    while r.exists(keys.drained("")):
        store.move_due(5000)
    refs = {k.decode(): v.decode() for k, v in r.hgetall(keys.ids("")).items()}
    first_start = f"{due - due % 1000}:"
    assert len(refs) == n and not any(" " in ref or ref.startswith(first_start) for ref in refs.values())
    assert [s.payload for s in store.find("t7")] == [with_id("retry-7", "t7", "q").encode()]
    rest = consistency(r)
    assert rest["stored"] == n and rest["stale_refs"] == 0 and rest["moved"] == n


def test_a_wider_publisher_extends_the_expiry_of_a_bucket_it_shares(r):
    """Publishers with different bucket widths share a start: the keys of that bucket must
    live until the wider one's end plus grace, or its message would expire before due."""
    store = Store(r)
    narrow = Settings(compress_after_ms=0, bucket_width_ms=1000, grace_ms=3_600_000)
    wide = Settings(compress_after_ms=0, bucket_width_ms=10_000, grace_ms=3_600_000)
    now = store.time_ms()
    start = now - now % 10_000 + 20_000
    store.schedule(Due(start + 200, task_id="a"), "q", kombu_payload("a"), narrow)
    store.schedule(Due(start + 300, task_id="c"), "q2", kombu_payload("c"), narrow)
    store.schedule(Due(start + 6000, task_id="b"), "q", kombu_payload("b"), wide)
    store.schedule(Due(start + 7000, task_id="d"), "q2", kombu_payload("d"), wide)
    store.schedule(Due(start + 400, task_id="e"), "q3", kombu_payload("e"), narrow)  # a new set
    assert r.zcard(keys.queue_set("", start, "q")) == 2 and r.zcard(keys.queue_set("", start, "q2")) == 2
    # Absolute expiries (set from the bucket's end, not from now): however long this takes.
    for dest in ("q", "q2", "q3"):
        at = expires_at(r, keys.queue_set("", start, dest))
        assert at is not None and at >= start + 10_000 + 3_600_000, dest
    for key in (
        keys.meta("", start),
        keys.task_ids("", start),
        keys.index(""),
        keys.ids(""),
        keys.counts(""),
    ):
        at = expires_at(r, key)
        assert at is not None and at >= start + 10_000 + 3_600_000 + 86_400_000, key


def test_an_earlier_message_in_a_narrower_bucket_is_announced_and_reported_as_next(r):
    """A wide bucket starts first but its message is due late; a narrower publisher's bucket
    starts after it and holds an earlier message. The publish wakes the movers, and the move
    reports the earlier due time, so the mover does not sleep past it."""
    store = Store(r)
    hour = Settings(compress_after_ms=0, bucket_width_ms=3_600_000)
    second = Settings(compress_after_ms=0, bucket_width_ms=1000)
    now = store.time_ms()
    # An hour after the next: both in the future, however near the top of an hour this runs.
    wide_start = now - now % 3_600_000 + 2 * 3_600_000
    store.schedule(Due(wide_start + 3_599_999, task_id="w"), "q", kombu_payload("w"), hour)
    assert store.move_due(100).next_due_ms == wide_start + 3_599_999
    pubsub = store.wake_subscription()
    narrow_due = wide_start + 1500
    store.schedule(Due(narrow_due, task_id="n"), "q2", kombu_payload("n"), second)
    woken = None
    deadline = time.monotonic() + 60
    while woken is None and time.monotonic() < deadline:
        woken = pubsub.get_message(timeout=1)
    pubsub.close()
    assert woken is not None and woken["data"] == f"{narrow_due}@0".encode()
    assert r.zrange(keys.index(""), 0, -1) == [str(wide_start).encode(), str(wide_start + 1000).encode()]
    assert store.move_due(100).next_due_ms == narrow_due
    assert store.earliest_due_ms() == narrow_due


def commands(r: redis.Redis, *names: str) -> int:
    """How many of these commands Redis ran since its stats were last reset, scripts' included."""
    return sum(calls(r, name) for name in names)


def test_a_move_reads_no_queues_first_message_for_its_next_due_time(r):
    """Each move call read the first message of every queue of the first bucket for the next
    due time: with 10,000 queues in it, or messages of 50 MB, an idle mover held Redis for 0.1
    to 1.3 s a call. It reads none: a bucket past the caller's longest sleep is told by its
    start, and a queue's earliest due time is found by counting."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    second = Settings(compress_after_ms=0, bucket_width_ms=1000)
    start = (clock() // 1000 + 3600) * 1000  # an hour ahead
    items = [(Due(start + 700 + n, task_id=f"m{n}"), f"q{n}", kombu_payload(f"m{n}")) for n in range(50)]
    store.schedule_many(items, second)

    def move(**kwargs: Any) -> tuple[int | None, int]:
        r.config_resetstat()
        due = store.move_due(100, **kwargs).next_due_ms
        return due, commands(r, "zrange")

    assert move() == (start + 700, 1)  # the index's first member: no queue's message read
    assert move(exact_ms=1000) == (start, 1)  # a bucket that starts past the horizon: its start
    clock.ms = start + 100  # started, its messages 600 ms ahead
    assert move(exact_ms=1000) == (start + 700, 1)
    clock.ms = start + 700
    assert store.move_due(100, exact_ms=1000).moved == 1
    assert store.move_due(100, exact_ms=1000).next_due_ms == start + 701
    clock.ms = start + 800
    assert store.move_due(100).moved == 49


def test_a_due_message_is_read_once_by_the_call_that_moves_it(r):
    """A move call read a due queue's first message for its due time and size, then again in
    its batch: a message of 40 MB cost the call about a third more (one of 55 MB, a review
    found, about a second). The batch begins with the member as read."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    due = clock() + 1000
    big = kombu_payload("big", body="x" * 1_000_000)
    store.schedule_many(
        [
            (Due(due, task_id="big"), "q", big),
            *[(Due(due + n, task_id=f"s{n}"), "q", kombu_payload(f"s{n}")) for n in (1, 2)],
        ],
        Settings(compress_after_ms=0),
    )
    clock.ms = due
    r.config_resetstat()
    assert store.move_due(100).moved == 1
    assert commands(r, "zrange") == 3  # the index's first bucket, the message once, the next one's score
    clock.ms = due + 2
    assert store.move_due(100).moved == 2
    assert r.lrange("q", 0, -1) == [kombu_payload("s2").encode(), kombu_payload("s1").encode(), big.encode()]


def test_a_started_bucket_with_nothing_due_is_read_once_until_a_message_in_it_is_due(r):
    """A move call read each queue of a started bucket twice (the visit, the next due time),
    nothing due: 10,000 queues in a bucket of an hour held Redis for 71 ms a call, 14 % of a
    core for an idle mover. The bucket's earliest due time is noted with its seq counter, which
    every publish steps and keeps true: the calls after read two fields of it, until its time.
    A store that does not keep it (an earlier version's) has the next call read every queue."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    hour = Settings(compress_after_ms=0, bucket_width_ms=3_600_000)
    start = (clock() // 3_600_000 + 1) * 3_600_000
    dues = [start + 600_000 + (n * 7919) % 50_000 for n in range(60)]
    store.schedule_many(
        [(Due(due, task_id=f"m{n}"), f"q{n}", kombu_payload(f"m{n}")) for n, due in enumerate(dues)], hour
    )
    clock.ms = start + 1000  # started, nothing due for ten minutes

    def move() -> tuple[int | None, int]:
        r.config_resetstat()
        due = store.move_due(100, exact_ms=1000).next_due_ms
        return due, commands(r, "zcount", "exists", "hgetall") + commands(r, "zrange") - 1  # (the index's)

    due, first = move()
    assert due == min(dues) and first >= 60  # a look at each queue
    for _ in range(3):
        assert move() == (min(dues), 0)  # none
    r.config_resetstat()
    assert store.overdue(clock.ms) == ({}, False)
    assert commands(r, "zcount", "hgetall") == 0  # the count of what is overdue reads none either
    r.config_resetstat()
    census = store.census(clock.ms, 60_000, 60)
    assert (census.overdue, sum(census.slots)) == (0, 60)
    assert commands(r, "zcount") == 2  # nor the census: each space's index, no queue's set
    store.schedule(Due(start + 900_000, task_id="later"), "q7", kombu_payload("later"), hour)
    assert move() == (min(dues), 0)
    store.schedule(Due(start + 300_000, task_id="early"), "q7", kombu_payload("early"), hour)
    assert move() == (start + 300_000, 0)
    meta, q8 = keys.meta("", start), keys.queue_set("", start, "q8")
    r.hincrby(meta, "seq", 1)  # a store of 1.0.0, which keeps no note, earlier than all
    r.hincrby(meta, "q:q8", 1)
    r.zadd(q8, {kombu_payload("old"): start + 200_000})
    due, again = move()
    assert due == start + 200_000 and again >= 60
    r.zpopmin(q8)
    r.hincrby(meta, "q:q8", -1)
    assert store.cancel("early") == 1
    assert move() == (start + 200_000, 0)  # taken out: still a bound, never later than the earliest
    clock.ms = start + 200_000
    due, looked = move()
    assert due == min(dues) and looked >= 60  # looked again at the bound: the next one, exact
    clock.ms = min(dues) - 1
    assert store.move_due(100, exact_ms=1000).moved == 0
    clock.ms = min(dues)
    assert store.move_due(100, exact_ms=1000).moved == 1


def test_a_bucket_whose_due_messages_wait_is_read_once_a_call_and_looked_at_a_share_of_the_time(r):
    """A full list among 10,000 queues of a started bucket: a mover looked every 50 ms, each
    call reading every queue twice (the visit, then the next due time), and kept Redis 60 to
    75 % busy. The visit's own look gives the next due time, and the looks take a tenth of the
    mover's time at most."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    hour = Settings(compress_after_ms=0, bucket_width_ms=3_600_000)
    start = (clock() // 3_600_000 + 1) * 3_600_000
    items = [(Due(start + 600_000, task_id=f"m{n}"), f"q{n}", kombu_payload(f"m{n}")) for n in range(60)]
    store.schedule_many([*items, (Due(start + 1000, task_id="h"), "full", kombu_payload("h"))], hour)
    r.rpush("full", "x")
    clock.ms = start + 2000

    def move() -> tuple[MoveResult, int]:
        r.config_resetstat()
        result = store.move_due(100, max_queue_length=1, exact_ms=1000)
        return result, commands(r, "zcount", "exists", "hgetall")

    result, reads = move()
    assert (result.held, result.next_due_ms) == (1, start + 1000)
    # Each queue's set once, with one ZCOUNT: the first queue not due is searched for its due
    # time, and the others hold nothing before it.
    assert 61 <= reads < 61 + 40
    result, again = move()
    assert (result.held, result.next_due_ms, again) == (1, start + 1000, reads)
    assert pacing.sleep_after(result, hour, 0.001) == pacing.HELD_POLL_S
    assert pacing.sleep_after(result, hour, 0.07) == pytest.approx(0.7)
    assert pacing.sleep_after(result, hour, 0.3) == 1.0  # (its longest sleep)
    r.delete("full")
    assert store.move_due(100, max_queue_length=1, exact_ms=1000).moved == 1


@pytest.mark.parametrize("damage", ["junk", "deleted", "deleted, then 1.0.0"])
def test_a_bucket_s_noted_earliest_goes_when_its_seq_counter_starts_again(r, damage):
    """The noted earliest holds while the bucket's seq counter reads what it read then: a counter
    deleted, or of text HINCRBY refuses (by hand), starts again at 1, and its first publish
    made it read as noted, with an earlier message stored: the move passed the bucket over and
    the overdue count said nothing, the message late by up to the bucket's width. A publish of
    1.0.0, which keeps no note, is told by the wake mark it leaves, due before the noted time."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    hour = Settings(compress_after_ms=0, bucket_width_ms=3_600_000)
    start = (clock() // 3_600_000 + 1) * 3_600_000
    store.schedule(Due(start + 600_000, task_id="a"), "qa", kombu_payload("a"), hour)
    clock.ms = start + 1000
    assert store.move_due(100).next_due_ms == start + 600_000
    meta = keys.meta("", start)
    assert r.hmget(meta, "seq", "ls") == [b"1", b"1"]
    if damage == "junk":
        r.hset(meta, "seq", "x")
    else:
        r.hdel(meta, "seq")
    if damage == "deleted, then 1.0.0":  # its put: the counter, the set, the counts, the wake mark
        r.hincrby(meta, "seq", 1)
        r.zadd(keys.queue_set("", start, "qb"), {kombu_payload("b"): start + 2000})
        r.hincrby(meta, "q:qb", 1)
        r.hincrby(keys.counts(""), "qb", 1)
        r.hset(meta, "w", start + 2000)
        assert r.hmget(meta, "seq", "ls") == [b"1", b"1"]
    else:
        store.schedule(Due(start + 2000, task_id="b"), "qb", kombu_payload("b"), hour)
    clock.ms = start + 5000
    assert store.overdue(clock.ms)[0] == {"qb": (1, start + 2000)}
    assert store.move_due(100).moved == 1
    assert r.llen("qb") == 1


def test_a_bucket_s_noted_earliest_that_its_end_or_wake_mark_contradicts_is_none(r):
    """A note written by hand: one at or past the bucket's end, or after the wake mark of a
    message still ahead, is read as none, and the bucket's queues are read."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    hour = Settings(compress_after_ms=0, bucket_width_ms=3_600_000)
    start = (clock() // 3_600_000 + 1) * 3_600_000
    store.schedule(Due(start + 600_000, task_id="a"), "qa", kombu_payload("a"), hour)
    store.schedule(Due(start + 2000, task_id="b"), "qb", kombu_payload("b"), hour)
    clock.ms = start + 1000
    assert store.move_due(100).next_due_ms == start + 2000
    meta = keys.meta("", start)
    r.hset(meta, "le", start + 3_600_000)  # at its end
    assert store.move_due(100).next_due_ms == start + 2000
    r.hset(meta, mapping={"le": start + 500_000, "w": start + 2000})  # after the mark
    assert store.move_due(100).next_due_ms == start + 2000
    clock.ms = start + 2000
    assert store.move_due(100).moved == 1


def test_a_bucket_s_noted_earliest_due_time_is_never_later_than_its_earliest_message(r):
    """Random publishes, cancels and moves in started buckets of one hour and one minute, the
    next due time against the earliest message stored: never later (a message would be late),
    nor past (the mover would spin); the overdue count exact; every message moved at its due
    time, none before."""
    import random

    rng = random.Random(7)
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    widths = [Settings(compress_after_ms=0, bucket_width_ms=w) for w in (3_600_000, 60_000)]
    begin = (clock() // 3_600_000 + 1) * 3_600_000
    clock.ms = begin + 1
    live: dict[str, tuple[int, str]] = {}
    delivered = 0
    for step in range(400):
        op = rng.random()
        if op < 0.5:
            due = clock.ms + rng.randint(1, 900_000)
            tag = f"m{step}"
            dest = f"q{rng.randint(0, 30)}"
            store.schedule(Due(due, task_id=tag), dest, kombu_payload(tag), rng.choice(widths))
            live[tag] = (due, dest)
        elif op < 0.65 and live:
            tag = rng.choice(sorted(live))
            assert store.cancel(tag) == 1
            del live[tag]
        else:
            clock.ms += rng.randint(0, 120_000)
        due_now = {tag: (due, dest) for tag, (due, dest) in live.items() if due <= clock.ms}
        overdue = {
            dest: (
                sum(1 for d, q in due_now.values() if q == dest),
                min(d for d, q in due_now.values() if q == dest),
            )
            for dest in {dest for _, dest in due_now.values()}
        }
        assert store.overdue(clock.ms)[0] == overdue, step
        exact_ms = rng.choice([None, 1000])
        result = store.move_due(1000, exact_ms=exact_ms)
        for tag in due_now:
            del live[tag]
        delivered += len(due_now)
        assert sum(int(r.llen(f"q{q}")) for q in range(31)) == delivered, step  # none early, none late
        earliest = min((due for due, _ in live.values()), default=None)
        assert (result.next_due_ms is None) if not live else (result.next_due_ms <= earliest), (
            step,
            result.next_due_ms,
            earliest,
        )
        # Nothing is due after the call: a next due time not ahead would have the mover spin.
        assert result.next_due_ms is None or result.next_due_ms > clock.ms, step
    sets = list(r.scan_iter(match="*z:*"))
    left = [score for name in sets for _, score in r.zrange(name, 0, -1, withscores=True)]
    assert len(left) == len(live) and all(int(score) > clock.ms for score in left)
    moved = [json.loads(m)["properties"]["delivery_tag"] for q in range(31) for m in r.lrange(f"q{q}", 0, -1)]
    assert not set(moved) & set(live)


def seed(
    store: Store,
    n: int,
    dests: list[str],
    *,
    delay_ms: int | None = None,
    due_ms: int | list[int] | None = None,
    width_ms: int = 60_000,
    name: str = "t",
) -> list[str]:
    """Schedule ``n`` small messages through the real script, ``delay_ms`` from Redis's
    now at each call (always stored), or at absolute ``due_ms`` (one or one each)."""
    if delay_ms is not None:
        dues = [Due(delay_ms, relative=True)] * n
    else:
        assert due_ms is not None
        dues = [Due(ms) for ms in (due_ms if isinstance(due_ms, list) else [due_ms] * n)]
    tags = [f"{name}{i}" for i in range(n)]
    items = [
        (Due(dues[i].ms, dues[i].relative, tags[i]), dests[i % len(dests)], kombu_payload(tags[i]))
        for i in range(n)
    ]
    results = Store.schedule_many(store, items, Settings(compress_after_ms=0, bucket_width_ms=width_ms))
    outcomes = Counter(r.outcome for r in results)
    assert outcomes == {Scheduled.STORED: n}, f"seeding was too slow for the chosen due time: {outcomes}"
    return tags


def due_after_seeding(store: Store, n: int) -> int:
    """An absolute due time (Redis ms) that seeding ``n`` messages will not reach:
    5 s plus three times the seeding time measured on a 1000-message sample."""
    scratch = Store(store.client, "calibrate:")
    began = time.monotonic()
    seed(scratch, 1000, ["calibrate:q"], delay_ms=600_000)
    took = time.monotonic() - began
    store.client.delete(*store.client.keys("calibrate:*"))
    return store.time_ms() + 5000 + int(3 * took * n)


def all_tags(client: redis.Redis, dests: list[str]) -> list[str]:
    return [tag for dest in dests for tag in tags_in(client, dest)]


def moved_total(client: redis.Redis, prefix: str = "") -> int:
    return int(client.hget(keys.totals(prefix), "moved") or 0)


def test_mover_process_moves_across_buckets_and_boundaries(r, prefix, start_mover):
    store = Store(r, prefix)
    now = store.time_ms()
    # The earliest is due 4.5 s ahead or more: seeding stores every message, however slow.
    boundary = keys.bucket_start(now + 6000, 1000) + 1000
    offsets = [-1, 0, 1, 999, 1000, -1000, -1001, *range(-1500, 2500, 97)]
    dests = [f"{prefix}a", f"{prefix}b"]
    dues = [boundary + o for o in offsets]
    tags = seed(store, len(dues), dests, due_ms=dues, width_ms=1000)
    assert len({s.start_ms for s in stored(r, prefix)}) >= 4
    mover = start_mover(prefix=prefix)
    wait_until(lambda: moved_total(r, prefix) == len(tags))
    assert stored(r, prefix) == [] and r.zcard(keys.index(prefix)) == 0
    assert sorted(all_tags(r, dests)) == sorted(tags)
    for dest in dests:  # due order within each list
        order = tags_in(r, dest)
        assert order == sorted(order, key=lambda t: (dues[int(t[1:])], int(t[1:])))
    # The refs go once each drained bucket has ended (the mover looks at least every second).
    wait_until(lambda: r.hlen(keys.ids(prefix)) == 0 and r.zcard(keys.drained(prefix)) == 0)
    assert not r.keys(f"{keys.ns(prefix)}t:*") and not r.keys(f"{keys.ns(prefix)}m:*")
    assert mover.stop() == 0, mover.output()
    assert "Traceback" not in mover.output()


def test_wakeup_publish_interrupts_a_long_sleep(r, monkeypatch):
    """A mover whose sleep cap, thaw look and sweep are all an hour away, on an empty store,
    sees a new message in time only because the publish wakes it: without the wake, the wait
    below runs out."""
    monkeypatch.setattr("kombu_delay.mover.loop.SWEEP_EVERY_S", 3600.0)
    store = Store(r)
    looked = threading.Event()
    settings = Settings(max_sleep_ms=3_600_000, thaw_ahead_ms=3 * 3_600_000)
    mover = Mover(store, settings, watch=False, on_thaw=lambda _: looked.set())
    runner = threading.Thread(target=mover.run, daemon=True)
    runner.start()
    try:
        assert looked.wait(60)  # subscribed, looked once: nothing; now it sleeps an hour
        seed(store, 1, ["q"], delay_ms=300)
        wait_until(lambda: r.llen("q") == 1)
    finally:
        mover.stop()
        joined(runner, 30)
    assert mover.stats.moved == 1


@pytest.mark.slow
def test_four_movers_20000_due_at_once_deliver_each_exactly_once(r, start_mover):
    n = 20_000
    dests = ["q.a", "q.b"]
    store = Store(r)
    tags = seed(store, n, dests, due_ms=due_after_seeding(store, n))
    movers = [start_mover("--batch-size", "200") for _ in range(4)]
    wait_until(lambda: r.zcard(keys.movers("")) == 4, timeout=60)
    wait_until(lambda: moved_total(r) == n, timeout=180)
    # Every message moved, each by one atomic script, and nothing is left to move: what is on
    # the lists now is all there will ever be.
    assert stored(r) == [] and Store(r).counts() == {}
    assert r.llen("q.a") + r.llen("q.b") == n
    delivered = Counter(all_tags(r, dests))
    assert set(delivered) == set(tags) and set(delivered.values()) == {1}
    per_mover = []
    for mover in movers:
        assert mover.stop() == 0, mover.output()
        line = [ln for ln in mover.output().splitlines() if "stopped after moving" in ln][-1]
        per_mover.append(int(line.split("stopped after moving ")[1].split()[0]))
    assert sum(per_mover) == n, per_mover
    print(f"\nfour movers, {n} messages due at once: moved per mover {per_mover}")


@pytest.mark.slow
def test_kill_9_mid_drain_then_restart_loses_and_doubles_nothing(r, start_mover):
    n = 20_000
    dests = ["k1", "k2", "k3"]
    store = Store(r)
    tags = seed(store, n, dests, delay_ms=2000)
    # 200 messages a second at most: the kill below, once 1,000 are moved, lands with 95 s of the
    # drain left at least, however busy the machine (a slower mover only leaves more).
    slow = start_mover("--max-rate", "200", "--batch-size", "100")
    wait_until(lambda: moved_total(r) >= 1000, timeout=120)
    os.kill(slow.pid, signal.SIGKILL)
    slow.popen.wait(30)
    at_kill = moved_total(r)
    assert 0 < at_kill < n, f"the kill did not land mid-drain ({at_kill} of {n} moved)"
    # Consistent at the kill: every message is either on a list or still scheduled.
    listed = all_tags(r, dests)
    left = [s.envelope.task_id for s in stored(r)]
    assert len(listed) == at_kill and sorted(listed + left) == sorted(tags)

    again = start_mover()
    wait_until(lambda: moved_total(r) == n, timeout=180)
    assert stored(r) == []  # nothing left to move: the lists hold all there will ever be
    delivered = Counter(all_tags(r, dests))
    assert set(delivered) == set(tags) and set(delivered.values()) == {1}
    assert again.stop() == 0, again.output()
    print(f"\nkill -9 after {at_kill} of {n} moved; restart delivered the rest once")


@pytest.fixture
def persistent_server() -> Any:
    server = RedisServer(persistence=True, appendfsync="always")
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


def test_redis_outage_mover_resumes_by_itself(persistent_server, spawn):
    server = persistent_server
    client = server.client()
    try:
        store = Store(client)
        mover = spawn(
            [
                sys.executable,
                "-m",
                "kombu_delay",
                "--broker",
                server.delay_url,
                "--log-level",
                "debug",
                "mover",
            ],
            name="mover",
        )
        wait_until(lambda: client.zcard(keys.movers("")) == 1)
        early = seed(store, 50, ["o"], delay_ms=500, name="early")  # moved before the outage
        late = seed(store, 200, ["o"], delay_ms=5000, name="late")  # due during it
        late_due = max(s.due_ms for s in stored(client))
        wait_until(lambda: client.llen("o") == 50)
        client.close()
        server.stop()
        wait_until(lambda: "Redis unavailable" in mover.output())
        # The outage outlasts the due times (this machine's clock is Redis's; Redis is down).
        wait_until(lambda: time.time() * 1000 > late_due + 500)
        assert mover.popen.poll() is None, mover.output()
        server.start()
        client = server.client()
        store = Store(client)
        wait_until(lambda: client.llen("o") == 250, timeout=120)
        assert "Redis unavailable (Redis is unavailable" not in mover.output()  # said once a line
        told = [line for line in mover.output().splitlines() if ".)" in line or ".;" in line]
        assert not told, told  # redis-py's full stop, inside ours
        # And its end told, once a whole round of the loop has succeeded (after the move).
        wait_until(lambda: "Redis calls succeed again, after" in mover.output(), timeout=60)
        fresh = seed(store, 1, ["o2"], delay_ms=300, name="fresh")  # and it keeps serving new work
        wait_until(lambda: client.llen("o2") == 1, timeout=60)
        delivered = Counter(tags_in(client, "o"))
        assert set(delivered.values()) == {1} and len(delivered) == 250
        assert tags_in(client, "o2") == fresh and len(early) + len(late) == 250
        assert mover.stop() == 0, mover.output()
        assert "unexpected error" not in mover.output()
    finally:
        client.close()


def test_a_stuck_destination_is_named_escaped_in_the_log(r, caplog):
    # A queue named with a newline wrote a line of its own choosing into the mover's log.
    forged = "q\n2026-12-05 01:40:00,000 INFO kombu_delay: FORGED all good\x1b[2K"
    result = MoveResult(
        0, None, 0, 0, 0, 0, 1, False, refused=1, refused_dests=[forged], wrongtype_dests=[forged]
    )
    with caplog.at_level(logging.WARNING, logger="kombu_delay.mover.loop"):
        Mover(Store(r), Settings(), name="m", watch=False).tally.tell_stuck(result)
    assert len(caplog.records) == 2
    for record in caplog.records:
        text = record.getMessage()
        assert "\n" not in text and "\x1b" not in text and repr(forged) in text


def test_wrong_type_destination_is_reported_and_kept_until_fixed(r, start_mover):
    store = Store(r)
    r.set("blocked", "not a list")
    tags = seed(store, 4, ["blocked", "fine"], delay_ms=300)
    mover = start_mover()
    wait_until(lambda: r.llen("fine") == 2)
    wait_until(lambda: "destination key is not a list: 'blocked' (rename" in mover.output())
    assert sorted(s.envelope.task_id for s in stored(r)) == [tags[0], tags[2]]
    assert Store(r).counts() == {"blocked": 2}
    assert "any more" not in mover.output()
    r.delete("blocked")  # fixed by the operator: the mover delivers on its next look
    wait_until(lambda: r.llen("blocked") == 2)
    assert stored(r) == []
    wait_until(lambda: "no due message stays scheduled for 'blocked' any more" in mover.output())
    assert mover.stop() == 0, mover.output()
    assert "WARNING" in mover.output()


def test_held_messages_in_more_buckets_than_a_call_visits_are_not_told_ended_while_held(r, caplog):
    # Held buckets used up a call's visits, and the next call went on after them: it saw none
    # held, and the end was told, then the warning again, some 20 times a second.
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    r.set("blocked", "not a list")
    seed(store, 4, ["blocked"], due_ms=[clock() + 1000 * i for i in range(1, 5)], width_ms=1000)
    clock.advance(6000)  # four buckets of held messages; a call visits two
    mover = Mover(store, Settings(batch_size=2), watch=False)
    runner = threading.Thread(target=mover.run, daemon=True)
    with caplog.at_level(logging.INFO, logger="kombu_delay.mover.loop"):
        runner.start()
        try:
            wait_until(lambda: mover.stats.calls >= 40)
            assert "any more" not in caplog.text
            r.delete("blocked")
            wait_until(lambda: r.llen("blocked") == 4)
            wait_until(lambda: "any more" in caplog.text)
        finally:
            mover.stop()
            joined(runner, 30)
    told = [rec.getMessage() for rec in caplog.records if "stay" in rec.getMessage()]
    assert len(told) == 2 and "any more" in told[1], told


def test_the_end_of_held_messages_is_told_once_after_a_call_that_looked_at_every_due_bucket(caplog):
    # Held messages were told every 10 s while they lasted, and their end not at all: a log
    # read after the fix could not tell whether they had moved.
    tally = Tally("m", 100)
    held = MoveResult(0, None, 0, 0, 0, 0, 2, False, wrongtype_dests=["blocked"])
    cut_short = MoveResult(5, None, 0, 0, 0, 0, 0, True)  # (the rest of what is due unread)
    visits_spent = MoveResult(0, None, 0, 0, 0, 0, 2, True, scan_after=1000, wrongtype_dests=["blocked"])
    went_on = MoveResult(0, None, 0, 0, 0, 0, 0, False)  # after the held buckets: saw none of them
    clear = MoveResult(2, None, 0, 0, 0, 0, 0, False)
    with caplog.at_level(logging.INFO, logger="kombu_delay.mover.loop"):
        for result in (held, visits_spent, went_on, held, cut_short, clear, clear, held):
            tally.move(result)
    told = [r.getMessage() for r in caplog.records if "stay" in r.getMessage()]
    assert len(told) == 3, told  # held; its end after the call that read everything; held again at once
    assert "not a list: 'blocked'" in told[0] and "not a list: 'blocked'" in told[2]
    assert told[1] == "mover m: no due message stays scheduled for 'blocked' any more: moved, or removed"


def test_a_bucket_key_of_another_type_is_named_in_an_error_not_told_as_expired(caplog):
    # Its messages were logged only as "lost: their bucket expired or was deleted", a WARNING
    # that named no key, though neither had happened.
    tally = Tally("m", 100)
    aside = MoveResult(
        0,
        None,
        0,
        0,
        0,
        0,
        0,
        True,
        recounted=2,
        damaged=[("kombu_delay:m:60000", "kombu_delay:aside:60000:1")],
    )
    lost = MoveResult(0, None, 0, 0, 0, 1, 0, False, damaged=[("kombu_delay:z:60000:q", "")])
    with caplog.at_level(logging.ERROR, logger="kombu_delay.mover.loop"):
        tally.move(aside)
        tally.move(lost)
    told = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and "(written by hand)" in r.getMessage()
    ]
    assert len(told) == 2, told
    assert (
        "'kombu_delay:m:60000' held another type" in told[0]
        and "renamed to 'kombu_delay:aside:60000:1'" in told[0]
    )
    assert (
        "sorted set 'kombu_delay:z:60000:q' holds another type" in told[1]
        and "gone with it, counted as expired" in told[1]
    )


def test_the_periodic_line_says_what_waits_now_not_a_lag(caplog, monkeypatch):
    # "moved 30 messages in the last 10 s; lag 0 ms" read as how late they had moved (42 s).
    now = [1000.0]
    monkeypatch.setattr("kombu_delay.mover.tally.time.monotonic", lambda: now[0])
    tally = Tally("m", 100)
    with caplog.at_level(logging.INFO, logger="kombu_delay.mover.loop"):
        now[0] += LOG_EVERY_S
        tally.move(MoveResult(30, None, 50_000, 0, 0, 0, 0, False, lateness_ms=[42_000] * 30))
        now[0] += LOG_EVERY_S
        tally.move(MoveResult(1, 48_000, 50_000, 0, 0, 0, 0, False))
    told = [r.getMessage() for r in caplog.records if "in the last" in r.getMessage()]
    assert told == [
        "mover m: moved 30 messages in the last 10 s; none due waits",
        "mover m: moved 1 messages in the last 10 s; the oldest due message waits 2,000 ms",
    ]


def test_a_wrong_type_destination_does_not_make_later_messages_of_other_queues_late(r, monkeypatch):
    """Stuck messages are already due, so they are the earliest scheduled: a later publish to
    another queue wakes no mover. The mover keeps polling while any are stuck, as it does
    while messages are held, instead of sleeping its whole max_sleep: an hour here, with its
    thaw look and sweep as far away, so without the polling the wait below runs out. Time is
    driven: the later message is due when the test says."""
    monkeypatch.setattr("kombu_delay.mover.loop.SWEEP_EVERY_S", 3600.0)
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    narrow = Settings(compress_after_ms=0, bucket_width_ms=1000)
    r.set("blocked", "not a list")
    seed(store, 2, ["blocked"], delay_ms=300, width_ms=1000)
    clock.advance(1000)  # the stuck ones are due
    mover = Mover(store, Settings(max_sleep_ms=3_600_000, thaw_ahead_ms=3 * 3_600_000), watch=False)
    runner = threading.Thread(target=mover.run, daemon=True)
    runner.start()
    try:
        wait_until(lambda: mover.stats.wrongtype >= 2)
        due = clock() + 1500  # a later bucket than the stuck one's
        store.schedule(Due(due, task_id="later"), "fine", kombu_payload("later"), narrow)
        calls = mover.stats.calls
        wait_until(lambda: mover.stats.calls >= calls + 2)  # it looked again: not due yet
        assert r.llen("fine") == 0
        clock.ms = due
        wait_until(lambda: r.llen("fine") == 1)
    finally:
        mover.stop()
        joined(runner, 30)
    assert store.counts() == {"blocked": 2}


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_exits_0_heartbeat_written_then_removed(r, start_mover, stop):
    # SIGHUP (a closed terminal, a supervisor's stop) ended the mover without its clean-up: its
    # heartbeat stayed, and probes took it for a running mover for 30 s.
    store = Store(r)
    mover = start_mover()
    beats = wait_until(lambda: store.heartbeats())
    assert isinstance(beats, dict) and len(beats) == 1
    (name, at_ms), now = next(iter(beats.items())), store.time_ms()
    assert now - 60_000 <= at_ms <= now
    assert f":{mover.pid}:" in name
    os.kill(mover.pid, stop)
    assert mover.popen.wait(60) == 0, mover.output()
    assert store.heartbeats() == {}
    assert "stopped after moving 0 messages" in mover.output()


def test_a_mover_under_nohup_keeps_running_after_sighup(r, redis_server, spawn):
    # SIGHUP stops a mover, but not one whose SIGHUP was ignored when it started (nohup).
    if shutil.which("nohup") is None:
        pytest.skip("no nohup on this machine")
    args = [sys.executable, "-m", "kombu_delay", "--broker", redis_server.delay_url, "mover"]
    mover = spawn(["nohup", *args], name="mover")
    store = Store(r)
    wait_until(lambda: store.heartbeats())
    os.kill(mover.pid, signal.SIGHUP)
    seed(store, 1, ["after-hup"], delay_ms=300, name="after-hup")  # moved: it still runs
    wait_until(lambda: r.llen("after-hup") == 1, timeout=60)
    assert mover.popen.poll() is None, mover.output()
    os.kill(mover.pid, signal.SIGTERM)
    assert mover.popen.wait(60) == 0, mover.output()


def test_sigint_exits_0(r, start_mover):
    # Also where SIGINT was ignored when the mover started: CI runs this suite as a background
    # job, which ignores it.
    mover = start_mover()
    wait_until(lambda: Store(r).heartbeats())
    os.kill(mover.pid, signal.SIGINT)
    assert mover.popen.wait(60) == 0, mover.output()


@pytest.mark.parametrize("args", [["mover", "--help"], ["--help"]])
def test_help_shows_examples(args):
    done = subprocess.run(
        [sys.executable, "-m", "kombu_delay", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Examples:" in done.stdout
    assert "kombu-delay" in done.stdout and "mover" in done.stdout


def test_mover_reads_its_options_from_the_environment(r, start_mover):
    """KOMBU_DELAY_* variables reach the mover (here the batch size, seen in its moves)."""
    store = Store(r)
    seed(store, 300, ["env"], delay_ms=300)
    mover = start_mover(env={"KOMBU_DELAY_BATCH_SIZE": "7"})
    wait_until(lambda: r.llen("env") == 300)
    sizes = [int(ln.split("MoveResult(moved=")[1].split(",")[0]) for ln in mover.output().splitlines()
             if "MoveResult(moved=" in ln]  # fmt: skip
    assert max(sizes) == 7
    assert mover.stop() == 0, mover.output()


def test_blocked_destination_does_not_block_other_destinations(r):
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    r.set("bad", "a string")
    items = [(Due(300, True, f"b{i}"), "bad", kombu_payload(f"b{i}")) for i in range(3)]
    store.schedule_many([*items, (Due(310, True, "g"), "good", kombu_payload("g"))], ORDINARY)
    clock.advance(1000)  # all due
    result = store.move_due(2)
    assert r.llen("good") == 1, "the message for another queue passes the blocked ones"
    assert (result.moved, result.wrongtype) == (1, 3)
    assert r.type("bad") == b"string" and store.counts() == {"bad": 3}


def test_queue_length_cap_counts_the_pushes_of_the_same_call(r):
    """One move call never takes a list past delay_max_queue_length; the rest wait, kept."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    r.rpush("capped", "filler")
    items = [(Due(200, True, f"c{i}"), "capped", kombu_payload(f"c{i}")) for i in range(5)]
    store.schedule_many(items, ORDINARY)
    clock.advance(1000)  # all due
    result = store.move_due(1000, max_queue_length=3)
    assert (result.moved, result.held) == (2, 3)
    assert r.llen("capped") == 3 and store.counts() == {"capped": 3}
    r.delete("capped")
    assert store.move_due(1000, max_queue_length=3).moved == 3


def test_mover_with_another_prefix_warns_about_stranded_messages(r, start_mover):
    """A mover whose global_keyprefix differs from the publisher's says so at start."""
    seed(Store(r, "app1:"), 1, ["app1:q"], delay_ms=60_000)
    mover = start_mover()  # no prefix
    wait_until(lambda: "stranded under key prefix 'app1:'" in mover.output())
    assert "WARNING" in mover.output() and "global_keyprefix" in mover.output()
    assert mover.stop() == 0, mover.output()
    right = start_mover(prefix="app1:")
    wait_until(lambda: Store(r, "app1:").heartbeats())
    assert right.stop() == 0
    assert "stranded" not in right.output()


def test_a_refusal_that_lasts_is_logged_once_a_minute_not_at_every_retry(server: RedisServer, caplog) -> None:
    # Under min-replicas-to-write with no replica in time, the mover logged a WARNING at each
    # retry of its backoff: 28 in 82 s, about 1,200 an hour. Another refusal is told at once.
    r = server.client()
    store = Store(r)
    mover = Mover(store, Settings(max_sleep_ms=200), watch=False)

    def said(level: int, code: str = "NOREPLICAS") -> list[str]:
        return [x.getMessage() for x in caplog.records if x.levelno == level and code in x.getMessage()]

    r.config_set("min-replicas-to-write", 1)
    runner = threading.Thread(target=mover.run, daemon=True)
    with caplog.at_level(logging.DEBUG, logger="kombu_delay.mover.loop"):
        runner.start()
        try:
            wait_until(lambda: len(said(logging.DEBUG)) >= 3, timeout=120)  # three retries more
            r.replicaof("127.0.0.1", str(free_port()))  # (a master not there): writes refused otherwise
            r.config_set("min-replicas-to-write", 0)
            wait_until(lambda: said(logging.WARNING, "a mover moves only on a master"), timeout=120)
            r.replicaof("NO", "ONE")
            wait_until(lambda: any("succeed again" in x.getMessage() for x in caplog.records), timeout=120)
        finally:
            r.replicaof("NO", "ONE")
            r.config_set("min-replicas-to-write", 0)
            mover.stop()
            joined(runner, 60)
    assert len(said(logging.WARNING)) == 1, said(logging.WARNING)


def test_failures_of_one_class_with_other_causes_are_other_kinds() -> None:
    # NOREPLICAS, MISCONF and BUSY are all RedisRefused: grouped by class, a failing disk after
    # a failover went untold until Redis answered again; so would a second key of another type.
    script = " script: fb5ec648, on @user_script:{}."
    noreplicas = [
        RedisRefused(f"Redis refused the write: NOREPLICAS Not enough good replicas.{script.format(n)}")
        for n in (289, 120)
    ]
    misconf = RedisRefused("Redis refused the write: MISCONF Errors writing to disk." + script.format(289))
    assert failure_kind(noreplicas[0]) == failure_kind(noreplicas[1]) != failure_kind(misconf)
    first, second = (WrongTypeKey(f"WRONGTYPE ...; '{key}' holds a string, not a hash") for key in ("a", "b"))
    assert failure_kind(first) != failure_kind(second)
    # Redis away is one failure however its words vary (a TLS one read "[SSL: ...]", then "EOF").
    tls = [
        RedisUnavailable(f"Redis is unavailable: {t}")
        for t in ("[SSL: TLSV1_ALERT_UNKNOWN_CA] x", "EOF occurred")
    ]
    assert failure_kind(tls[0]) == failure_kind(tls[1])


def test_a_failure_that_lasts_is_told_at_once_then_once_a_minute_marked_still(caplog) -> None:
    log = logging.getLogger("kombu_delay.test_repeats")
    repeats = Repeats(log, every=60.0)
    with caplog.at_level(logging.DEBUG, logger=log.name):
        for at in (0.0, 5.0, 59.0, 60.0, 61.0):
            repeats.tell(logging.WARNING, "away", f"away at {at:.0f}", now=at)
        repeats.tell(logging.ERROR, "other", "other at 62", now=62.0)  # another kind: at once
        repeats.tell(logging.WARNING, "away", "away at 63", now=63.0)  # back to the first: new again
    told = [(x.levelno, x.getMessage()) for x in caplog.records]
    assert told == [
        (logging.WARNING, "away at 0"),
        (logging.DEBUG, "away at 5"),
        (logging.DEBUG, "away at 59"),
        (logging.WARNING, "away at 60 (still)"),
        (logging.DEBUG, "away at 61"),
        (logging.ERROR, "other at 62"),
        (logging.WARNING, "away at 63"),
    ]
    assert repeats.over() and not repeats.over()  # its end, to be told once


def test_a_thaw_and_a_sweep_that_fail_on_a_key_damaged_by_hand_stop_no_move(r: redis.Redis) -> None:
    """The cold index replaced by a key of another type fails every thaw and sweep: the
    mover logs and counts it, retries them a minute later, and moves on."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    due = clock() + 5_000
    store.schedule(Due(due, task_id="t"), "q", "payload", Settings(compress_after_ms=0), now_ms=clock())
    r.set(keys.cold_index(""), "by hand")
    mover = Mover(store, Settings(), watch=False)
    assert mover.thaw() == 10.0  # DAMAGED_RETRY_S
    assert mover.sweep() == 60.0
    assert mover.stats.errors == 2
    clock.ms = due
    assert mover.drain().moved == 1
    assert r.lrange("q", 0, -1) == [b"payload"]


def test_a_thaw_that_keeps_failing_is_logged_once_a_minute_and_its_end_told(r: redis.Redis, caplog) -> None:
    # It logged an ERROR at each retry, every 10 s, and nothing once it worked again.
    r.set(keys.cold_index(""), "by hand")
    mover = Mover(Store(r), Settings(), watch=False)
    at = [1000.0]
    mover.thawer.monotonic = lambda: at[0]
    with caplog.at_level(logging.INFO, logger="kombu_delay"):
        for step in (0, 10, 10, 10, 35):  # tries at 0, 10, 20 and 30 s, then 65 s
            at[0] += step
            assert mover.thaw() == 10.0
        # A second key of another type is another failure: told at once, not a minute later.
        r.set(keys.dead(""), "by hand")
        at[0] += 10
        assert mover.thaw() == 10.0
        r.delete(keys.cold_index(""), keys.dead(""))
        at[0] += 10
        mover.thaw()
    told = [x.getMessage() for x in caplog.records if "thaw" in x.getMessage()]
    assert [t.split(" (")[0] for t in told] == [f"mover {mover.name}: thaw failed"] * 3 + [
        f"mover {mover.name}: the thaw works again"
    ], told
    assert "kombu_delay:dead" in told[2] and "(still)" not in told[2]
    assert mover.stats.errors == 6


def test_a_mover_whose_heartbeat_is_gone_says_redis_lost_its_data(r: redis.Redis, caplog) -> None:
    # A FLUSHALL, or a switch to an empty server, lost every scheduled message: the mover said
    # nothing, `health` exited 0 and no counter moved.
    mover = Mover(Store(r), Settings(), watch=False)
    interval = Settings().heartbeat_interval_ms / 1000

    def beat() -> list[str]:
        mover._last_beat -= interval  # (its next heartbeat is due)
        with caplog.at_level(logging.WARNING, logger="kombu_delay.mover"):
            caplog.clear()
            mover._beat()
        return [x.getMessage() for x in caplog.records]

    mover._beat()  # its first: nothing recorded before, nothing to tell
    assert beat() == []
    r.flushdb()
    [told] = beat()
    assert told.startswith(f"mover {mover.name}: its heartbeat was gone from Redis: Redis's data was flushed")
    assert beat() == []  # told once


def test_a_thaw_that_sets_a_meta_hash_aside_names_both_keys(r: redis.Redis, caplog) -> None:
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    due = clock() + 5_000
    cold = Settings(compress_after_ms=1_000, thaw_ahead_ms=1_000)
    store.schedule(Due(due, task_id="t"), "q", "payload", cold, now_ms=clock())
    assert r.exists(keys.cold_index(""))
    meta = keys.meta("", keys.bucket_start(due, Settings().bucket_width_ms))
    r.set(meta, "by hand")
    mover = Mover(store, Settings(), watch=False)
    with caplog.at_level(logging.ERROR, logger="kombu_delay.mover"):
        mover.thaw()
    assert mover.stats.thawed == 1
    [told] = [x.getMessage() for x in caplog.records]
    assert f"the bucket key {meta!r} held another type" in told
    assert "renamed to 'kombu_delay:aside:" in told
    clock.ms = due
    assert mover.drain().moved == 1 and r.lrange("q", 0, -1) == [b"payload"]


def test_the_plans_pass_over_a_meta_hash_of_another_type(r: redis.Redis) -> None:
    """The herd and thaw plans read the first buckets' meta hashes: one replaced by hand with
    a key of another type is passed over, as the move passes it over, not a failed step."""
    store = Store(r)
    start = keys.bucket_start(store.time_ms() + 180_000, 60_000)
    for i in range(3):
        store.schedule(Due(start + 1_000, task_id=f"t{i}"), "q", f"p{i}", ORDINARY)
    store.schedule(Due(start + 61_000, task_id="next"), "q", "next", ORDINARY)
    meta = keys.meta("", start)
    r.delete(meta)
    r.set(meta, "by hand")
    _, buckets = store.ordinary_buckets(10)
    assert [b.start_ms for b in buckets] == [start + 60_000]
    mover = Mover(store, Settings(), watch=False)
    mover.stager.step()
    mover.thaw()
    assert mover.stats.errors == 0


@pytest.mark.parametrize("key", [keys.movers, keys.totals], ids=lambda key: key.__name__)
def test_a_shared_key_of_another_type_is_one_error_line_per_try_not_a_traceback(r, prefix, caplog, key):
    # A mover logged a whole traceback as an "unexpected error" on every try; then a line
    # whose error, from a script, named no key. The line names the key, and what to do.
    r.set(key(prefix), "written by hand")
    mover = Mover(Store(r, prefix), Settings(max_sleep_ms=200), watch=False)
    runner = threading.Thread(target=mover.run)
    with caplog.at_level("ERROR", logger="kombu_delay"):
        runner.start()
        try:
            wait_until(lambda: mover.stats.errors >= 2, timeout=60)
        finally:
            mover.stop()
            joined(runner, 60)
    tries = [rec for rec in caplog.records if "WRONGTYPE" in rec.getMessage()]
    assert tries and all(rec.exc_info is None and "retrying" in rec.getMessage() for rec in tries)
    named = f"{key(prefix)!r} holds a string, not a "
    assert all(named in rec.getMessage() and "RENAME" in rec.getMessage() for rec in tries)
    assert not any("unexpected error" in rec.getMessage() for rec in caplog.records)
    r.delete(key(prefix))


def test_a_thaw_or_sweep_script_that_fails_holds_back_no_move(r, prefix, monkeypatch, caplog):
    # A thaw script failing with anything but a key of another type (a Lua file an upgrade in
    # place replaced under a running mover, say) escaped the drain to the loop's back-off: one
    # move batch per back-off, so a due burst of 2,000 took minutes.
    broken = "return redis.error_reply('ERR not the script this mover was written for')\n"
    monkeypatch.setitem(scripts._TEXTS, "thaw_scan", broken)
    monkeypatch.setitem(scripts._TEXTS, "sweep", broken)
    scripts.source.cache_clear()
    try:
        clock = FakeClock(r)
        store = Store(r, prefix, clock=clock)
        due, dest = clock() + 1000, f"{prefix}celery"
        items = [(Due(due, task_id=f"t{i}"), dest, kombu_payload(f"m{i}")) for i in range(2000)]
        assert {res.outcome for res in store.schedule_many(items, ORDINARY)} == {Scheduled.STORED}
        clock.advance(1000)
        told: list[BaseException] = []  # what the metrics count (kombu_delay_redis_errors_total)
        mover = Mover(store, Settings(batch_size=100), watch=False, on_error=told.append)
        with caplog.at_level("ERROR", logger="kombu_delay"):
            mover.drain()
        assert r.llen(dest) == 2000 and mover.stats.moved == 2000
        failed = {rec.getMessage().split(" failed ")[0].rsplit(" ", 1)[-1] for rec in caplog.records}
        assert failed == {"thaw", "sweep"}, caplog.text
        assert mover.stats.errors == len(told) == 2  # once each: retried later
    finally:
        scripts.source.cache_clear()


@pytest.mark.parametrize("member", ["abc", "1.5"])
def test_a_cold_index_member_that_names_no_bucket_holds_back_no_thaw(r: redis.Redis, member: str) -> None:
    """A member of the cold index written by hand made the thaw's plan raise on every pass, so
    no compressed message was ever thawed, nor delivered."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    due = clock() + 600_000
    store.schedule(Due(due, task_id="c"), "q", kombu_payload("c"), Settings(), now_ms=clock())
    cold_index = keys.cold_index("")
    assert r.zcard(cold_index) == 1  # stored compressed
    r.zadd(cold_index, {member: 0})
    mover = Mover(store, Settings(), watch=False)
    clock.ms = due - 1_000
    mover.thaw()
    assert mover.stats.errors == 0
    assert r.zscore(cold_index, member) is None  # the thaw's scan let it go
    clock.ms = due
    assert mover.drain().moved == 1
    assert tags_in(r, "q") == ["c"]
