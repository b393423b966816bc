"""One storage format, versioned: publishers and movers record it, and a mover (at its first
heartbeat, before its first move) and inspection refuse data recorded in another one."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from kombu_delay import StorageFormatError
from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.mover.loop import Mover
from kombu_delay.ops import health
from kombu_delay.store import Store, keys
from tests.support.stored import kombu_payload, redis_ms


def recorded(r: redis.Redis, prefix: str) -> bytes | None:
    value: bytes | None = r.hget(keys.totals(prefix), keys.FORMAT_FIELD)
    return value


def test_publishers_and_movers_record_the_format(r: redis.Redis, prefix: str) -> None:
    store = Store(r, prefix)
    assert recorded(r, prefix) is None
    store.heartbeat("m")
    assert recorded(r, prefix) == str(keys.FORMAT).encode()
    r.flushall()
    due = redis_ms(r) + 60_000
    store.schedule(Due(due, task_id="t"), f"{prefix}q", kombu_payload("t"), Settings())
    assert recorded(r, prefix) == str(keys.FORMAT).encode()
    assert store.totals() == {"scheduled": 1}  # the format is no counter
    store.check_format()


def test_a_namespace_nothing_uses_leaves_no_key(r: redis.Redis, prefix: str) -> None:
    # The heartbeats and the totals (with the format) had no expiry: a mover started once
    # under a prefix, or a run whose messages were all moved, left them for good.
    store = Store(r, prefix)
    now = redis_ms(r)
    store.heartbeat("m", forget_after_ms=3_600_000, now_ms=now)
    for key in (keys.movers(prefix), keys.totals(prefix)):
        assert 3_500_000 < r.pttl(key) <= 3_600_000
    # A heartbeat that asks for longer extends them; a publish keeps totals as long as its
    # bucket's keys.
    store.heartbeat("m", forget_after_ms=7_200_000, now_ms=now)
    assert r.pttl(keys.movers(prefix)) > 5_000_000
    due = now + 30 * 86_400_000
    store.schedule(Due(due, task_id="t"), f"{prefix}q", kombu_payload("t"), Settings(compress_after_ms=0))
    meta_ttl = r.pttl(keys.meta(prefix, due - due % 60_000))
    assert meta_ttl > 30 * 86_400_000 and r.pttl(keys.totals(prefix)) >= meta_ttl - 60_000


@pytest.fixture
def other_format(r: redis.Redis, prefix: str) -> Store:
    """A store whose data was recorded in a format after this one, holding one message."""
    store = Store(r, prefix)
    due = redis_ms(r) + 60_000
    store.schedule(Due(due, task_id="t"), f"{prefix}q", kombu_payload("t"), Settings())
    r.hset(keys.totals(prefix), keys.FORMAT_FIELD, keys.FORMAT + 1)
    return Store(r, prefix)


def test_a_mover_refuses_another_format_before_it_writes(
    r: redis.Redis, prefix: str, other_format: Store
) -> None:
    with pytest.raises(StorageFormatError) as caught:
        other_format.heartbeat("m")
    text = str(caught.value)
    assert f"storage format '{keys.FORMAT + 1}'" in text and f"format {keys.FORMAT} only" in text
    assert repr(prefix) in text
    assert not r.exists(keys.movers(prefix))
    assert recorded(r, prefix) == str(keys.FORMAT + 1).encode()  # never overwritten
    # The mover loop stops at once, having moved nothing (its first heartbeat comes first).
    mover = Mover(Store(r, prefix), Settings(), watch=False)
    with pytest.raises(StorageFormatError):
        mover.run()
    assert mover.stats.moved == 0 and other_format.counts() == {f"{prefix}q": 1}


@pytest.mark.parametrize(
    "entry",
    [
        lambda s: s.find("t"),
        lambda s: s.page(None, 10),
        lambda s: s.census(0, 1000, 3),
        lambda s: s.totals(),
        health.check,  # printed "no mover heartbeat", as if a mover could run on this data
        lambda s: s.purge([f"{s.prefix}q"]),  # "purged 0"
    ],
    ids=["find", "page", "census", "totals", "health", "purge"],
)
def test_inspection_refuses_another_format(other_format: Store, entry: Callable[[Store], object]) -> None:
    with pytest.raises(StorageFormatError):
        entry(other_format)
    assert other_format.counts() == {f"{other_format.prefix}q": 1}
