"""A worker on ``delay*`` never holds a popped message unrecorded (kombu_delay/poller.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from pathlib import Path

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

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


def test_a_message_taken_as_redis_goes_away_is_recorded_once_it_is_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
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
