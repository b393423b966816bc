"""A worker on ``delay*`` never holds a popped message unrecorded (kombu_delay/poller.py)."""

from __future__ import annotations

import contextlib

from kombu import Connection, Consumer, Exchange, Producer, Queue

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
