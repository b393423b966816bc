"""The sweep's renewal (sweep.lua) gives a held bucket one grace from the sweep's now, never
more, however often and however long it renews it; it never shortens an expiry a publisher
set, and keeps the longer grace of publishers sharing a bucket.

Time is driven through a fake clock (see ``FakeClock``): hours pass in a step.
"""

from __future__ import annotations

import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import Store, keys
from tests.support.stored import FakeClock, expires_at, kombu_payload, sweep_all

HOUR = 3_600_000
DAY = 24 * HOUR
#: The shortest grace accepted, and messages stored uncompressed.
SHORT = Settings(compress_after_ms=0, grace_ms=HOUR)
#: A bucket a day wide, kept a week after its end: shares its start with SHORT's narrow one.
WIDE = Settings(compress_after_ms=0, grace_ms=7 * DAY, bucket_width_ms=DAY)
#: Slack for ``expires_at``, which reads a PTTL, then TIME: later by at most the round trip.
SLACK = 1000


def expiry(client: redis.Redis, prefix: str, start: int) -> int:
    """The bucket's expiry as its meta hash records it (field ``x``), epoch ms."""
    x = client.hget(keys.meta(prefix, start), "x")
    assert x is not None
    return int(x)


def test_a_held_bucket_is_renewed_one_grace_from_now_never_more(r, prefix):
    """A destination key that is not a list holds a message for a day, swept every 10 minutes:
    after each sweep its keys expire one grace (the meta hash and task-id list a day more)
    from that sweep's now, as after the first; the renewals do not add up."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    q = f"{prefix}q"
    store.schedule(Due(clock() + 1000, task_id="held"), q, kombu_payload("held"), SHORT)
    r.set(q, "not a list")
    start = keys.bucket_start(clock() + 1000, SHORT.bucket_width_ms)
    # What each key of the bucket is given from now: its meta hash and task-id list a day more,
    # for a mover to settle the counts of a set that expired.
    grace_of = {
        keys.queue_set(prefix, start, q): HOUR,
        keys.meta(prefix, start): HOUR + DAY,
        keys.task_ids(prefix, start): HOUR + DAY,
    }
    for _ in range(6 * 24):
        clock.advance(10 * 60_000)
        assert store.move_due(100).moved == 0
        renewed, lost, _ = sweep_all(store)
        assert (renewed, lost) == (1, 0)
        now = clock()
        assert expiry(r, prefix, start) == now + HOUR
        for key, grace in grace_of.items():
            at = expires_at(r, key)
            assert at is not None and now + grace - 5 <= at <= now + grace + SLACK, (key, at - now)
    # The totals (with the storage format) are renewed with the shared keys: they never expire
    # before a bucket that holds a message. (Their expiry dropped here, since a renewal never
    # shortens one, and a driven clock cannot be compared with a TTL Redis counts itself.)
    r.persist(keys.totals(prefix))
    clock.advance(10 * 60_000)
    assert sweep_all(store)[0] == 1
    for key in (keys.totals(prefix), keys.meta(prefix, start)):
        at = expires_at(r, key)
        assert at is not None and clock() + HOUR + DAY - 5 <= at <= clock() + HOUR + DAY + SLACK, key


def test_a_renewal_never_shortens_a_publishers_expiry_and_keeps_its_longer_grace(r, prefix):
    """A narrow bucket with an hour's grace is held and renewed; then a publisher of day-wide
    buckets and a week's grace stores into the same start. The sweep leaves that later expiry as
    it is while it is more than a week ahead, then renews by the week, not the hour, and the
    renewals of the week do not add up either."""
    clock = FakeClock(r)
    day = clock() - clock() % DAY + DAY  # the start both widths share
    clock.advance(day - 10_000 - clock())
    store = Store(r, prefix, clock=clock)
    q, other = f"{prefix}q", f"{prefix}other"
    store.schedule(Due(day + 1000, task_id="held"), q, kombu_payload("held"), SHORT)
    r.set(q, "not a list")
    clock.advance(30 * 60_000)
    assert store.move_due(100).moved == 0
    assert sweep_all(store)[0] == 1
    assert expiry(r, prefix, day) == clock() + HOUR
    store.schedule(Due(day + 40 * 60_000, task_id="wide"), other, kombu_payload("wide"), WIDE)
    published = day + DAY + 7 * DAY
    assert expiry(r, prefix, day) == published
    clock.advance(60_000)
    assert sweep_all(store)[0] == 0  # more than a week ahead: nothing written
    assert expiry(r, prefix, day) == published
    clock.advance(day + DAY + 60_000 - clock())  # past the wide bucket's end
    assert sweep_all(store)[0] == 1
    assert expiry(r, prefix, day) == clock() + 7 * DAY
    clock.advance(DAY)
    assert sweep_all(store)[0] == 1
    assert expiry(r, prefix, day) == clock() + 7 * DAY
    at = expires_at(r, keys.queue_set(prefix, day, q))
    assert at is not None and clock() + 7 * DAY - 5 <= at <= clock() + 7 * DAY + SLACK


def test_a_thaw_after_a_renewal_of_its_cold_bucket_gives_the_publishers_grace(r, prefix):
    """A cold bucket renewed by the sweep records the grace it gave (g) and its renewal (x = r);
    a thaw then gives the ordinary bucket that grace, not x - end, which has the time since the
    bucket's end in it."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    q = f"{prefix}q"
    settings = Settings(compress_after_ms=60_000, thaw_ahead_ms=30_000, grace_ms=HOUR)
    due = clock() + 10 * 60_000
    store.schedule(Due(due, task_id="t1"), q, kombu_payload("t1"), settings)
    start = keys.bucket_start(due, settings.bucket_width_ms)
    cold_meta = keys.meta(prefix, start, keys.COLD)
    end = int(r.hget(cold_meta, "end"))
    # As sweep.lua leaves a bucket it renewed five hours after its end.
    renewal = end + 5 * HOUR + HOUR
    r.hset(cold_meta, mapping={"x": renewal, "r": renewal, "g": HOUR})
    clock.ms = due - 20_000
    assert store.thaw(30_000, 10).thawed == 1
    ordinary = keys.meta(prefix, keys.bucket_start(due, settings.bucket_width_ms))
    assert int(r.hget(ordinary, "x")) - int(r.hget(ordinary, "end")) == HOUR
