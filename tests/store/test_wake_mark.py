"""The wake-up of a publish (wake_if_first in _put.lua): a message that becomes the earliest
scheduled wakes the movers, whatever was published (by publishers of other bucket widths and
graces too), moved (on time or ahead), cancelled or purged before it; a message with an
earlier one still waiting in its bucket wakes no one, and costs no command to tell. A seeded
random run of those steps, time set per call."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.mover.wake import WakeUps
from kombu_delay.store import Store, keys
from tests.support.stored import kombu_payload, redis_ms

ORDINARY = Settings(compress_after_ms=0)
#: Compressed when due more than 3 s ahead, thawed 2 s ahead (as tests/store/test_cold.py).
JUST_COLD = Settings(compress_after_ms=2050, thaw_ahead_ms=2000)
#: Publishers sharing a namespace with other bucket widths and graces (the random run's).
MIXED = [
    ORDINARY,
    Settings(compress_after_ms=0, bucket_width_ms=1000),
    Settings(compress_after_ms=0, bucket_width_ms=60_000, grace_ms=3_600_000),
]
#: How long a wake-up that must come is waited for, s: it is written before the publish
#: returns, so it comes at once; the bound is for a machine that stalls.
WAKE_WAIT_S = 30


@pytest.fixture
def wakes(r: redis.Redis, prefix: str) -> Iterator[redis.client.PubSub]:
    pubsub = r.pubsub()
    pubsub.subscribe(keys.wake_channel(prefix))
    confirmed = pubsub.get_message(timeout=WAKE_WAIT_S)
    assert confirmed is not None and confirmed["type"] == "subscribe"
    yield pubsub
    pubsub.close()


def woke_for(wakes: redis.client.PubSub, due: int | str) -> bool:
    """Whether a wake-up for ``due`` (in database 0, unless it names one) comes, reading past
    earlier ones (which may be any)."""
    text = due if isinstance(due, str) else f"{due}@0"
    while (message := wakes.get_message(timeout=WAKE_WAIT_S)) is not None:
        if message["data"] == text.encode():
            return True
    return False


def test_every_message_that_becomes_the_earliest_wakes_the_movers(r, prefix, wakes) -> None:
    store, rng = Store(r, prefix), random.Random(21)
    queues = [f"{prefix}a", f"{prefix}b"]
    now = redis_ms(r)
    live: dict[str, tuple[int, str]] = {}  # task id -> (due, queue)
    earliest_published = 0
    for step in range(400):
        roll = rng.random()
        if roll < 0.6:
            # A publisher's clock may lag Redis's (an estimate, a clock stepped since it read it).
            judged_at = now - rng.choice([0, 0, rng.randrange(1, 5000)])
            due = judged_at + rng.randrange(1, 180_000)
            if any(due == d for d, _ in live.values()):
                continue  # each wake-up is told apart by its due time
            task, queue = f"t{step}", rng.choice(queues)
            earliest = all(due < d for d, _ in live.values())
            settings = rng.choice(MIXED)
            store.schedule(Due(due, task_id=task), queue, kombu_payload(task), settings, now_ms=judged_at)
            live[task] = (due, queue)
            if earliest:
                assert woke_for(wakes, due), f"step {step}: the earliest message woke no mover"
                earliest_published += 1
        elif roll < 0.8:
            now += rng.randrange(0, 60_000)
            ahead = rng.choice([0, 0, rng.randrange(1, 30_000)])
            store.move_due(10_000, now_ms=now, look_ahead_ms=ahead)
            live = {t: (d, q) for t, (d, q) in live.items() if d > now + ahead}
        elif roll < 0.97:
            if live:
                task = rng.choice(sorted(live))
                assert store.cancel(task, now_ms=now) == 1
                del live[task]
        else:
            queue = rng.choice(queues)
            store.purge([queue], now_ms=now)
            live = {t: (d, q) for t, (d, q) in live.items() if q != queue}
    assert earliest_published > 20  # the run tells something


def test_a_publisher_whose_clock_lags_is_not_misled_by_the_mark_of_a_moved_message(r, prefix, wakes) -> None:
    store, queue = Store(r, prefix), f"{prefix}q"
    base = (redis_ms(r) // 60_000 + 10) * 60_000
    at = base + 10_000
    store.schedule(Due(at, task_id="a"), queue, kombu_payload("a"), ORDINARY, now_ms=base)
    store.schedule(Due(at + 30_000, task_id="c"), queue, kombu_payload("c"), ORDINARY, now_ms=base)
    assert store.move_due(100, now_ms=at).moved == 1  # "a", at its due time
    # Judged a second behind the mover's clock: "a"'s mark looks ahead to it, but "a" is gone,
    # and this one is now the earliest.
    store.schedule(Due(at + 500, task_id="b"), queue, kombu_payload("b"), ORDINARY, now_ms=at - 1000)
    assert woke_for(wakes, at + 500)


def test_a_message_after_one_still_waiting_in_its_bucket_costs_no_rank_and_wakes_no_one(
    r, prefix, wakes
) -> None:
    store, queue = Store(r, prefix), f"{prefix}q"
    base = (redis_ms(r) // 60_000 + 10) * 60_000  # a bucket's start, 10 minutes ahead
    r.config_resetstat()
    for i in range(50):
        store.schedule(Due(base + 1000 + i, task_id=f"t{i}"), queue, kombu_payload(f"t{i}"), ORDINARY)
    assert "cmdstat_zrank" not in r.info("commandstats")
    assert r.hget(keys.meta(prefix, base), "w") == str(base + 1000).encode()
    # Only the first woke the movers: the next wake-up read is the earlier message's below.
    store.schedule(Due(base + 500, task_id="early"), queue, kombu_payload("early"), ORDINARY)
    first = wakes.get_message(timeout=WAKE_WAIT_S)
    assert first is not None and first["data"] == f"{base + 1000}@0".encode()
    second = wakes.get_message(timeout=WAKE_WAIT_S)
    assert second is not None and second["data"] == f"{base + 500}@0".encode()


def test_a_thaw_lets_the_next_compressed_message_wake_the_movers(r, prefix, wakes) -> None:
    store, queue = Store(r, prefix), f"{prefix}q"
    now = redis_ms(r)
    base = (now // 60_000 + 10) * 60_000
    # Two compressed messages in one cold bucket; the earlier is thawed (2 s ahead of its due).
    store.schedule(Due(base + 1000, task_id="a"), queue, kombu_payload("a"), JUST_COLD, now_ms=now)
    store.schedule(Due(base + 30_000, task_id="b"), queue, kombu_payload("b"), JUST_COLD, now_ms=now)
    assert woke_for(wakes, base + 1000)
    thawed = store.thaw(ahead_ms=2000, limit=1, now_ms=base - 1000)
    assert thawed.thawed == 1
    # Later than the thawed one, earlier than any compressed one left: it wakes the movers.
    store.schedule(Due(base + 2000, task_id="c"), queue, kombu_payload("c"), JUST_COLD, now_ms=base - 3000)
    assert woke_for(wakes, base + 2000)


@pytest.mark.parametrize("space", ["", keys.COLD])
def test_a_wider_publisher_raises_a_shared_buckets_end_even_with_a_shorter_grace(
    r, prefix, wakes, space
) -> None:
    """Publishers of different widths share a bucket's start: its end is the latest any asked
    for, even where the wider one's shorter grace leaves the expiry as it was. The first
    bucket's end is what a later bucket's message is judged the earliest by (and a thaw a
    cold bucket's width)."""
    store, queue = Store(r, prefix), f"{prefix}q"
    compress = 2050 if space else 0
    cold = {"compress_after_ms": compress, "thaw_ahead_ms": 2000}
    narrow = Settings(**cold, bucket_width_ms=1000)  # the default grace, 7 days
    wide = Settings(**cold, bucket_width_ms=60_000, grace_ms=3_600_000)
    now = redis_ms(r)
    start = (now // 3_600_000 + 2) * 3_600_000  # the start of a narrow and of a wide bucket
    store.schedule(Due(start + 500, task_id="narrow"), queue, kombu_payload("narrow"), narrow, now_ms=now)
    store.schedule(Due(start + 58_000, task_id="wide"), queue, kombu_payload("wide"), wide, now_ms=now)
    assert int(r.hget(keys.meta(prefix, start, space), "end")) == start + 60_000
    if space:  # the thaw reaching 2 s past the start restores the narrow message only
        assert store.thaw(ahead_ms=2000, limit=10, now_ms=start).thawed == 1
        return
    assert store.cancel("narrow", now_ms=now) == 1
    # In a later narrow bucket, before the wide message: now the earliest of all.
    store.schedule(Due(start + 10_000, task_id="next"), queue, kombu_payload("next"), narrow, now_ms=now)
    assert woke_for(wakes, start + 10_000)


def test_a_wake_up_names_its_database_and_a_mover_of_another_lets_it_be(redis_server, r, prefix) -> None:
    """Pub/sub ignores the database, so every database's movers share the channel: each
    publish, reschedule and thaw names its database in the wake-up, and a mover acts only on
    its own database's (and on one that names none, a 1.0.0 publisher's)."""
    db3 = redis_server.client(db=3)
    other, ours = Store(db3, prefix), Store(r, prefix)
    assert (other.db, ours.db) == (3, 0)
    queue, now = f"{prefix}q", redis_ms(r)
    with r.pubsub() as listener:
        listener.subscribe(keys.wake_channel(prefix))
        assert listener.get_message(timeout=WAKE_WAIT_S)["type"] == "subscribe"
        other.schedule(Due(now + 600_000, task_id="a"), queue, kombu_payload("a"), ORDINARY)
        assert woke_for(listener, f"{now + 600_000}@3")
        (stored,) = other.find("a")
        other.reschedule(stored, "a", kombu_payload("a"), now + 300_000, ORDINARY)
        assert woke_for(listener, f"{now + 300_000}@3")
        other.schedule(Due(now + 200_000, task_id="c"), queue, kombu_payload("c"), JUST_COLD, now_ms=now)
        assert woke_for(listener, f"{now + 200_000}@3")  # the compressed one's
        assert other.thaw(ahead_ms=2000, limit=10, now_ms=now + 199_000).thawed == 1
        assert woke_for(listener, f"{now + 200_000}@3")  # and its thaw's

    wake = WakeUps(ours, "m")
    wake.open()
    try:
        for _ in range(WAKE_WAIT_S):  # until subscribed
            r.publish(keys.wake_channel(prefix), "1@0")
            if wake.wait(1):
                break
        else:
            pytest.fail("the mover's subscription was never confirmed")
        other.schedule(Due(now + 100_000, task_id="b"), queue, kombu_payload("b"), ORDINARY)
        assert not wake.wait(3)  # database 3's wake-up: let be
        r.publish(keys.wake_channel(prefix), "1")  # a 1.0.0 publisher's names no database
        assert wake.wait(WAKE_WAIT_S)
        ours.schedule(Due(now + 100_000, task_id="b"), queue, kombu_payload("b"), ORDINARY)
        assert wake.wait(WAKE_WAIT_S)
    finally:
        wake.close()
        db3.close()
