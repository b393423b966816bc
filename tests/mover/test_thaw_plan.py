"""Thaw planning: a cold bucket too large to thaw within ``delay_thaw_ahead`` starts early
enough to be in the ordinary space by its due time; several movers share a thaw and never
restore a message twice. Time is driven (the store's clock and the thaw's own), never waited
for."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.mover import thaw_plan
from kombu_delay.mover.tally import MoverStats
from kombu_delay.mover.thaw import Thawer
from kombu_delay.store import Store, cold, keys
from kombu_delay.store.replies import BucketCounts
from tests.support.stored import FakeClock, kombu_payload

#: Short spans: a message due more than 6 s ahead is stored compressed, thawed 5 s ahead.
FAST = Settings(compress_after_ms=6000, thaw_ahead_ms=5000)
NOW = 1_700_000_000_000
S = 1000


def bucket(start_s: float, count: int, width_s: float = 60) -> BucketCounts:
    start = NOW + int(start_s * S)
    return BucketCounts(start, start + int(width_s * S), count)


# (buckets, rate/s, expected horizon - NOW in s, expected next start - NOW in s or None)
PLANS = [
    pytest.param([], 10_000, 30, None, id="nothing stored: the minimum lead"),
    pytest.param([bucket(20, 1000)], 10_000, 30, None, id="small bucket: the minimum lead is enough"),
    # 1,000,000 at 10,000/s take 100 s, planned as 200 s (SAFETY) + 2 s (MARGIN).
    pytest.param([bucket(150, 1_000_000)], 10_000, 210, None, id="herd: covered to its end"),
    pytest.param([bucket(300, 1_000_000)], 10_000, 30, 98, id="herd further out: begins in 98 s"),
    pytest.param([bucket(300, 1_000_000)], 40_000, 30, 248, id="a faster rate begins later"),
    # The later bucket waits behind the earlier one: its lead counts both (1.2 M: 242 s).
    pytest.param(
        [bucket(100, 200_000), bucket(230, 1_000_000)], 10_000, 290, None, id="lead counts what is before"
    ),
    pytest.param(
        [bucket(30, 200_000), bucket(300, 1_000_000)], 10_000, 90, 58, id="first herd now, second later"
    ),
    pytest.param([bucket(20, 10**9)], 0.5, 80, None, id="the rate is never taken below MIN_RATE"),
]


@pytest.mark.parametrize(("buckets", "rate", "horizon_s", "next_s"), PLANS)
def test_plan(buckets: list[BucketCounts], rate: float, horizon_s: float, next_s: float | None) -> None:
    planned = thaw_plan.plan(NOW, buckets, 30 * S, rate)
    assert planned.horizon_ms == NOW + horizon_s * S
    assert planned.next_start_ms == (None if next_s is None else NOW + next_s * S)


def test_the_lead_grows_with_the_herd_and_never_falls_below_the_margin() -> None:
    assert thaw_plan.lead_ms(0, 10_000) == thaw_plan.MARGIN_MS
    assert thaw_plan.lead_ms(1_000_000, 10_000) == 200_000 + thaw_plan.MARGIN_MS
    assert thaw_plan.lead_ms(2_000_000, 10_000) == 400_000 + thaw_plan.MARGIN_MS


def test_the_rate_is_measured_over_windows_and_damped() -> None:
    rate = thaw_plan.Rate()
    assert rate.per_s == thaw_plan.DEFAULT_RATE and not rate.measured
    assert rate.told() == "5000/s, assumed until measured"
    rate.add(1000, 0.1)  # shorter than a window: not yet a measurement
    assert rate.per_s == thaw_plan.DEFAULT_RATE
    rate.add(9000, 0.4)  # 10,000 in 0.5 s
    assert rate.measured and rate.per_s == 20_000 and rate.told() == "20000/s measured"
    rate.add(5000, 0.5)  # a window at 10,000/s moves the estimate half way
    assert rate.per_s == 15_000
    rate.add(1, 10.0)  # the machine paused: the estimate halves at most, and never below MIN_RATE
    assert rate.per_s == (15_000 + 0.1) / 2
    for _ in range(30):
        rate.add(0, 1.0)
    assert rate.per_s == thaw_plan.MIN_RATE
    # A log line must not show the floor as measured (it showed 1000/s where 130/s was).
    assert rate.told().startswith("1000/s, the lowest a plan assumes; measured 0/s")


# -- against Redis -------------------------------------------------------------------------


def herd(store: Store, due: int, n: int, dest: str = "q", tag: str = "h") -> None:
    items = [
        (Due(due, task_id=f"{tag}{i}"), dest, kombu_payload(f"{tag}{i}", body=f"b{i}")) for i in range(n)
    ]
    store.schedule_many(items, FAST)


def cold_count(r: redis.Redis, prefix: str = "") -> int:
    total = 0
    for start in r.zrange(keys.cold_index(prefix), 0, -1):
        meta = r.hgetall(keys.meta(prefix, int(start), keys.COLD))
        total += sum(int(v) for k, v in meta.items() if k.startswith(b"q:"))
    return total


def thawer_of(store: Store, clock: FakeClock, rate: float) -> Thawer:
    """A mover's thaw whose own clock follows the store's, at a known rate."""
    thawer = Thawer(store, FAST, "t", MoverStats(), monotonic=lambda: clock.ms / 1000)
    thawer.rate = thaw_plan.Rate(rate)
    return thawer


def run_thaw(thawer: Thawer) -> int:
    """Thaw steps until one says to wait; return how many were restored."""
    before = thawer.stats.thawed
    while thawer.step() == 0.0:
        pass
    return thawer.stats.thawed - before


def test_a_trickle_of_thaws_measures_no_rate_and_a_herd_does(r: redis.Redis) -> None:
    # A rate was measured from any step that thawed something to the next: a trickle of a few
    # messages a look measured each step's own overhead, some hundreds a second, taken as the
    # mover's rate (MIN_RATE): its herds' thaws and copies then began many times too early.
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    seconds = [0.0]

    def ticking() -> float:  # each step takes 50 ms
        seconds[0] += 0.05
        return seconds[0]

    thawer = Thawer(store, FAST, "t", MoverStats(), monotonic=ticking)
    for n in range(40):
        herd(store, clock() + 10_000, 2, tag=f"t{n}-")
        clock.advance(6_000)
        seconds[0] += 6.0
        assert run_thaw(thawer) == 2
    assert not thawer.rate.measured and thawer.rate.per_s == thaw_plan.DEFAULT_RATE
    herd(store, clock() + 10_000, 6_000, tag="h")
    clock.advance(6_000)
    seconds[0] += 6.0
    assert run_thaw(thawer) == 6_000
    assert thawer.rate.measured and thawer.rate.per_s > thaw_plan.MIN_RATE


def test_cold_buckets_are_counted_earliest_first(r: redis.Redis, prefix: str) -> None:
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    first = clock() + 120_000
    first += 30_000 - first % 60_000  # mid-bucket, so that first + 1 shares its bucket
    herd(store, first, 5, "q1")
    herd(store, first + 1, 2, "q2", tag="x")  # same bucket, another queue
    herd(store, first + 600_000, 3, "q1", tag="y")
    now, buckets = store.cold_buckets(10)
    assert now == clock()
    width = FAST.bucket_width_ms
    start = first - first % width
    assert [(b.start_ms, b.end_ms, b.count) for b in buckets] == [
        (start, start + width, 7),
        (start + 600_000, start + 600_000 + width, 3),
    ]
    assert store.cold_buckets(1)[1] == buckets[:1]


def test_a_plan_reads_a_bucket_s_counts_again_as_often_as_its_distance_asks(r: redis.Redis) -> None:
    """A mover's plans read the counts of the first 256 buckets every second: a million
    messages over 10,000 queues cost Redis about 70 ms a second. A bucket ahead is read again
    once its counts are older than a twentieth of the time until it starts; one begun, always."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    width = FAST.bucket_width_ms
    near = clock() - clock() % width + 30 * width
    far = near + 300 * width  # 330 minutes ahead: read again every 16.5
    herd(store, near, 5, "q1")
    herd(store, far, 3, "q1", tag="f")

    def plan() -> tuple[dict[int, int], int]:
        r.config_resetstat()
        _, buckets = store.cold_buckets(256)
        stats = r.info("commandstats")
        return {b.start_ms: b.count for b in buckets}, int(stats.get("cmdstat_hgetall", {}).get("calls", 0))

    assert plan() == ({near: 5, far: 3}, 2)
    herd(store, far, 2, "q2", tag="g")
    assert plan() == ({near: 5, far: 3}, 0)  # as read: 90 s and 16.5 minutes old at most
    clock.advance((far - clock()) // 20 + 1)
    assert plan() == ({near: 5, far: 5}, 2)
    clock.ms = near
    assert plan() == ({near: 5, far: 5}, 1)
    assert plan() == ({near: 5, far: 5}, 1)  # begun: read at every plan


def test_a_herd_too_large_for_the_minimum_lead_is_thawed_in_time(r: redis.Redis) -> None:
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    n, rate = 3000, 1000.0  # planned lead: 3 s at 1000/s, doubled, + 2 s = 8 s
    due = clock() + 200_000
    due += 30_000 - due % 60_000  # mid-bucket: the bucket starts 30 s before the herd
    start = due - due % 60_000
    herd(store, due, n)
    small_due = start + 120_000 + 30_000  # a message alone in a later bucket
    herd(store, small_due, 1, tag="s")
    assert cold_count(r) == n + 1
    thawer = thawer_of(store, clock, rate)

    clock.ms = start - 8_000  # its lead before its bucket's start: not before the herd's due
    assert run_thaw(thawer) == 0
    clock.ms = due - 9_000
    assert run_thaw(thawer) == 0
    clock.ms = due - 8_000
    assert run_thaw(thawer) == n  # the whole bucket, 8 s before the herd is due
    assert cold_count(r) == 1 and thawer.horizon_ms == start + 60_000
    assert store.move_due(5000).moved == 0  # thawed is not due
    clock.ms = due - 1
    assert store.move_due(5000).moved == 0
    clock.ms = due
    assert store.move_due(5000).moved == n

    # One message is thawed FAST.thaw_ahead ahead of its due time, as ever.
    clock.ms = small_due - FAST.thaw_ahead_ms - 1001
    assert run_thaw(thawer) == 0
    clock.ms = small_due - FAST.thaw_ahead_ms
    assert run_thaw(thawer) == 1
    assert cold_count(r) == 0 and not r.exists(keys.cold_index(""))


def test_a_herd_growing_after_the_plan_is_planned_again(r: redis.Redis) -> None:
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    # Half way through its bucket: one due 4 to 5 s into it was looked for by the minimum lead
    # at 999 ms below (a look between plans), and its new plan came a second later than here.
    due = (clock() // 60_000 + 5) * 60_000 + 30_000
    herd(store, due, 10)
    thawer = thawer_of(store, clock, 1000.0)
    clock.ms = due - 10_000
    assert run_thaw(thawer) == 0  # 10 messages: the minimum lead is enough
    herd(store, due, 4000, tag="late")  # the campaign is published meanwhile: 10 s of lead
    clock.advance(999)
    assert run_thaw(thawer) == 0  # the plan is a second old only: not read again yet
    clock.advance(1)
    assert run_thaw(thawer) == 4010


def test_two_movers_share_a_herd_and_restore_each_message_once(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock(r)
    n = 3000
    due = clock() + 100_000
    herd(Store(r, clock=clock), due, n)
    one, two = (thawer_of(Store(r, clock=clock), clock, 1000.0) for _ in range(2))
    clock.ms = due - 8_000  # 3000 at 1000/s: the planned begin of either mover

    # The worst interleaving: the second mover thaws a whole batch while the first has
    # listed the same members and is restoring them (in Python, between its two scripts).
    unpack, interleaved = cold.unpack, []

    def unpack_after_the_other(member: bytes) -> tuple[str, bytes]:
        if not interleaved:
            interleaved.append(member)
            two.step()
        return unpack(member)

    monkeypatch.setattr(cold, "unpack", unpack_after_the_other)
    first: list[int] = []
    one.on_thaw = lambda result: first.append(result.gone)
    one.step()
    monkeypatch.setattr(cold, "unpack", unpack)
    assert two.stats.thawed == 100 and one.stats.thawed == 0 and first == [100]

    while min(one.step(), two.step()) == 0.0:  # in turns, until neither finds more
        pass
    assert one.stats.thawed + two.stats.thawed == n and one.stats.thawed > 0
    assert cold_count(r) == 0
    clock.ms = due
    store = Store(r, clock=clock)
    assert store.move_due(5000).moved == n and store.move_due(5000).moved == 0
    ids = Counter(json.loads(raw)["properties"]["delivery_tag"] for raw in r.lrange("q", 0, -1))
    assert len(ids) == n and set(ids.values()) == {1}
    assert store.counts() == {} and store.totals().get("scheduled") == n


#: Buckets of 20 ms: a plan's first 256 cover 5 s only.
NARROW = Settings(compress_after_ms=6000, thaw_ahead_ms=5000, bucket_width_ms=20)


def trickle_then_herd(store: Store, first: int, n: int, settings: Settings = NARROW) -> int:
    """One message in each of 300 narrow buckets from ``first``, then ``n`` due at one time in
    the bucket after them, the one a plan must see; return the herd's due time."""
    width = settings.bucket_width_ms
    first -= first % width
    trickle = [(Due(first + i * width, task_id=f"s{i}"), "q", kombu_payload(f"s{i}")) for i in range(300)]
    due = first + 300 * width + width // 2
    items = [(Due(due, task_id=f"h{i}"), "q", kombu_payload(f"h{i}", body=f"b{i}")) for i in range(n)]
    store.schedule_many(trickle + items, settings)
    return due


def test_a_large_bucket_is_planned_behind_any_number_of_small_ones(r: redis.Redis, prefix: str) -> None:
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = trickle_then_herd(store, clock() + 120_000, 1000)
    start = due - due % NARROW.bucket_width_ms
    _, buckets = store.cold_buckets(256)
    assert len(buckets) == 257 and buckets[-1] == BucketCounts(start, start + 20, 1000, (("q", 1000),))
    assert r.zrange(keys.large(prefix, keys.COLD), 0, -1, withscores=True) == [(str(start).encode(), start)]
    # One short of the size is no large bucket.
    herd(store, due + 60_000, 999, tag="y")
    assert r.zcard(keys.large(prefix, keys.COLD)) == 1


def test_a_bucket_of_many_queues_is_noted_by_its_publishes_together(r: redis.Redis, prefix: str) -> None:
    """A herd spread over queues of fewer than 1,000 each is noted once its bucket has taken
    10,000 publishes, in the cold space by the publishes and in the ordinary one by its thaw."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = trickle_then_herd(store, clock() + 120_000, 0)
    start = due - due % NARROW.bucket_width_ms

    def spread(at: int, n: int, tag: str) -> list[tuple[Due, str, str]]:
        return [
            (Due(at, task_id=f"{tag}{i}"), f"{prefix}q{i % 20}", kombu_payload(f"{tag}{i}", body=f"b{i}"))
            for i in range(n)
        ]

    store.schedule_many(spread(due, 10_000, "h") + spread(due + 60_000, 9_999, "y"), NARROW)
    assert r.zrange(keys.large(prefix, keys.COLD), 0, -1) == [str(start).encode()]
    assert not r.exists(keys.large(prefix))
    clock.ms = due - NARROW.thaw_ahead_ms
    while store.thaw(NARROW.thaw_ahead_ms, 1000).thawed:
        pass
    assert r.zrange(keys.large(prefix), 0, -1) == [str(start).encode()]
    assert not r.exists(keys.large(prefix, keys.COLD))  # taken out with its drained bucket


def test_a_herd_behind_many_narrow_buckets_begins_its_thaw_by_its_lead(r: redis.Redis) -> None:
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    n = 3000
    due = trickle_then_herd(store, clock() + 120_000, n)
    start = due - due % NARROW.bucket_width_ms
    # A plan reads the first 256 buckets and the large one: its lead counts the herd and at
    # most 256 small ones before it, at 1000/s, doubled, + 2 s (8 to 8.5 s, not the minimum 5).
    thawer = Thawer(store, NARROW, "t", MoverStats(), monotonic=lambda: clock.ms / 1000)
    thawer.rate = thaw_plan.Rate(1000.0)
    clock.ms = start - thaw_plan.lead_ms(256 + n, 1000.0) - 1000
    thawed = run_thaw(thawer)
    assert thawed < 300 and cold_count(r) > n  # the minimum lead: the trickle's first only
    clock.ms = start - thaw_plan.lead_ms(n, 1000.0)
    assert run_thaw(thawer) == 300 + n - thawed and cold_count(r) == 0
    assert not r.exists(keys.large("", keys.COLD))  # taken out with its drained bucket
    clock.ms = due
    assert store.move_due(5000).moved == 300 + n and r.llen("q") == 300 + n
    assert store.counts() == {} and not r.exists(keys.large(""))


def test_a_large_ordinary_bucket_is_planned_behind_any_number_of_small_ones(
    r: redis.Redis, prefix: str
) -> None:
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    ordinary = Settings(compress_after_ms=0, bucket_width_ms=20)
    due = trickle_then_herd(store, clock() + 120_000, 1000, ordinary)
    start = due - due % 20
    _, buckets = store.ordinary_buckets(64)
    assert len(buckets) == 65 and buckets[-1].start_ms == start and buckets[-1].count == 1000
    clock.ms = due
    while store.move_due(5000).moved:
        pass
    assert store.counts() == {} and not r.exists(keys.large(prefix))


def test_a_large_bucket_hint_of_another_type_stores_and_plans_all_the_same(
    r: redis.Redis, prefix: str
) -> None:
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    r.set(keys.large(prefix, keys.COLD), "by hand")
    due = trickle_then_herd(store, clock() + 120_000, 1000)
    assert cold_count(r, prefix) == 1300
    _, buckets = store.cold_buckets(256)
    assert len(buckets) == 256  # the first buckets, as before there was a hint
    clock.ms = due
    thawer = Thawer(store, NARROW, "t", MoverStats(), monotonic=lambda: clock.ms / 1000)
    assert run_thaw(thawer) == 1300 and cold_count(r, prefix) == 0
    assert r.get(keys.large(prefix, keys.COLD)) == b"by hand"


def test_a_hint_of_a_bucket_let_go_without_it_is_forgotten_once_begun(r: redis.Redis, prefix: str) -> None:
    # A mover of 1.0.0 lets a bucket go without taking it out of the hint: stale entries sort
    # first, and enough of them hid every large bucket behind them from the plans.
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = trickle_then_herd(store, clock() + 120_000, 1000)
    start = due - due % NARROW.bucket_width_ms
    past, ahead = clock() - 60_000, due + 10**6
    for space in (keys.COLD, ""):
        r.zadd(keys.large(prefix, space), {str(past): past, str(ahead): ahead})
    _, buckets = store.cold_buckets(256)
    assert buckets[-1].start_ms == ahead and buckets[-1].count == 0  # ahead: kept, counts nothing
    assert r.zrange(keys.large(prefix, keys.COLD), 0, -1) == [str(start).encode(), str(ahead).encode()]
    store.ordinary_buckets(64)
    assert r.zrange(keys.large(prefix), 0, -1) == [str(ahead).encode()]


def test_a_cold_set_of_another_type_in_a_herds_bucket_stops_no_thaw(
    r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # The plan read the first due time of each set of a bucket whose lead had come, and a set
    # of another type (by hand) failed that read: every plan failed, and nothing compressed
    # was thawed again, in any bucket.
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    n = 3000
    due = clock() + 200_000
    herd(store, due, n)
    herd(store, due, 5, dest="bad", tag="b")
    start = due - due % FAST.bucket_width_ms
    r.delete(keys.queue_set("", start, "bad", keys.COLD))
    r.set(keys.queue_set("", start, "bad", keys.COLD), "by hand")
    thawer = thawer_of(store, clock, 1000.0)
    clock.ms = due - thaw_plan.lead_ms(n, 1000.0)
    with caplog.at_level(logging.ERROR):
        assert run_thaw(thawer) == n and thawer.stats.errors == 0
    assert thawer.stats.expired == 5  # lost to delivery, counted; the others go on
    [told] = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR]
    assert repr(keys.queue_set("", start, "bad", keys.COLD)) in told and "counted as expired" in told
