"""A publish due well ahead is judged by the publisher's estimate of Redis's clock, read once
in a while, not by a TIME call in every publish: never early, and nothing lost when the
estimate is wrong (kombu_delay/store/clock.py)."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable

import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import Store, clock, keys, spaces
from kombu_delay.store.replies import Scheduled
from tests.support.stored import calls, kombu_payload, redis_ms

HOUR_MS = 3_600_000


class SteppedClock:
    """A monotonic clock that a test can step: as if Redis's clock had been stepped the other
    way since the publisher's last reading."""

    def __init__(self) -> None:
        self.step_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.step_s


def read_clock(
    r: redis.Redis, monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time
) -> clock.RedisClock:
    """A clock with a usable reading, taken now. On a busy machine a round trip may take longer
    than MAX_ROUND_TRIP_S, and such a reading gives no estimate until the next refresh: read
    again, as often as it takes (within reason)."""
    for _ in range(200):
        estimate = clock.RedisClock(r, monotonic=monotonic, wall=wall)
        if estimate.estimate_ms() is not None:
            return estimate
    raise AssertionError("200 readings of Redis's clock in a row took longer than MAX_ROUND_TRIP_S")


def estimating_store(r: redis.Redis, prefix: str) -> Store:
    """A store whose estimate of Redis's clock has a usable reading."""
    store = Store(r, prefix)
    store.redis_clock = read_clock(r)
    return store


def stepped_store(r: redis.Redis, prefix: str) -> tuple[Store, SteppedClock]:
    store = Store(r, prefix)
    stepped = SteppedClock()
    # The reading, before any step.
    store.redis_clock = read_clock(r, monotonic=stepped, wall=lambda: time.time() + stepped.step_s)
    return store, stepped


def test_a_publish_well_ahead_asks_redis_no_time(r: redis.Redis, prefix: str) -> None:
    store, settings, queue = estimating_store(r, prefix), Settings(compress_after_ms=0), f"{prefix}q"
    base = redis_ms(r)
    store.schedule(Due(base + 60_000, task_id="first"), queue, kombu_payload("first"), settings)
    r.config_resetstat()
    for i in range(50):
        result = store.schedule(Due(base + 60_000, task_id=f"t{i}"), queue, kombu_payload(f"t{i}"), settings)
        assert result.outcome is Scheduled.STORED
    assert calls(r, "time") == 0
    # Due now: judged by Redis's clock, and pushed as plain kombu would.
    result = store.schedule(Due(base - 1, task_id="now"), queue, kombu_payload("now"), settings)
    assert result.outcome is Scheduled.PUSHED_NOW
    assert calls(r, "time") == 1
    # Due within the margin of the estimate (or already): Redis's clock again.
    store.schedule(Due(base + clock.MARGIN_MS // 2, task_id="near"), queue, kombu_payload("near"), settings)
    assert calls(r, "time") == 2


def test_an_estimate_ahead_of_redis_never_pushes_early(r: redis.Redis, prefix: str) -> None:
    store, stepped = stepped_store(r, prefix)
    stepped.step_s = HOUR_MS / 1000  # the estimate runs an hour ahead of Redis
    settings, queue = Settings(compress_after_ms=0), f"{prefix}q"
    for name, ahead_ms in (("soon", 5_000), ("later", 30 * 60_000), ("far", 2 * HOUR_MS)):
        due = redis_ms(r) + ahead_ms
        result = store.schedule(Due(due, task_id=name), queue, kombu_payload(name), settings)
        assert result.outcome is Scheduled.STORED, name
        assert result.due_ms == due
    assert r.llen(queue) == 0
    moved = store.move_due(100)
    assert moved.moved == 0
    assert r.llen(queue) == 0


def test_an_estimate_behind_redis_stores_a_due_message_for_the_mover(r: redis.Redis, prefix: str) -> None:
    """A message already due by Redis's clock, that the estimate takes for one due ahead, is
    stored rather than pushed, and the next move delivers it: late by one move, not lost."""
    store, stepped = stepped_store(r, prefix)
    stepped.step_s = -HOUR_MS / 1000  # the estimate runs an hour behind Redis
    settings, queue = Settings(compress_after_ms=0), f"{prefix}q"
    overdue = kombu_payload("overdue")
    result = store.schedule(Due(redis_ms(r) - 30 * 60_000, task_id="overdue"), queue, overdue, settings)
    assert result.outcome is Scheduled.STORED
    ahead = kombu_payload("ahead")
    store.schedule(Due(redis_ms(r) + 60_000, task_id="ahead"), queue, ahead, settings)
    assert r.llen(queue) == 0
    # Its bucket outlives the mover's coming: it expires a grace after its end, by Redis's clock.
    for stored_set in r.keys(f"{keys.ns(prefix)}z:*"):
        assert r.pttl(stored_set) > settings.grace_ms - HOUR_MS
    moved = store.move_due(100)
    assert moved.moved == 1
    assert r.lrange(queue, 0, -1) == [overdue.encode()]
    assert [s.payload for s in store.find("ahead")] == [ahead.encode()]


def test_a_slow_reading_is_not_used(r: redis.Redis) -> None:
    """A reading whose round trip took too long gives no estimate: Redis's clock judges."""
    ticks = itertools.count(0.0, clock.MAX_ROUND_TRIP_S * 2)  # each reading of it takes that long
    slow = clock.RedisClock(r, monotonic=lambda: next(ticks))
    assert slow.judge_by(redis_ms(r) + HOUR_MS) is None


def test_the_estimate_is_read_again_after_the_refresh(r: redis.Redis) -> None:
    now = [1000.0]
    estimate = clock.RedisClock(r, monotonic=lambda: now[0], wall=lambda: now[0])
    before = redis_ms(r)
    r.config_resetstat()
    first = estimate.estimate_ms()
    assert first is not None and before <= first < before + 30_000  # (a stall between the lines)
    now[0] += clock.REFRESH_S / 2
    estimate.estimate_ms()
    assert calls(r, "time") == 1
    now[0] += clock.REFRESH_S
    estimate.estimate_ms()
    assert calls(r, "time") == 2


def test_the_arguments_of_a_publish_well_ahead(r: redis.Redis, prefix: str) -> None:
    """The estimate goes first among the optional arguments: almost every publish sends it."""
    store, settings = estimating_store(r, prefix), Settings(compress_after_ms=0)
    due = Due(redis_ms(r) + 120_000, task_id="a")
    _, args = store._schedule_call(spaces.ORDINARY, due, f"{prefix}q", "{}", settings)
    assert len(args) == 8
    assert abs(int(args[6]) - redis_ms(r)) < 30_000 and args[7] == 1  # (a stall between the lines)


def test_the_estimate_is_read_again_when_the_machine_slept(r: redis.Redis) -> None:
    """A suspended machine's monotonic clock stands still while its wall clock (and Redis's)
    goes on: the estimate is read again at once, not a refresh later."""
    mono, wall = [1000.0], [time.time()]
    estimate = clock.RedisClock(r, monotonic=lambda: mono[0], wall=lambda: wall[0])
    estimate.estimate_ms()
    r.config_resetstat()
    wall[0] += clock.MAX_PARTING_S / 2
    mono[0] += clock.MAX_PARTING_S / 2
    estimate.estimate_ms()
    assert calls(r, "time") == 0
    wall[0] += 2 * 3600  # two hours asleep: the monotonic clock stood still
    estimate.estimate_ms()
    assert calls(r, "time") == 1


def test_an_estimate_late_by_more_than_the_grace_loses_nothing(r: redis.Redis, prefix: str) -> None:
    """A message overdue by more than delay_grace, that an estimate three hours late takes for
    one due ahead, is stored with expiries set by Redis's clock: kept until the move."""
    store, stepped = stepped_store(r, prefix)
    stepped.step_s = -3 * HOUR_MS / 1000
    settings, queue = Settings(compress_after_ms=0, grace_ms=HOUR_MS, bucket_width_ms=1000), f"{prefix}q"
    overdue = kombu_payload("overdue")
    result = store.schedule(Due(redis_ms(r) - 2 * HOUR_MS, task_id="overdue"), queue, overdue, settings)
    assert result.outcome is Scheduled.STORED
    [stored_set] = r.keys(f"{keys.ns(prefix)}z:*")
    assert r.pttl(stored_set) > HOUR_MS - 60_000
    moved = store.move_due(100)
    assert (moved.moved, moved.expired) == (1, 0)
    assert r.lrange(queue, 0, -1) == [overdue.encode()]


def test_only_a_due_time_a_margin_before_the_estimate_is_surely_past(r: redis.Redis) -> None:
    """What a publisher pushes at once, as plain kombu (no script): a message due at least
    MARGIN_MS before Redis's clock as estimated; a nearer one, or any with no usable reading, goes
    through the script, which judges it by Redis's clock."""
    frozen = 1000.0
    estimate = clock.RedisClock(r, monotonic=lambda: frozen, wall=lambda: frozen)
    now = estimate.estimate_ms()
    assert now is not None
    edge = math.floor(now) - clock.MARGIN_MS
    assert estimate.surely_past(edge) and estimate.surely_past(edge - HOUR_MS)
    assert not estimate.surely_past(edge + 1)
    assert not estimate.surely_past(int(now))
    ticks = itertools.count(0.0, clock.MAX_ROUND_TRIP_S * 2)
    slow = clock.RedisClock(r, monotonic=lambda: next(ticks))
    assert not slow.surely_past(0)


def test_a_store_pushes_at_once_only_what_is_surely_due(r: redis.Redis, prefix: str) -> None:
    store, now = estimating_store(r, prefix), redis_ms(r)
    assert store.surely_due(Due(now - 60_000))
    assert not store.surely_due(Due(now + 60_000))
    assert not store.surely_due(Due(-1, relative=True))  # a delay is always the script's
    # With a clock of its own (tests), by that clock.
    fixed = Store(r, prefix, clock=lambda: now)
    assert fixed.surely_due(Due(now)) and not fixed.surely_due(Due(now + 1))


def test_the_schedule_script_pushes_what_is_due_by_its_millisecond_and_stores_the_next(
    r: redis.Redis, prefix: str
) -> None:
    # Only the store's own check (above) had a test at the millisecond: the script judging by
    # the same clock could push a message due a millisecond later, early, and nothing failed.
    store, now = Store(r, prefix), redis_ms(r)
    outcomes = [
        store.schedule(
            Due(now + d, task_id=f"t{d}"), f"{prefix}q", kombu_payload(f"t{d}"), Settings(), now_ms=now
        ).outcome
        for d in (-1, 0, 1, 2)
    ]
    assert outcomes == [Scheduled.PUSHED_NOW, Scheduled.PUSHED_NOW, Scheduled.STORED, Scheduled.STORED]
    assert r.llen(f"{prefix}q") == 2


def test_a_move_call_s_deadline_allows_a_second_then_longer_after_a_late_one() -> None:
    # The deadline of a move call (move.lua moves nothing past it): the time it is sent, by
    # Redis's clock as the last reply told it, plus a second; twice as long after each call that
    # came late, up to the client's socket_timeout (a minute without one), and a second again
    # after one in time. A socket_timeout under a millisecond gave every call a deadline already
    # past as it ran; one of 10 s let a call the server read 6 s late push what it would.
    seconds = [100.0]
    for timeout, longest in ((10.0, 10_000), (0.0009, clock.LEAST_WAIT_MS), (None, clock.NO_TIMEOUT_WAIT_MS)):
        give_up = clock.GiveUp(redis.Redis(port=1, socket_timeout=timeout), monotonic=lambda: seconds[0])
        assert give_up.deadline() == ""  # no reply heard yet: none
        give_up.heard(5_000_000)
        seconds[0] += 2.5
        assert give_up.deadline() == str(5_000_000 + 2_500 + clock.LEAST_WAIT_MS)
        allowed = []
        for _ in range(8):
            give_up.heard(5_000_000, late=True)
            allowed.append(int(give_up.deadline(sent_ms=0)))
        assert allowed == [min(longest, clock.LEAST_WAIT_MS * 2**n) for n in range(1, 9)]
        give_up.heard(5_000_000)  # another call's reply (a heartbeat's): the allowance stays
        assert give_up.deadline(sent_ms=7_000) == str(7_000 + allowed[-1])
        give_up.heard(5_000_000, late=False)
        assert give_up.deadline(sent_ms=7_000) == str(7_000 + clock.LEAST_WAIT_MS)
