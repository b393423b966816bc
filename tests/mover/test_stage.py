"""A mover's staging (kombu_delay/mover/stage.py): which herds it copies ahead, when, and the
whole path through a real mover process: a herd handed over at its due time, each once."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.mover import stage, thaw_plan
from kombu_delay.mover.stage import Stager
from kombu_delay.store import Store, keys
from kombu_delay.store.replies import Scheduled
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.procs import wait_until
from tests.support.stored import ORDINARY, FakeClock, kombu_payload, redis_ms, schedule_herd, tags_in

MIN_RUN = 1000


def schedule(store: Store, dest: str, due: int, n: int, name: str = "h") -> None:
    schedule_herd(store, dest, due, [f"{name}{i}" for i in range(n)])


def staged(r: redis.Redis, prefix: str) -> dict[str, int]:
    found = r.scan_iter(match=keys.ns(prefix) + "h:*", count=1000)
    return {key.decode().rsplit(":", 1)[-1]: int(r.llen(key)) for key in found}


def run_steps(stager: Stager, steps: int = 20) -> None:
    """Steps of a stager whose clock moves 2 s a step, so each step may plan: a run is copied
    once two plans found its count unchanged."""
    for _ in range(steps):
        stager.step()


def ticking(step: int = 2) -> Callable[[], float]:
    """A clock for a stager that moves ``step`` s (2 by default) each time it is read."""
    ticks = iter(range(0, 100_000, step))
    return lambda: float(next(ticks))


def next_start(clock: FakeClock) -> int:
    """The start of the ordinary bucket after the one ``clock`` reads now."""
    return (clock() // ORDINARY.bucket_width_ms + 1) * ORDINARY.bucket_width_ms


def next_bucket(r: redis.Redis, prefix: str) -> tuple[FakeClock, Store, int]:
    """A driven clock, a store on it, and a time 10 ms into the next ordinary bucket."""
    clock = FakeClock(r)
    return clock, Store(r, prefix, clock=clock), next_start(clock) + 10


def test_a_herd_is_copied_once_its_lead_has_come_and_small_or_distant_runs_are_not(
    r: redis.Redis, prefix: str
) -> None:
    clock, store, soon = next_bucket(r, prefix)
    schedule(store, f"{prefix}big", soon, 3000)
    schedule(store, f"{prefix}small", soon, 500, name="s")
    # Due in an hour: 3,000 at the assumed rate need seconds of lead, not an hour.
    schedule(store, f"{prefix}far", soon + 3_600_000, 3000, name="f")
    clock.ms = soon - 1000  # 3,000 at the assumed rate need 2.3 s of lead
    stager = Stager(store, ORDINARY, "t", monotonic=ticking(), min_run=MIN_RUN)

    run_steps(stager)
    assert staged(r, prefix) == {"big": 3000}
    run_steps(stager)  # the next plan: the staged run is settled, nothing is copied again
    assert staged(r, prefix) == {"big": 3000}

    clock.ms = soon + 3_600_000 - 2000
    run_steps(stager)
    assert staged(r, prefix) == {"big": 3000, "far": 3000}


def test_a_herd_late_in_its_bucket_is_copied_by_its_own_due_time_not_the_buckets_start(
    r: redis.Redis, prefix: str
) -> None:
    # Judged by its bucket's start, a herd due 58 s into its minute was copied 60 s ahead, not
    # its lead (2 s for 3,000), and held twice in Redis's memory all that time.
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    width = ORDINARY.bucket_width_ms
    start = next_start(clock)
    due = start + width - 2000
    schedule(store, f"{prefix}late", due, 3000)
    clock.ms = start + 1000  # past its bucket's start by more than its lead: 57 s before due
    run_steps(Stager(store, ORDINARY, "t", monotonic=ticking(), min_run=MIN_RUN))
    assert staged(r, prefix) == {}
    clock.ms = due - 1000  # within its lead
    run_steps(Stager(store, ORDINARY, "t", monotonic=ticking(), min_run=MIN_RUN))
    assert staged(r, prefix) == {"late": 3000}


def test_a_herds_set_of_another_type_is_passed_over_and_the_others_are_copied(
    r: redis.Redis, prefix: str
) -> None:
    # The plan kept a run whose set had no head to read (of another type, by hand), and the
    # copy failed on it at every step: the error held up the mover's loop, and every queue's
    # moves, until the herd was due.
    clock, store, soon = next_bucket(r, prefix)
    schedule(store, f"{prefix}bad", soon, 3000, name="b")
    schedule(store, f"{prefix}big", soon, 3000)
    bad = keys.queue_set(prefix, soon - soon % ORDINARY.bucket_width_ms, f"{prefix}bad")
    r.delete(bad)
    r.set(bad, "by hand")
    clock.ms = soon - 1000
    told: list[BaseException] = []
    stager = Stager(store, ORDINARY, "t", monotonic=ticking(), min_run=MIN_RUN, told=told.append)
    run_steps(stager)  # raised WrongTypeKey at each step
    assert staged(r, prefix) == {"big": 3000} and told == []
    assert r.get(bad) == b"by hand"


def test_no_copy_with_a_rate_cap_a_queue_cap_or_too_little_free_memory(
    r: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = next_start(clock) + 10
    clock.ms = due - 1000  # within the run's lead
    schedule(store, f"{prefix}q", due, 3000)
    for settings in (Settings(max_rate=100), Settings(max_queue_length=10)):
        stager = Stager(store, settings, "t", min_run=MIN_RUN)
        assert not stager.enabled
        stager.step()
    assert staged(r, prefix) == {}

    # A maxmemory whose share is less than the herd's own set takes (Redis uses more still, so
    # under noeviction nothing is evicted): no room, whatever else Redis frees meanwhile. Half
    # of the used_memory read just before failed under load, where that read was swollen for a
    # moment (buffers, a lazy free) and Redis soon used less than the copy needs below it.
    # The plan leaves the copy out: Redis is never asked, and so never refuses it (``told``).
    limit = 2**20
    herd = keys.queue_set(prefix, due - due % ORDINARY.bucket_width_ms, f"{prefix}q")
    assert r.memory_usage(herd) > limit * stage.MEMORY_SHARE
    r.config_set("maxmemory", str(limit))
    try:
        told: list[BaseException] = []
        with caplog.at_level(logging.INFO, logger="kombu_delay.mover.stage"):
            run_steps(Stager(store, ORDINARY, "t", monotonic=ticking(), min_run=MIN_RUN, told=told.append))
        assert staged(r, prefix) == {} and told == []
        # Said, once (a herd moved in batches, late by their time, said nothing of why).
        said = [rec.getMessage() for rec in caplog.records if "is not copied ahead" in rec.getMessage()]
        assert len(said) == 1 and "a herd of 3000 messages" in said[0] and "maxmemory" in said[0], said
        r.config_set("maxmemory", str(2**31))
        run_steps(Stager(store, ORDINARY, "t", monotonic=ticking(), min_run=MIN_RUN))
        assert staged(r, prefix) == {"q": 3000}
    finally:
        r.config_set("maxmemory", "0")


def test_a_copy_that_takes_redis_past_its_share_of_maxmemory_is_dropped_and_not_made_again(
    r: redis.Redis, prefix: str
) -> None:
    # The plan's size of a herd is MEMORY USAGE's, from a sample of its first members: a herd of
    # small first members and large later ones was copied to 102 % of maxmemory (and under
    # allkeys-lru, Redis evicted the herd's own set to make room). Each step now looks again.
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = next_start(clock) + 10
    clock.ms = due - 1000  # within the run's lead
    # Messages of 2 KB: the copy is large beside what Redis's own use moves by between two reads
    # (client buffers: hundreds of KB), which made small ones pass under the share now and then.
    body = "A" * 2000
    herd = [(Due(due, task_id=f"h{i}"), f"{prefix}q", kombu_payload(f"h{i}", body=body)) for i in range(3000)]
    store.schedule_many(herd, ORDINARY)
    stager = Stager(store, ORDINARY, "t", monotonic=ticking(), min_run=MIN_RUN)
    r.config_set("maxmemory", str(int(r.info("memory")["used_memory"]) + 2**30))
    try:
        for _ in range(20):  # until a first batch is copied: 2,000 of the 3,000
            stager.step()
            if staged(r, prefix):
                break
        assert staged(r, prefix) == {"q": stage.STAGE_BATCH}
        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory", str(int(used / 0.95)))  # past 80 % of it (95 %), not past it
        stager.step()
        assert staged(r, prefix) == {}
        r.config_set("maxmemory", str(used + 2**30))
        run_steps(stager)
        assert staged(r, prefix) == {}  # not made again while its herd is as it was
    finally:
        r.config_set("maxmemory", "0")
    assert r.zcard(keys.queue_set(prefix, due - due % ORDINARY.bucket_width_ms, f"{prefix}q")) == 3000


def moved_as_release_1_0_moves(r: redis.Redis, prefix: str, start: int, dest: str) -> None:
    """Move a bucket's set for ``dest`` as a mover of 1.0.0 did, which knew nothing of copies:
    in batches, its members pushed and taken out, their counts taken off, the copy left."""
    zset, meta = keys.queue_set(prefix, start, dest), keys.meta(prefix, start)
    members = r.zrange(zset, 0, -1)
    r.lpush(dest, *members)
    r.zrem(zset, *members)
    r.hincrby(meta, f"q:{dest}", -len(members))
    r.hdel(keys.counts(prefix), dest)


def test_a_copy_whose_herd_a_mover_of_1_0_moved_in_batches_goes_with_its_bucket(
    r: redis.Redis, prefix: str
) -> None:
    # During an upgrade (new movers beside 1.0.0 ones): a copy of 10,000 messages of 1 KB, 10 MB,
    # outlived its herd by the bucket's grace, 7 days.
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    width, dest = ORDINARY.bucket_width_ms, f"{prefix}q"
    start = next_start(clock)
    due = start + width // 2
    schedule(store, dest, due, 3000)
    clock.ms = due - 1000
    run_steps(Stager(store, ORDINARY, "t", monotonic=ticking(), min_run=MIN_RUN))
    assert staged(r, prefix) == {"q": 3000}
    # Its expiry: at most an hour past its due time (a 1.0.0 mover's clean-up drops no copy),
    # however long its bucket's grace.
    before = redis_ms(r)  # read first: the copy's time left can only have shrunk since
    left = r.pttl(keys.staged(prefix, start, dest))
    assert 0 < left <= due + 3_600_000 - before + 5  # (5 ms: the clock's rounding)
    clock.ms = due
    moved_as_release_1_0_moves(r, prefix, start, dest)
    store.move_due(1000)  # finds it drained: retired
    clock.ms = start + width + 1  # the bucket has ended: its clean-up, 1,000 task ids a call
    for _ in range(10):
        if not store.move_due(1000).more:
            break
    assert staged(r, prefix) == {}
    assert r.llen(dest) == 3000


def test_a_mover_delivers_a_herd_at_its_due_time_each_message_once(r: redis.Redis, start_mover) -> None:
    """A herd a mover process copies ahead and hands over. Whether the copy is whole by the due
    time depends on the machine's speed (the lead is a few seconds): a late one moves the herd
    in batches, as correctly. The tests above, on a driven clock, show when the copy is made;
    this one that a real mover delivers the herd on time and once either way."""
    n = stage.MIN_RUN + 2000
    store = Store(r)
    dest = "herd"
    due = redis_ms(r) + 20_000  # the mover's start, a plan and six copy steps come first
    # A stager plans by bucket start: just past one, the copy would begin only 2 s before due.
    due += max(0, 5_000 - due % 60_000)
    schedule(store, dest, due, n)
    mover = start_mover()
    early = 0
    while True:  # LLEN first, Redis's clock after: a message seen before due is early
        length = r.llen(dest)
        if redis_ms(r) >= due:
            break
        early = max(early, length)
        time.sleep(0.01)  # a sample every 10 ms, not a wait for anything
    wait_until(lambda: r.llen(dest) == n, timeout=60)
    assert early == 0
    delivered = Counter(tags_in(r, dest))
    assert set(delivered) == {f"h{i}" for i in range(n)} and set(delivered.values()) == {1}
    assert store.counts() == {} and staged(r, "") == {}
    assert mover.stop() == 0, mover.output()


def test_a_herd_still_being_published_is_copied_once_it_settles(r: redis.Redis, prefix: str) -> None:
    clock, store, due = next_bucket(r, prefix)
    clock.ms = due - 1000
    dest = f"{prefix}q"
    stager = Stager(store, ORDINARY, "t", monotonic=ticking(), min_run=MIN_RUN)
    copies: list[int] = []  # the limit of each stage call that may copy (0: it only looks)
    stage_call = store.stage
    store.stage = lambda *args: copies.append(args[2]) or stage_call(*args)  # type: ignore[method-assign]
    schedule(store, dest, due, 2000)
    for more in range(3):
        stager.step()  # each look finds the run grown since the last: no copy is begun
        schedule(store, dest, due, 500, name=f"m{more}-")
    assert copies and set(copies) == {0}
    run_steps(stager)
    assert staged(r, prefix) == {"q": 3500}


def test_a_herd_is_copied_while_its_queue_gets_other_messages_before_and_after_it(
    r: redis.Redis, prefix: str
) -> None:
    clock, store, due = next_bucket(r, prefix)
    due += 990
    clock.ms = due - 1500
    dest = f"{prefix}q"
    stager = Stager(store, ORDINARY, "t", monotonic=ticking(), min_run=MIN_RUN)
    schedule(store, dest, due, 3000)
    for i in range(12):  # steady traffic into the same set, none at the herd's millisecond
        stager.step()
        schedule(store, dest, due + 100 + i, 1, name=f"after{i}-")
        schedule(store, dest, due - 100 - i, 1, name=f"before{i}-")
    assert staged(r, prefix) == {"q": 3000}
    clock.ms = due
    results = [store.move_due(500).moved for _ in range(3)]
    assert results == [12, 3000, 0]  # what was due before it, then the herd whole


def test_a_publisher_the_acl_refuses_unlink_drops_the_herd_copy_it_makes_wrong() -> None:
    """A message published at a staged herd's millisecond drops the herd's copy: with DEL where
    the ACL refuses the publisher UNLINK (the documented publisher line), and the publish
    succeeds, as a retry would store it twice."""
    with RedisServer() as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "pub", "on", ">pw", "~*", "&*", "+@all", "-unlink")
        clock = FakeClock(admin)
        store = Store(admin, clock=clock)
        width = ORDINARY.bucket_width_ms
        soon = next_start(clock) + 10
        schedule(store, "q", soon, 3000)
        clock.ms = soon - 1000
        run_steps(Stager(store, ORDINARY, "t", monotonic=ticking(), min_run=MIN_RUN))
        assert staged(admin, "") == {"q": 3000}
        publisher = Store(server.client(username="pub", password="pw"), clock=clock)
        result = publisher.schedule(Due(soon, task_id="late"), "q", kombu_payload("late"), ORDINARY)
        assert result.outcome is Scheduled.STORED
        assert staged(admin, "") == {}
        assert not admin.hget(keys.meta("", soon - soon % width), "h:q")
        clock.ms = soon
        while store.move_due(1000).more:
            pass
        assert Counter(tags_in(admin, "q")) == Counter([*(f"h{i}" for i in range(3000)), "late"])


def test_a_mover_that_thaws_or_copies_slowly_copies_a_herd_earlier(r: redis.Redis, prefix: str) -> None:
    clock, store, soon = next_bucket(r, prefix)
    schedule(store, f"{prefix}q", soon, 3000)
    clock.ms = soon - 5000  # 3,000 need 2.3 s of lead at RATE, 8 s at 1,000 a second
    run_steps(Stager(store, ORDINARY, "t", monotonic=ticking(), min_run=MIN_RUN))
    assert staged(r, prefix) == {}

    slow_thaw = thaw_plan.Rate()
    slow_thaw.add(1000, 1.0)  # this mover's thaws: 1,000 a second
    # Its copies: 2,000 a step, a step every second of this clock: 2,000 a second.
    stager = Stager(store, ORDINARY, "t", monotonic=ticking(1), min_run=MIN_RUN, thaw_rate=slow_thaw)
    assert stager.assumed_rate() == 1000
    run_steps(stager)
    assert staged(r, prefix) == {"q": 3000}
    assert stager.rate.measured and stager.assumed_rate() == stager.rate.per_s == 2000

    # The next herd is planned at its copies' rate, not its thaws': 3,000 at 2,000 a second
    # need 5 s of lead (at 1,000 a second, 8 s).
    later = soon + 2 * ORDINARY.bucket_width_ms
    schedule(store, f"{prefix}q2", later, 3000, name="l")
    clock.ms = later - 6000
    run_steps(stager)
    assert "q2" not in staged(r, prefix)
    clock.ms = later - 5000
    run_steps(stager)
    assert staged(r, prefix)["q2"] == 3000

    fast_thaw = thaw_plan.Rate()
    fast_thaw.add(100_000, 1.0)
    assert Stager(store, ORDINARY, "t", thaw_rate=fast_thaw).assumed_rate() == stage.RATE  # never above it
