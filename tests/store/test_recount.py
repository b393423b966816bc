"""A bucket's counts that miss members (its meta hash evicted or deleted, a member added by
hand, a field that is not a number) never let it go while its sorted sets hold messages: the
script that would retire it counts them again, and they are delivered.

Time is driven through a fake clock (see ``FakeClock``).
"""

from __future__ import annotations

import json
import logging

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.mover.loop import Mover
from kombu_delay.store import Store, keys
from tests.support.stored import FakeClock, kombu_payload, sweep_all, tags_in

#: Messages stored uncompressed, in one-minute buckets.
PLAIN = Settings(compress_after_ms=0)
#: Stored compressed (the cold space) when due more than a second ahead.
COLD = Settings(compress_after_ms=1000, thaw_ahead_ms=1000)


def _one_bucket(clock: FakeClock, lead_ms: int) -> int:
    """A due time ``lead_ms`` ahead whose bucket holds the next ten seconds too."""
    due = clock() + lead_ms
    if due % 60_000 > 50_000:
        due += 10_000
    return due


def _store_five(store: Store, clock: FakeClock, prefix: str, settings: Settings, lead_ms: int) -> int:
    due = _one_bucket(clock, lead_ms)
    for i in range(5):
        store.schedule(Due(due + i * 1000, task_id=f"m{i}"), f"{prefix}q", kombu_payload(f"m{i}"), settings)
    return due


def _move_all(store: Store, rounds: int = 10) -> int:
    return sum(store.move_due(100).moved for _ in range(rounds))


def test_a_started_bucket_whose_meta_hash_is_gone_is_counted_again_and_delivered(r, prefix, caplog):
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = _store_five(store, clock, prefix, PLAIN, 30_000)
    start = keys.bucket_start(due, PLAIN.bucket_width_ms)
    r.delete(keys.meta(prefix, start))
    clock.ms = due  # the bucket has started; the move comes before any sweep
    mover = Mover(store, PLAIN, watch=False)
    with caplog.at_level(logging.ERROR, logger="kombu_delay"):
        first = store.move_due(100)
        mover._account(first)
    assert first.recounted == 5 and first.moved == 0 and first.more
    assert "missing from their bucket's counts" in caplog.text
    meta = keys.meta(prefix, start)
    assert r.pttl(meta) > 0  # made anew with an expiry: it cannot outlive its bucket forever
    assert store.counts() == {f"{prefix}q": 5}  # still counted once, not twice
    clock.ms = due + 5000
    assert _move_all(store) == 5
    assert tags_in(r, f"{prefix}q") == [f"m{i}" for i in range(5)]
    assert store.counts() == {}
    assert store.totals()["recounted"] == 5


def test_a_member_added_by_hand_does_not_strand_the_real_ones(r, prefix):
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = _store_five(store, clock, prefix, PLAIN, 30_000)
    start = keys.bucket_start(due, PLAIN.bucket_width_ms)
    r.zadd(keys.queue_set(prefix, start, f"{prefix}q"), {"GARBAGE not json": due})
    for step in range(5):  # one message falls due a second: the counts reach zero one early
        clock.ms = due + step * 1000
        _move_all(store, 2)
    clock.ms = due + 10_000
    _move_all(store)
    items = r.lrange(f"{prefix}q", 0, -1)
    assert b"GARBAGE not json" in items
    assert sorted(json.loads(x)["properties"]["delivery_tag"] for x in items if x.startswith(b"{")) == [
        f"m{i}" for i in range(5)
    ]
    assert not r.exists(keys.queue_set(prefix, start, f"{prefix}q"))
    assert store.counts() == {}
    assert store.totals()["recounted"] == 1
    assert not r.exists(keys.index(prefix))  # nothing left behind


def test_a_cold_member_added_by_hand_does_not_strand_the_real_ones(r, prefix):
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = _one_bucket(clock, 30_000)
    n = 300  # thawed in three steps and more: the counts reach zero one step early
    items = [(Due(due, task_id=f"c{i}"), f"{prefix}q", kombu_payload(f"c{i}")) for i in range(n)]
    store.schedule_many(items, COLD)
    [start] = {int(s) for s in r.zrange(keys.cold_index(prefix), 0, -1)}
    cold_set = keys.queue_set(prefix, start, f"{prefix}q", keys.COLD)
    assert r.zcard(cold_set) == n
    r.zadd(cold_set, {"GARBAGE": due})
    clock.ms = due - 500  # within the thaw horizon
    for _ in range(10):
        store.thaw(2000, 100)
    assert not r.exists(cold_set)
    clock.ms = due + 1000
    _move_all(store)
    assert sorted(tags_in(r, f"{prefix}q")) == sorted(f"c{i}" for i in range(n))
    assert store.counts() == {}


def test_a_cold_bucket_whose_meta_hash_is_gone_is_thawed_whole(r, prefix, caplog):
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = _store_five(store, clock, prefix, COLD, 30_000)
    [start] = {int(s) for s in r.zrange(keys.cold_index(prefix), 0, -1)}
    r.delete(keys.meta(prefix, start, keys.COLD))
    clock.ms = due - 500  # within the thaw horizon
    mover = Mover(store, COLD, watch=False)
    with caplog.at_level(logging.ERROR, logger="kombu_delay"):
        result = store.thaw(2000, 100)
        mover.thawer._account(result)
    assert result.recounted == 5
    assert "missing from their bucket's counts" in caplog.text
    clock.ms = due + 10_000
    for _ in range(5):
        store.thaw(2000, 100)
        _move_all(store, 2)
    assert sorted(tags_in(r, f"{prefix}q")) == [f"m{i}" for i in range(5)]
    assert store.counts() == {}


@pytest.mark.parametrize("junk", ["xyz", "1.5", "-0.5"])
def test_a_field_that_is_not_a_count_stops_no_move(r: redis.Redis, prefix: str, junk: str) -> None:
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = _store_five(store, clock, prefix, PLAIN, 30_000)
    start = keys.bucket_start(due, PLAIN.bucket_width_ms)
    later = due + 120_000
    store.schedule(Due(later, task_id="other"), f"{prefix}b", kombu_payload("other"), PLAIN)
    r.hset(keys.meta(prefix, start), "junk", junk)
    assert store.ordinary_buckets(10)[1][0].count == 5  # the planners read past it
    r.hset(keys.meta(prefix, start), f"q:{prefix}q", junk)  # the count itself, written by hand
    clock.ms = later
    assert _move_all(store) == 6
    assert tags_in(r, f"{prefix}b") == ["other"]
    assert sorted(tags_in(r, f"{prefix}q")) == [f"m{i}" for i in range(5)]
    assert store.counts() == {} and _real_counts(r, prefix) == {}


def test_a_meta_hash_swept_anew_has_an_expiry(r, prefix):
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = _store_five(store, clock, prefix, PLAIN, 30 * 60_000)
    meta = keys.meta(prefix, keys.bucket_start(due, PLAIN.bucket_width_ms))
    r.delete(meta)
    assert sweep_all(store)[2] == 1
    assert r.pttl(meta) > 0
    assert sweep_all(store)[2] == 0  # counted once
    assert store.counts() == {f"{prefix}q": 5}


def _real_counts(r: redis.Redis, prefix: str) -> dict[str, int]:
    """What the sorted sets of both spaces hold, per destination."""
    found: dict[str, int] = {}
    for key in r.scan_iter(match=keys.ns(prefix) + "*z:*", count=1000):
        rest = key.decode().removeprefix(keys.ns(prefix)).removeprefix("c")  # "z:<start>:<dest>"
        dest = rest.split(":", 2)[2]
        found[dest] = found.get(dest, 0) + int(r.zcard(key))
    return found


@pytest.mark.parametrize("then", ["move", "cancel"])
def test_a_meta_hash_deleted_then_made_anew_by_a_publish_is_counted_once(r, prefix, then):
    """A publish into a bucket whose meta hash is gone makes it anew, counting only itself; the
    counts of its destination still hold the others. Moving part of the bucket (or cancelling
    the new message) brings the meta count to zero: the rest are counted again in the meta hash,
    not in the counts, which had them all along."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = _store_five(store, clock, prefix, PLAIN, 30_000)
    start = keys.bucket_start(due, PLAIN.bucket_width_ms)
    r.delete(keys.meta(prefix, start))
    store.schedule(Due(due + 5000, task_id="late"), f"{prefix}q", kombu_payload("late"), PLAIN)
    if then == "move":
        clock.ms = due + 3000  # four due: more than the new meta hash counts
        assert _move_all(store, 1) == 4
    else:
        assert store.cancel("late") == 1
    left = 2 if then == "move" else 5
    assert store.counts() == {f"{prefix}q": left} == _real_counts(r, prefix)
    clock.ms = due + 10_000
    _move_all(store)
    moved = [f"m{i}" for i in range(5)] + (["late"] if then == "move" else [])
    assert sorted(tags_in(r, f"{prefix}q")) == sorted(moved)
    assert store.counts() == {} and _real_counts(r, prefix) == {}


def test_a_meta_hash_made_anew_for_another_queue_leaves_no_queue_behind(r, prefix):
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = _store_five(store, clock, prefix, PLAIN, 30_000)
    start = keys.bucket_start(due, PLAIN.bucket_width_ms)
    r.delete(keys.meta(prefix, start))
    store.schedule(Due(due, task_id="other"), f"{prefix}q2", kombu_payload("other"), PLAIN)
    clock.ms = due + 10_000
    _move_all(store)
    assert tags_in(r, f"{prefix}q2") == ["other"]
    assert tags_in(r, f"{prefix}q") == [f"m{i}" for i in range(5)]
    assert store.counts() == {} and _real_counts(r, prefix) == {}


def test_a_purge_removes_what_a_bucket_holds_beyond_its_counts(r, prefix):
    """A purged message must never run: members a lost meta hash no longer counts go too."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = _store_five(store, clock, prefix, PLAIN, 30_000)
    r.delete(keys.meta(prefix, keys.bucket_start(due, PLAIN.bucket_width_ms)))
    assert store.purge([f"{prefix}q"]) == 5
    clock.ms = due + 10_000
    _move_all(store)
    assert not r.exists(f"{prefix}q") and _real_counts(r, prefix) == {}
