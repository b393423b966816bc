"""Counts the scripts did not write (a member added by hand, a meta hash made anew, a counter
written by hand) neither strand nor lose a message: a meta count never falls below zero, text
HINCRBY refuses counts as nothing, and a thaw mends what it would fail on before it takes a
message from the cold space. Time is set per call, never waited for."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.errors import WrongTypeKey
from kombu_delay.message import Due
from kombu_delay.mover.tally import MoverStats, tell_damaged
from kombu_delay.mover.thaw import Thawer
from kombu_delay.store import Store, keys
from kombu_delay.store.replies import Scheduled
from tests.support.stored import FakeClock, kombu_payload, redis_ms

WIDTH = 60_000
ORDINARY = Settings(compress_after_ms=0)
COLD = Settings(compress_after_ms=60_000, thaw_ahead_ms=30_000)


def _bucket(r: redis.Redis, ahead: int = 2) -> tuple[int, int]:
    """Redis's clock now, and the start of a bucket ``ahead`` widths later."""
    now = redis_ms(r)
    return now, (now // WIDTH + ahead) * WIDTH


def _delivered(r: redis.Redis, dest: str) -> list[str]:
    """The tags (kombu_payload's delivery tags) of what is on ``dest``, pushed first first."""
    return [json.loads(m)["properties"]["delivery_tag"] for m in reversed(r.lrange(dest, 0, -1))]


@pytest.mark.parametrize("damage", ["member added by hand", "meta hash made anew"])
def test_a_bucket_whose_count_would_fall_below_zero_still_moves_what_comes_next(
    r: redis.Redis, prefix: str, damage: str
) -> None:
    now, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}celery"
    zset, meta = keys.queue_set(prefix, start, dest), keys.meta(prefix, start)
    store.schedule(Due(start + 10_000, task_id="a1"), dest, kombu_payload("a1"), ORDINARY, now_ms=now)
    if damage == "member added by hand":
        r.zadd(zset, {kombu_payload("hand"): start + 5_000})
    else:
        r.delete(meta)
        store.schedule(Due(start + 12_000, task_id="a2"), dest, kombu_payload("a2"), ORDINARY, now_ms=now)
    # The move takes one member more than the meta hash counts: recounted as it goes (ERROR
    # logged by the mover, `recounted` in the totals), as a member found when its bucket
    # drained is; it went uncounted, and the totals stopped adding up.
    result = store.move_due(100, now_ms=start + 20_000)
    assert (result.moved, result.recounted) == (2, 1)
    assert int(r.hget(meta, f"q:{dest}") or 0) == 0
    assert store.totals()["recounted"] == 1

    # A later publish into the same bucket is indexed and expires, and is moved when due.
    store.schedule(
        Due(start + 30_000, task_id="b1"), dest, kombu_payload("b1"), ORDINARY, now_ms=start + 20_000
    )
    assert r.zscore(keys.index(prefix), str(start)) is not None
    assert r.pttl(zset) > 0
    assert store.move_due(100, now_ms=start + 31_000).moved == 1
    assert _delivered(r, dest)[-1] == "b1"
    assert store.counts() == {}


@pytest.mark.parametrize("junk", [" 3", "0x3", "3e0", "03", "+3", "3.0"])
def test_a_count_hincrby_refuses_counts_nothing_and_stops_no_move(
    r: redis.Redis, prefix: str, junk: str
) -> None:
    now, start = _bucket(r)
    store = Store(r, prefix)
    bad, good = f"{prefix}bad", f"{prefix}good"
    for i in range(3):
        store.schedule(
            Due(start + 1_000 + i, task_id=f"b{i}"), bad, kombu_payload(f"b{i}"), ORDINARY, now_ms=now
        )
        store.schedule(
            Due(start + 2_000 + i, task_id=f"g{i}"), good, kombu_payload(f"g{i}"), ORDINARY, now_ms=now
        )
    r.hset(keys.meta(prefix, start), f"q:{bad}", junk)  # read by Lua's tonumber, refused by HINCRBY
    moved, recounted = 0, 0
    for _ in range(3):
        result = store.move_due(100, now_ms=start + 10_000)
        moved, recounted = moved + result.moved, recounted + result.recounted
    assert (r.llen(good), r.llen(bad)) == (3, 3)
    assert moved == 6 and recounted == 3


def test_a_thaw_mends_a_damaged_counter_before_it_takes_a_message(r: redis.Redis, prefix: str) -> None:
    now, start = _bucket(r, ahead=10)
    store, dest = Store(r, prefix), f"{prefix}celery"
    cold = [(Due(start + 5_000 + i, task_id=f"c{i}"), dest, kombu_payload(f"c{i}")) for i in range(50)]
    store.schedule_many(cold, COLD, now_ms=now)
    assert r.zcard(keys.queue_set(prefix, start, dest, "c")) == 50
    # An ordinary message in the bucket the thaw restores into, then counters no script wrote:
    # its seq and end in the ordinary bucket, its count in the cold one.
    store.schedule(Due(start + 59_000, task_id="o1"), dest, kombu_payload("o1"), ORDINARY, now_ms=now)
    r.hset(keys.meta(prefix, start), mapping={"seq": "junk", "end": "soon"})
    r.hset(keys.meta(prefix, start, "c"), f"q:{dest}", " 50")

    # The cold count is junk: the first call counts the set again (recounted), the next thaws.
    thawed = [store.thaw(40_000, 100, now_ms=start - 30_000) for _ in range(3)]
    assert sum(t.thawed for t in thawed) == 50 and sum(t.recounted for t in thawed) == 50
    assert r.zcard(keys.queue_set(prefix, start, dest, "c")) == 0
    assert r.zcard(keys.queue_set(prefix, start, dest)) == 51
    for at in (start + 6_000, start + 60_000):
        store.move_due(500, now_ms=at)
    assert sorted(_delivered(r, dest)) == sorted([f"c{i}" for i in range(50)] + ["o1"])


@pytest.mark.parametrize("key", ["sorted set", "task-id list"])
def test_a_thaw_into_a_key_of_another_type_dead_letters_instead_of_losing(r, prefix, key):
    now, start = _bucket(r, ahead=10)
    store, dest = Store(r, prefix), f"{prefix}celery"
    cold = [(Due(start + 5_000 + i, task_id=f"c{i}"), dest, kombu_payload(f"c{i}")) for i in range(5)]
    other = f"{prefix}other"
    cold.append((Due(start + 5_000, task_id="o1"), other, kombu_payload("o1")))
    store.schedule_many(cold, COLD, now_ms=now)
    # Written by hand: the bucket's sorted set for dest, or its task-id list, as a string.
    damaged = {
        "sorted set": keys.queue_set(prefix, start, dest),
        "task-id list": keys.task_ids(prefix, start),
    }[key]
    r.set(damaged, "not mine")
    result = store.thaw(40_000, 100, now_ms=start - 30_000)
    if key == "sorted set":
        assert (result.thawed, result.dead, result.blocked) == (1, 5, 5)
    else:  # the bucket's one task-id list serves every destination
        assert (result.thawed, result.dead, result.blocked) == (0, 6, 6)
    assert result.blocking == [(damaged, result.blocked)]  # named once, with its count, for the log
    assert r.zcard(keys.queue_set(prefix, start, dest, "c")) == 0
    assert r.llen(keys.dead(prefix)) == result.dead  # kept, as stored
    assert r.get(damaged) == b"not mine"


def test_a_thaw_into_a_bucket_whose_meta_hash_is_of_another_type_sets_it_aside_and_loses_nothing(
    r: redis.Redis, prefix: str
) -> None:
    """The thaw comes up to delay_thaw_ahead before the bucket's first move, which sets such a
    key aside: it dead-lettered the compressed messages due there (the move then delivered only
    the others). It sets the key aside itself now; where RENAME is refused, they go to the
    dead-letter list as before, and the bucket's move lets its own messages go, once, naming
    the key."""
    now, start = _bucket(r, ahead=10)
    store, dest = Store(r, prefix), f"{prefix}celery"
    cold = [(Due(start + 5_000 + i, task_id=f"c{i}"), dest, kombu_payload(f"c{i}")) for i in range(5)]
    store.schedule_many(cold, COLD, now_ms=now)
    store.schedule(Due(start + 5_000, task_id="o1"), dest, kombu_payload("o1"), ORDINARY, now_ms=now)
    meta = keys.meta(prefix, start)
    r.delete(meta)
    r.set(meta, "by hand")
    result = store.thaw(40_000, 100, now_ms=start - 30_000)
    assert (result.thawed, result.dead, result.expired) == (5, 0, 0)
    [(named, aside)] = result.damaged
    assert named == meta and aside.startswith(f"{prefix}kombu_delay:aside:{start}:")
    assert r.get(aside) == b"by hand" and r.ttl(aside) == -1  # kept as it was
    assert store.totals()["recounted"] == 1  # o1, counted again from its set
    assert store.move_due(100, now_ms=start + 5_000 - 1).moved == 0  # none early
    assert store.move_due(100, now_ms=start + 10_000).moved == 6
    assert sorted(_delivered(r, dest)) == sorted(["o1"] + [f"c{i}" for i in range(5)])
    assert store.counts() == {} and r.llen(keys.dead(prefix)) == 0

    # Where RENAME is refused: the thawed messages are dead-lettered, as before, and the bucket's
    # own messages are the move's to let go, once. (Each thaw call let the bucket go again, for
    # each queue: the counts of healthy messages in other buckets went with it.)
    later, other = start + WIDTH, f"{prefix}other"
    cold = [
        (Due(later + 5_000 + i, task_id=f"d{q}{i}"), q, kombu_payload("d"))
        for q in (dest, other)
        for i in range(2)
    ]
    for i, q in enumerate((dest, other) * 2):
        store.schedule(
            Due(later + 1_000 + i, task_id=f"o{i}"), q, kombu_payload(f"o{i}"), ORDINARY, now_ms=now
        )
        store.schedule(
            Due(later + WIDTH + i, task_id=f"h{i}"), q, kombu_payload(f"h{i}"), ORDINARY, now_ms=now
        )
    store.schedule_many(cold, COLD, now_ms=now)
    meta = keys.meta(prefix, later)
    r.delete(meta)
    r.set(meta, "by hand")
    before = store.totals()
    r.acl_setuser("mover", enabled=True, nopass=True, commands=["+@all", "-rename"], keys=["*"])
    as_mover = Store(redis.Redis(port=r.connection_pool.connection_kwargs["port"], username="mover"), prefix)
    try:
        thaws = [as_mover.thaw(40_000, 2, now_ms=later - 30_000) for _ in range(3)]
        assert store.counts() == {dest: 4, other: 4}  # 2 let go at their move, 2 healthy, each
        moves = [as_mover.move_due(100, now_ms=at) for at in (later + 10_000, later + WIDTH + 10_000)]
    finally:
        r.acl_deluser("mover")
    assert [(t.thawed, t.dead, t.damaged) for t in thaws] == [(0, 2, []), (0, 2, []), (0, 0, [])]
    assert [t.blocking for t in thaws] == [[(meta, 2)], [(meta, 2)], []]
    assert r.llen(keys.dead(prefix)) == 4 and r.get(meta) == b"by hand"
    assert (moves[0].moved, moves[0].expired, moves[0].damaged) == (0, 4, [(meta, "")])  # let go once
    assert moves[1].moved == 4 and store.counts() == {}
    totals = store.totals()
    assert totals["expired"] - before.get("expired", 0) == 8  # 4 dead, 4 let go
    assert totals.get("unreadable") == 1


def test_a_mover_tells_thawed_messages_dead_lettered_once_a_minute_naming_the_key(
    r: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Where a bucket's key is of another type, each thaw step that met it logged an ERROR,
    naming no key: compressed messages due a second apart gave a line each. The mover names the
    key, at once and then once a minute while it lasts, with the count since its last line; the
    dead letters count each message. Two keys met by turns are each told once a minute too."""
    clock = FakeClock(r)
    store, dest, other = Store(r, prefix, clock=clock), f"{prefix}celery", f"{prefix}other"
    start = (clock() // WIDTH + 2) * WIDTH
    cold = [
        (Due(start + 1_000 * i, task_id=f"c{i}"), (dest, other)[i % 2], kombu_payload(f"c{i}"))
        for i in range(40)
    ]
    store.schedule_many(cold, COLD, now_ms=clock())
    damaged, second = keys.queue_set(prefix, start, dest), keys.queue_set(prefix, start, other)
    r.set(damaged, "not mine")
    r.set(second, "not mine")
    stats = MoverStats()
    thawer = Thawer(store, COLD, "t", stats, monotonic=lambda: clock.ms / 1000)
    clock.ms = start - COLD.thaw_ahead_ms
    with caplog.at_level(logging.ERROR, logger="kombu_delay.mover.thaw"):
        for _ in range(40):  # one message a second comes within the thaw's reach
            thawer.step()
            clock.advance(1_000)
        told = [rec.getMessage() for rec in caplog.records if "could not be stored" in rec.getMessage()]
        assert stats.dead == 40 and r.llen(keys.dead(prefix)) == 40
        assert len(told) == 2 and "(still)" not in told[0] + told[1]  # a line for each key
        assert repr(damaged) in told[0] and repr(second) in told[1] and "1 thawed message could" in told[0]
        assert repr(keys.dead(prefix)) in told[0]
        late = Due(start + 50_000, task_id="late")  # compressed, stored 70 s before due
        store.schedule(late, dest, kombu_payload("late"), COLD, now_ms=start - 20_000)
        clock.advance(30_000)
        while thawer.step() == 0.0:
            pass
    told = [rec.getMessage() for rec in caplog.records if "could not be stored" in rec.getMessage()]
    assert len(told) == 3 and told[2].endswith("(still)") and stats.dead == 41
    # Its own 19 told at debug level since its last line, and the late one: not the other key's.
    assert "20 thawed messages could" in told[2] and repr(damaged) in told[2]


def test_an_end_written_by_hand_in_the_first_bucket_fails_no_publish_and_no_thaw(r, prefix):
    now, start = _bucket(r, ahead=10)
    store = Store(r, prefix)
    store.schedule(
        Due(start + 1_000, task_id="head"), f"{prefix}q0", kombu_payload("head", "q0"), ORDINARY, now_ms=now
    )
    r.hset(keys.meta(prefix, start), "end", "oops")  # the index's first bucket, read by every wake check
    later = start + 2 * WIDTH
    cold = [
        (Due(later + i, task_id=f"c{i}"), f"{prefix}{q}", kombu_payload(f"c{i}", q))
        for i, q in enumerate("ab")
    ]
    store.schedule_many(cold, COLD, now_ms=now)
    store.schedule(Due(later + 5, task_id="o1"), f"{prefix}b", kombu_payload("o1", "b"), ORDINARY, now_ms=now)
    assert store.thaw(40_000, 100, now_ms=later - 30_000).thawed == 2
    for at in (start + 2_000, later + 1_000):
        store.move_due(100, now_ms=at)
    assert [r.llen(f"{prefix}{q}") for q in ("q0", "a", "b")] == [1, 1, 2]


@pytest.mark.parametrize("end", ["inf", "nan", "1e20", "1.5"])
def test_an_end_lua_reads_as_a_number_but_no_time_is_replaced_and_loses_no_message(r, prefix, end):
    """An end written by hand that Lua's tonumber takes for a number (no publish writes one)
    used to be kept for ever: a reschedule out of its bucket then retired the bucket with that
    end and failed after taking the message out."""
    now, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}celery"
    store.schedule(Due(start + 10, task_id="a"), dest, kombu_payload("a"), ORDINARY, now_ms=now)
    r.hset(keys.meta(prefix, start), "end", end)
    store.schedule(Due(start + 20, task_id="b"), dest, kombu_payload("b"), ORDINARY, now_ms=now)
    assert r.hget(keys.meta(prefix, start), "end") == str(start + WIDTH).encode()  # replaced
    r.hset(keys.meta(prefix, start), "end", end)  # and written again, after the last publish
    assert store.cancel("b", now_ms=now) == 1
    later = start + 10 * WIDTH
    [old] = store.find("a")
    store.reschedule(old, "a", kombu_payload("a"), later, ORDINARY, now_ms=now)  # its bucket drains
    assert all(math.isfinite(score) for _, score in r.zrange(keys.drained(prefix), 0, -1, withscores=True))
    store.move_due(100, now_ms=later)
    assert _delivered(r, dest) == ["a"]


@pytest.mark.parametrize(
    "field",
    ["counts", "totals scheduled", "meta q", "meta seq"],
)
@pytest.mark.parametrize("settings", [ORDINARY, COLD], ids=["ordinary", "cold"])
def test_a_count_written_by_hand_fails_no_publish_so_no_retry_stores_it_twice(
    r: redis.Redis, prefix: str, field: str, settings: Settings
) -> None:
    """A publish's counts come after its message is stored: one HINCRBY refuses would fail the
    call with the message kept, and kombu's retry would store it again."""
    now, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}celery"
    store.schedule(Due(start + 1_000, task_id="first"), dest, kombu_payload("first"), settings, now_ms=now)
    key, name = {
        "counts": (keys.counts(prefix), dest),
        "totals scheduled": (keys.totals(prefix), "scheduled"),
        "meta q": (None, f"q:{dest}"),
        "meta seq": (None, "seq"),
    }[field]
    if key is None:
        key = keys.meta(prefix, start, keys.COLD if settings is COLD else "")
    r.hset(key, name, "oops")
    store.schedule(Due(start + 2_000, task_id="second"), dest, kombu_payload("second"), settings, now_ms=now)
    assert len(store.find("second")) == 1
    if settings is COLD:
        store.thaw(3_600_000, 100, now_ms=start)
    assert store.move_due(100, now_ms=start + 10_000).moved == 2
    assert sorted(_delivered(r, dest)) == ["first", "second"]
    assert store.counts() == {}


def test_a_lifetime_total_written_by_hand_stops_no_move(r: redis.Redis, prefix: str) -> None:
    now, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}celery"
    for i in range(3):
        store.schedule(
            Due(start + 1_000 + i, task_id=f"m{i}"), dest, kombu_payload(f"m{i}"), ORDINARY, now_ms=now
        )
    r.hset(keys.totals(prefix), "moved", "oops")
    assert store.move_due(100, now_ms=start + 10_000).moved == 3
    assert r.llen(dest) == 3
    assert store.totals()["moved"] == 3


def test_counts_written_by_hand_read_as_none_where_stats_and_listing_read_them(
    r: redis.Redis, prefix: str
) -> None:
    now, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}celery"
    store.schedule(Due(start + 1_000, task_id="m"), dest, kombu_payload("m"), ORDINARY, now_ms=now)
    r.hset(keys.counts(prefix), f"{prefix}other", "5x")
    r.hset(keys.meta(prefix, start), f"q:{prefix}other", "2e0")
    r.hset(keys.totals(prefix), "purged", "oops")
    assert store.counts() == {dest: 1}
    assert store.pending([dest, f"{prefix}other"]) == 1
    assert store.dests(start) == [dest]
    assert store.totals()["purged"] == 0


@pytest.mark.parametrize("written", ["abc", "0", None])
def test_a_message_whose_count_was_written_by_hand_is_still_found_and_cancelled(
    r: redis.Redis, prefix: str, written: str | None
) -> None:
    # find and cancel read the sets of the destinations a bucket counts: with its count junk or
    # 0, a message a mover would deliver (counted again once the bucket looks drained) was
    # "not scheduled" to them.
    now, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}fq"
    for task_id in ("m", "n"):
        store.schedule(
            Due(start + 1_000, task_id=task_id), dest, kombu_payload(task_id), ORDINARY, now_ms=now
        )
    if written is None:  # the meta hash deleted (or evicted) whole
        r.delete(keys.meta(prefix, start))
    else:
        r.hset(keys.meta(prefix, start), f"q:{dest}", written)
    assert [(s.dest, s.due_ms) for s in store.find("m")] == [(dest, start + 1_000)]
    assert store.cancel("m") == 1
    assert store.find("m") == []
    result = store.move_due(100, now_ms=start + 10_000)
    assert result.moved + store.move_due(100, now_ms=start + 10_000).moved == 1
    assert _delivered(r, dest) == ["n"]


def test_find_looks_past_a_bucket_key_of_another_type_and_names_a_shared_one(
    r: redis.Redis, prefix: str
) -> None:
    # find read a bucket's meta hash and sets with redis.call: one written by hand failed it
    # with Redis's bare WRONGTYPE, naming no key, for every message of that bucket, in `find`
    # and the dashboard's task page alike. A meta hash of another type is now read as a lost
    # one (the message is found, and a cancel names the key); a set of another type holds none.
    now, start = _bucket(r)
    store, dest, other = Store(r, prefix), f"{prefix}fq", f"{prefix}other"
    store.schedule(Due(start + 1_000, task_id="m"), dest, kombu_payload("m"), ORDINARY, now_ms=now)
    store.schedule(Due(start + 1_000, task_id="o"), other, kombu_payload("o"), ORDINARY, now_ms=now)
    meta, gone = keys.meta(prefix, start), keys.queue_set(prefix, start, other)
    kept = r.dump(meta)
    r.delete(meta, gone)
    r.set(meta, "written by hand")
    r.set(gone, "written by hand")
    assert [(s.dest, s.due_ms) for s in store.find("m")] == [(dest, start + 1_000)]
    assert store.find("o") == []
    with pytest.raises(WrongTypeKey, match=f"{meta} holds a string"):
        store.cancel("m", now_ms=now)
    r.delete(meta)
    r.restore(meta, 0, kept)
    assert store.cancel("m", now_ms=now) == 1  # another queue's set still of another type
    r.delete(keys.ids(prefix))
    r.set(keys.ids(prefix), "written by hand")
    with pytest.raises(WrongTypeKey, match=f"'{keys.ids(prefix)}' holds a string"):
        store.find("m")


def test_a_bucket_set_replaced_by_a_key_of_another_type_stops_no_other_move(
    r: redis.Redis, prefix: str
) -> None:
    """Its messages are lost to delivery (counted as expired); the key is left as it is."""
    now, start = _bucket(r)
    store, good, bad = Store(r, prefix), f"{prefix}good", f"{prefix}bad"
    for i in range(3):
        store.schedule(
            Due(start + 1_000 + i, task_id=f"g{i}"), good, kombu_payload(f"g{i}"), ORDINARY, now_ms=now
        )
        store.schedule(
            Due(start + 1_000 + i, task_id=f"b{i}"), bad, kombu_payload(f"b{i}"), ORDINARY, now_ms=now
        )
    later = start + WIDTH
    store.schedule(Due(later + 1_000, task_id="later"), good, kombu_payload("later"), ORDINARY, now_ms=now)
    wrong = keys.queue_set(prefix, start, bad)
    r.delete(wrong)
    r.set(wrong, "by hand")
    # stats failed on it with Redis's bare WRONGTYPE once the bucket had started: it holds none
    census = store.census(start + 10_000, 60_000, 2)
    assert (census.overdue, census.vanished) == (3, 3)
    # Nor the overdue count, which the dashboard's overview reads: it failed every overview page.
    assert store.overdue(start + 10_000) == ({good: (3, start + 1_000)}, False)
    result = store.move_due(100, now_ms=start + 10_000)
    assert (result.moved, result.expired) == (3, 3)
    assert result.damaged == [(wrong, "")]  # named, for the mover's error
    assert result.next_due_ms == later + 1_000
    assert _delivered(r, good) == ["g0", "g1", "g2"]
    assert r.get(wrong) == b"by hand"
    assert store.move_due(100, now_ms=later + 2_000).moved == 1
    assert store.counts() == {}


def test_a_meta_hash_replaced_by_a_key_of_another_type_is_set_aside_and_loses_nothing(
    r: redis.Redis, prefix: str
) -> None:
    """Nothing of that bucket could be counted or moved: it left the index, its messages lost at
    their due time (counted as unreadable), while `stats` and `ls` said they would be delivered.
    A move now renames the key out of the way, kept as it was, and counts the bucket again from
    its sorted sets; where RENAME is refused, the bucket is let go as before, and named."""
    now, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}celery"
    damaged, later = start + WIDTH, start + 2 * WIDTH
    for at, task_id in ((start, "first"), (damaged, "lost"), (later, "later")):
        store.schedule(Due(at + 1_000, task_id=task_id), dest, kombu_payload(task_id), ORDINARY, now_ms=now)
    meta = keys.meta(prefix, damaged)
    r.delete(meta)
    r.set(meta, "by hand")
    assert store.overdue(damaged + 10_000) == ({dest: (1, start + 1_000)}, False)  # passed over
    assert store.sweep("", 100, now_ms=now).cursor == ""
    assert store.reindex(now_ms=now) == (0, 0)
    assert store.move_due(100, now_ms=start + 10_000).moved == 1
    calls = [store.move_due(100, now_ms=later + 10_000) for _ in range(3)]
    assert [(c.moved, c.expired, c.recounted) for c in calls] == [(1, 0, 1), (1, 0, 0), (0, 0, 0)]
    [(named, aside)] = calls[0].damaged
    assert named == meta and aside.startswith(f"{prefix}kombu_delay:aside:{damaged}:")
    assert r.get(aside) == b"by hand" and r.ttl(aside) == -1  # kept as it was
    assert sorted(_delivered(r, dest)) == ["first", "later", "lost"]
    assert store.totals().get("unreadable") is None and store.counts() == {}
    assert store.find("lost") == []

    # Where RENAME is refused, the bucket is let go (its message lost, counted) and named.
    late = later + WIDTH
    store.schedule(Due(late + 1_000, task_id="gone"), dest, kombu_payload("gone"), ORDINARY, now_ms=now)
    meta = keys.meta(prefix, late)
    r.delete(meta)
    r.set(meta, "by hand")
    r.acl_setuser("mover", enabled=True, nopass=True, commands=["+@all", "-rename"], keys=["*"])
    as_mover = Store(redis.Redis(port=r.connection_pool.connection_kwargs["port"], username="mover"), prefix)
    try:
        result = as_mover.move_due(100, now_ms=late + 10_000)
    finally:
        r.acl_deluser("mover")
    assert (result.moved, result.expired, result.damaged) == (0, 1, [(meta, "")])
    assert store.totals()["unreadable"] == 1 and store.counts() == {}
    assert r.get(meta) == b"by hand"


def test_a_cold_bucket_of_another_type_holds_back_no_other_thaw(
    r: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A cold bucket's meta hash, or one of its sorted sets, replaced by hand: that bucket's
    messages are lost (counted as expired, taken off the counts), every other one thaws."""
    now, start = _bucket(r, ahead=5)
    store, dest = Store(r, prefix), f"{prefix}celery"
    starts = [start, start + WIDTH, start + 2 * WIDTH]
    for i, at in enumerate(starts):
        store.schedule(Due(at + 1_000, task_id=f"m{i}"), dest, kombu_payload(f"m{i}"), COLD, now_ms=now)
    assert r.zcard(keys.cold_index(prefix)) == 3
    r.delete(keys.meta(prefix, starts[0], keys.COLD))
    r.set(keys.meta(prefix, starts[0], keys.COLD), "by hand")
    wrong_set = keys.queue_set(prefix, starts[1], dest, keys.COLD)
    r.delete(wrong_set)
    r.set(wrong_set, "by hand")
    result = store.thaw(10 * WIDTH, 100, now_ms=start - 30_000)
    assert (result.thawed, result.expired) == (1, 2)
    # Named, for the mover's log (the thaw told only how many were lost, naming no key).
    assert result.damaged == [(keys.meta(prefix, starts[0], keys.COLD), ""), (wrong_set, "")]
    assert store.thaw(10 * WIDTH, 100, now_ms=start - 30_000).damaged == []  # once
    with caplog.at_level(logging.ERROR):
        tell_damaged("t", result.damaged)
    meta_told, set_told = (rec.getMessage() for rec in caplog.records)
    assert "compressed bucket's meta hash" in meta_told and "RENAME" not in meta_told
    assert repr(wrong_set) in set_told and "counted as expired" in set_told
    assert store.totals()["unreadable"] == 1
    assert store.counts() == {dest: 1}
    assert store.move_due(100, now_ms=starts[2] + 2_000).moved == 1
    assert _delivered(r, dest) == ["m2"]
    assert store.counts() == {}


def test_a_drained_bucket_whose_task_id_list_is_of_another_type_is_let_go(
    r: redis.Redis, prefix: str
) -> None:
    now, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}celery"
    store.schedule(Due(start + 1_000, task_id="a"), dest, kombu_payload("a"), ORDINARY, now_ms=now)
    store.schedule(Due(start + WIDTH + 1_000, task_id="b"), dest, kombu_payload("b"), ORDINARY, now_ms=now)
    assert store.move_due(100, now_ms=start + 2_000).moved == 1
    tasks = keys.task_ids(prefix, start)
    r.delete(tasks)
    r.set(tasks, "by hand")
    assert r.zscore(keys.drained(prefix), str(start)) is not None
    assert store.move_due(100, now_ms=start + WIDTH + 2_000).moved == 1  # after the first bucket's end
    assert r.zscore(keys.drained(prefix), str(start)) is None
    assert store.totals()["unreadable"] == 1
    assert store.totals()["moved"] == 2
    assert _delivered(r, dest) == ["a", "b"]


@pytest.mark.parametrize(
    ("call", "damaged"),
    [
        ("cancel", "counts"),
        ("cancel", "old meta"),
        ("reschedule", "counts"),
        ("reschedule", "old meta"),
        ("reschedule", "new meta"),
        ("reschedule", "new set"),
        ("reschedule", "new task list"),
    ],
)
def test_a_key_of_another_type_refuses_a_cancel_or_reschedule_before_it_takes_anything(
    r: redis.Redis, prefix: str, call: str, damaged: str
) -> None:
    # Redis keeps a script's writes before a command that fails: with the counts hash replaced
    # by a string, a cancel took the message and then failed, so it said "error" for a message
    # it had cancelled; a reschedule whose new bucket's keys were damaged took the message and
    # then failed to store it again, and lost it.
    now, start = _bucket(r)
    new_start = start + 10 * WIDTH
    store, dest = Store(r, prefix), f"{prefix}celery"
    store.schedule(Due(start + 10_000, task_id="w1"), dest, kombu_payload("w1"), ORDINARY, now_ms=now)
    key = {
        "counts": keys.counts(prefix),
        "old meta": keys.meta(prefix, start),
        "new meta": keys.meta(prefix, new_start),
        "new set": keys.queue_set(prefix, new_start, dest),
        "new task list": keys.task_ids(prefix, new_start),
    }[damaged]
    [before] = store.find("w1")
    kept = r.dump(key)
    r.delete(key)
    r.set(key, "written by hand")
    with pytest.raises(WrongTypeKey):
        if call == "cancel":
            store.cancel("w1", now_ms=now)
        else:
            store.reschedule(before, "w1", kombu_payload("w1"), new_start + 1_000, ORDINARY, now_ms=now)
    assert r.zscore(keys.queue_set(prefix, start, dest), before.payload) == before.score  # still there
    r.delete(key)
    if kept is not None:
        r.restore(key, 0, kept)
    assert store.find("w1") == [before]  # the damage undone, the message is where it was, once


def test_a_first_bucket_of_another_type_does_not_fail_a_publish_that_stored_its_message(
    r: redis.Redis, prefix: str
) -> None:
    # The wake-up reads the first bucket's end after the message is stored: with that meta
    # hash replaced by a string, the publish failed, and kombu's retry would store it twice.
    now, head = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}celery"
    store.schedule(Due(head + 10_000, task_id="h1"), dest, kombu_payload("h1"), ORDINARY, now_ms=now)
    r.delete(keys.meta(prefix, head))
    r.set(keys.meta(prefix, head), "written by hand")
    later = head + 2 * WIDTH
    result = store.schedule(
        Due(later + 10_000, task_id="l1"), dest, kombu_payload("l1"), ORDINARY, now_ms=now
    )
    assert result.outcome is Scheduled.STORED
    assert r.zcard(keys.queue_set(prefix, later, dest)) == 1


@pytest.mark.parametrize("damaged", ["gc", "later set"])
def test_a_key_of_another_type_stops_a_purge_with_what_it_removed_counted(
    r: redis.Redis, prefix: str, damaged: str
) -> None:
    # A purge whose drained-bucket set was a string removed the messages, then failed: it said
    # "error", and the lifetime totals counted nothing purged for messages gone.
    now, start = _bucket(r)
    later = start + 3 * WIDTH
    store, dest = Store(r, prefix), f"{prefix}celery"
    for due, tag in ((start + 1_000, "p1"), (later + 1_000, "p2")):
        store.schedule(Due(due, task_id=tag), dest, kombu_payload(tag), ORDINARY, now_ms=now)
    key = keys.drained(prefix) if damaged == "gc" else keys.queue_set(prefix, later, dest)
    kept = r.dump(key)
    r.delete(key)
    r.set(key, "written by hand")
    with pytest.raises(WrongTypeKey, match=key) as caught:
        store.purge([dest], now_ms=now)
    left = 2 if damaged == "gc" else 1  # the shared key: nothing taken; a bucket's: what came before
    told = "nothing was changed" if damaged == "gc" else "stopped there, after removing 1 here (counted)"
    assert told in str(caught.value)
    assert store.counts() == {dest: left}
    assert int(store.totals().get("purged", 0)) == 2 - left
    r.delete(key)
    if kept is not None:
        r.restore(key, 0, kept)
    assert store.purge([dest], now_ms=now) == left
    totals = store.totals()
    assert store.counts() == {} and totals["purged"] == totals["scheduled"] == 2


def test_a_purge_that_fails_after_purging_compressed_messages_says_how_many(
    r: redis.Redis, prefix: str
) -> None:
    # The compressed space is purged first: an ordinary index of another type then failed the
    # purge with "nothing was changed", the compressed messages gone.
    now, _ = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}celery"
    for tag in ("c1", "c2"):
        store.schedule(Due(now + 7_200_000, task_id=tag), dest, kombu_payload(tag), COLD, now_ms=now)
    assert r.zcard(keys.index(prefix, keys.COLD)) == 1 and r.exists(keys.index(prefix)) == 0
    r.set(keys.index(prefix), "written by hand")
    with pytest.raises(WrongTypeKey, match=r"nothing was changed.*; 2 were purged before it$"):
        store.purge([dest], now_ms=now)
    assert store.find("c1") == [] and int(store.totals()["purged"]) == 2


@pytest.mark.parametrize("written", ["0", "-1"])
def test_a_queue_expiry_written_by_hand_as_none_deletes_no_list(r, prefix, written) -> None:
    # The move renewed the list's expiry with PEXPIRE of whatever e:<dest> held: 0 or less
    # deleted the list, with what the move had pushed and what was waiting on it already.
    now, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}celery"
    r.lpush(dest, kombu_payload("waiting"))
    store.schedule(Due(start + 10_000, task_id="a1"), dest, kombu_payload("a1"), ORDINARY, now_ms=now)
    r.hset(keys.meta(prefix, start), f"e:{dest}", written)
    assert store.move_due(100, now_ms=start + 20_000).moved == 1
    assert _delivered(r, dest) == ["waiting", "a1"]
    assert r.pttl(dest) == -1  # no expiry set: none was declared


@pytest.mark.parametrize("member", ["abc", "0abc", "inf", "nan", "1e400", "1.5"])
def test_an_index_member_that_names_no_bucket_is_let_go_without_an_error(r, prefix, member):
    # The move took it out of the index, then failed on it (ZADD to the clean-up set of a
    # start that is no number): one error, logged as unexpected, per such member.
    now, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}celery"
    store.schedule(Due(start + 10_000, task_id="a1"), dest, kombu_payload("a1"), ORDINARY, now_ms=now)
    r.zadd(keys.index(prefix), {member: 0})
    assert store.move_due(100, now_ms=start + 20_000).moved == 1
    assert r.zscore(keys.index(prefix), member) is None
    assert r.zscore(keys.drained(prefix), member) is None
    r.zadd(keys.index(prefix), {member: 0})
    store.sweep("", 100, now_ms=start + 20_000)  # (it reads the index too)


def test_a_publish_refused_on_a_shared_key_of_another_type_names_it(r: redis.Redis, prefix: str) -> None:
    # Redis's WRONGTYPE from a script names no key: "... on @user_function:571". The CLI and
    # health named it; a publish, every one of which then failed, did not.
    now, start = _bucket(r)
    store = Store(r, prefix)
    r.set(keys.counts(prefix), "by hand")
    with pytest.raises(WrongTypeKey, match=f"'{keys.counts(prefix)}' holds a string"):
        store.schedule(
            Due(start + 1_000, task_id="a"), f"{prefix}celery", kombu_payload("a"), ORDINARY, now_ms=now
        )


@pytest.mark.parametrize("kind", ["meta", "set", "task ids", "cold meta"])
def test_a_publish_into_a_bucket_key_of_another_type_names_the_key(r, prefix, kind) -> None:
    """A bucket's own key written over by hand before its first message: Redis's WRONGTYPE
    from the script named no key, and every publish due in that bucket failed alike."""
    now, start = _bucket(r)
    store = Store(r, prefix)
    dest = f"{prefix}celery"
    cold = kind == "cold meta"  # (ten widths further: far enough ahead to be stored compressed)
    due = Due(start + 1_000 + (10 * WIDTH if cold else 0), task_id="a")
    at = keys.bucket_start(due.ms, WIDTH)
    key = {
        "meta": keys.meta(prefix, at),
        "set": keys.queue_set(prefix, at, dest),
        "task ids": keys.task_ids(prefix, at),
        "cold meta": keys.meta(prefix, at, "c"),
    }[kind]
    r.set(key, "by hand")
    settings = COLD if cold else ORDINARY
    with pytest.raises(WrongTypeKey, match=f"'{key}' holds a string, not a"):
        store.schedule(due, dest, kombu_payload("a"), settings, now_ms=now)
    assert store.counts() == {} and store.find("a") == []  # nothing stored


@pytest.mark.parametrize("settings", [ORDINARY, COLD], ids=["ordinary", "cold"])
@pytest.mark.parametrize("shared", ["counts", "totals", "ids", "index"])
def test_a_publish_refused_on_a_shared_key_of_another_type_stores_nothing(
    r: redis.Redis, prefix: str, settings: Settings, shared: str
) -> None:
    # The publish stored the message, then failed on the key: the caller got an error, and
    # kombu's retry stored it again, each copy delivered, none found by find or cancel.
    now, start = _bucket(r, ahead=3)
    store, dest = Store(r, prefix), f"{prefix}celery"
    store.schedule(Due(start + 1_000, task_id="a"), dest, kombu_payload("a"), settings, now_ms=now)
    key = {"counts": keys.counts, "totals": keys.totals, "ids": keys.ids}.get(shared)
    key_name = (
        key(prefix)
        if key
        else (keys.cold_index(prefix) if settings.compress_after_ms else keys.index(prefix))
    )
    kept = r.dump(key_name)
    r.delete(key_name)
    r.set(key_name, "by hand")
    later = Due(start + WIDTH + 1_000, task_id="b")  # a new bucket: its set enters the index
    for _ in range(2):  # as kombu's retry sends it again
        with pytest.raises(WrongTypeKey, match=f"{key_name}' holds a string"):
            store.schedule(later, dest, kombu_payload("b"), settings, now_ms=now)
    r.delete(key_name)
    r.restore(key_name, 0, kept)
    assert store.find("b") == [] and [m.dest for m in store.find("a")] == [dest]
    assert sum(r.zcard(k) for k in r.scan_iter(match=f"{keys.ns(prefix)}*z:*")) == 1
    assert store.counts() == {dest: 1} and store.totals()["scheduled"] == 1
    store.schedule(later, dest, kombu_payload("b"), settings, now_ms=now)
    assert [m.dest for m in store.find("b")] == [dest] and store.counts() == {dest: 2}


@pytest.mark.parametrize("shared", [keys.counts, keys.totals, keys.ids])
def test_a_move_is_refused_whole_on_a_shared_key_of_another_type(r: redis.Redis, prefix: str, shared) -> None:
    # With counts a string, a move pushed its messages, then failed counting them: delivered,
    # and missing from the totals for good. It now refuses before it takes anything.
    now, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}celery"
    store.schedule(Due(start + 1_000, task_id="a"), dest, kombu_payload("a"), ORDINARY, now_ms=now)
    kept = r.dump(shared(prefix))
    r.delete(shared(prefix))
    r.set(shared(prefix), "by hand")
    with pytest.raises(WrongTypeKey, match=f"{shared(prefix)} holds a string"):
        store.move_due(100, now_ms=start + 2_000)
    assert _delivered(r, dest) == []
    r.delete(shared(prefix))
    if kept is not None:
        r.restore(shared(prefix), 0, kept)
    assert store.move_due(100, now_ms=start + 2_000).moved == 1
    assert _delivered(r, dest) == ["a"] and store.totals().get("moved") == 1


@pytest.mark.parametrize("siblings", ["not json", '{"a": 1}', "[1, [2]]", "", '["{p}q\\u0006\\u00163", 7]'])
def test_a_queues_other_lists_written_by_hand_stop_no_move(
    r: redis.Redis, prefix: str, siblings: str
) -> None:
    """The hash that names a queue's other lists (renewed with it, x-expires) is passed over
    where its value is no array of keys, or it is a key of another type; a key in it is
    renewed, and nothing else is."""
    _, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}q"
    other = f"{prefix}q{keys.KOMBU_PRIORITY_SEP}3"
    r.lpush(other, "waiting")
    store.schedule(Due(start + 10, task_id="a"), dest, kombu_payload("a"), ORDINARY, expires_ms=30_000)
    r.hset(keys.lists(prefix), dest, siblings.replace("{p}", prefix))
    assert store.move_due(10, now_ms=start + 10).moved == 1
    assert 0 < r.pttl(dest) <= 30_000 and r.llen(other) == 1
    if "{p}" in siblings:
        assert 0 < r.pttl(other) <= 30_000
    else:
        assert r.pttl(other) == -1
    r.delete(keys.lists(prefix))
    r.set(keys.lists(prefix), "by hand")
    store.schedule(Due(start + 20, task_id="b"), dest, kombu_payload("b"), ORDINARY, expires_ms=30_000)
    assert store.move_due(10, now_ms=start + 20).moved == 1


def test_a_bucket_of_a_queue_with_x_expires_holds_only_numbers_for_older_movers(
    r: redis.Redis, prefix: str
) -> None:
    """A 1.0.0 mover reads every field of a bucket's meta hash as a number: a field of text
    there (the queue's other lists, once kept in it) stopped every move it made."""
    _, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}q"
    others = [f"{prefix}q{keys.KOMBU_PRIORITY_SEP}{n}" for n in (3, 6, 9)]
    for space in (ORDINARY, COLD):
        due = Due(start + 10 + (0 if space is ORDINARY else 3_600_000), task_id=f"t{space is COLD}")
        store.schedule(due, dest, kombu_payload(due.task_id), space, expires_ms=30_000, siblings=others)
    metas = [k for k in r.keys(f"{keys.ns(prefix)}*") if b"m:" in k]
    assert len(metas) == 2
    for meta in metas:
        assert all(int(value) is not None for value in r.hvals(meta)), r.hgetall(meta)
    assert json.loads(r.hget(keys.lists(prefix), dest)) == others
    assert r.pttl(keys.lists(prefix)) > 0


def test_a_reschedule_to_now_past_an_expiry_written_by_hand_says_it_rescheduled(
    r: redis.Redis, redis_server, prefix: str
) -> None:
    """It pushed the message, then failed on the x-expires it read (``abc``), so the caller
    took a message that was delivered for one that was not."""
    from kombu_delay.control import DelayControl

    _, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}q"
    store.schedule(Due(start + 10, task_id="a"), dest, kombu_payload("a"), ORDINARY, expires_ms=30_000)
    r.hset(keys.meta(prefix, start), f"e:{dest}", "abc")
    with DelayControl(redis_server.url, {"global_keyprefix": prefix} if prefix else {}) as control:
        assert control.reschedule("a", countdown=-1) == 1
    assert r.llen(dest) == 1 and store.find("a") == []


def test_a_queues_entry_of_its_other_lists_goes_with_its_last_message_and_outlives_none(
    r: redis.Redis, redis_server, prefix: str
) -> None:
    """Kept apart from the buckets, the entries of queues that came and went stayed, and steady
    traffic renewed them all; and one rescheduled far ahead outlived the entry."""
    from kombu_delay.control import DelayControl

    now, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}q"
    others = [f"{prefix}q{keys.KOMBU_PRIORITY_SEP}3"]
    for i, due in enumerate((start + 10, start + WIDTH + 10)):
        store.schedule(
            Due(due, task_id=f"t{i}"), dest, kombu_payload(f"t{i}"), ORDINARY, 30_000, siblings=others
        )
    assert store.move_due(10, now_ms=start + 10).moved == 1
    assert r.hexists(keys.lists(prefix), dest)  # one still scheduled
    assert store.move_due(10, now_ms=start + WIDTH + 10).moved == 1
    assert not r.exists(keys.lists(prefix))

    store.schedule(
        Due(now + 60_000, task_id="far"), dest, kombu_payload("far"), ORDINARY, 30_000, siblings=others
    )
    with DelayControl(redis_server.url, {"global_keyprefix": prefix} if prefix else {}) as control:
        assert control.reschedule("far", countdown=30 * 86_400) == 1
    assert r.pttl(keys.lists(prefix)) > 30 * 86_400_000


def test_a_queues_entry_of_its_other_lists_goes_however_its_last_message_goes(
    r: redis.Redis, redis_server, prefix: str
) -> None:
    """Only a move of a queue's last message deleted its entry: one cancelled, purged,
    rescheduled to now or expired left it, and every publish of such a queue renewed the hash,
    so each short-lived queue that ever was kept one. A reschedule of the last message ahead
    keeps it, and one to now renews the other lists before it goes."""
    from kombu_delay.control import DelayControl

    _, start = _bucket(r)
    store = Store(r, prefix)
    ways = ("cancel", "purge", "now", "expired", "ahead", "not last")
    dests = {way: f"{prefix}q-{way.replace(' ', '-')}" for way in ways}
    others = {way: [f"{dest}{keys.KOMBU_PRIORITY_SEP}3"] for way, dest in dests.items()}
    for way, dest in dests.items():
        for n in range(2 if way == "not last" else 1):
            due = Due(start + 10 + n, task_id=f"{way}-{n}")
            store.schedule(due, dest, kombu_payload(due.task_id), ORDINARY, 30_000, siblings=others[way])
    assert sorted(r.hkeys(keys.lists(prefix))) == sorted(d.encode() for d in dests.values())
    r.rpush(others["now"][0], "a message of the other list")
    with DelayControl(redis_server.url, {"global_keyprefix": prefix} if prefix else {}) as control:
        assert control.cancel("cancel-0") == 1
        assert control.purge("q-purge") == 1
        assert control.reschedule("now-0", countdown=-1) == 1
        assert control.reschedule("ahead-0", countdown=3 * 86_400) == 1
        assert control.cancel("not last-0") == 1
    r.delete(keys.queue_set(prefix, start, dests["expired"]))  # as its expiry would
    store.move_due(10, now_ms=start + 10)  # settles the expired one's count
    assert sorted(r.hkeys(keys.lists(prefix))) == [dests["ahead"].encode(), dests["not last"].encode()]
    assert 0 < r.pttl(others["now"][0]) <= 30_000  # renewed with the push, as kombu's publish would
    assert r.llen(dests["now"]) == 1


def test_a_queues_entry_of_its_other_lists_goes_when_its_bucket_lost_its_meta_hash(
    r: redis.Redis, prefix: str
) -> None:
    """A bucket whose meta hash was lost (evicted, deleted) is counted again from its sets, with
    no note of the queue's expiry: its last message's move left the queue's entry in <ns>lists,
    which every later publish of another such queue renewed."""
    _, start = _bucket(r)
    store, dest = Store(r, prefix), f"{prefix}q-lost-meta"
    others = [f"{dest}{keys.KOMBU_PRIORITY_SEP}3"]
    for n in range(3):
        due = Due(start + 10 + n, task_id=f"lost-{n}")
        store.schedule(due, dest, kombu_payload(due.task_id), ORDINARY, 30_000, siblings=others)
    assert r.hexists(keys.lists(prefix), dest)
    r.delete(keys.meta(prefix, start))
    for _ in range(3):  # counted again, then moved
        store.move_due(10, now_ms=start + 20)
    assert r.llen(dest) == 3 and not store.counts()
    assert not r.hexists(keys.lists(prefix), dest)


def test_a_queues_entry_of_its_other_lists_is_written_again_by_a_publish_not_first_in_its_bucket(
    r: redis.Redis, prefix: str
) -> None:
    """Two publishers of one x-expires queue, one that knows its expiry and one that does not:
    the move of the last message of the one that does not deleted the entry, and a publish of
    the one that does, behind the other's in a bucket, did not write it again. The push then
    renewed its own list only, and the queue's other lists expired with what they held."""
    _, start = _bucket(r)
    # A user of the documented ACL line, which grants no HEXISTS: its refusal read as an entry.
    r.execute_command("ACL", "SETUSER", "mixed", "reset", "on", ">pw", "~*", "&*", "+@all", "-hexists")
    user = redis.Redis(
        host=r.connection_pool.connection_kwargs["host"],
        port=r.connection_pool.connection_kwargs["port"],
        username="mixed",
        password="pw",
    )
    store, dest = Store(user, prefix), f"{prefix}q-mixed"
    others = [f"{dest}{keys.KOMBU_PRIORITY_SEP}9"]
    r.rpush(others[0], "a message of the other list")
    r.pexpire(others[0], 30_000)
    aware = {"expires_ms": 30_000, "siblings": others}

    def publish(due: int, task_id: str, **options: Any) -> None:
        store.schedule(Due(due, task_id=task_id), dest, kombu_payload(task_id), ORDINARY, **options)

    publish(start + 10, "unaware-1")
    assert store.move_due(10, now_ms=start + 10).moved == 1
    assert not r.hexists(keys.lists(prefix), dest)
    later = start + WIDTH
    publish(later + 10, "unaware-2")
    publish(later + 20, "aware", **aware)  # not first in its bucket
    assert r.hexists(keys.lists(prefix), dest)
    r.pexpire(others[0], 5_000)
    assert store.move_due(10, now_ms=later + 20).moved == 2
    assert 5_000 < r.pttl(others[0]) <= 30_000  # renewed with the push, as kombu's publish would
