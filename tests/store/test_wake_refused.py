"""A user whose ACL lacks the wake-up channel (``&<prefix>kombu_delay:*``): the PUBLISH that
wakes movers comes after every write of a publish (or a thaw), so its refusal must not fail the
call, or a retry would store the message twice. The message is stored once, the call says the
wake was refused, and the totals count it. On Redis 6 (scripts) and 7 (functions)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import Store, keys
from kombu_delay.store.replies import Scheduled
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.servers import binary_before, binary_from
from tests.support.stored import FakeClock, kombu_payload, redis_ms, stored

ORDINARY = Settings(compress_after_ms=0)
#: Compressed when due more than 3 s ahead, thawed 2 s ahead (as tests/store/test_cold.py).
JUST_COLD = Settings(compress_after_ms=2050, thaw_ahead_ms=2000)


@pytest.fixture(scope="module", params=["redis6", "redis7"])
def server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    binary = binary_before(7) if request.param == "redis6" else binary_from(7)
    with RedisServer(binary=binary) as started:
        yield started


@pytest.fixture
def admin(server: RedisServer) -> Iterator[redis.Redis]:
    client = server.client()
    client.flushall()
    yield client
    client.close()


def user(server: RedisServer, admin: redis.Redis, *channels: str) -> redis.Redis:
    """A client of a user who may run anything on any key, and publish on ``channels`` only
    (``reset`` leaves it none)."""
    admin.execute_command(
        "ACL", "SETUSER", "pub", "reset", "on", ">pw", "~*", "+@all", "resetchannels", *channels
    )
    return server.client(username="pub", password="pw")


def test_a_refused_wake_stores_the_message_once_and_says_so(server, admin, prefix):
    store, queue = Store(user(server, admin), prefix), f"{prefix}q"
    base = redis_ms(admin) + 600_000
    first = store.schedule(Due(base, task_id="a"), queue, kombu_payload("a"), ORDINARY)
    assert (first.outcome, first.wake_refused) == (Scheduled.STORED, True)
    # Not the earliest: no wake-up, so nothing refused (and no command more than before).
    later = store.schedule(Due(base + 1000, task_id="b"), queue, kombu_payload("b"), ORDINARY)
    assert (later.outcome, later.wake_refused) == (Scheduled.STORED, False)
    earlier = store.schedule(Due(base - 1000, task_id="c"), queue, kombu_payload("c"), ORDINARY)
    assert (earlier.outcome, earlier.wake_refused) == (Scheduled.STORED, True)
    # A compressed message's wake-up (movers look for something to thaw) likewise.
    cold = store.schedule(Due(base - 2000, task_id="d"), queue, kombu_payload("d"), JUST_COLD)
    assert (cold.outcome, cold.wake_refused) == (Scheduled.STORED, True)
    assert sorted(s.envelope.task_id for s in stored(admin, prefix)) == ["a", "b", "c", "d"]
    assert admin.hget(keys.totals(prefix), "wake_refused") == b"3"
    assert admin.hget(keys.totals(prefix), "scheduled") == b"4"


def test_a_granted_wake_reaches_the_movers_and_counts_nothing(server, admin, prefix):
    channel = keys.wake_channel(prefix)
    store = Store(user(server, admin, f"&{keys.ns(prefix)}*"), prefix)
    with admin.pubsub() as listener:
        listener.subscribe(channel)
        assert listener.get_message(timeout=10)["type"] == "subscribe"
        due = redis_ms(admin) + 600_000
        result = store.schedule(Due(due, task_id="a"), f"{prefix}q", kombu_payload("a"), ORDINARY)
        assert (result.outcome, result.wake_refused) == (Scheduled.STORED, False)
        woken = listener.get_message(timeout=10)
    assert woken is not None and woken["data"] == f"{due}@0".encode()
    assert admin.hget(keys.totals(prefix), "wake_refused") is None


def test_a_thaw_whose_wake_is_refused_still_restores_the_message(server, admin, prefix):
    """put_group (a thaw into the ordinary space) wakes movers as a publish does."""
    clock = FakeClock(admin)
    store, queue = Store(user(server, admin), prefix, clock=clock), f"{prefix}q"
    due = clock() + 2100
    store.schedule(Due(due, task_id="t"), queue, kombu_payload("t"), JUST_COLD)
    admin.hdel(keys.totals(prefix), "wake_refused")  # the publish's own refusal
    clock.ms = due - 1900  # within the thaw horizon
    assert store.thaw(2000, 10).thawed == 1
    assert [(s.envelope.task_id, s.cold) for s in stored(admin, prefix)] == [("t", False)]
    assert admin.hget(keys.totals(prefix), "wake_refused") == b"1"
    clock.ms = due
    assert store.move_due(10).moved == 1
    assert admin.lrange(queue, 0, -1) == [kombu_payload("t").encode()]
