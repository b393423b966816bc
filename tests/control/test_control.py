"""DelayControl on a real Redis: cancel, reschedule, listing, stats and purge, with and without
``global_keyprefix``; end to end with a real mover process and a real Celery worker."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Exchange, Producer, Queue
from kombu.exceptions import ChannelError

import kombu_delay
from kombu_delay import BadETA, DelayControl, EditConflict, RedisUnavailable
from kombu_delay.config import MAX_DURATION_MS, Settings
from kombu_delay.control.gate import Once
from kombu_delay.message import Due, index_id
from kombu_delay.store import Store, keys
from kombu_delay.store.listing import Cursor
from kombu_delay.store.replies import Rescheduled, Scheduled
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.procs import ROOT, wait_until
from tests.support.stored import ORDINARY, FakeClock, kombu_payload, redis_ms
from tests.support.workers import INSPECT_APP, inspect_ledger, start_inspect_worker

SEP = "\x06\x16"
HOUR_MS = 3_600_000
ORDINARY_HOUR = Settings(bucket_width_ms=HOUR_MS, compress_after_ms=0)


def options(prefix: str) -> dict[str, object]:
    """Transport options of these tests: the ordinary layout, which they look into
    (test_cold.py covers the cold space)."""
    ordinary: dict[str, object] = {"delay_compress_after": 0}
    return {"global_keyprefix": prefix, **ordinary} if prefix else ordinary


def publisher(redis_server, prefix: str, **conf: object) -> Celery:
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = options(prefix)
    app.conf.update(conf)
    return app


def truth(r, prefix: str) -> Counter[str]:
    """Count the stored messages per destination by reading every bucket's sorted sets
    (``<ns>z:<start>:<dest>``), not the counters (tests only)."""
    found: Counter[str] = Counter()
    head = f"{keys.ns(prefix)}z:"
    for key in r.scan_iter(match=f"{head}*"):
        _start, dest = key.decode()[len(head) :].split(":", 1)
        found[dest] += r.zcard(key)
    return +found


def leftover_keys(r, prefix: str) -> set[str]:
    # The notes of what edits took (for a publish's retry) go by themselves, within minutes.
    taken = keys.taken(prefix)
    assert not r.exists(taken) or 0 < r.pttl(taken) <= keys.TAKEN_KEEP_MS
    keep = {keys.totals(prefix), keys.movers(prefix), taken}
    return {k.decode() for k in r.scan_iter(match=f"{keys.ns(prefix)}*")} - keep


def awaiting_cleanup(r, prefix: str, start_ms: int) -> set[str]:
    """The keys a drained bucket leaves until its end has passed and a move cleans it up: its
    meta hash (its seq keeps refs unique), its task-id list, and its entry in ``gc``. Each
    must expire by itself too, so a dead system does not keep them."""
    left = {keys.meta(prefix, start_ms), keys.task_ids(prefix, start_ms), keys.drained(prefix)}
    assert all(r.pttl(key) > 0 for key in left), {key: r.pttl(key) for key in left}
    assert r.zscore(keys.drained(prefix), str(start_ms)) == start_ms + 60_000  # scored by its end
    assert not r.zscore(keys.index(prefix), str(start_ms))
    return left


def warm_up(r, app: Celery) -> None:
    app.send_task("inspect.record", ("warm",))
    wait_until(lambda: any(e["tag"] == "warm" for e in inspect_ledger(r)), timeout=120)


def test_cancel_before_eta_means_the_worker_never_runs_it(r, redis_server, spawn, start_mover, prefix):
    app = publisher(redis_server, prefix)
    start_mover(prefix=prefix)
    worker = start_inspect_worker(spawn, redis_server, options(prefix))
    warm_up(r, app)
    # Due 8 s on: the cancel below comes long before, however busy the machine.
    sent = [app.send_task("inspect.record", (f"n{i}",), countdown=8) for i in range(5)]
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        assert ctl.cancel(sent[2].id) == 1
        assert ctl.cancel(sent[2].id) == 0
        last = app.send_task("inspect.record", ("last",), countdown=9)
        wait_until(lambda: any(e["id"] == last.id for e in inspect_ledger(r)), timeout=120)
        ran = Counter(e["tag"] for e in inspect_ledger(r))
        assert ran == Counter({"warm": 1, "n0": 1, "n1": 1, "n3": 1, "n4": 1, "last": 1}), worker.output()
        stats = ctl.stats()
        assert stats.scheduled == 0
        assert stats.totals["cancelled"] == 1
    app.close()


def test_reschedule_earlier_and_later_runs_once_at_the_new_time(r, redis_server, spawn, start_mover, prefix):
    app = publisher(redis_server, prefix)
    start_mover(prefix=prefix)
    start_inspect_worker(spawn, redis_server, options(prefix))
    warm_up(r, app)
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        # Each reschedule comes seconds before the time it moves away from, however busy
        # the machine: "later" is rescheduled at once, "earlier" has 20 s.
        late = app.send_task("inspect.record", ("later",), countdown=8)
        assert ctl.reschedule(late.id, eta=datetime.now(UTC) + timedelta(seconds=12)) == 1
        early = app.send_task("inspect.record", ("earlier",), countdown=20)
        old_early_due = ctl.find(early.id)[0].due_ms
        assert ctl.reschedule(early.id, countdown=4) == 1
        new_early_due = ctl.find(early.id)[0].due_ms
        assert new_early_due < old_early_due
        new_late_due = ctl.find(late.id)[0].due_ms
        # A sentinel due after the old ETA of "earlier": when it has run, a copy left at
        # the old time would have run too.
        sentinel = app.send_task("inspect.record", ("sentinel",), countdown=22)
        wait_until(lambda: any(e["id"] == sentinel.id for e in inspect_ledger(r)), timeout=180)
    runs = {e["tag"]: [x for x in inspect_ledger(r) if x["tag"] == e["tag"]] for e in inspect_ledger(r)}
    assert len(runs["earlier"]) == 1 and len(runs["later"]) == 1
    (ran_early,), (ran_late,) = runs["earlier"], runs["later"]
    assert ran_early["ran_ms"] >= new_early_due  # never before its new time
    assert ran_late["ran_ms"] >= new_late_due
    # The ETA inside the message was rewritten: a worker given the old one would have held
    # "earlier" in memory until then. (Checked on the ETA the worker read, not by when it ran:
    # how late a run comes is no test's to bound.)
    assert datetime.fromisoformat(ran_early["eta"]) == datetime.fromtimestamp(new_early_due / 1000, UTC)
    assert datetime.fromisoformat(ran_late["eta"]) == datetime.fromtimestamp(new_late_due / 1000, UTC)
    app.close()


def test_cancel_of_a_retried_task_id_cancels_every_pending_message(r, redis_server, prefix):
    app = publisher(redis_server, prefix)
    task_id = str(uuid.uuid4())
    app.send_task("inspect.record", ("first",), countdown=300, task_id=task_id)
    app.send_task("inspect.record", ("retry",), countdown=900, task_id=task_id, retries=1)
    other = app.send_task("inspect.record", ("other",), countdown=300)
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        assert len(ctl.find(task_id)) == 2
        assert ctl.cancel(task_id) == 2
        assert ctl.find(task_id) == []
        assert ctl.cancel("no-such-id") == 0
        assert [m.task_id for m in ctl.find(other.id)] == [other.id]
        assert ctl.stats().scheduled == 1
        assert not r.hexists(keys.ids(prefix), task_id)
    app.close()


def _stored_payload(ctl: DelayControl, task_id: str) -> dict[str, object]:
    (stored,) = ctl.store.find(task_id)
    result: dict[str, object] = json.loads(stored.message)
    return result


def test_reschedule_rewrites_the_eta_inside_celery_protocol_2_and_1(r, redis_server, prefix):
    new_eta = datetime(2031, 5, 6, 7, 8, 9, 123000, tzinfo=UTC)
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        for protocol in (2, 1):
            app = publisher(redis_server, prefix, task_protocol=protocol)
            sent = app.send_task("inspect.record", ("p",), countdown=600)
            assert ctl.reschedule(sent.id, eta=new_eta) == 1
            assert ctl.find(sent.id)[0].due_ms == int(new_eta.timestamp() * 1000)
            message = _stored_payload(ctl, sent.id)
            if protocol == 2:
                eta = message["headers"]["eta"]  # type: ignore[index]
            else:
                eta = json.loads(base64.b64decode(message["body"]))["eta"]  # type: ignore[arg-type]
            assert datetime.fromisoformat(eta) == new_eta
            app.close()


def test_reschedule_keeps_a_compressed_protocol_1_body_compressed(r, redis_server, prefix):
    # A protocol 1 task sent with task_compression carries its ETA in a compressed body: the
    # new ETA goes into it, compressed as before, so a worker can still decode it.
    import kombu.compression

    new_eta = datetime(2031, 5, 6, 7, 8, 9, 123000, tzinfo=UTC)
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        app = publisher(redis_server, prefix, task_protocol=1, task_compression="zlib")
        sent = app.send_task("inspect.record", ("p",), countdown=600)
        assert ctl.reschedule(sent.id, eta=new_eta) == 1
        message = _stored_payload(ctl, sent.id)
        compression = message["headers"]["compression"]  # type: ignore[index]
        body = kombu.compression.decompress(base64.b64decode(message["body"]), compression)  # type: ignore[arg-type]
        assert datetime.fromisoformat(json.loads(body)["eta"]) == new_eta
        app.close()


@pytest.mark.parametrize("body_encoding", ["base64", None])
def test_reschedule_rewrites_a_msgpack_protocol_1_body_in_msgpack(r, redis_server, prefix, body_encoding):
    # Held since its body is read in msgpack too: a reschedule earlier must write its new ETA
    # into it, as msgpack, or its worker would wait for the old one. With no body encoding, the
    # body is bytes, which kombu's JSON writes as an object: find and cancel did not know it.
    import msgpack
    from kombu.utils.json import loads

    new_eta = datetime(2031, 5, 6, 7, 8, 9, 123000, tzinfo=UTC)
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        app = publisher(redis_server, prefix, task_protocol=1, task_serializer="msgpack")
        app.conf.broker_transport_options = {**options(prefix), "body_encoding": body_encoding}
        sent = app.send_task("inspect.record", ("p",), countdown=600)
        assert ctl.reschedule(sent.id, eta=new_eta) == 1
        message = _stored_payload(ctl, sent.id)
        assert message["content-type"] == "application/x-msgpack"
        raw = (
            loads(json.dumps(message["body"])) if body_encoding is None else base64.b64decode(message["body"])
        )
        body = msgpack.unpackb(raw, raw=False)  # type: ignore[arg-type]
        assert datetime.fromisoformat(body["eta"]) == new_eta and body["args"] == ["p"]
        (item,) = ctl.scheduled().items
        assert (item.task_id, item.task) == (sent.id, "inspect.record")
        app.close()


def test_reschedule_keeps_an_x_delay_message_as_it_is(r, redis_server, prefix):
    with Connection(redis_server.delay_url, transport_options=options(prefix)) as conn:
        queue = Queue("plain", Exchange("plain", "direct"), "plain")
        Producer(conn.default_channel).publish(
            {"n": 1},
            exchange=queue.exchange,
            routing_key="plain",
            declare=[queue],
            headers={"x-delay": 60_000},
        )
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        (item,) = ctl.scheduled().items
        before = _stored_payload(ctl, item.task_id)
        assert ctl.reschedule(item.task_id, countdown=120) == 1
        assert _stored_payload(ctl, item.task_id) == before
        assert ctl.find(item.task_id)[0].due_ms > item.due_ms + 50_000


def test_a_thaw_listed_before_a_reschedule_in_its_bucket_keeps_the_new_time(r, redis_server, prefix):
    # An x-delay message keeps its bytes when rescheduled: a reschedule within its cold bucket,
    # between a thaw's listing and its store, left the same member at another score, which
    # the thaw claimed by its bytes and stored at the due time it had listed (the old one).
    cold = {**options(prefix), "delay_compress_after": 60}
    with Connection(redis_server.delay_url, transport_options=cold) as conn:
        queue = Queue("plain", Exchange("plain", "direct"), "plain")
        Producer(conn.default_channel).publish(
            {"n": 1}, exchange=queue.exchange, routing_key="plain", declare=[queue], headers={"x-delay": 6e5}
        )
    with DelayControl(redis_server.url, cold) as ctl:
        (item,) = ctl.scheduled().items
        assert r.zcard(keys.cold_index(prefix)) == 1  # stored compressed
        old = item.due_ms
        new = old + 20_000 if old % 60_000 < 30_000 else old - 20_000  # in the same bucket
        store = Store(r, prefix)
        restored = store._restored

        def rescheduled_meanwhile(listed: list[Any]) -> Any:
            assert ctl.reschedule(item.task_id, eta=datetime.fromtimestamp(new / 1000, UTC)) == 1
            return restored(listed)

        store._restored = rescheduled_meanwhile  # type: ignore[method-assign]
        first = store.thaw(3_600_000, 100)
        assert (first.thawed, first.gone) == (0, 1)
        store._restored = restored  # type: ignore[method-assign]
        assert store.thaw(3_600_000, 100).thawed == 1
        (found,) = ctl.find(item.task_id)
        assert found.due_ms == new and r.zcard(keys.cold_index(prefix)) == 0


def test_reschedule_to_now_onto_a_key_that_is_not_a_list_keeps_the_message(r, redis_server, prefix):
    app = publisher(redis_server, prefix)
    sent = app.send_task("t.wrongtype", countdown=600, queue="wrongq")
    dest = keys.destination(prefix, "wrongq", 0, SEP)
    r.set(dest, "not a list")
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        (before,) = ctl.find(sent.id)
        with pytest.raises(kombu_delay.RedisRefused, match="other than a list"):
            ctl.reschedule(sent.id, countdown=0)
        assert ctl.find(sent.id) == [before]
        assert ctl.stats().totals.get("rescheduled", 0) == 0
        r.delete(dest)
        assert ctl.reschedule(sent.id, countdown=0) == 1
    assert json.loads(r.rpop(dest))["headers"]["id"] == sent.id
    assert truth(r, prefix) == Counter()


def test_reschedule_rejects_naive_datetimes_and_needs_one_time(r, redis_server):
    with DelayControl(redis_server.url) as ctl:
        with pytest.raises(BadETA):
            ctl.reschedule("x", eta=datetime(2030, 1, 1))
        with pytest.raises(TypeError):
            ctl.reschedule("x")
        with pytest.raises(TypeError):
            ctl.reschedule("x", eta=datetime.now(UTC), countdown=1)


def test_arguments_of_the_wrong_type_are_type_errors_that_say_so(r, redis_server):
    # cancel(None), cancel(b"x") and reschedule(eta="2030-...") failed on an attribute deep in
    # the store; reschedule(countdown=True) and countdown="5" were taken; stats(hours=0) drew
    # one 60-minute slot.
    with DelayControl(redis_server.url) as ctl:
        for task_id in (None, 123, b"x"):
            for call in (ctl.cancel, ctl.find, lambda t: ctl.reschedule(t, countdown=5)):
                with pytest.raises(TypeError, match=f"a task id is a str, not {type(task_id).__name__}"):
                    call(task_id)
        with pytest.raises(TypeError, match="an aware datetime, not str"):
            ctl.reschedule("x", eta="2030-01-01T00:00:00+00:00")  # type: ignore[arg-type]
        for countdown in (True, "5", b"5", bytearray(b"5"), [], (), {}):  # [] was "now"
            with pytest.raises(TypeError, match="countdown is a number of seconds"):
                ctl.reschedule("x", countdown=countdown)  # type: ignore[arg-type]
        for hours, slot in ((0, 60), (-1, 60), (1, 0)):
            with pytest.raises(ValueError, match="both must be over 0"):
                ctl.stats(hours=hours, slot_minutes=slot)
        assert ctl.reschedule("x", countdown=5) == 0 and ctl.cancel("x") == 0  # (still fine)
    # Checked before anything reaches Redis (Redis's clock was read first, and a Redis gone
    # hid the TypeError).
    with DelayControl(redis_server.url) as ctl:
        ctl.store.time_ms = lambda: pytest.fail("Redis's clock read before the countdown was checked")
        with pytest.raises(TypeError, match="countdown is a number of seconds"):
            ctl.reschedule("x", countdown="5")  # type: ignore[arg-type]
    with DelayControl(redis_server.url) as ctl:
        assert ctl.reschedule("x", countdown=Decimal("2.5")) == ctl.reschedule("x", countdown=2.5) == 0
        # A cursor that is none raised "not enough values to unpack"; limit="3" a raw
        # comparison error; purge(None) answered 0; stats(max_buckets=0) was taken.
        for call, error, text in (
            (lambda: ctl.scheduled(cursor="x"), ValueError, "not a cursor of scheduled"),
            (lambda: ctl.scheduled(cursor=5), TypeError, "a cursor is a str"),  # type: ignore[arg-type]
            (lambda: ctl.scheduled(limit="3"), TypeError, "limit is a whole number"),  # type: ignore[arg-type]
            (lambda: ctl.scheduled(limit=0), ValueError, "limit must be at least 1"),
            (lambda: ctl.scheduled(queue=b"q"), TypeError, "a queue is named by a str"),  # type: ignore[arg-type]
            (lambda: ctl.purge(None), TypeError, "a queue is named by a str"),  # type: ignore[arg-type]
            (lambda: ctl.stats(max_buckets=0), ValueError, "max_buckets must be at least 1"),
            (lambda: ctl.dead_letters(offset=-1), ValueError, "offset must be at least 0"),
            (lambda: ctl.dead_letters(limit=True), TypeError, "limit is a whole number"),
        ):
            with pytest.raises(error, match=text):
                call()
    # DelayControl(app) failed on an attribute of the app, deep in the connection's gate.
    with pytest.raises(
        TypeError, match=r"a kombu Connection \(of a Celery app: app.connection_for_write\(\)\), not Celery"
    ):
        DelayControl(publisher(redis_server, ""))  # type: ignore[arg-type]


def test_reschedule_of_an_envelope_moved_meanwhile_writes_nothing(r, redis_server, prefix):
    app = publisher(redis_server, prefix)
    sent = app.send_task("inspect.record", ("x",), countdown=300)
    app.close()
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        (stored,) = ctl.store.find(sent.id)
        assert stored.dest == f"{prefix}celery" and index_id(stored.payload) == sent.id
        assert ctl.cancel(sent.id) == 1  # stands for a mover that moved it a moment ago
        outcome = ctl.store.reschedule(stored, sent.id, "{}", stored.due_ms + 1000, ORDINARY)
        assert outcome is Rescheduled.GONE
        assert ctl.stats().scheduled == 0
        assert r.lrange(f"{prefix}celery", 0, -1) == []
        # Nothing but the drained bucket's bookkeeping, which waits for the clean-up.
        assert leftover_keys(r, prefix) == awaiting_cleanup(r, prefix, stored.start_ms)


def test_reschedule_to_a_past_time_sends_it_now(r, redis_server, prefix):
    app = publisher(redis_server, prefix)
    sent = app.send_task("inspect.record", ("x",), countdown=300)
    app.close()
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        (stored,) = ctl.store.find(sent.id)
        assert ctl.reschedule(sent.id, countdown=-1) == 1
        (raw,) = r.lrange(f"{prefix}celery", 0, -1)
        assert json.loads(raw)["headers"]["id"] == sent.id
        assert ctl.stats().scheduled == 0
        assert ctl.find(sent.id) == [] and not r.hexists(keys.ids(prefix), sent.id)
        assert leftover_keys(r, prefix) == awaiting_cleanup(r, prefix, stored.start_ms)
        # It left the store onto its list: the lifetime totals still add up to what is stored.
        totals = ctl.stats().totals
        assert (totals["scheduled"], totals["moved"], totals["rescheduled"]) == (1, 1, 1)


def test_reschedule_onto_an_identical_message_merges_them_and_totals_add_up(r, redis_server, prefix):
    """An x-delay message carries no ETA to rewrite: rescheduled onto the time of its identical
    twin, it merges with it (a bucket stores one copy of a payload per queue)."""
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        store = ctl.store
        now = store.time_ms()
        dest, payload = f"{prefix}celery", kombu_payload("twin")
        for due in (now + 300_000, now + 600_000):
            store.schedule(Due(due, task_id="twin"), dest, payload, ORDINARY)
        assert ctl.reschedule("twin", eta=datetime.fromtimestamp((now + 600_000) / 1000, UTC)) == 2
        assert len(ctl.find("twin")) == 1
        stats = ctl.stats()
        assert stats.scheduled == 1
        assert (stats.totals["scheduled"], stats.totals["cancelled"], stats.totals["rescheduled"]) == (
            2,
            1,
            2,
        )


def test_ls_paging_is_stable_while_messages_are_moved(r, redis_server, prefix):
    """Pages are read while messages move: between every two pages the clock advances and a
    move takes what is due (time driven, so the moves interleave with every page)."""
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        clock = FakeClock(r)
        store = Store(r, prefix, clock=clock)
        now = clock()
        dest = f"{prefix}celery"
        # A member is its payload: each message carries its own id (its delivery tag).
        early = [
            (Due(now + 1500 + 10 * i, task_id=f"e{i}"), dest, kombu_payload(f"e{i}")) for i in range(300)
        ]
        late = [
            (Due(now + 600_000 + 10 * i, task_id=f"l{i}"), dest, kombu_payload(f"l{i}")) for i in range(200)
        ]
        assert {x.outcome for x in store.schedule_many(early + late, ORDINARY)} == {Scheduled.STORED}
        clock.advance(1500)
        seen: list[tuple[str, int]] = []
        cursor = None
        moves = []
        while True:
            page = ctl.scheduled(limit=7, cursor=cursor)
            seen += [(m.task_id, m.due_ms) for m in page.items]
            if page.cursor is None:
                break
            cursor = page.cursor
            clock.advance(50)
            moves.append(store.move_due(1000).moved)
    ids = [task_id for task_id, _ in seen]
    assert sum(moves) > 0 and r.llen(dest) == sum(moves), "nothing moved while pages were read"
    assert len(ids) == len(set(ids)), "a message was listed twice"
    assert {f"l{i}" for i in range(200)} <= set(ids), "a message still scheduled was skipped"
    assert [due for _, due in seen] == sorted(due for _, due in seen)


def test_the_next_page_skips_nothing_when_the_last_one_listed_has_left(r, redis_server, prefix):
    """The cursor names the last message listed; when that one is moved or cancelled before
    the next page, the page goes on from its score, not past an offset."""
    hour = Settings(compress_after_ms=0, bucket_width_ms=3_600_000)
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        clock = FakeClock(r)
        store = ctl.store
        store.clock = clock
        now = clock()
        dest = f"{prefix}celery"
        # One-hour buckets: all four share one sorted set (unless an hour ends within 5 s).
        items = [(Due(now + 400, task_id="m0"), dest, kombu_payload("m0"))]
        items += [(Due(now + 5000 + i, task_id=f"m{i}"), dest, kombu_payload(f"m{i}")) for i in (1, 2, 3)]
        store.schedule_many(items, hour)
        first = ctl.scheduled(limit=1)
        assert [m.task_id for m in first.items] == ["m0"]
        clock.advance(401)
        assert store.move_due(100).moved == 1
        second = ctl.scheduled(limit=1, cursor=first.cursor)
        assert [m.task_id for m in second.items] == ["m1"]
        assert ctl.cancel("m1") == 1
        third = ctl.scheduled(limit=5, cursor=second.cursor)
        assert [m.task_id for m in third.items] == ["m2", "m3"] and third.cursor is None
        # A last page exactly full has no next one either (the CLI offered an empty one).
        full = ctl.scheduled(limit=2, cursor=second.cursor)
        assert [m.task_id for m in full.items] == ["m2", "m3"] and full.cursor is None

        # Members sharing one score (seq wraps after 2048 publishes into a bucket): cancel
        # the last one listed before every next page; none of the others is skipped.
        due = now + 600_000
        herd = [(Due(due, task_id=f"h{i}"), dest, kombu_payload(f"h{i}")) for i in range(3 * keys.SEQ_SLOTS)]
        store.schedule_many(herd, hour)
        assert r.zcount(keys.queue_set(prefix, keys.bucket_start(due, 3_600_000), dest), due, due) == 3
        listed: set[str] = set()
        cancelled: set[str] = set()
        cursor = None
        while True:
            page = ctl.scheduled(limit=5, cursor=cursor)
            listed.update(m.task_id for m in page.items)
            if page.cursor is None:
                break
            last = page.items[-1].task_id
            assert ctl.cancel(last) == 1
            cancelled.add(last)
            cursor = page.cursor
        assert {f"h{i}" for i in range(3 * keys.SEQ_SLOTS)} - cancelled <= listed


def test_paging_and_purge_with_more_than_2048_messages_in_one_millisecond(r, redis_server, prefix):
    # seq wraps at 2048, so members share scores: cursors and purge must count ties.
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        store = ctl.store
        due = store.time_ms() + 600_000
        items = [
            (Due(due, task_id=f"t{i}"), f"{prefix}{'a' if i % 2 else 'b'}", kombu_payload(f"t{i}"))
            for i in range(5000)
        ]
        assert {res.outcome.name for res in store.schedule_many(items, ORDINARY)} == {"STORED"}
        start = keys.bucket_start(due, 60_000)
        scores = {
            dest: [
                s
                for _, s in r.zrange(keys.queue_set(prefix, start, f"{prefix}{dest}"), 0, -1, withscores=True)
            ]
            for dest in "ab"
        }
        # The seq counter is the bucket's: the two sets hold the odd and the even seqs, and
        # within each set members share scores.
        assert len(set(scores["a"]) | set(scores["b"])) == keys.SEQ_SLOTS
        assert all(len(found) == 2500 and len(set(found)) == keys.SEQ_SLOTS // 2 for found in scores.values())
        seen: list[str] = []
        listed_dests: list[str] = []
        cursor = None
        while True:
            page = ctl.scheduled(limit=7, cursor=cursor)
            seen += [m.task_id for m in page.items]
            listed_dests += [m.dest for m in page.items]
            if page.cursor is None:
                break
            cursor = page.cursor
        # Due order: by score, then destination, then member (byte order within one score).
        members = [
            (score, dest, member)
            for dest in "ab"
            for member, score in r.zrange(
                keys.queue_set(prefix, start, f"{prefix}{dest}"), 0, -1, withscores=True
            )
        ]
        assert seen == [index_id(member) for _, _, member in sorted(members)]
        assert listed_dests.count(f"{prefix}a") == 2500
        only_a = []
        cursor = None
        while True:
            page = ctl.scheduled(queue="a", limit=100, cursor=cursor)
            only_a += [m.task_id for m in page.items]
            if page.cursor is None:
                break
            cursor = page.cursor
        assert sorted(only_a) == sorted(f"t{i}" for i in range(1, 5000, 2))
        assert store.purge([f"{prefix}b"], limit=10) == 2500
        assert truth(r, prefix) == Counter({f"{prefix}a": 2500})
        assert ctl.stats().by_queue == {"a": 2500}
        # A purge leaves the refs to the bucket's clean-up; they name nothing any more.
        assert r.hlen(keys.ids(prefix)) == 5000
        assert [ctl.find(f"t{i}") for i in (0, 2, 4998)] == [[], [], []]
        assert [len(ctl.find(f"t{i}")) for i in (1, 3, 4999)] == [1, 1, 1]


def test_stats_match_the_truth_after_publishes_moves_cancels_and_expiries(r, redis_server, prefix):
    app = publisher(redis_server, prefix)
    celery_ids = [app.send_task("inspect.record", countdown=600).id for _ in range(6)]
    for _ in range(4):
        app.send_task("inspect.record", countdown=1200, queue="emails", priority=9)
    for _ in range(3):
        app.send_task("inspect.record", countdown=3000, queue="emails")
    app.close()
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        store = ctl.store
        clock = FakeClock(r)  # time is driven from here on: stats judge by this clock too
        store.clock = clock
        stats = ctl.stats(hours=2, slot_minutes=30)
        assert stats.by_destination == dict(truth(r, prefix))
        assert stats.by_queue == {"celery": 6, "emails": 7}
        assert stats.scheduled == 13
        assert [s.count for s in stats.histogram] == [10, 3, 0, 0]
        assert stats.later == 0 and stats.overdue == 0
        assert stats.earliest_due_ms is not None and stats.earliest_due_ms > stats.now_ms

        # Overdue: due, but no mover has run yet.
        now = clock()
        quick = [
            (Due(now + 300, task_id=f"q{i}"), f"{prefix}celery", kombu_payload(f"q{i}")) for i in range(5)
        ]
        store.schedule_many(quick, ORDINARY)
        clock.advance(1000)
        stats = ctl.stats()
        assert stats.overdue == 5
        assert stats.oldest_overdue_ms == 700
        assert stats.by_queue["celery"] == 11
        assert store.move_due(1000).moved == 5
        stats = ctl.stats()
        assert (stats.overdue, stats.by_destination) == (0, dict(truth(r, prefix)))

        # Cancels.
        assert ctl.cancel(celery_ids[0]) + ctl.cancel(celery_ids[1]) == 2
        assert ctl.stats().by_destination == dict(truth(r, prefix))

        # Expiries: two buckets whose sets are gone (an expiry after the grace, or a delete by
        # hand, look alike to a mover); the counts are settled by the next move, through the
        # bucket's meta hash.
        now = clock()
        short = Settings(compress_after_ms=0, bucket_width_ms=1000)
        expiring = keys.bucket_start(now + 1000, 1000)
        gone = keys.bucket_start(now + 3000, 1000)
        store.schedule_many(
            [(Due(now + 1000, task_id=f"x{i}"), f"{prefix}lost", kombu_payload(f"x{i}")) for i in range(3)],
            short,
        )
        store.schedule_many(
            [(Due(gone + 10, task_id=f"d{i}"), f"{prefix}lost", kombu_payload(f"d{i}")) for i in range(2)],
            short,
        )
        assert ctl.stats().by_queue["lost"] == 5
        r.delete(
            keys.queue_set(prefix, expiring, f"{prefix}lost"), keys.queue_set(prefix, gone, f"{prefix}lost")
        )
        clock.ms = gone + 11
        assert ctl.stats().by_queue["lost"] == 5  # not settled yet
        assert store.move_due(1000).expired == 5
        stats = ctl.stats()
        assert stats.by_destination == dict(truth(r, prefix))
        assert "lost" not in stats.by_queue
        totals = stats.totals
        assert totals["scheduled"] == 23
        assert (totals["moved"], totals["cancelled"], totals["expired"]) == (5, 2, 5)
        assert (
            totals["scheduled"] - totals["moved"] - totals["cancelled"] - totals["expired"] == stats.scheduled
        )
        assert stats.to_dict()["by_queue"] == {"celery": 4, "emails": 7}


def test_purge_removes_every_priority_of_one_queue_only(r, redis_server, prefix):
    app = publisher(redis_server, prefix)
    for pri in (0, 3, 9):
        app.send_task("inspect.record", countdown=600, queue="emails", priority=pri)
    kept = app.send_task("inspect.record", countdown=600)
    app.close()
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        assert ctl.purge("emails") == 3
        assert ctl.purge("emails") == 0
        assert [m.task_id for m in ctl.scheduled().items] == [kept.id]
        assert truth(r, prefix) == Counter({f"{prefix}celery": 1})
        assert ctl.stats().totals["purged"] == 3


def test_purge_leaves_a_queue_whose_name_begins_with_the_purged_one(r, redis_server, prefix):
    # A purge takes the queue's priority lists with it ("a", "a\x06\x163"): no test had a
    # second queue named from the first ("a", "ab"), which a purge by name prefix would take.
    app = publisher(redis_server, prefix)
    app.send_task("inspect.record", countdown=600, queue="a")
    app.send_task("inspect.record", countdown=600, queue="a", priority=3)
    kept = [app.send_task("inspect.record", countdown=600, queue=q).id for q in ("ab", "a:b", "a.")]
    app.close()
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        assert ctl.purge("a") == 2
        assert sorted(m.task_id for m in ctl.scheduled().items) == sorted(kept)
    assert truth(r, prefix) == Counter({f"{prefix}ab": 1, f"{prefix}a:b": 1, f"{prefix}a.": 1})


def test_a_rescheduled_message_lies_in_the_bucket_of_its_new_time(r, redis_server, prefix):
    # Moves go by score, but find, cancel, the census and the clean-up go by bucket: one put in
    # a bucket whose range does not hold its due time (no test looked) is out of their reach.
    app = publisher(redis_server, prefix)
    sent = app.send_task("inspect.record", countdown=600)
    app.close()
    base = (int(datetime.now(UTC).timestamp()) // 120 + 60) * 120_000  # an even minute, an hour on
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        for due in (base + 30_500, base + 90_500):  # an even minute's, then an odd one's
            assert ctl.reschedule(sent.id, eta=datetime.fromtimestamp(due / 1000, UTC)) == 1
            start = due - due % 60_000
            assert r.zcard(keys.queue_set(prefix, start, f"{prefix}celery")) == 1, start
            assert [found.due_ms for found in ctl.find(sent.id)] == [due]


def test_a_purge_runs_over_maxmemory_as_a_cancel_does():
    # A purge is how an operator frees memory: its mark, its first write, was refused (OOM).
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as server:
        client = server.client()
        app = Celery(broker=server.url.replace("redis://", "delayredis://", 1))
        for countdown in (30, 600, 7200):  # ordinary and compressed
            app.send_task("inspect.record", countdown=countdown, queue="emails")
        app.close()
        client.rpush("filler", "x" * 10_000)
        client.config_set("maxmemory", client.info("memory")["used_memory"] // 2)
        with DelayControl(server.url) as ctl:
            assert ctl.purge("emails") == 3
            assert ctl.stats().totals["purged"] == 3
        assert not client.exists(keys.purging(""))


def test_a_reschedule_while_its_queue_is_purged_is_refused_and_the_purge_removes_the_message(
    r, redis_server, prefix
):
    # A purge walks the buckets over many calls. A reschedule between two of them took a
    # message from a bucket not yet reached into one passed, and it outlived the purge.
    app = publisher(redis_server, prefix)
    app.send_task("inspect.record", countdown=600, queue="emails")
    late = app.send_task("inspect.record", countdown=7200, queue="emails")
    app.close()
    with (
        DelayControl(redis_server.url, options(prefix)) as ctl,
        DelayControl(redis_server.url, options(prefix)) as other,
    ):
        store = ctl.store
        purge = store._scripts["purge"]
        refused: list[str] = []

        def purge_then_reschedule(**call: object) -> object:
            reply = purge(**call)
            if int(reply[0]) and not refused:  # the first bucket is purged, the late one not yet
                with pytest.raises(EditConflict, match="is being purged") as conflict:
                    other.reschedule(late.id, countdown=300)  # into a bucket the purge has passed
                refused.append(str(conflict.value))
                assert 0 < r.pttl(keys.purging(prefix)) <= 60_000  # one a dead purger left goes
            return reply

        store._scripts._loaded["purge"] = purge_then_reschedule  # type: ignore[assignment]
        assert store.purge([f"{prefix}emails"], limit=2) == 2
        assert refused
        assert other.find(late.id) == [] and truth(r, prefix) == Counter()
        assert other.reschedule(late.id, countdown=300) == 0  # once it has ended: purged
        assert not r.exists(keys.purging(prefix))


def test_a_purge_mark_a_dead_purger_left_goes_by_itself_while_other_queues_are_purged(
    r, redis_server, prefix
):
    # The mark's expiry was the hash's: each purge of any queue renewed it, so with purges
    # at least once a minute a dead purger's mark refused reschedules of its queue for ever.
    app = publisher(redis_server, prefix)
    sent = app.send_task("inspect.record", countdown=600, queue="emails")
    app.close()
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        mark, dests = keys.purging(prefix), [f"{prefix}emails"]
        ctl.store._scripts["purging"](keys=[mark], args=[1, 60_000, *dests])  # a live purge
        with pytest.raises(EditConflict, match="is being purged"):
            ctl.reschedule(sent.id, countdown=300)
        ctl.store._scripts["purging"](keys=[mark], args=[-1, 60_000, *dests])  # it ended
        ctl.store._scripts["purging"](keys=[mark], args=[1, 1, *dests])  # one that died: 1 ms
        busy = [f"{prefix}busy"]
        ctl.store._scripts["purging"](keys=[mark], args=[1, 60_000, *busy])  # another, under way
        until = int(r.hget(mark, f"x:{prefix}emails") or 0)
        wait_until(lambda: int(r.time()[0]) * 1000 + int(r.time()[1]) // 1000 > until)
        assert ctl.purge("other") == 0  # renews the hash's expiry
        assert ctl.reschedule(sent.id, countdown=300) == 1
        # The dead purger's fields went with the next purge's call, not with the hash, which
        # the purges under way kept.
        assert r.hmget(mark, f"c:{prefix}emails", f"x:{prefix}emails") == [None, None]
        ctl.store._scripts["purging"](keys=[mark], args=[-1, 60_000, *busy])
        # A queue named x:emails: its count field was emails's deadline field, and a purge of
        # emails that began and ended meanwhile took its mark away.
        ctl.store._scripts["purging"](keys=[mark], args=[1, 60_000, f"{prefix}x:emails"])
        for step in (1, -1):
            ctl.store._scripts["purging"](keys=[mark], args=[step, 60_000, *dests])
        assert r.hget(mark, f"c:{prefix}x:emails") == b"1" and r.hget(mark, f"x:{prefix}x:emails") is not None


def test_a_reschedule_refused_by_a_purge_says_what_it_rescheduled_before(r, redis_server, prefix):
    # One id in two queues, the second being purged: the first was rescheduled, and the
    # error said nothing of it (the docs said it changed nothing).
    app = publisher(redis_server, prefix)
    for queue in ("qb", "qa"):
        app.send_task("inspect.record", countdown=600, queue=queue, task_id="two-q")
    app.close()
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        before = {m.queue: m.due_ms for m in ctl.find("two-q")}
        ctl.store._scripts["purging"](keys=[keys.purging(prefix)], args=[1, 60_000, f"{prefix}qa"])
        with pytest.raises(EditConflict, match=r"qa' is being purged.*; 1 of its messages rescheduled"):
            ctl.reschedule("two-q", countdown=3000)
        after = {m.queue: m.due_ms for m in ctl.find("two-q")}
        assert after["qa"] == before["qa"] and after["qb"] > before["qb"] + 2_000_000


def test_a_reschedule_refused_for_a_key_not_a_list_says_what_it_rescheduled_before(r, redis_server, prefix):
    app = publisher(redis_server, prefix)
    for queue in ("qb", "qa"):
        app.send_task("inspect.record", countdown=600, queue=queue, task_id="two-q")
    app.close()
    r.set(f"{prefix}qa", "not a list")
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        with pytest.raises(kombu_delay.RedisRefused, match=r"; 1 of its messages rescheduled before"):
            ctl.reschedule("two-q", countdown=-10)
        assert [m.queue for m in ctl.find("two-q")] == ["qa"] and r.llen(f"{prefix}qb") == 1


def test_a_queue_listed_or_purged_after_its_counts_were_lost_still_shows_its_messages(
    r, redis_server, prefix
):
    # ls --queue read the queue's lists from <ns>counts alone: with counts gone (evicted,
    # deleted by hand) it listed nothing, exit 0, while the messages waited to be delivered.
    app = publisher(redis_server, prefix)
    sent = [app.send_task("inspect.record", countdown=600, queue="lsq", priority=p).id for p in (0, 9)]
    app.close()
    r.delete(keys.counts(prefix))
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        listed, cursor = [], None
        while True:
            page = ctl.scheduled(queue="lsq", cursor=cursor)
            listed += [m.task_id for m in page.items]
            if (cursor := page.cursor) is None:
                break
        assert sorted(listed) == sorted(sent)
        assert ctl.purge("lsq") == 2


def test_deleting_a_queue_drops_its_delayed_messages_too(r, redis_server, prefix):
    """Left behind, they would recreate the deleted queue's list when due."""
    with Connection(redis_server.delay_url, transport_options=options(prefix)) as conn:
        channel = conn.default_channel
        queues = [Queue(name, Exchange(name, "direct"), name, channel=channel) for name in ("gone", "kept")]
        for queue in queues:
            queue.declare()
            for pri in (0, 9):
                Producer(channel).publish(
                    {"n": pri},
                    exchange=queue.exchange,
                    routing_key=queue.name,
                    priority=pri,
                    headers={"x-delay": 600_000},
                )
        Producer(channel).publish({"now": 1}, exchange=queues[1].exchange, routing_key="kept")
        assert truth(r, prefix) == Counter(
            {f"{prefix}gone": 1, f"{prefix}gone{SEP}9": 1, f"{prefix}kept": 1, f"{prefix}kept{SEP}9": 1}
        )
        queues[1].delete(if_empty=True)  # its list holds a message: nothing is deleted
        queues[0].delete()
        assert truth(r, prefix) == Counter({f"{prefix}kept": 1, f"{prefix}kept{SEP}9": 1})
        assert r.llen(f"{prefix}kept") == 1


def test_a_queue_is_deleted_with_its_delayed_messages_only_where_kombu_deletes_it(r, redis_server, prefix):
    """On redis:// a message with an ETA sits on the list: an ``if_empty`` delete (as
    ``exchange_delete`` makes) keeps a queue holding one, and a channel with no binding of
    the queue deletes nothing. Its delayed messages stay likewise."""
    held = Counter({f"{prefix}held": 1})
    with Connection(redis_server.delay_url, transport_options=options(prefix)) as conn:
        channel = conn.default_channel
        exchange = Exchange("held", "direct")
        queue = Queue("held", exchange, "held", channel=channel)
        queue.declare()
        Producer(channel).publish(
            {"n": 1}, exchange=exchange, routing_key="held", headers={"x-delay": 600_000}
        )
        assert truth(r, prefix) == held
        exchange(channel).delete()  # its queues only if empty: this one holds a delayed message
        assert truth(r, prefix) == held
        queue.delete(if_empty=True)
        assert truth(r, prefix) == held
        with Connection(redis_server.delay_url, transport_options=options(prefix)) as other:
            Queue("held", exchange, "held", channel=other.default_channel).delete()  # no binding here
        assert truth(r, prefix) == held
        queue.delete()
        assert truth(r, prefix) == Counter()


def test_a_queue_holding_only_delayed_messages_exists_and_counts_them(r, redis_server, prefix):
    """On redis:// a message with an ETA sits on the list, so the queue exists (a passive
    declare finds it) and its size counts the message: ``qsize()`` and ``queue_declare``'s
    message count read the same here, each priority's delayed messages included."""
    with Connection(redis_server.delay_url, transport_options=options(prefix)) as conn:
        queue = conn.SimpleQueue("sized")
        with pytest.raises(ChannelError):  # nothing yet, as on redis://
            conn.default_channel.queue_declare("sized", passive=True)
        for pri in (0, 9):
            queue.put({"n": pri}, headers={"x-delay": 600_000}, priority=pri)
        assert r.llen(f"{prefix}sized") == 0  # none on a list
        assert queue.qsize() == 2
        assert conn.default_channel.queue_declare("sized", passive=True).message_count == 2
        queue.put({"now": 1})
        assert queue.qsize() == 3
        queue.close()


@pytest.mark.process
def test_celery_purge_also_purges_delayed_messages(r, redis_server, prefix):
    app = publisher(redis_server, prefix)
    for i in range(4):
        app.send_task("inspect.record", countdown=600, queue="emails", priority=i * 3)
    app.send_task("inspect.record", queue="emails")  # on the list now
    app.send_task("inspect.record", countdown=600)  # another queue: kept
    app.close()
    env = {"INSPECT_BROKER": redis_server.delay_url, "INSPECT_OPTIONS": json.dumps(options(prefix))}
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", INSPECT_APP, "purge", "-f", "-Q", "emails"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Purged 5 messages" in out.stdout, out.stdout
    assert truth(r, prefix) == Counter({f"{prefix}celery": 1})
    assert r.llen(f"{prefix}emails") == 0


def test_no_leaks_after_11000_publish_move_and_cancel_cycles(r, redis_server, prefix):
    settings = Settings(compress_after_ms=0, bucket_width_ms=1000)
    dests = [f"{prefix}celery", f"{prefix}emails", f"{prefix}emails{SEP}9"]
    expected_cancelled = expected_rescheduled = scheduled = 0
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        store = ctl.store
        clock = FakeClock(r)  # time is driven: nothing is due until the test says so
        store.clock = clock
        for n in range(2):
            now = clock()
            items = []
            for i in range(5000):
                task_id = f"t{n}-{i}"
                due = now + 4000 + i % 1000
                items.append((Due(due, task_id=task_id), dests[i % 3], kombu_payload(task_id)))
                if i % 10 == 0:  # a retry: a second pending message under the same id
                    retry = kombu_payload(task_id, body=base64.b64encode(b'{"retry": 1}').decode())
                    items.append((Due(due + 50, task_id=task_id), dests[i % 3], retry))
            outcomes = {res.outcome.name for res in store.schedule_many(items, settings)}
            assert outcomes == {"STORED"}
            scheduled += len(items)
            for i in range(0, 5000, 3):
                want = 2 if i % 10 == 0 else 1
                assert ctl.cancel(f"t{n}-{i}") == want
                expected_cancelled += want
            for i in range(1, 5000, 51):  # never one of the cancelled (i % 3 == 0)
                done = ctl.reschedule(f"t{n}-{i}", countdown=0.4 if i % 2 else -1)
                assert done == (2 if i % 10 == 0 else 1)
                expected_rescheduled += done

            def drained() -> bool:
                clock.advance(1000)
                store.move_due(1000)
                return not store.counts()

            wait_until(drained, timeout=60, interval=0)

        def cleaned_up() -> bool:
            # Drained buckets wait in gc until their end; then a move drops their refs
            # (moved messages' refs linger until then) and deletes their meta and task ids.
            clock.advance(1000)
            store.move_due(1000)
            return not leftover_keys(r, prefix)

        wait_until(cleaned_up, timeout=60, interval=0)
        totals = store.totals()
    assert leftover_keys(r, prefix) == set()
    assert r.pttl(keys.totals(prefix)) > 0  # kept no longer than the buckets were
    assert totals["scheduled"] == scheduled
    assert totals["cancelled"] == expected_cancelled
    assert totals["rescheduled"] == expected_rescheduled
    # Every message ended on its list (moved, or pushed at once by a reschedule to the past)
    # or was cancelled.
    assert sum(r.llen(d) for d in dests) + totals["cancelled"] == scheduled


@pytest.mark.parametrize("scheme", ["delayredis", "redis"])
def test_control_from_a_kombu_connection_leaves_it_open(r, redis_server, prefix, scheme):
    app = publisher(redis_server, prefix)
    sent = app.send_task("inspect.record", countdown=300)
    app.close()
    url = redis_server.delay_url if scheme == "delayredis" else redis_server.url
    with Connection(url, transport_options=options(prefix)) as conn:
        with DelayControl(conn) as ctl:
            assert [m.task_id for m in ctl.find(sent.id)] == [sent.id]
            assert ctl.cancel(sent.id) == 1
        assert conn.connected
        assert conn.default_channel.client.ping()


def test_app_control_purge_counts_delayed_messages(r, redis_server, prefix):
    app = publisher(redis_server, prefix)
    app.conf.task_queues = [Queue("emails")]
    for _ in range(3):
        app.send_task("inspect.record", countdown=600, queue="emails")
    app.send_task("inspect.record", queue="emails")
    assert app.control.purge() == 4
    assert truth(r, prefix) == Counter()
    assert r.llen(f"{prefix}emails") == 0
    app.close()


def list_queue(store: Store, dest: str, examine: int) -> tuple[list[str], list[int]]:
    """Page through ``dest``'s messages as ``ls --queue`` does (each cursor printed and parsed
    again); return the task ids listed and the buckets each call opened."""
    opened: list[int] = []
    real = store.dests

    def counting(*args: Any, **kwargs: Any) -> list[str]:
        opened.append(args[0])
        return real(*args, **kwargs)

    store.dests = counting  # type: ignore[method-assign]
    listed, per_call, cursor = [], [], None
    try:
        for _ in range(1000):
            before = len(opened)
            found, cursor = store.page(cursor, 50, {dest}, examine=examine)
            per_call.append(len(opened) - before)
            listed += [index_id(s.payload) for s in found]
            if cursor is None:
                return listed, per_call
            cursor = Cursor.parse(str(cursor))
        raise AssertionError("the listing never ended")
    finally:
        del store.dests


def test_a_queue_listing_opens_a_bounded_number_of_buckets_per_call(r, prefix):
    """A queue's messages among many buckets of another queue: each call opened every bucket
    ahead, however few held anything for it. Now each call counts every bucket it opens against
    its budget, and its cursor goes on from the next one."""
    store = Store(r, prefix, clock=FakeClock(r))
    base = (store.clock() // HOUR_MS + 2) * HOUR_MS
    second = Settings(bucket_width_ms=1000, compress_after_ms=0)
    busy, rare = f"{prefix}busy", f"{prefix}rare"
    items = [
        (Due(base + 1000 * i + 100, task_id=f"b{i}"), busy, kombu_payload(f"b{i}", "busy")) for i in range(45)
    ]
    items += [
        (Due(base + 20_500, task_id="r0"), rare, kombu_payload("r0", "rare")),
        (Due(base + 45_500, task_id="r1"), rare, kombu_payload("r1", "rare")),
    ]
    store.schedule_many(items, second)
    listed, per_call = list_queue(store, rare, examine=10)
    assert listed == ["r0", "r1"]
    assert max(per_call) <= 11 and sum(per_call) == 46, per_call  # each bucket opened once
    # An hour-wide bucket open across the narrow ones: the listing still ends, nothing twice.
    store.schedule(Due(base + 30_500, task_id="r-wide"), rare, kombu_payload("r-wide", "rare"), ORDINARY_HOUR)
    assert list_queue(store, rare, examine=10)[0] == ["r0", "r-wide", "r1"]
    assert list_queue(store, busy, examine=10)[0] == [f"b{i}" for i in range(45)]


def test_a_queue_listing_reads_only_that_queues_count_of_each_bucket(r, prefix):
    """A bucket's meta hash counts every queue it holds messages for: with 10,000 queues, a
    listing of one read about a million counts (an HGETALL a bucket) for a page. It reads the
    counts of the queues listed only."""
    store = Store(r, prefix, clock=FakeClock(r))
    base = (store.clock() // HOUR_MS + 2) * HOUR_MS
    due = [Due(base + 1000 * (i % 30) + 100, task_id=f"m{i}") for i in range(3000)]
    items = [(d, f"{prefix}q{i % 200}", kombu_payload(f"m{i}", "q")) for i, d in enumerate(due)]
    store.schedule_many(items, Settings(bucket_width_ms=1000, compress_after_ms=0))
    r.config_resetstat()
    listed, _ = list_queue(store, f"{prefix}q7", examine=10_000)
    assert listed == [f"m{i}" for i in sorted(range(7, 3000, 200), key=lambda i: (i % 30, i))]
    stats = r.info("commandstats")
    assert "cmdstat_hgetall" not in stats and stats["cmdstat_hmget"]["calls"] >= 30, stats


def test_a_wide_bucket_open_across_many_narrow_ones_does_not_cut_every_page(r, prefix):
    """A page's cursor starts at the wide bucket still open, so the next page opens again the
    narrow buckets before the cursor: those are not new ground, and count nothing, or every page
    would end after its first message."""
    store = Store(r, prefix, clock=FakeClock(r))
    base = (store.clock() // HOUR_MS + 2) * HOUR_MS
    second = Settings(bucket_width_ms=1000, compress_after_ms=0)
    busy, wide = f"{prefix}busy", f"{prefix}wide"
    store.schedule_many(
        [
            (Due(base + 1000 * i + 100, task_id=f"b{i}"), busy, kombu_payload(f"b{i}", "busy"))
            for i in range(60)
        ],
        second,
    )
    store.schedule_many(
        [(Due(base + 61_000 + i, task_id=f"w{i}"), wide, kombu_payload(f"w{i}", "wide")) for i in range(20)],
        ORDINARY_HOUR,
    )
    listed, per_call = list_queue(store, wide, examine=30)
    assert listed == [f"w{i}" for i in range(20)]
    # The first call opens the 61 buckets before the first message (no page ends before its
    # first message), past its budget: it lists what it read of the wide bucket then, and a
    # next call (if any) the rest. Counted, the 60 opened again would cut each page after one
    # message: 20 calls.
    assert len(per_call) <= 2, per_call


def test_a_bucket_of_many_busy_queues_is_listed_a_full_page_at_a_time(r, prefix):
    """Opening a bucket reads ahead in each of its sets: with more sets than the budget covers,
    every page stopped at its first message, and read the whole bucket again for the next."""
    store = Store(r, prefix, clock=FakeClock(r))
    base = (store.clock() // HOUR_MS + 2) * HOUR_MS
    second = Settings(bucket_width_ms=60_000, compress_after_ms=0)
    items = [
        (Due(base + 100 + i, task_id=f"q{q}-{i}"), f"{prefix}q{q}", kombu_payload(f"q{q}-{i}", f"q{q}"))
        for q in range(20)
        for i in range(40)
    ]
    store.schedule_many(items, second)
    listed, sizes, cursor = [], [], None
    for _ in range(100):
        found, cursor = store.page(cursor, 50, examine=100)  # 20 sets read ahead: past the budget
        sizes.append(len(found))
        listed += [index_id(s.payload) for s in found]
        if cursor is None:
            break
        cursor = Cursor.parse(str(cursor))
    assert sorted(listed) == sorted(item[0].task_id for item in items)  # each once
    assert len(listed) == len(set(listed))
    due_order = [int(task_id.split("-")[1]) for task_id in listed]
    assert due_order == sorted(due_order)
    assert len(sizes) <= 20 and min(sizes[:-1]) >= 10, sizes  # not 800 pages of one


@pytest.mark.parametrize("compress_after_ms", [0, 60_000], ids=["ordinary", "cold"])
def test_the_longest_grace_and_width_store_a_message_due_at_the_ceiling(r, prefix, compress_after_ms):
    # The bounds Settings keeps both to: every expiry a publish sets is one Redis takes.
    longest = Settings(
        grace_ms=MAX_DURATION_MS, bucket_width_ms=MAX_DURATION_MS, compress_after_ms=compress_after_ms
    )
    store = Store(r, prefix)
    store.schedule(Due(keys.MAX_DUE_MS, task_id="last"), f"{prefix}celery", kombu_payload("last"), longest)
    assert store.counts() == {f"{prefix}celery": 1}
    assert [s.cold for s in store.find("last")] == [bool(compress_after_ms)]
    stored = [key for key in r.scan_iter(f"{prefix}kombu_delay:*") if r.type(key) == b"zset"]
    assert stored and all(r.pttl(key) > 0 for key in stored)


def test_listing_is_earliest_first_across_spaces_widths_and_queues(r, redis_server, prefix):
    """Compressed messages due in an hour, ordinary ones due in seconds, hour-wide and
    second-wide buckets, three destinations: every page size lists them in due order, and a
    thaw between pages skips nothing."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    now = clock()
    hour = Settings(bucket_width_ms=3_600_000, compress_after_ms=60_000)
    second = Settings(bucket_width_ms=1000, compress_after_ms=60_000)
    dests = [f"{prefix}a", f"{prefix}b", f"{prefix}b\x06\x163"]
    plan = []
    for i in range(60):
        ahead = [9_000, 30_000, 59 * 60_000, 2 * 3_600_000][i % 4] + 997 * i  # distinct due times
        plan.append((f"t{i:02d}", now + ahead, dests[i % 3], hour if i % 2 else second))
    for task_id, due, dest, settings in plan:
        store.schedule(Due(due, task_id=task_id), dest, kombu_payload(task_id), settings)
    assert r.zcard(keys.cold_index(prefix)) and r.zcard(keys.index(prefix))  # both spaces in use
    truth = [task_id for task_id, *_ in sorted(plan, key=lambda p: p[1])]
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        for limit in (1, 3, 7, 100):
            listed, cursor = [], None
            while True:
                page = ctl.scheduled(limit=limit, cursor=cursor)
                listed += [m.task_id for m in page.items]
                if page.cursor is None:
                    break
                cursor = page.cursor
            assert listed == truth, limit
        # A mover thaws between pages: nothing skipped, still in due order.
        first = ctl.scheduled(limit=20)
        clock.advance(59 * 60_000)
        while store.thaw(30_000, 100).thawed:
            pass
        listed, cursor = [m.task_id for m in first.items], first.cursor
        while cursor is not None:
            page = ctl.scheduled(limit=6, cursor=cursor)
            listed += [m.task_id for m in page.items]
            cursor = page.cursor
        assert set(listed) == set(truth)
        order = [dict((p[0], p[1]) for p in plan)[t] for t in listed]
        assert order == sorted(order)


def test_a_control_made_from_a_url_serves_many_threads_at_once(r, redis_server, prefix):
    # kombu's pool holds 10 connections and refuses the 11th: with 32 threads (the dashboard
    # runs up to 64) most cancels failed with "Redis is unavailable: Too many connections".
    store = Store(r, prefix)
    due = store.time_ms() + 600_000
    ids = [f"many-{i}" for i in range(320)]
    store.schedule_many([(Due(due, task_id=i), f"{prefix}q", kombu_payload(i)) for i in ids], ORDINARY)
    with (
        DelayControl(redis_server.url, {"global_keyprefix": prefix}) as control,
        ThreadPoolExecutor(32) as pool,
    ):
        cancelled = list(pool.map(control.cancel, ids))
    assert cancelled == [1] * 320 and store.counts() == {}


def test_edits_that_keep_losing_their_message_say_so_instead_of_none_scheduled(
    r, redis_server, prefix, monkeypatch
):
    # Each claim lost to another edit (threads rescheduling the same id over and over) made
    # cancel and reschedule give up after three looks and answer 0, "nothing scheduled",
    # while the message was still scheduled: an app then dropped its reminder, and it ran.
    store = Store(r, prefix)
    due = store.time_ms() + 600_000
    store.schedule(Due(due, task_id="busy"), f"{prefix}q", kombu_payload("busy"), ORDINARY)
    with DelayControl(redis_server.url, {"global_keyprefix": prefix}) as control:
        monkeypatch.setattr(Store, "_cancel_one", lambda *args: 0)  # as if moved meanwhile, each time
        with pytest.raises(kombu_delay.EditConflict, match="1 still scheduled"):
            control.cancel("busy")
        monkeypatch.setattr(DelayControl, "_reschedule_one", lambda *args: False)
        with pytest.raises(kombu_delay.EditConflict, match="1 still at another time"):
            control.reschedule("busy", countdown=60)
        monkeypatch.undo()
        assert [m.due_ms for m in control.find("busy")] == [due]  # nothing lost
        assert control.cancel("busy") == 1 and control.cancel("busy") == 0


def test_two_reschedules_of_one_id_to_one_time_both_count_it(r, redis_server, prefix, monkeypatch):
    # Two editors (a form submitted twice, two operators) moving one id to one time: the one
    # whose claim the other took found the message at that time, left it, and answered 0, "not
    # scheduled", while it was, as asked (an app took that for "already sent", and sent it again).
    store = Store(r, prefix)
    now = store.time_ms()
    store.schedule(Due(now + 600_000, task_id="twice"), f"{prefix}q", kombu_payload("twice"), ORDINARY)
    target = datetime.fromtimestamp((now + 900_000) // 1000, UTC)
    find = Store.find
    with (
        DelayControl(redis_server.url, options(prefix)) as control,
        DelayControl(redis_server.url, options(prefix)) as other,
    ):

        def found_then_taken(self: Store, *args: Any, **kwargs: Any) -> Any:
            found = find(self, *args, **kwargs)
            monkeypatch.setattr(Store, "find", find)
            assert other.reschedule("twice", eta=target) == 1  # the other editor, in between
            return found

        monkeypatch.setattr(Store, "find", found_then_taken)
        assert control.reschedule("twice", eta=target) == 1
        assert [m.due_ms for m in store.find("twice")] == [int(target.timestamp() * 1000)]
        assert control.cancel("twice") == 1


def test_two_reschedules_of_one_ids_two_messages_leave_both_at_the_time_of_the_last(
    r, redis_server, prefix, monkeypatch
):
    # Two editors, two messages under one id (a retry's), two times: each took one message, lost
    # the other, found it at the other's time and moved it to its own. Both answered 2, and the
    # messages were left one at each time.
    store = Store(r, prefix)
    now = store.time_ms()
    for n, body in ((1, "e30="), (2, "W10=")):  # (two messages: their bodies differ)
        payload = kombu_payload("two", body=body)
        store.schedule(Due(now + n * 600_000, task_id="two"), f"{prefix}q", payload, ORDINARY)
    mine, theirs = now + 900_000, now + 1_500_000
    with (
        DelayControl(redis_server.url, options(prefix)) as control,
        DelayControl(redis_server.url, options(prefix)) as other,
    ):
        real, calls = DelayControl._reschedule_one, []

        def theirs_too(stored: Any) -> None:  # the other editor's own reschedule of that message
            (now_stored,) = [s for s in other.store.find("two") if s.payload == stored.payload]
            assert real(other, "two", now_stored, theirs)

        def interleaved(self: DelayControl, task_id: str, stored: Any, due_ms: int) -> bool:
            calls.append(stored)
            if len(calls) == 2:  # the other took the second message first
                theirs_too(stored)
            done = real(self, task_id, stored, due_ms)
            if len(calls) == 3:  # and, looking again, moved the first, this one's, to its time
                theirs_too(calls[0])
            return done

        monkeypatch.setattr(DelayControl, "_reschedule_one", interleaved)
        assert control.reschedule("two", eta=datetime.fromtimestamp(mine / 1000, UTC)) == 2
        assert sorted(m.due_ms for m in store.find("two")) == [mine, mine]


def test_a_control_given_a_kombu_connection_serves_more_threads_than_its_pool_holds(r, redis_server, prefix):
    # DelayControl(app.connection_for_write()), shared as the docs say it may be: its pool holds
    # 10 connections and refused the 11th, so calls failed with "Redis is unavailable: Too many
    # connections". They wait for a connection now.
    store = Store(r, prefix)
    due = store.time_ms() + 600_000
    ids = [f"conn-{i}" for i in range(320)]
    store.schedule_many([(Due(due, task_id=i), f"{prefix}q", kombu_payload(i)) for i in ids], ORDINARY)
    options = {"global_keyprefix": prefix, "max_connections": 4}
    with (
        Connection(redis_server.delay_url, transport_options=options) as conn,
        ThreadPoolExecutor(32) as pool,
    ):
        control, other = DelayControl(conn), DelayControl(conn)  # one pool: both wait their turn
        found = list(pool.map(lambda i: (control.find(i), other.time_ms())[0], ids))
        cancelled = list(pool.map(lambda i: other.cancel(i) if int(i[5:]) % 2 else control.cancel(i), ids))
    assert [len(f) for f in found] == [1] * 320
    assert cancelled == [1] * 320 and store.counts() == {}


@pytest.mark.parametrize("compressed", [False, True], ids=["ordinary", "compressed"])
def test_a_reschedule_keeps_the_grace_its_message_was_published_with(r, redis_server, prefix, compressed):
    # Rescheduled with the editor's settings (the CLI's, the dashboard's: the defaults), a
    # message published with a 30-day grace was kept 7 days: a mover outage within the
    # publisher's grace lost it.
    month_ms = 30 * 86_400_000
    app = publisher(
        redis_server, prefix, broker_transport_options={**options(prefix), "delay_grace": month_ms // 1000}
    )
    sent = app.send_task("inspect.record", ("x",), countdown=300)
    app.close()
    editor = {"global_keyprefix": prefix} if prefix else {}
    if not compressed:
        editor["delay_compress_after"] = 0
    with DelayControl(redis_server.url, editor) as ctl:
        assert ctl._settings.grace_ms == 7 * 86_400_000  # the default
        assert ctl.reschedule(sent.id, countdown=7200) == 1
        (stored,) = ctl.store.find(sent.id)
        assert stored.cold is compressed
        kept_ms = r.pttl(stored.space.queue_set(prefix, stored.start_ms, stored.dest))
        assert kept_ms >= stored.start_ms + month_ms - redis_ms(r) - 60_000


def test_a_message_rescheduled_again_and_again_is_kept_no_longer_each_time(r, redis_server, prefix):
    # Each reschedule kept the new bucket a width longer than the old (its expiry past its start,
    # taken as the grace): ten of them, ten minutes more, carried on to the shared keys.
    app = publisher(redis_server, prefix, broker_transport_options=options(prefix))
    sent = app.send_task("inspect.record", ("x",), countdown=300)
    app.close()
    editor = {**({"global_keyprefix": prefix} if prefix else {}), "delay_compress_after": 0}
    with DelayControl(redis_server.url, editor) as ctl:
        width, grace = ctl._settings.bucket_width_ms, ctl._settings.grace_ms
        for i in range(10):
            assert ctl.reschedule(sent.id, countdown=3600 + 60 * (i % 2)) == 1
        (stored,) = ctl.store.find(sent.id)
        kept_past_start = int(r.hget(keys.meta(prefix, stored.start_ms), "x")) - stored.start_ms
        assert kept_past_start <= width + grace + 1_000, kept_past_start - width - grace


def test_a_reschedule_keeps_the_grace_of_a_narrow_publisher_in_a_wider_ones_bucket(r, redis_server, prefix):
    # Two publishers' buckets that share a start keep the widest one's end: the grace was read
    # as the expiry past that end, an hour short of the narrow publisher's 30 days.
    month_ms, hour_ms = 30 * 86_400_000, 3_600_000
    eta = datetime.fromtimestamp((redis_ms(r) // hour_ms + 2) * hour_ms / 1000, UTC)
    for width, grace_ms, task in ((3600, hour_ms, "wide"), (1, month_ms, "narrow")):
        conf = {**options(prefix), "delay_bucket_width": width, "delay_grace": grace_ms // 1000}
        app = publisher(redis_server, prefix, broker_transport_options=conf)
        sent = app.send_task("inspect.record", (task,), eta=eta)
        app.close()
    editor = {**({"global_keyprefix": prefix} if prefix else {}), "delay_compress_after": 0}
    with DelayControl(redis_server.url, editor) as ctl:
        assert ctl.reschedule(sent.id, countdown=7200) == 1
        (stored,) = ctl.store.find(sent.id)
        kept_ms = r.pttl(stored.space.queue_set(prefix, stored.start_ms, stored.dest))
        assert kept_ms >= stored.due_ms + month_ms - redis_ms(r) - 60_000


def test_threads_waiting_for_the_first_open_share_its_failure(silent_server):
    # Against a Redis that accepts connections and never answers, the first open of the store
    # fails after the socket timeout. The threads that waited for it then took their turn at it,
    # one after another: six of a dashboard's requests failed 5, 10, ... 30 s later. Now they
    # fail with the attempt they waited for, within moments of each other.
    timeout_s = 5
    options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}

    def call(control: DelayControl) -> tuple[str, float]:
        try:
            control.time_ms()
        except RedisUnavailable as exc:
            return type(exc).__name__, time.monotonic()
        return "answered", time.monotonic()

    with DelayControl(silent_server.delay_url, options) as control, ThreadPoolExecutor(6) as pool:
        ends = list(pool.map(call, [control] * 6))
    assert [name for name, _ in ends] == ["RedisUnavailable"] * 6
    times = [at for _, at in ends]
    assert max(times) - min(times) < timeout_s


def test_a_first_open_failure_is_kept_without_its_callers_frames_until_an_open_succeeds():
    # The exception raised was kept for the control's life, with every frame it went through: a
    # dashboard request's, its Authorization header among their locals.
    once: Once[str] = Once()

    def fail() -> str:
        try:
            raise ConnectionRefusedError("refused")
        except ConnectionRefusedError as exc:  # (as every error of default_channel: with a cause)
            raise RedisUnavailable("Redis is unavailable: refused") from exc

    with pytest.raises(RedisUnavailable) as raised:
        once.get(fail)
    kept = once._failure
    assert kept is not None and kept is not raised.value and kept.__traceback__ is None
    assert kept.__cause__ is None and str(kept) == "Redis is unavailable: refused"
    assert once.get(lambda: "store") == "store" and once._failure is None
