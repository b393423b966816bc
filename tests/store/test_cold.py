"""The cold space: messages due far ahead are stored compressed, and movers restore them
(thaw) into the ordinary buckets before they are due, byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import zlib
from collections import Counter
from collections.abc import Callable

import pytest
import redis
from celery import Celery

from kombu_delay.config import Settings
from kombu_delay.control import DelayControl
from kombu_delay.errors import (
    ConfigError,
    CorruptMember,
    OverMaxmemory,
    PayloadTooLarge,
    RedisRefused,
    RedisUnavailable,
    WrongTypeKey,
)
from kombu_delay.message import Due, parse_iso_ms
from kombu_delay.mover.loop import Mover
from kombu_delay.mover.thaw import PAST_MAXMEMORY_LOOK_S
from kombu_delay.store import Store, cold, keys, spaces
from kombu_delay.store.replies import Scheduled, ThawResult
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.e2e_app import QUEUE
from tests.support.procs import joined, wait_until
from tests.support.stored import FakeClock, fill_to_maxmemory, kombu_payload, stored, tags_in
from tests.support.workers import records, start_worker, wait_worker_ready

#: Short spans, so a test waits seconds, not the default minute.
FAST = Settings(compress_after_ms=3000, thaw_ahead_ms=2000)
#: A message due 2.1 s ahead is stored compressed, and is due soon after its thaw horizon.
JUST_COLD = Settings(compress_after_ms=2050, thaw_ahead_ms=2000)


def celery_message(r: redis.Redis, queue: str = "capture") -> str:
    """A message exactly as Celery's apply_async makes it (sent through plain redis://)."""
    pool = r.connection_pool.connection_kwargs
    app = Celery("capture", broker=f"redis://{pool['host']}:{pool['port']}/0")
    try:
        app.send_task("proj.tasks.add", args=[2, 3], kwargs={"note": "é ✓"}, countdown=600, queue=queue)
    finally:
        app.close()
    raw = r.rpop(queue)
    assert raw is not None
    return raw.decode()


def cold_members(r: redis.Redis, prefix: str = "") -> list[tuple[int, str, bytes, float]]:
    """Every member of the cold space: (bucket start, dest, member, score)."""
    found = []
    for start in r.zrange(keys.cold_index(prefix), 0, -1):
        meta = r.hgetall(keys.meta(prefix, int(start), keys.COLD))
        for name in meta:
            if name.startswith(b"q:"):
                dest = name[2:].decode()
                key = keys.queue_set(prefix, int(start), dest, keys.COLD)
                for member, score in r.zrange(key, 0, -1, withscores=True):
                    found.append((int(start), dest, bytes(member), float(score)))
    return found


def test_the_format_restores_celery_messages_byte_for_byte(r):
    message = celery_message(r)
    task_id = json.loads(message)["headers"]["id"]
    member = cold.pack(message, task_id)
    assert member is not None
    assert member[0] == cold.WRITTEN and member[2 : 2 + member[1]] == task_id.encode()
    assert len(member) < len(message.encode()) / 3
    assert cold.unpack(member) == (task_id, message.encode())
    # A released dictionary never changes: members stored by it must stay readable.
    assert hashlib.sha256(cold.DICTIONARY).hexdigest()[:16] == "40f6ada0aac67e7e"
    assert cold.pack(message, "x" * 256) is None  # the id's length must fit its byte


@pytest.mark.parametrize(
    "damage",
    [
        lambda m: m[:-3],  # truncated
        lambda m: m + b"tail",  # data past the end
        lambda m: bytes([3]) + m[1:],  # an unknown version
        lambda m: m[:1] + bytes([200]) + m[2:],  # an id length past the end
        lambda m: m[:-6] + bytes([m[-6] ^ 0xFF]) + m[-5:],  # a flipped byte
        lambda m: b"",
    ],
    ids=["truncated", "trailing", "version", "id-length", "flipped", "empty"],
)
def test_a_damaged_member_is_refused_never_guessed(r, damage):
    message = celery_message(r)
    member = cold.pack(message, "tid", cold.VERSION)
    assert member is not None
    with pytest.raises(CorruptMember):
        cold.unpack(damage(member))


def test_a_damaged_compressed_message_is_cancelled_by_the_id_it_carries_in_the_clear(r):
    # cancel said "not scheduled" of it while stats counted it: find leaves out what cannot be
    # restored, and the thaw would only dead-letter it. Its id is in the clear: a cancel takes it.
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    for tag in ("damaged", "other"):
        store.schedule(Due(clock() + 600_000, task_id=tag), "q", kombu_payload(tag), FAST)
    [(start, dest, member, score)] = [m for m in cold_members(r) if cold.task_id_of(m[2]) == "damaged"]
    key = keys.queue_set("", start, dest, keys.COLD)
    r.zrem(key, member)
    r.zadd(key, {member[:-12] + bytes(b ^ 0xFF for b in member[-12:]): score})
    assert cold.task_id_of(member[:-12]) == "damaged" and cold.task_id_of(b"\x07\x01x") is None
    assert store.find("damaged") == []  # nothing to show
    assert store.cancel("damaged") == 1
    assert store.counts() == {"q": 1} and [cold.task_id_of(m[2]) for m in cold_members(r)] == ["other"]
    assert store.cancel("damaged") == 0


def test_any_bit_changed_in_a_member_is_refused_or_changes_nothing(r):
    # Raw deflate has no check: of 20,000 single-bit changes, 14,000 inflated to another
    # message (changed fields, or no JSON: a stock worker exits on one), delivered as it.
    message = celery_message(r)
    member = cold.pack(message, "tid", cold.VERSION)
    assert member is not None
    changed = 0
    for bit in range(len(member) * 8):
        damaged = bytearray(member)
        damaged[bit // 8] ^= 1 << (bit % 8)
        try:
            got = cold.unpack(bytes(damaged))
        except CorruptMember:
            changed += 1
            continue
        assert got == ("tid", message.encode()), bit  # a bit deflate never reads: the same message
    assert changed > len(member) * 8 * 0.9


def test_a_member_stored_before_the_crc_is_still_read(r):
    message = celery_message(r)
    member = cold.pack(message, "tid", cold.VERSION)
    assert member is not None and member[0] == cold.VERSION == 2
    unchecked = bytes([cold.UNCHECKED_VERSION]) + member[1:-4]
    assert cold.unpack(unchecked) == ("tid", message.encode())
    assert cold.pack(message, "tid") == unchecked  # what publishers write, until no 1.0.0 mover runs
    with pytest.raises(CorruptMember):  # and a version 2 member without its CRC is no member
        cold.unpack(member[:-4])


def test_options_validate_and_the_thaw_horizon_bounds_compression(r):
    with pytest.raises(ConfigError, match="delay_thaw_ahead"):
        Settings.from_options({"delay_thaw_ahead": 0}, env={})
    with pytest.raises(ConfigError, match="delay_compress_after"):
        Settings.from_options({"delay_compress_after": -1}, env={})
    assert Settings.from_options({"delay_compress_after": 0}, env={}).compress_after_ms == 0
    defaults = Settings.from_options({}, env={})
    assert (defaults.compress_after_ms, defaults.thaw_ahead_ms) == (60_000, 30_000)
    # A mover may thaw further ahead than publishers compress: nothing due within the thaw
    # horizon is stored compressed then.
    wide = Settings.from_options({"delay_compress_after": 2, "delay_thaw_ahead": 3}, env={})
    store = Store(r)
    store.schedule(Due(2500, relative=True, task_id="near"), "q", kombu_payload("near"), wide)
    store.schedule(Due(3500, relative=True, task_id="far"), "q", kombu_payload("far"), wide)
    assert [cold.unpack(m)[0] for _, _, m, _ in cold_members(r)] == ["far"]


def test_a_far_countdown_is_stored_compressed_and_seen_by_every_view(r, redis_server, prefix):
    app = Celery("cold", broker=redis_server.delay_url)
    app.conf.broker_transport_options = {"global_keyprefix": prefix}
    try:
        far = app.send_task("proj.tasks.add", args=[1, 2], queue="q1", countdown=3600).id
        near = app.send_task("proj.tasks.add", args=[3, 4], queue="q1", countdown=30).id
    finally:
        app.close()
    members = cold_members(r, prefix)
    assert [cold.unpack(m)[0] for _, _, m, _ in members] == [far]
    assert [s.envelope.task_id for s in stored(r, prefix) if not s.cold] == [near]
    message = json.loads(cold.unpack(members[0][2])[1])
    assert message["headers"]["id"] == far and message["properties"]["delivery_info"]["routing_key"] == "q1"

    control = DelayControl(redis_server.delay_url, {"global_keyprefix": prefix})
    stats = control.stats(hours=2, slot_minutes=30)
    assert stats.scheduled == 2 and stats.later == 0
    # The near one in the first slot; the far one in a later slot (by its bucket's start).
    assert stats.histogram[0].count == 1 and sum(s.count for s in stats.histogram) == 2
    [found] = control.find(far)
    assert (
        found.task == "proj.tasks.add"
        and found.queue == "q1"
        and found.size == len(cold.unpack(members[0][2])[1])
    )
    listed, cursor = [], None
    while True:  # one message per page: the cursor crosses from the ordinary space to the cold one
        page = control.scheduled(limit=1, cursor=cursor)
        listed += [m.task_id for m in page.items]
        if page.cursor is None:
            break
        cursor = page.cursor
    assert listed == [near, far]  # earliest first, whatever the space


def test_a_mover_thaws_ahead_and_delivers_each_message_once_exactly_as_published(r):
    """The mover's loop runs in a thread; time is driven (a fake clock) in steps, and at each
    step the clock stands still while the test waits for the mover: what it may do is decided
    by the clock, never by how fast the machine is."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    message = celery_message(r)
    now = clock()
    dues = [now + 3500 + 37 * i for i in range(40)]
    payloads = [message.replace("proj.tasks.add", f"proj.tasks.t{i}") for i in range(40)]
    for i, (due, payload) in enumerate(zip(dues, payloads, strict=True)):
        assert store.schedule(Due(due, task_id=f"t{i}"), "q", payload, FAST).outcome is Scheduled.STORED
    assert len(cold_members(r)) == 40 and all(s.cold for s in stored(r))

    mover = Mover(store, FAST, watch=False)
    runner = threading.Thread(target=mover.run, daemon=True)
    runner.start()
    try:
        # A millisecond before the first due time every message is within the thaw horizon
        # (2 s): all are thawed ahead, none is pushed.
        clock.ms = dues[0] - 1
        wait_until(lambda: mover.stats.thawed == 40)
        assert not cold_members(r) and r.llen("q") == 0
        for step in range(0, 40, 3):  # 0, 3, ..., 39
            clock.ms = dues[step]
            wait_until(lambda: r.llen("q") == step + 1)  # noqa: B023
            # Never early: what is on the list is exactly what is due by the clock.
            assert sorted(r.lrange("q", 0, -1)) == sorted(p.encode() for p in payloads[: step + 1])
    finally:
        mover.stop()
        joined(runner, 30)
    assert sorted(r.lrange("q", 0, -1)) == sorted(p.encode() for p in payloads)  # byte for byte, each once
    assert not cold_members(r) and store.counts() == {}
    assert store.totals() == {"scheduled": 40, "moved": 40}
    assert not r.exists(keys.cold_index(""))
    # The id index drops a drained bucket's refs once its end has passed, in a move's leftover
    # budget, so how many are left depends on how many passes the mover made: finish the
    # clean-up at a time past every bucket's end, then nothing may be left behind.
    assert r.hlen(keys.ids("")) <= 40
    store.move_due(1000, now_ms=dues[-1] + 3_600_000)
    assert r.hlen(keys.ids("")) == 0 and not r.exists(keys.drained(""))


def test_a_move_without_a_thaw_never_pushes_a_compressed_message(r, redis_server):
    """What a mover of an older version does: it moves the ordinary buckets only."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    due = clock() + 2100
    store.schedule(Due(due, task_id="t"), "q", kombu_payload("t"), JUST_COLD)
    assert len(cold_members(r)) == 1
    clock.advance(2200)
    assert store.move_due(100).moved == 0 and r.llen("q") == 0
    # The overdue message still counts, and a thaw then a move deliver it.
    assert store.earliest_due_ms() == due
    with DelayControl(redis_server.delay_url) as control:
        control.store.clock = clock
        assert control.stats().overdue == 1
    assert store.thaw(2000, 10).thawed == 1
    result = store.move_due(100)
    assert result.moved == 1 and result.lateness_ms == [100]
    assert tags_in(r, "q") == ["t"]


def test_two_movers_thaw_the_same_messages_each_once(r, redis_server):
    """Two mover threads on one driven clock: both find the same 3,000 messages within their
    thaw horizon at once, then due at once."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    now = clock()
    n = 3000
    items = [(Due(now + 4000 + i % 500, task_id=f"t{i}"), "q", kombu_payload(f"t{i}")) for i in range(n)]
    assert all(x.outcome is Scheduled.STORED for x in store.schedule_many(items, FAST))
    assert len(cold_members(r)) == n
    movers = [Mover(Store(redis_server.client(), clock=clock), FAST, watch=False) for _ in range(2)]
    runners = [threading.Thread(target=m.run, daemon=True) for m in movers]
    for t in runners:
        t.start()
    try:
        clock.ms = now + 3000  # every message within the thaw horizon (2 s), none due
        wait_until(lambda: not cold_members(r), timeout=120)
        assert r.llen("q") == 0
        clock.ms = now + 4500  # all due
        wait_until(lambda: store.counts() == {}, timeout=120)
    finally:
        for m in movers:
            m.stop()
        for t in runners:
            t.join(30)
    # Nothing is left to push: what is on the list is all that will ever be.
    tags = Counter(tags_in(r, "q"))
    assert len(tags) == n and set(tags.values()) == {1}
    assert sum(m.stats.thawed for m in movers) == n
    assert store.totals() == {"scheduled": n, "moved": n}


@pytest.mark.parametrize("dead_list", ["list", "string"])
def test_a_corrupt_member_goes_to_the_dead_letters_counted_and_nothing_else_is_lost(r, prefix, dead_list):
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    now = clock()
    for tag in ("good", "bad"):
        store.schedule(
            Due(now + 2100, task_id=tag),
            "q",
            kombu_payload(tag),
            JUST_COLD,
        )
    start, dest, member, score = next(m for m in cold_members(r, prefix) if cold.unpack(m[2])[0] == "bad")
    key = keys.queue_set(prefix, start, dest, keys.COLD)
    damaged = member[:-4]
    r.zrem(key, member)
    r.zadd(key, {damaged: score})
    clock.advance(150)  # within the thaw horizon
    if dead_list == "string":
        # The dead-letter list written by hand as another type: the thaw took its members out
        # before its LPUSH failed, and Redis kept the takes: both messages were lost.
        r.set(keys.dead(prefix), "by hand")
        with pytest.raises(WrongTypeKey, match="dead"):
            store.thaw(2000, 10)
        assert len(cold_members(r, prefix)) == 2  # nothing taken
        r.delete(keys.dead(prefix))
    result = store.thaw(2000, 10)
    assert (result.thawed, result.dead) == (1, 1)
    assert r.lrange(keys.dead(prefix), 0, -1) == [damaged]  # kept as it was stored
    clock.advance(2000)
    assert store.move_due(10).moved == 1
    assert tags_in(r, "q") == ["good"]
    totals = store.totals()
    assert totals["dead"] == 1 and store.counts() == {}
    # Lost to delivery, so counted as expired too: the totals add up to what is stored (0).
    assert totals["scheduled"] - totals["moved"] - totals["expired"] == 0
    assert not r.exists(keys.cold_index(prefix))


def test_cancel_reschedule_and_purge_reach_compressed_messages(r, redis_server, prefix):
    store = Store(r, prefix)
    control = DelayControl(redis_server.delay_url, {"global_keyprefix": prefix})
    app = Celery("cold", broker=redis_server.delay_url)
    app.conf.broker_transport_options = {"global_keyprefix": prefix}
    try:
        ids = [app.send_task("proj.tasks.add", args=[i], queue="q1", countdown=7200).id for i in range(4)]
    finally:
        app.close()
    assert len(cold_members(r, prefix)) == 4
    assert control.cancel(ids[0]) == 1 and control.find(ids[0]) == []
    # Cold to cold (far), cold to the ordinary space (near), cold to now.
    assert control.reschedule(ids[1], countdown=3600) == 1
    assert control.reschedule(ids[2], countdown=20) == 1
    assert control.reschedule(ids[3], countdown=-1) == 1
    assert [cold.unpack(m)[0] for _, _, m, _ in cold_members(r, prefix)] == [ids[1]]
    assert [s.envelope.task_id for s in stored(r, prefix) if not s.cold] == [ids[2]]
    pushed = json.loads(r.lpop(f"{prefix}q1"))
    assert pushed["headers"]["id"] == ids[3]
    # The compressed message carries its new ETA, as the ordinary one would.
    [(_, _, member, score)] = cold_members(r, prefix)
    assert parse_iso_ms(json.loads(cold.unpack(member)[1])["headers"]["eta"]) == int(score)
    assert control.purge("q1") == 2
    assert store.counts() == {} and not cold_members(r, prefix) and not stored(r, prefix)
    assert not r.hget(keys.ids(prefix), ids[1])  # the cold message's ref left with it


def test_a_publisher_clock_behind_redis_stores_the_message_uncompressed(r, monkeypatch):
    store = Store(r)
    # A ten-minute thaw horizon: the message is due within it, by Redis's clock, for minutes.
    settings = Settings(compress_after_ms=3000, thaw_ahead_ms=600_000)
    due = store.time_ms() + 300_000
    # This process believes the message is due hours ahead; Redis's clock says otherwise.
    monkeypatch.setattr("kombu_delay.store.spaces.time.time", lambda: (due - 10_000_000) / 1000)
    result = store.schedule(Due(due, task_id="t"), "q", kombu_payload("t"), settings)
    assert result.outcome is Scheduled.STORED
    assert not cold_members(r) and [s.envelope.task_id for s in stored(r)] == ["t"]


def test_a_message_over_the_servers_string_limit_is_refused_at_publish_in_either_space():
    # With proto-max-bulk-len lowered, a compressed message passed (its member is small) and
    # then no thaw could send it back: Redis dropped the mover's connection on every try.
    with RedisServer(extra_args=["--proto-max-bulk-len", "1mb"]) as server:
        r = server.client()
        store = Store(r)
        due = Due(store.time_ms() + 3_600_000, task_id="big")
        big = kombu_payload("big", body="x" * (2 * 2**20))
        for settings in (Settings(compress_after_ms=0), Settings()):
            with pytest.raises(PayloadTooLarge, match=r"\(1,048,576 bytes, proto-max-bulk-len\)"):
                store.schedule(due, "q", big, settings)
        assert r.ping() and store.counts() == {} and not cold_members(r)
        fits = kombu_payload("fits", body="y" * (900 * 1024))
        assert store.schedule(due, "q", fits, Settings(compress_after_ms=0)).outcome is Scheduled.STORED
        r.close()


@pytest.mark.usefixtures("large_cold_members")
def test_a_limit_lowered_after_it_was_read_is_read_again_where_a_send_breaks():
    # The limit read was kept a minute: lowered meanwhile (CONFIG SET), a publish of 2 MB broke
    # its connection, raised RedisUnavailable (which kombu retries) for that minute, and a
    # thaw failed as an outage for it, holding every queue's moves back.
    with RedisServer() as server:
        r = server.client()
        clock = FakeClock(r)
        store = Store(r, clock=clock)
        now = clock()
        due = Due(now + 3_600_000, task_id="first")
        first = kombu_payload("first", body="x" * (2 * 2**20))
        assert store.schedule(due, "q", first, Settings(compress_after_ms=0)).outcome is Scheduled.STORED
        for tag, body in (("a", "e30="), ("big", "x" * (2 * 2**20))):
            store.schedule(Due(now + 2100, task_id=tag), "q", kombu_payload(tag, body=body), JUST_COLD)
        editor = Store(server.client(), clock=clock)
        assert editor.over_bulk_limit(2 * 2**20 + 1) is None  # read before the limit is lowered
        r.config_set("proto-max-bulk-len", 2**20)
        with pytest.raises(PayloadTooLarge, match=r"\(1,048,576 bytes, proto-max-bulk-len\)"):
            store.schedule(Due(now + 3_600_000, task_id="second"), "q", first, Settings(compress_after_ms=0))
        assert store.find("second") == [] and r.ping()
        [a] = editor.find("a")
        with pytest.raises(PayloadTooLarge, match="'a' stays as it was"):
            editor.reschedule(
                a, "a", kombu_payload("a", body="x" * (2 * 2**20)), now + 9000, Settings(compress_after_ms=0)
            )
        assert editor.find("a") == [a]

        r.config_set("proto-max-bulk-len", 512 * 2**20)
        mover = Store(server.client(), clock=clock)
        assert mover.over_bulk_limit(2 * 2**20 + 1) is None  # read before the limit is lowered
        r.config_set("proto-max-bulk-len", 2**20)
        clock.advance(150)  # within the thaw horizon
        with pytest.raises((RedisUnavailable, RedisRefused)):  # a broken pipe, or Redis's error first
            mover.thaw(2000, 10)  # the send breaks: the limit read is forgotten
        result = mover.thaw(2000, 10)
        assert (result.thawed, result.dead) == (1, 1)
        r.close()


def _no_config_user(server: RedisServer, r: redis.Redis) -> redis.Redis:
    """A client whose ACL refuses CONFIG, as the one Security gives does."""
    r.acl_setuser(
        "noconfig", enabled=True, passwords=["+pw"], categories=["+@all", "-@dangerous"], keys=["*"]
    )
    return server.client(username="noconfig", password="pw")


@pytest.mark.usefixtures("large_cold_members")
def test_where_config_is_refused_a_declared_length_tells_the_limit():
    # With no CONFIG, 512 MB was assumed: a message over a lowered limit was sent, and Redis
    # dropped the connection (or, compressed, stored it, and every thaw then failed). Redis
    # refuses a request that declares a length over its limit, before any byte of it comes.
    with RedisServer(extra_args=["--proto-max-bulk-len", "3mb"]) as server:
        r = server.client()
        client = _no_config_user(server, r)
        store = Store(client)
        due = store.time_ms() + 3_600_000
        fits = kombu_payload("fits", body="x" * (2 * 2**20))
        over = kombu_payload("over", body="x" * (4 * 2**20))
        for settings in (Settings(compress_after_ms=0), Settings()):
            assert store.schedule(Due(due, task_id="fits"), "q", fits, settings).outcome is Scheduled.STORED
            with pytest.raises(PayloadTooLarge, match=r"\(4,19\d,\d{3} bytes refused, proto-max-bulk-len\)"):
                store.schedule(Due(due, task_id="over"), "q", over, settings)
        [asked] = [entry for entry in r.acl_log() if entry["object"] in ("config", "config|get")]  # 6.2, 7
        assert int(asked["count"]) == 1  # asked once, not on every publish
        assert client.ping() and len(store.find("fits")) == 2 and store.find("over") == []
        client.close()
        r.close()


@pytest.mark.usefixtures("large_cold_members")
def test_where_config_is_refused_only_redis_refusing_the_length_refuses_a_message():
    # The first way of asking sent a PING of the message's size, which Redis echoes: an
    # output-buffer limit below it closed the connection, and that was taken for "too long".
    with RedisServer(extra_args=["--client-output-buffer-limit", "normal", "1mb", "0", "0"]) as server:
        r = server.client()
        client = _no_config_user(server, r)
        store = Store(client)
        due = store.time_ms() + 3_600_000
        big = kombu_payload("big", body="x" * (2 * 2**20))
        for settings in (Settings(compress_after_ms=0), Settings()):
            assert store.schedule(Due(due, task_id="big"), "q", big, settings).outcome is Scheduled.STORED
        assert store.counts() == {"q": 2} and client.ping()  # (reading it back would pass the limit)
        client.close()
        r.close()


@pytest.mark.usefixtures("large_cold_members")
@pytest.mark.parametrize("config", [True, False], ids=["config", "no-config"])
def test_a_compressed_message_over_a_limit_lowered_since_its_publish_is_dead_lettered_alone(caplog, config):
    with RedisServer() as server:
        r = server.client()
        mover = r if config else _no_config_user(server, r)
        clock = FakeClock(r)
        store = Store(r, clock=clock)
        now = clock()
        for tag, body in (("a", "e30="), ("big", "x" * (2 * 2**20)), ("b", "e30=")):
            store.schedule(Due(now + 2100, task_id=tag), "q", kombu_payload(tag, body=body), JUST_COLD)
        [big] = [m for _, _, m, _ in cold_members(r) if cold.unpack(m)[0] == "big"]
        r.config_set("proto-max-bulk-len", 2**20)
        clock.advance(150)  # within the thaw horizon
        result = Store(mover, clock=clock).thaw(2000, 10)
        assert (result.thawed, result.dead) == (2, 1)
        assert r.lrange(keys.dead(""), 0, -1) == [big]  # kept as it was stored
        limit = "1,048,576 bytes" if config else "2,097,"
        assert f"over Redis's limit for one string ({limit}" in caplog.text
        clock.advance(2000)
        assert store.move_due(10).moved == 2
        assert sorted(tags_in(r, "q")) == ["a", "b"]
        assert store.totals()["dead"] == 1 and store.counts() == {}
        r.close()


@pytest.mark.parametrize("skew_s", [-3600, 3600])
def test_the_space_is_chosen_by_the_estimate_of_redis_clock_not_this_machines(r, monkeypatch, skew_s):
    # With this machine's wall clock an hour behind, a message 5 s ahead was packed for the cold
    # space, refused by the script as due too soon, and sent again: two calls per publish.
    store = Store(r)
    settings = Settings(compress_after_ms=60_000, thaw_ahead_ms=30_000)
    now = store.time_ms()
    monkeypatch.setattr("kombu_delay.store.spaces.time.time", lambda: now / 1000 + skew_s)
    assert store._space_for(Due(now + 5_000, task_id="near"), settings, None, "{}") is spaces.ORDINARY
    assert store._space_for(Due(now + 120_000, task_id="far"), settings, None, "{}") is spaces.COLD


def test_a_message_too_large_to_compress_quickly_is_stored_as_it_is(r):
    # A 50 MB message took 13 s to publish, compressed by its publisher, against 4 s stored as
    # it is (2.3 s on redis://): the cold space is for the many small messages of a backlog.
    store = Store(r)
    settings = Settings(compress_after_ms=60_000, thaw_ahead_ms=30_000)
    due = store.time_ms() + 600_000
    payloads = {}
    for tag, size in (("fits", cold.MAX_PACKED_BYTES), ("large", cold.MAX_PACKED_BYTES + 1)):
        payloads[tag] = kombu_payload(tag, body="x" * (size - len(kombu_payload(tag, body=""))))
        assert len(payloads[tag]) == size
        assert store.schedule(Due(due, task_id=tag), "q", payloads[tag], settings).outcome is Scheduled.STORED
    assert sorted((s.envelope.task_id, s.cold) for s in stored(r)) == [("fits", True), ("large", False)]
    assert [s.envelope.payload for s in stored(r) if s.envelope.task_id == "large"] == [
        payloads["large"].encode()
    ]


def test_a_delay_from_now_chooses_its_space_without_reading_redis_clock(r):
    # An x-delay counts from Redis's clock inside the script: the choice of space needs no
    # estimate of it, and a publisher read Redis's clock (a TIME round trip) for one anyway.
    store = Store(r)
    readings = []
    read = store.redis_clock._read
    store.redis_clock._read = lambda: readings.append(read())  # type: ignore[method-assign]
    for ms in (5_000, 3_600_000):
        store.schedule(Due(ms, relative=True, task_id=f"d{ms}"), "q", kombu_payload("d"), Settings())
    assert readings == [] and len(cold_members(r)) == 1


def test_zero_compress_after_stores_nothing_compressed(r):
    store = Store(r)
    store.schedule(
        Due(3_600_000, relative=True, task_id="t"), "q", kombu_payload("t"), Settings(compress_after_ms=0)
    )
    assert not cold_members(r) and len(stored(r)) == 1


def test_overdue_compressed_messages_are_delivered_once_after_a_mover_outage(r):
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    settings = JUST_COLD
    now = clock()
    for i in range(5):
        store.schedule(Due(now + 2100, task_id=f"t{i}"), "q", kombu_payload(f"t{i}"), settings)
    assert len(cold_members(r)) == 5
    clock.advance(3000)  # due, never thawed: no mover ran meanwhile
    mover = Mover(store, settings, watch=False)
    runner = threading.Thread(target=mover.run, daemon=True)
    runner.start()
    try:
        wait_until(lambda: r.llen("q") >= 5, timeout=60)
    finally:
        mover.stop()
        joined(runner, 30)
    assert sorted(tags_in(r, "q")) == [f"t{i}" for i in range(5)]
    assert store.counts() == {} and r.zcard(keys.index("")) == 0
    assert store.totals() == {"scheduled": 5, "moved": 5}


@pytest.mark.slow
def test_a_worker_runs_a_compressed_task_at_its_due_time_once(r, redis_server, spawn, start_mover):
    env = {"KOMBU_DELAY_THAW_AHEAD": "1"}
    start_mover(env=env)
    worker = start_worker(spawn, redis_server.url, redis_server.url, "cold")
    wait_worker_ready(r, redis_server.url, worker)
    app = Celery("cold", broker=redis_server.delay_url)
    # One-second buckets: a mover plans a bucket's thaw from its start, which a minute's bucket
    # put up to a minute before the due time (it thawed them before they were counted below).
    app.conf.broker_transport_options = {
        "delay_compress_after": 2,
        "delay_thaw_ahead": 1,
        "delay_bucket_width": 1,
    }
    # Due 10 s on: stored compressed (more than 2 s ahead) however slow the publish, and
    # still compressed when counted below (a mover thaws 1 s before due).
    try:
        sent = [
            app.send_task("e2e.record", ("cold",), queue=QUEUE, countdown=10 + i / 10).id for i in range(5)
        ]
    finally:
        app.close()
    assert len(cold_members(r)) == 5
    dues = {cold.unpack(m)[0]: int(s) for _, _, m, s in cold_members(r)}
    wait_until(lambda: len(records(r, "cold")) >= 5, timeout=120)
    # Each pushed once by a mover, and nothing left to push: no duplicate can come later.
    wait_until(lambda: not stored(r) and r.llen(QUEUE) == 0, timeout=60)
    assert Store(r).totals() == {"scheduled": 5, "moved": 5}
    runs = records(r, "cold")
    assert Counter(rec["id"] for rec in runs) == Counter(sent)
    for rec in runs:
        assert rec["start_us"] >= dues[rec["id"]] * 1000  # never before its due millisecond
    assert worker.popen.poll() is None, worker.output()


def test_any_kombu_message_restores_not_only_celery_tasks():
    for payload in (kombu_payload("t"), json.dumps({"body": "x" * 5000, "headers": {"x-delay": 5}}), "{}"):
        member = cold.pack(payload, "t")
        assert member is not None and cold.unpack(member)[1] == payload.encode()
    # The format is plain raw deflate with a preset dictionary: any zlib can read it.
    member = cold.pack("{}", "abc")
    assert member is not None
    inflate = zlib.decompressobj(-15, cold.DICTIONARY + b"abc")
    assert inflate.decompress(member[5:]) == b"{}"


def find_stale_once(monkeypatch: pytest.MonkeyPatch, stale: dict[str, list]) -> None:
    """Make Store.find answer each task id of ``stale`` with what it holds, once (a find made
    before another edit or a thaw moved the message), and then find as ever."""
    real_find = Store.find

    def find(self: Store, task_id: str, unreadable: bool = False) -> list:
        return stale.pop(task_id) if task_id in stale else real_find(self, task_id, unreadable)

    monkeypatch.setattr(Store, "find", find)


def rescheduled_after_a_find(
    r: redis.Redis, redis_server: RedisServer
) -> tuple[FakeClock, Store, dict[str, list]]:
    """Task "a" scheduled a minute ahead, found, then rescheduled by another edit three hours
    ahead (into the cold space); returns the clock, a store and that find, now stale."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    store.schedule(Due(clock() + 60_000, task_id="a"), "q", kombu_payload("a"), Settings())
    stale = {"a": store.find("a")}
    with DelayControl(redis_server.delay_url) as control:
        assert control.reschedule("a", countdown=3 * 3600) == 1
    [moved] = store.find("a")
    assert moved.cold and moved.ref != stale["a"][0].ref
    return clock, store, stale


def test_a_cancel_or_reschedule_racing_a_thaw_still_reaches_the_message(r, redis_server, monkeypatch):
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    now = clock()
    for tag in ("a", "b"):
        store.schedule(Due(now + 2100, task_id=tag), "q", kombu_payload(tag), JUST_COLD)
    before = {tag: store.find(tag) for tag in ("a", "b")}
    assert all(found[0].cold for found in before.values())
    clock.advance(150)
    assert store.thaw(2000, 10).thawed == 2  # a mover thaws them after the find
    find_stale_once(monkeypatch, dict(before))
    assert store.cancel("a") == 1
    with DelayControl(redis_server.delay_url) as control:
        assert type(control.store) is Store
        assert control.reschedule("b", countdown=600) == 1
    assert store.find("a") == []
    [moved] = store.find("b")
    assert moved.due_ms > now + 500_000 and store.counts() == {"q": 1}


def test_a_cancel_racing_a_reschedule_still_reaches_the_message(r, redis_server, monkeypatch):
    # A reschedule between a cancel's find and its removal left the message scheduled in its
    # new bucket, and the cancel said "not scheduled".
    _, store, stale = rescheduled_after_a_find(r, redis_server)
    find_stale_once(monkeypatch, stale)
    assert store.cancel("a") == 1
    assert store.find("a") == [] and store.counts() == {}


def test_a_long_rate_capped_drain_still_thaws_in_time(r):
    """A backlog under a rate cap keeps one drain() busy for seconds; a compressed message whose
    thaw horizon begins meanwhile is thawed during that drain, before its due time, not after it.

    Time is driven: the clock enters the thaw horizon once a third of the backlog has moved. The
    rate cap bounds the rest of the drain from below (1,000 messages at 300/s, at least 2.3 s
    however slow the machine), and a mover looks for something to thaw at least every 0.67 s
    (a third of its 2 s horizon)."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    n = 1500
    due = clock() + 60_000
    store.schedule(Due(due, task_id="c"), "q", kombu_payload("c"), JUST_COLD)
    assert len(cold_members(r)) == 1
    plain = Settings(compress_after_ms=0, bucket_width_ms=1000)
    backlog = [(Due(clock() + 400 + i % 10, task_id=f"l{i}"), "q", kombu_payload(f"l{i}")) for i in range(n)]
    assert {x.outcome for x in store.schedule_many(backlog, plain)} == {Scheduled.STORED}
    clock.advance(1000)  # the backlog is due, all at once
    thaws: list[tuple[int, int, int]] = []  # (thawed, clock, listed) at each thaw

    def on_result(result: object) -> None:
        if mover.stats.moved >= n // 3 and clock() < due - 1500:
            clock.ms = due - 1500  # within the thaw horizon (2 s), not due

    def on_thaw(result: ThawResult) -> None:
        if result.thawed:
            thaws.append((result.thawed, clock(), r.llen("q")))

    mover = Mover(
        store, Settings(max_rate=300, thaw_ahead_ms=2000), watch=False, on_result=on_result, on_thaw=on_thaw
    )
    mover.drain()  # returns once nothing is due
    assert thaws, "the compressed message waited for the drain to end"
    [(thawed, at, listed)] = thaws
    assert thawed == 1 and at < due and listed < n, thaws  # during the drain, before its due time
    assert r.llen("q") == n and not cold_members(r)
    clock.ms = due
    wait_until(lambda: mover.drain() and r.llen("q") == n + 1)
    assert tags_in(r, "q")[-1] == "c" and store.counts() == {}


def test_a_drained_bucket_thawed_into_keeps_the_shared_keys_expiring(r):
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    due = clock() + 2100
    if due % 60_000 > 59_000:  # both messages must share one minute bucket
        due += 2000
    store.schedule(Due(due, task_id="w"), "q", kombu_payload("w"), Settings(compress_after_ms=0))
    store.schedule(Due(due + 1, task_id="c"), "q", kombu_payload("c"), JUST_COLD)
    assert len(cold_members(r)) == 1
    assert store.cancel("w") == 1 and not r.exists(keys.index(""))  # the ordinary index emptied
    clock.ms = due + 1 - 1900  # within the thaw horizon
    assert store.thaw(2000, 10).thawed == 1
    assert r.pttl(keys.index("")) > 0 and r.pttl(keys.ids("")) > 0 and r.pttl(keys.counts("")) > 0


def test_a_cold_bucket_whose_meta_is_gone_leaves_its_index(r):
    store = Store(r)
    store.schedule(Due(2100, relative=True, task_id="c"), "q", kombu_payload("c"), JUST_COLD)
    [(start, _, _, _)] = cold_members(r)
    r.delete(keys.meta("", start, keys.COLD), keys.queue_set("", start, "q", keys.COLD))
    wait_until(lambda: store.thaw(2000, 10).next_ms is None and not r.exists(keys.cold_index("")), timeout=30)
    assert store.earliest_due_ms() is None


def test_a_thaw_under_maxmemory_is_refused_whole_and_moves_go_on_then_what_is_due_thaws_past_it(
    tmp_path, caplog
):
    # Once only compressed messages are due, nothing moves, so nothing frees memory: refused
    # whole, they used to stay stored for good, overdue, while the mover said "moves go on".
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as server:
        client = server.client()
        clock = FakeClock(client)
        store = Store(client, clock=clock)
        now = clock()
        store.schedule(Due(now + 2100, task_id="c"), "q", kombu_payload("c"), JUST_COLD)
        store.schedule(Due(now + 300, task_id="w"), "q", kombu_payload("w"), JUST_COLD)
        assert len(cold_members(client)) == 1
        clock.advance(400)  # w is due, c within the thaw horizon
        fill_to_maxmemory(client, 100_000)
        client.config_set("maxmemory", client.info("memory")["used_memory"] // 2)
        with pytest.raises(RedisRefused, match="maxmemory"):
            store.thaw(2000, 10)
        assert len(cold_members(client)) == 1  # nothing taken
        told: list[BaseException] = []  # what the metrics count (kombu_delay_redis_errors_total)
        mover = Mover(store, JUST_COLD, watch=False, on_error=told.append)
        with caplog.at_level("WARNING", logger="kombu_delay"):
            assert mover.thaw() == PAST_MAXMEMORY_LOOK_S  # refused ahead, and nothing compressed is due
        assert "over maxmemory" in caplog.text and "thawed only once due" in caplog.text
        assert [type(exc) for exc in told] == [OverMaxmemory] and mover.stats.errors == 1
        assert len(cold_members(client)) == 1 and mover.stats.thawed == 0
        assert store.move_due(10).moved == 1  # a move frees memory: it is not refused
        clock.ms = now + 2098  # (a thaw past maxmemory reaches 1 ms ahead, to take all of its ms)
        mover.thawer.wake()
        assert mover.thaw() == PAST_MAXMEMORY_LOOK_S and len(cold_members(client)) == 1  # not before due
        clock.ms = now + 2100  # c is due, and nothing but c: no move frees memory
        assert store.move_due(10).moved == 0
        mover.thawer.wake()
        mover.thaw()
        assert not cold_members(client) and mover.stats.thawed == 1  # thawed past maxmemory
        assert store.move_due(10).moved == 1
        assert tags_in(client, "q") == ["w", "c"]
        # Its end is told too (it was not), once a thaw ahead writes again: one with nothing to
        # thaw writes nothing, and said so while Redis was over maxmemory still.
        later = mover.thawer.monotonic() + 3600  # (past PAST_MAXMEMORY_FOR_S)
        mover.thawer.monotonic = lambda: later
        mover.thawer.wake()
        with caplog.at_level("INFO", logger="kombu_delay"):
            mover.thaw()
            assert "Redis has room again" not in caplog.text
            client.config_set("maxmemory", 0)
            store.schedule(Due(clock.ms + 2100, task_id="d"), "q", kombu_payload("d"), JUST_COLD)
            clock.advance(400)
            mover.thawer.wake()
            mover.thaw()
        assert f"mover {mover.name}: Redis has room again" in caplog.text and mover.stats.thawed == 2


def test_past_maxmemory_a_cold_bucket_whose_counts_are_gone_is_recounted_and_thawed(tmp_path):
    # The scan that lists what to thaw recounts a bucket whose meta hash is gone; its first
    # write was one Redis refuses over maxmemory, so every compressed message stayed stored.
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as server:
        client = server.client()
        clock = FakeClock(client)
        store = Store(client, clock=clock)
        due = clock() + 2100
        for tag in ("a", "b"):
            store.schedule(Due(due, task_id=tag), "q", kombu_payload(tag), JUST_COLD)
        [(start, _, _, _), _] = cold_members(client)
        client.delete(keys.meta("", start, keys.COLD))
        fill_to_maxmemory(client, 100_000)
        client.config_set("maxmemory", client.info("memory")["used_memory"] // 2)
        clock.ms = due
        mover = Mover(store, JUST_COLD, watch=False)
        waits = []
        for _ in range(3):  # the scan that recounts the bucket lists its members on the next
            mover.thawer.wake()
            waits.append(mover.thaw())
        assert not cold_members(client) and mover.stats.thawed == 2, (waits, mover.stats)
        assert store.move_due(10).moved == 2 and sorted(tags_in(client, "q")) == ["a", "b"]
        client.config_set("maxmemory", 0)


def test_a_mover_that_thaws_further_ahead_than_a_publisher_is_woken_in_time(r):
    """The mover thaws 30 min ahead, so it looks for something to thaw every 10 min (a third of
    its horizon) and sleeps up to an hour; the publisher stores a message compressed only 3.5 s
    before its due time. Its publish wakes the mover, which thaws it at once: without the wake
    the wait below would run out long before the mover's next look. Time is driven, so the
    message is due only when the test says."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    looked = threading.Event()
    settings = Settings(thaw_ahead_ms=30 * 60_000, max_sleep_ms=3_600_000)
    mover = Mover(store, settings, watch=False, on_thaw=lambda _: looked.set())
    runner = threading.Thread(target=mover.run, daemon=True)
    runner.start()
    try:
        assert looked.wait(60)  # subscribed, and looked once: nothing; the next look is 10 min on
        due = clock() + 3500
        publisher = Settings(compress_after_ms=3000, thaw_ahead_ms=2000)
        assert (
            store.schedule(Due(due, task_id="c"), "q", kombu_payload("c"), publisher).outcome
            is Scheduled.STORED
        )
        wait_until(lambda: mover.stats.thawed == 1, timeout=60)  # stored compressed, thawed now
        assert r.llen("q") == 0  # thawed ahead, not due
        clock.ms = due
        got = r.brpop(["q"], timeout=60)
        assert got is not None and got[1] == kombu_payload("c").encode()
    finally:
        mover.stop()
        joined(runner, 30)


def wakes(r: redis.Redis, publish: Callable[[], object]) -> list[int]:
    """The due times that ``publish`` announced on the wake channel."""
    pubsub = r.pubsub()
    pubsub.subscribe(keys.wake_channel(""))
    try:
        confirmed = pubsub.get_message(timeout=30)  # subscribed before anything is published
        assert confirmed is not None and confirmed["type"] == "subscribe"
        publish()
        r.publish(keys.wake_channel(""), "end")  # the stream is read up to here
        seen = []
        while (message := pubsub.get_message(timeout=30)) is not None and message["data"] != b"end":
            seen.append(int(message["data"].split(b"@")[0]))
        return seen
    finally:
        pubsub.close()


def test_a_compressed_message_due_before_the_first_cold_bucket_ends_wakes_the_movers(r):
    """Publishers with different bucket widths: an hour-wide cold bucket starts first but holds
    a message due late; a narrower publisher's compressed message lands in a bucket that starts
    after it yet is due sooner. Its publish must wake the movers (a mover that thaws further
    ahead than this publisher looks rarely), and a later one in the narrow bucket need not."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    hour = Settings(bucket_width_ms=3_600_000, compress_after_ms=2000, thaw_ahead_ms=1000)
    narrow = Settings(bucket_width_ms=1000, compress_after_ms=2000, thaw_ahead_ms=1000)
    clock.ms += 3_600_000 - clock.ms % 3_600_000 + 1000  # a second into an hour (never behind Redis)
    now = clock()
    wide_due = now - now % 3_600_000 + 3_599_000  # late in the current hour, 1 s before its end
    soon = now + 30_000
    publish_wide = lambda: store.schedule(Due(wide_due, task_id="w"), "q", kombu_payload("w"), hour)  # noqa: E731
    assert wakes(r, publish_wide) == [wide_due]
    assert r.zrange(keys.cold_index(""), 0, 0) == [str(wide_due - wide_due % 3_600_000).encode()]
    assert wakes(r, lambda: store.schedule(Due(soon, task_id="n"), "q", kombu_payload("n"), narrow)) == [soon]
    assert r.zrange(keys.cold_index(""), 0, 0) == [str(now - now % 3_600_000).encode()]  # still first
    # Later than an earlier one in its own set: not the earliest, no wake.
    later = soon + 100
    assert wakes(r, lambda: store.schedule(Due(later, task_id="n2"), "q", kombu_payload("n2"), narrow)) == []
    assert len(cold_members(r)) == 3


def test_a_mover_that_thaws_far_ahead_is_in_time_with_a_narrow_publisher_behind_a_wide_bucket(r):
    """The end to end case of the review: a wide cold bucket first, a mover that thaws 30 min
    ahead (so it looks every 10 min), and a narrow publisher's message due 3.5 s later, in a
    bucket that starts after the wide one. Its publish wakes the mover, which thaws it at once."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    clock.ms += 3_600_000 - clock.ms % 3_600_000 + 1000  # a second into an hour (never behind Redis)
    now = clock()
    wide_due = now - now % 3_600_000 + 3_599_000  # beyond the mover's horizon: not thawed
    store.schedule(Due(wide_due, task_id="w"), "q", kombu_payload("w"), Settings(bucket_width_ms=3_600_000))
    looked = threading.Event()
    settings = Settings(thaw_ahead_ms=30 * 60_000, max_sleep_ms=3_600_000)
    mover = Mover(store, settings, watch=False, on_thaw=lambda _: looked.set())
    runner = threading.Thread(target=mover.run, daemon=True)
    runner.start()
    try:
        assert looked.wait(60)  # looked once: nothing within its horizon; the next look is 10 min on
        due = clock() + 3500
        publisher = Settings(bucket_width_ms=1000, compress_after_ms=3000, thaw_ahead_ms=2000)
        assert (
            store.schedule(Due(due, task_id="c"), "q", kombu_payload("c"), publisher).outcome
            is Scheduled.STORED
        )
        wait_until(lambda: mover.stats.thawed == 1, timeout=60)
        assert r.llen("q") == 0 and [cold.unpack(m)[0] for _, _, m, _ in cold_members(r)] == ["w"]
        clock.ms = due
        got = r.brpop(["q"], timeout=60)
        assert got is not None and got[1] == kombu_payload("c").encode()
    finally:
        mover.stop()
        joined(runner, 30)


def test_a_thaw_replaces_only_the_thawed_refs_of_each_task_id(r, prefix):
    """The id index is rewritten once per thaw call: each thawed message's cold ref gives way
    to its ordinary one, and a task id's other refs (an ordinary message of the same id, a
    retry of it thawed in the same call) stay, each once."""
    clock = FakeClock(r)
    store, queue = Store(r, prefix, clock=clock), f"{prefix}q"
    due = clock() + 600_000
    bodies = ["b3JkaW5hcnk=", "Y29sZC0x", "Y29sZC0y"]  # three messages of task id "t"
    ordinary = Settings(compress_after_ms=0)
    store.schedule(Due(due, task_id="t"), queue, kombu_payload("t", body=bodies[0]), ordinary)
    for offset, body in enumerate(bodies[1:], 1):
        store.schedule(Due(due + offset, task_id="t"), queue, kombu_payload("t", body=body), FAST)
    store.schedule(Due(due + 3, task_id="u"), queue, kombu_payload("u"), FAST)
    assert len(cold_members(r, prefix)) == 3
    ids = keys.ids(prefix)
    assert sum(ref.startswith("c") for ref in r.hget(ids, "t").decode().split()) == 2

    clock.ms = due - 1000
    assert store.thaw(2000, 100).thawed == 3
    refs = r.hget(ids, "t").decode().split()
    assert len(refs) == len(set(refs)) == 3 and not any(ref.startswith("c") for ref in refs)
    found = store.find("t")
    assert sorted(json.loads(s.payload)["body"] for s in found) == sorted(bodies)
    assert not any(s.cold for s in found)
    assert [s.cold for s in store.find("u")] == [False]
    assert len(r.hget(ids, "u").split()) == 1
    assert store.cancel("t") == 3 and not r.hexists(ids, "t")


def test_a_reschedule_racing_a_reschedule_is_the_one_that_stays(r, redis_server, monkeypatch):
    # Another reschedule between this one's find and its own call left the message at the other
    # time, and this one said "not scheduled" (0): the latest reschedule now wins.
    clock, store, stale = rescheduled_after_a_find(r, redis_server)  # the other edit
    find_stale_once(monkeypatch, stale)
    with DelayControl(redis_server.delay_url) as control:
        assert control.reschedule("a", countdown=600) == 1
    [now_at] = store.find("a")
    assert 590_000 < now_at.due_ms - clock() < 610_000
    assert store.counts() == {"q": 1}


def test_a_reschedule_raced_between_two_messages_of_a_task_counts_each_once(r, redis_server, monkeypatch):
    # A task with two messages (a retry reusing its id), and another reschedule of both between
    # this one's first and second: the look again rescheduled both, and counted 3.
    store = Store(r)
    now = store.time_ms()
    store.schedule(Due(now + 60_000, task_id="a"), "q", kombu_payload("a"), Settings())
    retry = kombu_payload("a").replace('"priority": 0', '"priority": 1')
    store.schedule(Due(now + 120_000, task_id="a"), "q", retry, Settings())
    with DelayControl(redis_server.delay_url) as control, DelayControl(redis_server.delay_url) as other:
        real = type(control.store).reschedule
        calls = []

        def racing(self: Store, old, *args, **kwargs):
            calls.append(old)
            if len(calls) == 2:  # between this reschedule's two messages
                assert other.reschedule("a", countdown=1800) == 2
            return real(self, old, *args, **kwargs)

        monkeypatch.setattr(type(control.store), "reschedule", racing)
        assert control.reschedule("a", countdown=600) == 2
    found = store.find("a")
    assert sorted(round((s.due_ms - now) / 60_000) for s in found) == [10, 10]


def test_a_reschedule_to_a_message_over_the_servers_string_limit_changes_nothing():
    with RedisServer(extra_args=["--proto-max-bulk-len", "1mb"]) as server:
        r = server.client()
        ctl_store = Store(r)
        due = Due(ctl_store.time_ms() + 3_600_000, task_id="t")
        ctl_store.schedule(due, "q", kombu_payload("t"), Settings())
        [old] = ctl_store.find("t")
        bigger = kombu_payload("t", body="x" * (2 * 2**20))
        with pytest.raises(PayloadTooLarge, match="'t' stays as it was"):
            ctl_store.reschedule(old, "t", bigger, due.ms + 60_000, Settings())
        assert r.ping() and ctl_store.find("t") == [old]
        r.close()


def assert_moved_once(r: redis.Redis, store: Store, clock: FakeClock, at: int, payloads: list[str]) -> None:
    """Move everything due at ``at`` onto the list "q": each payload once, as published."""
    clock.ms = at
    while store.move_due(500).more:
        pass
    assert sorted(r.lrange("q", 0, -1)) == sorted(p.encode() for p in payloads)


@pytest.mark.usefixtures("large_cold_members")
@pytest.mark.parametrize("shape", ["compressible", "random"])
def test_a_thaw_call_stores_about_16_mb_however_large_its_messages(r, shape):
    # 100 messages listed and stored in one call whatever their size: 100 of 10 MB held Redis
    # for 4.6 s, and a message of zeros restores to hundreds of times its member.
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    due = clock() + 60_000
    body = (lambda i: "x" * 4_000_000) if shape == "compressible" else (lambda i: os.urandom(2_000_000).hex())
    payloads = [f"{i:02d}" + body(i) for i in range(7)]
    for i, payload in enumerate(payloads):
        assert store.schedule(Due(due + i, task_id=f"t{i}"), "q", payload, FAST).outcome is Scheduled.STORED
    assert len(cold_members(r)) == 7
    calls = []
    for _ in range(10):
        result = store.thaw(FAST.thaw_ahead_ms, 100, now_ms=due - 1000)
        calls.append((result.thawed, result.more))
        if not result.more:
            break
    # About 16 MiB a call (at least one message), counting each member and its message: 4 MB
    # messages whose members are 4 KB, five then two; or members of 2 MB, three, three, one.
    assert [n for n, _ in calls if n] == ([5, 2] if shape == "compressible" else [3, 3, 1]), calls
    assert not cold_members(r) and store.counts() == {"q": 7}
    assert_moved_once(r, store, clock, due + 10, payloads)


@pytest.mark.usefixtures("large_cold_members")
def test_a_small_cold_message_ahead_of_large_ones_does_not_list_them_all_in_one_scan(r):
    # A scan was sized by its first member alone: one small member ahead of 2 MB ones listed
    # them all in one call. They are read in chunks, which stop once 16 MiB are read.
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    due = clock() + 60_000
    payloads = ["small"] + [f"{i:02d}" + os.urandom(2_000_000).hex() for i in range(10)]
    for i, payload in enumerate(payloads):
        assert store.schedule(Due(due + i, task_id=f"t{i}"), "q", payload, FAST).outcome is Scheduled.STORED
    members = sorted(len(member) for _, _, member, _ in cold_members(r))
    reply = store._scripts["thaw_scan"](
        keys=[spaces.COLD.index(""), keys.counts(""), keys.totals("")],
        args=[store.ns, 2000, 100, due - 1000, "0"],
    )
    listed = [len(member) for member in reply[6:][3::4]]
    assert int(reply[2]) == 1 and len(listed) < len(payloads), listed  # more: the rest wait
    assert keys.CALL_BYTES <= sum(listed) + 64 * len(listed) <= keys.CALL_BYTES + members[-1] + 64
    while store.thaw(FAST.thaw_ahead_ms, 100, now_ms=due - 1000).more:
        pass
    assert not cold_members(r) and store.counts() == {"q": len(payloads)}
    assert_moved_once(r, store, clock, due + 100, payloads)


def test_a_thaw_cut_by_its_limit_says_more(r):
    # The scan said no more when its limit ran out inside the last bucket it visited.
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    due = clock() + 60_000
    for i in range(150):
        assert store.schedule(Due(due, task_id=f"t{i}"), "q", f"p{i}", FAST).outcome is Scheduled.STORED
    first = store.thaw(FAST.thaw_ahead_ms, 100, now_ms=due - 1000)
    assert (first.thawed, first.more) == (100, True), first
    last = store.thaw(FAST.thaw_ahead_ms, 100, now_ms=due - 1000)
    assert (last.thawed, last.more) == (50, False), last


def test_a_member_two_movers_fail_to_restore_is_logged_once(r, caplog, monkeypatch):
    # Each mover logged the member it could not restore before its thaw call, whichever of
    # them took it: two movers, two ERRORs for one dead letter.
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    for tag in ("a", "bad"):
        store.schedule(Due(clock() + 2100, task_id=tag), "q", kombu_payload(tag), JUST_COLD)
    [(start, bad)] = [(start, m) for start, _, m, _ in cold_members(r) if cold.unpack(m)[0] == "bad"]
    key = keys.queue_set("", start, "q", keys.COLD)
    r.zadd(key, {bad[:-3]: r.zscore(key, bad)})  # cut short: it no longer inflates
    r.zrem(key, bad)
    clock.advance(150)
    one, two = Store(r, clock=clock), Store(r, clock=clock)
    unpack, interleaved = cold.unpack, []

    def unpack_after_the_other(member: bytes) -> tuple[str, bytes]:
        if not interleaved:  # the other mover thaws the whole batch first
            interleaved.append(member)
            assert two.thaw(2000, 10).dead == 1
        return unpack(member)

    monkeypatch.setattr(cold, "unpack", unpack_after_the_other)
    with caplog.at_level("DEBUG", logger="kombu_delay"):
        result = one.thaw(2000, 10)
    assert (result.thawed, result.dead, result.gone) == (0, 0, 2)
    errors = [rec for rec in caplog.records if rec.levelname == "ERROR"]
    assert len(errors) == 1 and "1 cold scheduled message could not be restored" in errors[0].getMessage()
    assert "dead-letter list" in errors[0].getMessage() and r.llen(keys.dead("")) == 1
