"""A worker on ``delay*`` never holds a popped message unrecorded (kombu_delay/poller.py)."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import signals
from kombu import Connection, Consumer, Exchange, Producer, Queue

from kombu_delay import poller
from kombu_delay.errors import write_waits_out
from kombu_delay.mover import embedded  # noqa: F401  (what Celery loads: it sets WORKER_STOPPING)
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.procs import wait_until


def test_a_message_popped_while_the_consumer_has_no_credit_is_delivered_and_recorded_unacked(
    r, redis_server, prefix
):
    # kombu leaves a BRPOP's reply unread once its channel has no credit: the message in it,
    # popped from its list, was nowhere else, and a worker killed then lost it (acks_late too).
    options = {"global_keyprefix": prefix} if prefix else {}
    queue = Queue("q", Exchange("q"), "q")
    with (
        Connection(redis_server.delay_url, transport_options=options) as worker,
        Connection(redis_server.delay_url, transport_options=options) as publisher,
    ):
        producer = Producer(publisher.channel(), exchange=queue.exchange, routing_key="q")
        channel = worker.channel()
        channel.basic_qos(0, 2, False)
        got: list[str] = []
        Consumer(channel, [queue], callbacks=[lambda body, message: got.append(body)]).consume()
        producer.publish("A", declare=[queue])
        worker.drain_events(timeout=30)
        assert got == ["A"]
        with contextlib.suppress(TimeoutError):
            worker.drain_events(timeout=0.5)  # credit for one more: a BRPOP goes out, and waits
        channel.basic_qos(0, 1, False)  # the credit goes (Celery lowers it once an ETA has come)
        producer.publish("B")
        wait_until(lambda: r.llen(f"{prefix}q") == 0, timeout=30)  # popped, into the BRPOP's reply
        worker.drain_events(timeout=30)
        assert got == ["A", "B"]
        assert r.hlen(f"{prefix}unacked") == 2  # both restored, if this worker died now


@pytest.fixture(autouse=True)
def running(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker not told to stop (another test may have sent Celery's signal in this process):
    for every test here, each of which tells what a worker does as it runs, or is told to stop."""
    monkeypatch.setattr(poller, "WORKER_STOPPING", threading.Event())
    monkeypatch.setattr(poller, "consuming", poller._publishing)


def test_a_message_taken_as_redis_goes_away_is_recorded_once_it_is_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, running: None
) -> None:
    # kombu records a message taken (its unacked hash) by a command after the BRPOP that took it:
    # where Redis went away between the two (a restart), the message, on no list any more, was
    # lost (one task in each of three restarts under a worker taking due messages).
    queue = Queue("q", Exchange("q"), "q")
    with RedisServer(directory=str(tmp_path), persistence=True, appendfsync="always") as server:
        r = server.client()
        with Connection(server.delay_url) as worker, Connection(server.delay_url) as publisher:
            Producer(publisher.channel(), exchange=queue.exchange, routing_key="q").publish(
                "A", declare=[queue], headers={"id": "task-a"}
            )
            channel = worker.channel()
            raw = json.loads(r.rpop("q"))  # what the BRPOP's reply holds: on no list now
            message = channel.Message(raw, channel=channel)
            server.stop()
            back = threading.Timer(5, server.start)  # a restart's time, seconds
            back.start()
            try:
                with caplog.at_level(logging.WARNING, logger="kombu_delay.poller"):
                    channel.qos.append(message, message.delivery_tag)
            finally:
                back.join()
            assert r.hexists("unacked", message.delivery_tag)  # restored from there if the worker dies
            [told] = [rec.getMessage() for rec in caplog.records if rec.name == "kombu_delay.poller"]
            assert "message 'task-a', taken from its list, is not recorded as taken yet" in told


def test_an_acknowledgement_lost_to_a_restart_is_written_once_redis_is_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, running: None
) -> None:
    # A task acknowledged as Redis restarted ("Couldn't ack ... network:ConnectionError") kept its
    # record in kombu's unacked hash, and ran again after the visibility timeout.
    with RedisServer(directory=str(tmp_path), persistence=True, appendfsync="always") as server:
        r = server.client()
        with Connection(server.delay_url) as worker:
            channel = worker.channel()
            message = channel.Message(taken_message("task-d"), channel=channel)
            channel.qos.append(message, message.delivery_tag)
            assert r.hexists("unacked", message.delivery_tag)
            server.stop()
            back = threading.Timer(5, server.start)  # a restart's time, seconds
            back.start()
            try:
                with caplog.at_level(logging.WARNING, logger="kombu_delay.poller"):
                    channel.basic_ack(message.delivery_tag)
            finally:
                back.join()
            assert not r.hexists("unacked", message.delivery_tag)  # not restored: it ran once
            assert not r.zscore("unacked_index", message.delivery_tag)
            [told] = [rec.getMessage() for rec in caplog.records if rec.name == "kombu_delay.poller"]
            assert "message 'task-d' is not acknowledged yet" in told


def test_a_message_taken_is_given_up_at_once_when_the_worker_is_told_to_stop(
    redis_server, caplog: pytest.LogCaptureFixture, running: None
) -> None:
    # The retry held a worker's shutdown for its whole minute (a supervisor's kill in between
    # lost the message unsaid).
    with RedisServer() as server, Connection(server.delay_url) as worker:
        channel = worker.channel()
        message = channel.Message(taken_message("task-b"), channel=channel)
        server.stop()
        told = threading.Timer(
            3, signals.worker_shutting_down.send, kwargs={"sender": "w@h", "sig": "SIGTERM"}
        )
        told.start()
        try:
            with (
                caplog.at_level(logging.WARNING, logger="kombu_delay.poller"),
                pytest.raises(redis.ConnectionError),
            ):
                channel.qos.append(message, message.delivery_tag)
        finally:
            told.join()
    [_, lost] = [rec.getMessage() for rec in caplog.records if rec.name == "kombu_delay.poller"]
    assert lost.startswith("kombu-delay: message 'task-b', taken from its list, could not be recorded")
    assert lost.endswith("; the worker is stopping): it is lost")


def test_a_message_kombu_cannot_record_fails_at_once_not_as_redis_not_answering(
    redis_server, caplog: pytest.LogCaptureFixture, running: None
) -> None:
    # kombu counts a KeyError among its connection errors: a message with no exchange in its
    # delivery info was tried again for a minute, Redis well, the worker running nothing.
    with Connection(redis_server.delay_url) as worker:
        channel = worker.channel()
        raw = taken_message("task-c")
        del raw["properties"]["delivery_info"]["exchange"]
        message = channel.Message(raw, channel=channel)
        with caplog.at_level(logging.WARNING, logger="kombu_delay.poller"), pytest.raises(KeyError):
            channel.qos.append(message, message.delivery_tag)
    assert not [rec for rec in caplog.records if rec.name == "kombu_delay.poller"]


def taken_message(task_id: str) -> dict[str, Any]:
    """A message as kombu's BRPOP reply holds it."""
    return {
        "body": "e30=",
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"id": task_id},
        "properties": {
            "body_encoding": "base64",
            "delivery_info": {"exchange": "q", "routing_key": "q"},
            "delivery_mode": 2,
            "delivery_tag": f"tag-{task_id}",
            "priority": 0,
        },
    }


def test_a_message_taken_as_redis_is_at_its_maxmemory_is_delivered_not_lost(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Redis refused the record (OOM, noeviction): kombu raised, the worker stopped ("Unrecoverable
    # error: OutOfMemoryError"), and the message it had taken, on no list any more, was lost.
    admin = server.client()
    with Connection(server.delay_url) as worker:
        queue = worker.SimpleQueue("full")
        queue.put({"n": 1})
        queue.put({"n": 2})
        admin.config_set("maxmemory", 1)  # every write that may grow memory is refused now
        with caplog.at_level(logging.ERROR, logger="kombu_delay.poller"):
            first, second = queue.get(timeout=30), queue.get(timeout=30)
        assert (first.payload, second.payload) == ({"n": 1}, {"n": 2})
        assert admin.hlen("unacked") == 0 and admin.llen("full") == 0  # in this worker's memory only
        told = [rec.getMessage() for rec in caplog.records if rec.name == "kombu_delay.poller"]
        assert len(told) == 2 and "delivered unrecorded" in told[0] and "maxmemory" in told[0], told
        first.ack()  # (deleting needs no memory)
        # Given back unrun: from memory, as there is no record to restore it from; Redis refuses
        # the push too until memory is freed, and it was dropped at the first refusal.
        requeued = threading.Thread(target=second.requeue)
        with caplog.at_level(logging.WARNING, logger="kombu_delay.poller"):
            requeued.start()
            wait_until(lambda: any("is not on its list yet" in r.getMessage() for r in caplog.records))
            admin.config_set("maxmemory", 0)
            requeued.join()
        back = [json.loads(base64.b64decode(json.loads(m)["body"])) for m in admin.lrange("full", 0, -1)]
        assert back == [{"n": 2}]
        queue.close()


def test_a_message_recorded_is_acknowledged_while_redis_is_at_its_maxmemory(server: RedisServer) -> None:
    # Redis refuses every command of a MULTI at its maxmemory, deletions too: kombu's ack raised,
    # and the worker stopped, its record left to run the task again after the visibility timeout.
    admin = server.client()
    with Connection(server.delay_url) as worker:
        queue = worker.SimpleQueue("full")
        queue.put({"n": 1})
        message = queue.get(timeout=30)
        assert admin.hlen("unacked") == 1
        admin.config_set("maxmemory", 1)
        message.ack()
        assert admin.hlen("unacked") == 0 and admin.zcard("unacked_index") == 0
        admin.config_set("maxmemory", 0)
        queue.close()


@contextlib.contextmanager
def one_queued(
    server: RedisServer, caplog: pytest.LogCaptureFixture, name: str
) -> Iterator[tuple[redis.Redis, Connection, Any]]:
    """A worker's connection with a message on queue ``name``, the poller's warnings captured:
    Redis (as an admin), the connection and the queue."""
    admin = server.client()
    with (
        Connection(server.delay_url) as worker,
        caplog.at_level(logging.WARNING, logger="kombu_delay.poller"),
    ):
        queue = worker.SimpleQueue(name)
        queue.put({"n": 1})
        yield admin, worker, queue


def refusing_writes(admin: redis.Redis, on: bool) -> None:
    """Make a standalone Redis refuse every write (NOREPLICAS), as a master does that lost its
    replicas under ``min-replicas-to-write``, or accept them again."""
    admin.config_set("min-replicas-to-write", 1 if on else 0)


@contextlib.contextmanager
def taken_then_refused(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> Iterator[tuple[Any, Any, Any]]:
    """A message popped off list ``refusing`` as kombu's BRPOP pops one (on no list any more),
    and then every write refused (NOREPLICAS), with the poller's warnings captured: Redis (as
    an admin), the worker's channel and the message."""
    admin = server.client()
    with (
        Connection(server.delay_url) as worker,
        caplog.at_level(logging.WARNING, logger="kombu_delay.poller"),
    ):
        worker.SimpleQueue("refusing").put({"n": 1})
        channel = worker.channel()
        message = channel.Message(json.loads(admin.rpop("refusing")), channel=channel)
        refusing_writes(admin, True)
        try:
            yield admin, channel, message
        finally:
            refusing_writes(admin, False)


def test_a_record_refused_for_a_while_is_written_once_redis_takes_writes_again(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Taken just before a master refused writes in a failover (NOREPLICAS): kombu raised, the
    # worker stopped, and the message it had taken was lost.
    with taken_then_refused(server, caplog) as (admin, channel, message):
        for step, said in (
            (lambda: channel.qos.append(message, message.delivery_tag), "not recorded as taken yet"),
            (lambda: channel.basic_ack(message.delivery_tag), "not acknowledged yet"),
        ):
            done = threading.Thread(target=step)
            done.start()
            wait_until(lambda said=said: any(said in r.getMessage() for r in caplog.records), timeout=60)
            refusing_writes(admin, False)
            done.join()
            if said.startswith("not recorded"):  # recorded: restored from there if the worker dies
                assert admin.hexists("unacked", message.delivery_tag)
                refusing_writes(admin, True)
        assert not admin.hexists("unacked", message.delivery_tag)  # acknowledged: not run again
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_record_refused_past_the_retry_is_delivered_unrecorded(
    server: RedisServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(poller, "RECORD_RETRY_S", 2.0)
    with taken_then_refused(server, caplog) as (admin, channel, message):
        channel.qos.append(message, message.delivery_tag)
        assert message.delivery_tag in channel.qos._delivered
        assert not admin.hexists("unacked", message.delivery_tag)
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(told) == 1 and "NOREPLICAS" in told[0] and "delivered unrecorded" in told[0], told


def test_a_consumer_waits_while_redis_refuses_to_hand_out_messages(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # kombu's BRPOP, a write, refused (NOREPLICAS) raised out of drain_events: a worker stopped.
    with one_queued(server, caplog, "refusing") as (admin, _worker, queue):
        refusing_writes(admin, True)
        with pytest.raises(queue.Empty):
            queue.get(timeout=3)
        assert admin.llen("refusing") == 1  # nothing taken meanwhile
        refusing_writes(admin, False)
        assert queue.get(timeout=30).payload == {"n": 1}
    assert any("refuses to hand out messages" in r.getMessage() for r in caplog.records)


def test_a_sweep_refused_for_now_is_told_once_a_minute_not_at_every_sweep(
    server: RedisServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kombu sweeps every 10 s: a refusal that lasted was told at each, where a refused pop is
    # told once a minute.
    monkeypatch.setattr(poller.RecordingQoS, "_restore_refused_told", 0.0)
    admin = server.client()
    refusing_writes(admin, True)
    try:
        with Connection(server.delay_url) as conn, caplog.at_level(logging.WARNING, logger=poller.__name__):
            qos = conn.default_channel.qos
            for _ in range(3):
                qos.restore_visible(interval=1)
    finally:
        refusing_writes(admin, False)
    told = [r for r in caplog.records if "not restored now" in r.getMessage()]
    assert len(told) == 1 and "NOREPLICAS" in told[0].getMessage(), caplog.text


def test_a_workers_binding_refused_for_now_is_waited_out_and_a_publishers_raised(
    server: RedisServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker started in a failover (NOREPLICAS) stopped at kombu's write of its queue's binding.
    admin = server.client()
    with (
        Connection(server.delay_url) as conn,
        caplog.at_level(logging.WARNING, logger="kombu_delay.poller"),
    ):
        refusing_writes(admin, True)
        try:
            with pytest.raises(redis.ResponseError, match="NOREPLICAS"):  # a publisher: as kombu
                Queue("published", Exchange("published"), "published")(conn.channel()).declare()
            monkeypatch.setattr(poller, "consuming", lambda: True)  # a worker's consumer
            binding = threading.Thread(
                target=Queue("consumed", Exchange("consumed"), "consumed")(conn.channel()).declare
            )
            binding.start()
            wait_until(lambda: any("binding of queue" in r.getMessage() for r in caplog.records), timeout=60)
        finally:
            refusing_writes(admin, False)
        binding.join(timeout=60)
    assert admin.smembers("_kombu.binding.consumed") == {b"consumed\x06\x16\x06\x16consumed"}
    assert not admin.exists("_kombu.binding.published")


@pytest.mark.parametrize(
    ("error", "waits"),
    [
        (redis.ResponseError("NOREPLICAS Not enough good replicas to write."), True),
        (redis.ResponseError("BUSY Redis is busy running a script. You can only call SCRIPT KILL"), True),
        (redis.ResponseError("MISCONF Redis is configured to save RDB snapshots, but ..."), True),
        (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), True),
        (redis.exceptions.MasterDownError("Link with MASTER is down"), True),
        (
            redis.ResponseError(
                "Command # 1 (ZADD unacked_index 1 t) of pipeline caused error: NOREPLICAS Not"
            ),
            True,
        ),
        (
            redis.exceptions.ExecAbortError("Transaction discarded because of: BUSY Redis is busy running"),
            True,
        ),
        (  # Redis 6, from inside a script (kombu binds a queue with x-expires by one)
            redis.ResponseError(
                "Error running script (call to f_2b70): @user_script:325: user_script:325: "
                "@user_script: 329: -NOREPLICAS Not enough good replicas to write."
            ),
            True,
        ),
        (
            redis.ResponseError(
                "Error running script (call to f_fb5e): @user_script:289: @user_script: 289: "
                "-READONLY You can't write against a read only replica."
            ),
            True,
        ),
        (redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), False),
        (redis.ResponseError("ERR a task named BUSY NOREPLICAS"), False),
    ],
)
def test_the_refusals_a_worker_waits_out(error: redis.ResponseError, waits: bool) -> None:
    # BUSY (a script past busy-reply-threshold) stopped a worker on its acknowledgement.
    assert write_waits_out(error) is waits


def test_an_acknowledgement_answered_busy_is_written_once_the_script_ends(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = server.client()
    with (
        Connection(server.delay_url) as worker,
        caplog.at_level(logging.WARNING, logger="kombu_delay.poller"),
    ):
        worker.SimpleQueue("busy").put({"n": 1})
        message = worker.SimpleQueue("busy").get(timeout=30)
        with script_running(server):
            message.ack()  # answered BUSY until the script ends (5 s): it stopped the worker
    assert not admin.hexists("unacked", message.delivery_tag)
    assert any("not acknowledged yet" in r.getMessage() and "BUSY" in r.getMessage() for r in caplog.records)


@contextlib.contextmanager
def script_running(server: RedisServer) -> Iterator[None]:
    """A script running for 5 s, past a busy-reply threshold of 0.1 s: every other client is
    answered BUSY (the block starts once one is); ended when the block ends."""
    admin = server.client()
    admin.config_set("busy-reply-threshold" if server_major(admin) >= 7 else "lua-time-limit", 100)
    busy_loop = (
        "local t = redis.call('TIME') local s = t[1] repeat t = redis.call('TIME') until t[1] - s >= 5"
    )
    running = threading.Thread(target=lambda: server.client().eval(busy_loop, 0))
    running.start()
    try:
        wait_until(lambda: answered_busy(admin), timeout=60)
        yield
    finally:
        running.join()


def server_major(admin: redis.Redis) -> int:
    return int(admin.info("server")["redis_version"].split(".")[0])


def answered_busy(admin: redis.Redis) -> bool:
    try:
        admin.exists("x")
    except redis.ResponseError as exc:
        return "BUSY" in str(exc)
    return False


def test_a_shutdown_gives_back_those_delivered_unrecorded_before_kombus_own_restore(
    server: RedisServer, caplog: pytest.LogCaptureFixture, running: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kombu's restore of all ended at the first recorded message Redis refused to restore: one
    # delivered unrecorded after it was dropped, with nothing said.
    monkeypatch.setattr(poller, "GIVE_BACK_STOPPING_S", 1.0)
    admin = server.client()
    with Connection(server.delay_url) as worker:
        queue = worker.SimpleQueue("full")
        queue.put({"n": 1})
        queue.put({"n": 2})
        recorded = queue.get(timeout=30)
        admin.config_set("maxmemory", 1)
        unrecorded = queue.get(timeout=30)
        assert admin.hexists("unacked", recorded.delivery_tag)
        signals.worker_shutting_down.send(sender="w@h", sig="SIGTERM")
        with (
            caplog.at_level(logging.WARNING, logger="kombu_delay.poller"),
            contextlib.suppress(redis.ResponseError),
        ):
            worker.default_channel.qos.restore_unacked()  # (kombu's own part raises: refused)
        admin.config_set("maxmemory", 0)
    told = [r.getMessage() for r in caplog.records if "could not be put back onto its list" in r.getMessage()]
    assert len(told) == 1 and repr(unrecorded.delivery_tag) in told[0], told
    back = [json.loads(m)["properties"]["delivery_tag"] for m in admin.lrange("full", 0, -1)]
    assert back == [recorded.delivery_tag] or admin.hexists("unacked", recorded.delivery_tag)  # not lost


def test_a_message_given_back_while_redis_answers_busy_waits_for_the_script(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # kombu's give-back read the bindings first, logged the BUSY, pushed nothing: the message gone.
    with one_queued(server, caplog, "busy") as (admin, _worker, queue):
        admin.config_set("maxmemory", 1)
        message = queue.get(timeout=30)  # delivered unrecorded
        admin.config_set("maxmemory", 0)
        with script_running(server):
            message.requeue()
        assert admin.llen("busy") == 1


def test_an_acknowledgement_refused_at_a_warm_shutdown_is_told_not_raised(
    server: RedisServer, caplog: pytest.LogCaptureFixture, running: None
) -> None:
    # Raised into Celery, it turned a warm shutdown into "Unrecoverable error" and tracebacks.
    with one_queued(server, caplog, "stopping") as (admin, _worker, queue):
        message = queue.get(timeout=30)
        refusing_writes(admin, True)
        signals.worker_shutting_down.send(sender="w@h", sig="SIGTERM")
        try:
            message.ack()
        finally:
            refusing_writes(admin, False)
    assert admin.hexists("unacked", message.delivery_tag)  # restored after the visibility timeout
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(told) == 1 and "could not be acknowledged" in told[0] and "the worker is stopping" in told[0]
