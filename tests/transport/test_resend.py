"""A delayed publish whose reply was lost is stored once when kombu sends it again, and a
publish whose request was lost is stored by the retry (kombu_delay/resend.py)."""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime

import pytest
import redis
from kombu import Connection, Exchange, Producer, Queue

from kombu_delay import DelayControl, resend
from kombu_delay.errors import RedisUnavailable
from kombu_delay.store import Store, clock
from tests.support.proxy import LossyProxy
from tests.support.stored import redis_ms

POLICY = {"max_retries": 5, "interval_start": 0.2, "interval_step": 0.2, "interval_max": 1}


def _script_call(r: redis.Redis) -> bytes:
    """What a delayed publish sends Redis: its function, or on Redis 6 its script."""
    return b"FCALL" if int(str(r.info("server")["redis_version"]).split(".")[0]) >= 7 else b"EVALSHA"


@pytest.fixture(autouse=True)
def _no_attempts_left() -> None:
    resend._attempts.clear()  # another test's failures are not this one's


@pytest.mark.parametrize("delay_s", [30, 3600], ids=["ordinary", "compressed"])
@pytest.mark.parametrize("headers", [{"id": "t-1"}, {}], ids=["task-id", "no-id"])
def test_a_publish_whose_reply_was_lost_is_stored_once_when_kombu_sends_it_again(
    r, redis_server, prefix, delay_s, headers, caplog
):
    options = {"global_keyprefix": prefix} if prefix else {}
    queue = Queue("q", Exchange("q"), "q")
    with (
        LossyProxy(redis_server.port) as proxy,
        Connection(f"delayredis://127.0.0.1:{proxy.port}/0", transport_options=options) as conn,
    ):
        producer = Producer(conn, exchange=queue.exchange, routing_key="q")
        # The first publish loads the scripts and asks what it needs; the second is one call.
        producer.publish("warm", headers={"x-delay": delay_s * 1000}, declare=[queue])
        proxy.arm(_script_call(r), "reply")
        with caplog.at_level(logging.WARNING, logger="kombu_delay.resend"):
            producer.publish(
                "B", headers={**headers, "x-delay": delay_s * 1000}, retry=True, retry_policy=POLICY
            )
        assert proxy.lost.is_set()
    assert int(r.hget(f"{prefix}kombu_delay:counts", f"{prefix}q")) == 2  # "warm" and "B", once each
    assert r.hget(f"{prefix}kombu_delay:totals", "resent") == b"1"
    assert "stored by an earlier attempt whose reply was lost" in caplog.text
    assert not resend._attempts


@pytest.mark.parametrize("delay_s", [30, 3600], ids=["ordinary", "compressed"])
@pytest.mark.parametrize("edit", ["cancel", "reschedule"])
def test_an_edit_between_a_lost_reply_and_kombus_retry_is_not_undone_by_the_retry(
    r, redis_server, prefix, delay_s, edit, caplog
):
    # The retry looked for its first attempt, found nothing (the edit took it), and stored the
    # message again: the cancelled task ran, the rescheduled one ran twice.
    options = {"global_keyprefix": prefix} if prefix else {}
    queue = Queue("q", Exchange("q"), "q")
    edited: list[int] = []
    with DelayControl(redis_server.url, options) as ctl:

        def edit_now() -> None:  # between the lost reply and kombu's retry
            if edit == "cancel":
                edited.append(ctl.cancel("t-1"))
            else:
                edited.append(ctl.reschedule("t-1", countdown=2 * delay_s))

        with (
            LossyProxy(redis_server.port, on_lost=edit_now) as proxy,
            Connection(f"delayredis://127.0.0.1:{proxy.port}/0", transport_options=options) as conn,
        ):
            producer = Producer(conn, exchange=queue.exchange, routing_key="q")
            producer.publish("warm", headers={"x-delay": delay_s * 1000}, declare=[queue])
            proxy.arm(_script_call(r), "reply")
            # A task's, whose ETA a reschedule rewrites: its bytes are not the first attempt's.
            eta = datetime.fromtimestamp(redis_ms(r) / 1000 + delay_s, UTC).isoformat()
            with caplog.at_level(logging.WARNING, logger="kombu_delay.resend"):
                producer.publish(
                    "B", headers={"task": "t", "id": "t-1", "eta": eta}, retry=True, retry_policy=POLICY
                )
            assert proxy.lost.is_set()
        assert edited == [1]
        found = ctl.store.find("t-1")
        if edit == "cancel":
            assert found == []
        else:  # once, at its new time
            (stored,) = found
            assert stored.due_ms >= redis_ms(r) + delay_s * 1000
    assert int(r.hget(f"{prefix}kombu_delay:counts", f"{prefix}q")) == (1 if edit == "cancel" else 2)
    assert r.hget(f"{prefix}kombu_delay:totals", "resent") == b"1"
    assert "and cancelled or rescheduled since" in caplog.text
    assert not resend._attempts


@pytest.mark.parametrize("edit", ["none", "cancel", "reschedule"])
def test_a_publish_routed_to_two_queues_is_stored_once_in_each_when_one_reply_was_lost(
    r, redis_server, edit, caplog
):
    # kombu's retry sends the message to every queue of its route again: the queue whose store
    # had gone through got it twice (and a cancel or reschedule between was undone there).
    exchange = Exchange("route", type="direct")
    queues = [Queue(name, exchange, "both") for name in ("first_q", "second_q")]
    edited: list[int] = []
    stored_then: list[str] = []  # kombu sends to the route's queues in the order of a Redis set
    with DelayControl(redis_server.url) as ctl:

        def edit_now() -> None:
            stored_then.extend(sorted(stored.dest for stored in ctl.store.find("t-2")))
            if edit == "cancel":
                edited.append(ctl.cancel("t-2"))
            elif edit == "reschedule":
                edited.append(ctl.reschedule("t-2", countdown=600))

        with (
            LossyProxy(redis_server.port, on_lost=edit_now) as proxy,
            Connection(f"delayredis://127.0.0.1:{proxy.port}/0") as conn,
        ):
            producer = Producer(conn, exchange=exchange, routing_key="both")
            producer.publish("warm", headers={"x-delay": 30_000}, declare=queues)
            proxy.arm(b"\r\n$8\r\nsecond_q\r\n", "reply")  # the second queue's store
            eta = datetime.fromtimestamp(redis_ms(r) / 1000 + 30, UTC).isoformat()
            producer.publish(
                "B", headers={"task": "t", "id": "t-2", "eta": eta}, retry=True, retry_policy=POLICY
            )
            assert proxy.lost.is_set()
        assert "second_q" in stored_then  # its reply lost, not its store
        assert edited == ([] if edit == "none" else [len(stored_then)])
        found = sorted(stored.dest for stored in ctl.store.find("t-2"))
    # Once in each queue; a cancel took what was stored then (a queue the publish reached only
    # after it, by kombu's retry, keeps its message, as one published after a cancel does).
    assert found == (
        sorted({"first_q", "second_q"} - set(stored_then)) if edit == "cancel" else ["first_q", "second_q"]
    )
    assert not resend._attempts


def test_a_publish_to_two_queues_that_redis_refused_in_one_is_stored_once_in_each_by_the_retry(
    r, redis_server
):
    # kombu retries a refusal as it does a lost connection, to every queue of the route: the
    # queue stored before the refusal got a second copy (as on redis://, where each push does).
    exchange = Exchange("route", type="direct")
    queues = [Queue(name, exchange, "both") for name in ("first_q", "second_q")]
    with DelayControl(redis_server.url) as ctl:
        with (
            LossyProxy(redis_server.port) as proxy,
            Connection(f"delayredis://127.0.0.1:{proxy.port}/0") as conn,
        ):
            producer = Producer(conn, exchange=exchange, routing_key="both")
            producer.publish("warm", headers={"x-delay": 30_000}, declare=queues)
            proxy.arm(_script_call(r), "refuse", skip=1)  # the store of whichever queue comes second
            eta = datetime.fromtimestamp(redis_ms(r) / 1000 + 30, UTC).isoformat()
            producer.publish(
                "B", headers={"task": "t", "id": "t-3", "eta": eta}, retry=True, retry_policy=POLICY
            )
            assert proxy.lost.is_set()
        assert sorted(stored.dest for stored in ctl.store.find("t-3")) == ["first_q", "second_q"]


def test_the_same_message_published_again_after_a_lost_reply_is_a_second_message(r, redis_server, caplog):
    # Only kombu's retry of the publish whose reply was lost is looked for: an app that caught
    # the error and publishes the same message again later (a periodic job, a fixed task id)
    # sends a second one, which plain kombu stores. It was taken for the retry, and dropped.
    queue = Queue("q", Exchange("q"), "q")
    with (
        LossyProxy(redis_server.port) as proxy,
        Connection(f"delayredis://127.0.0.1:{proxy.port}/0") as conn,
    ):
        producer = Producer(conn, exchange=queue.exchange, routing_key="q")
        producer.publish("warm", headers={"x-delay": 30_000}, declare=[queue])
        proxy.arm(_script_call(r), "reply")
        with pytest.raises(RedisUnavailable):
            producer.publish("B", headers={"id": "t-1", "x-delay": 30_000}, retry=False)
        assert proxy.lost.is_set()
        with caplog.at_level(logging.WARNING, logger="kombu_delay.resend"):
            producer.publish("B", headers={"id": "t-1", "x-delay": 30_000}, retry=True, retry_policy=POLICY)
    assert int(r.hget("kombu_delay:counts", "q")) == 3  # "warm", and "B" twice: two publishes
    assert r.hget("kombu_delay:totals", "resent") is None
    assert "reply was lost" not in caplog.text


@pytest.mark.parametrize("delay_s", [30, 3600], ids=["ordinary", "compressed"])
def test_a_publish_whose_request_was_lost_is_stored_by_the_retry(r, redis_server, delay_s):
    queue = Queue("q", Exchange("q"), "q")
    with (
        LossyProxy(redis_server.port) as proxy,
        Connection(f"delayredis://127.0.0.1:{proxy.port}/0") as conn,
    ):
        producer = Producer(conn, exchange=queue.exchange, routing_key="q")
        producer.publish("warm", headers={"x-delay": delay_s * 1000}, declare=[queue])
        proxy.arm(_script_call(r), "request")
        producer.publish(
            "B", headers={"id": "t-1", "x-delay": delay_s * 1000}, retry=True, retry_policy=POLICY
        )
        assert proxy.lost.is_set()
    assert int(r.hget("kombu_delay:counts", "q")) == 2
    assert r.hget("kombu_delay:totals", "resent") is None
    assert not resend._attempts


def test_an_identical_message_published_again_after_a_success_is_stored_again(r, redis_server):
    # Only an attempt whose reply was lost is looked for: two publishes that both succeed are
    # two messages, even of the same bytes but for the delivery tag.
    queue = Queue("q", Exchange("q"), "q")
    with Connection(redis_server.delay_url) as conn:
        producer = Producer(conn, exchange=queue.exchange, routing_key="q")
        for _ in range(2):
            producer.publish("B", headers={"id": "t-1", "x-delay": 60_000}, declare=[queue])
    assert int(r.hget("kombu_delay:counts", "q")) == 2


def test_the_attempts_remembered_are_bounded_in_number_and_time(r, monkeypatch):
    # A long outage fails many publishes: each is remembered for a while, the oldest dropped.
    monkeypatch.setattr(resend, "MAX_KEPT", 3)
    for n in range(5):
        with pytest.raises(RedisUnavailable), resend.once(None, ("b", "", "q"), {"body": str(n)}, "t", "x"):  # type: ignore[arg-type]
            raise RedisUnavailable("gone")
    assert [key[2] for key in resend._attempts] == [resend._fingerprint({"body": str(n)}) for n in (2, 3, 4)]
    store = Store(r)  # where each retry looks for the attempts before it, and finds none
    for _ in range(resend.MAX_ATTEMPTS + 5):  # a network that keeps failing one message
        with pytest.raises(RedisUnavailable), resend.once(store, ("b", "", "q"), {"body": "4"}, "t", "x"):
            raise RedisUnavailable("gone")
    assert len(resend._remembered(resend._key(("b", "", "q"), {"body": "4"}))) == resend.MAX_ATTEMPTS
    monkeypatch.setattr(resend, "KEPT_S", 0.0)
    assert resend._remembered(resend._key(("b", "", "q"), {"body": "4"})) == []
    assert not resend._attempts


def test_an_attempt_is_matched_only_by_a_retry_in_its_own_thread():
    # Two threads publishing the same message are two publishes: with both replies lost, one
    # retry matched the other thread's attempt too, and the message was stored three times.
    where = ("b", "", "q")
    with pytest.raises(RedisUnavailable), resend.once(None, where, {"body": "m"}, "t", "x"):  # type: ignore[arg-type]
        raise RedisUnavailable("gone")
    entered: list[bool] = []

    def other_thread() -> None:  # no store is asked: this thread has no attempt of its own
        with resend.once(None, where, {"body": "m"}, "t", "x") as first:  # type: ignore[arg-type]
            entered.append(first)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert entered == [True]
    assert len(resend._remembered(resend._key(where, {"body": "m"}))) == 1  # this thread's, kept


def test_a_retry_that_finds_its_message_due_by_now_pushes_nothing_more(r, redis_server, monkeypatch, caplog):
    # A publish a minute ahead whose reply was lost, retried once it is due (a retry policy
    # waiting out an outage in which no mover ran either): the retry pushed it at once, without
    # looking for the attempt that stored it, and the mover then moved that one too: twice.
    queue = Queue("q", Exchange("q"), "q")
    now = redis_ms(r)
    due = now + 60_000
    eta = datetime.fromtimestamp(due / 1000, UTC).isoformat()
    with (
        LossyProxy(redis_server.port) as proxy,
        Connection(f"delayredis://127.0.0.1:{proxy.port}/0") as conn,
    ):
        producer = Producer(conn, exchange=queue.exchange, routing_key="q")
        producer.publish("warm", headers={"x-delay": 30_000}, declare=[queue])
        # Redis's clock as the publisher estimates it: now at the first attempt, and past the
        # due time by the retry, which comes once the reply is lost.
        monkeypatch.setattr(
            clock.RedisClock, "estimate_ms", lambda self: due + 10_000 if proxy.lost.is_set() else now
        )
        proxy.arm(_script_call(r), "reply")
        with caplog.at_level(logging.WARNING, logger="kombu_delay.resend"):
            producer.publish(
                "B", headers={"task": "t.x", "id": "t-1", "eta": eta}, retry=True, retry_policy=POLICY
            )
        assert proxy.lost.is_set()
    assert r.llen("q") == 0  # not pushed: the stored one is the mover's to move
    assert int(r.hget("kombu_delay:counts", "q")) == 2  # "warm" and "B", once each
    assert r.hget("kombu_delay:totals", "resent") == b"1"
    assert "stored by an earlier attempt whose reply was lost" in caplog.text
    assert not resend._attempts


def test_a_cancel_whose_reply_was_lost_says_it_may_have_been_made(r, redis_server) -> None:
    # It raised "Redis is unavailable" alone, and the caller's retry said 0: nothing was
    # scheduled, which reads as a cancel that did nothing, of a message it had cancelled.
    with Connection(redis_server.delay_url) as conn:
        for task_id in ("warm-1", "gone-1"):
            Producer(conn).publish({"n": 1}, routing_key="edits", headers={"id": task_id, "x-delay": 600_000})
    with LossyProxy(redis_server.port) as proxy:
        url = f"delayredis://127.0.0.1:{proxy.port}/0"
        with DelayControl(url, {"socket_timeout": 5}) as control:
            assert control.cancel("warm-1") == 1 and len(control.find("gone-1")) == 1  # (scripts loaded)
            proxy.arm(b"gone-1", "reply", skip=1)  # the find's request passes, the cancel's reply is lost
            with pytest.raises(
                RedisUnavailable, match=r"its last cancel may have been made .*\(find tells\)"
            ):
                control.cancel("gone-1")
            assert proxy.lost.is_set()
            assert control.find("gone-1") == [] and control.cancel("gone-1") == 0  # it was made
