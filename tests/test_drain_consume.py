"""``delay_batched_consume``: a read takes the prefetch window, kombu's ack semantics hold.

A real kombu consumer on ``delayredis://`` against the suite's Redis: every message is in
kombu's unacked set before its callback sees it, the prefetch limit is never passed, acks
remove it, a requeue and a channel close put it back, nothing is delivered twice.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from kombu import Connection, Exchange, Queue
from kombu.message import Message

from kombu_delay.tooling.redis_server import RedisServer

from .conftest import wait_until

QUEUE = "batched"


@pytest.fixture(params=[True, False], ids=["batched", "kombu"])
def batched(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def conn(redis_server: RedisServer, r: redis.Redis, prefix: str, batched: bool) -> Iterator[Connection]:
    options = {"delay_batched_consume": batched, "global_keyprefix": prefix}
    with Connection(redis_server.delay_url, transport_options=options) as connection:
        yield connection


def _publish(conn: Connection, n: int) -> list[str]:
    queue = Queue(QUEUE, Exchange(QUEUE), QUEUE)
    with conn.Producer() as producer:
        for i in range(n):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key=QUEUE, declare=[queue])
    return [str(i) for i in range(n)]


def _consume(
    conn: Connection, r: redis.Redis, prefix: str, prefetch: int, ack: bool
) -> tuple[list[int], list[int], list[Message]]:
    """Consume what ``prefetch`` allows without acking (or everything, acking); return
    (bodies in delivery order, unacked count seen by each callback, messages)."""
    bodies: list[int] = []
    seen_unacked: list[int] = []
    messages: list[Message] = []

    def on_message(body: dict[str, int], message: Message) -> None:
        # The message must already be recorded where kombu restores it from.
        assert r.hexists(f"{prefix}unacked", message.delivery_tag)
        bodies.append(body["i"])
        seen_unacked.append(int(r.hlen(f"{prefix}unacked")))
        messages.append(message)
        if ack:
            message.ack()

    channel = conn.default_channel
    channel.basic_qos(0, prefetch, False)
    with conn.Consumer(Queue(QUEUE, Exchange(QUEUE), QUEUE), channel=channel, callbacks=[on_message]):
        while True:
            try:
                conn.drain_events(timeout=2)
            except TimeoutError:
                break
    return bodies, seen_unacked, messages


def test_each_message_is_recorded_before_its_callback_and_acks_remove_it(
    conn: Connection, r: redis.Redis, prefix: str
) -> None:
    _publish(conn, 30)
    bodies, seen, _ = _consume(conn, r, prefix, prefetch=8, ack=True)
    assert bodies == list(range(30))  # all, once, in list order
    assert max(seen) <= 8
    assert r.hlen(f"{prefix}unacked") == 0 and r.zcard(f"{prefix}unacked_index") == 0
    assert r.llen(f"{prefix}{QUEUE}") == 0


def test_a_batched_read_takes_the_window_in_one_round_trip(
    conn: Connection, r: redis.Redis, prefix: str, batched: bool
) -> None:
    _publish(conn, 32)
    r.config_resetstat()
    bodies, _, _ = _consume(conn, r, prefix, prefetch=8, ack=True)
    assert bodies == list(range(32))
    brpops = int(r.info("commandstats").get("cmdstat_brpop", {}).get("calls", 0))
    # kombu: one BRPOP per message; batched: one per window of 8 (the acks come after the
    # whole batch was handed over). Either way the reads that time out at the end add a few.
    assert brpops <= 32 // 8 + 3 if batched else brpops >= 32


def test_the_prefetch_limit_holds_and_a_close_restores_what_was_not_acked(
    conn: Connection, r: redis.Redis, prefix: str
) -> None:
    _publish(conn, 20)
    bodies, seen, _ = _consume(conn, r, prefix, prefetch=5, ack=False)
    assert bodies == list(range(5))  # no more than the window, without acks
    assert seen[-1] == 5
    assert r.llen(f"{prefix}{QUEUE}") == 15
    conn.release()  # kombu restores the unacked messages of a closing channel
    assert r.llen(f"{prefix}{QUEUE}") == 20
    assert r.hlen(f"{prefix}unacked") == 0


def test_what_a_dead_worker_held_comes_back_after_the_visibility_timeout(
    redis_server: RedisServer, r: redis.Redis, prefix: str, batched: bool
) -> None:
    """A worker killed mid-batch restores nothing itself: its messages wait in the unacked
    set, and another consumer puts them back once the visibility timeout has passed."""
    options = {"delay_batched_consume": batched, "global_keyprefix": prefix}
    dead = Connection(redis_server.delay_url, transport_options=options)
    _publish(dead, 20)
    bodies, _, _ = _consume(dead, r, prefix, prefetch=5, ack=False)
    assert bodies == list(range(5))
    # The worker is gone without a word (kill -9): its connection is never closed, so
    # nothing is restored by it (a close would put the unacked messages back at once).
    assert r.llen(f"{prefix}{QUEUE}") == 15 and r.hlen(f"{prefix}unacked") == 5
    # The other consumer's visibility timeout is 1 s: it takes them for abandoned sooner.
    soon = {**options, "visibility_timeout": 1}
    with Connection(redis_server.delay_url, transport_options=soon) as other:
        qos = other.default_channel.qos

        def restored() -> bool:
            qos.restore_visible(num=100, interval=1)
            return int(r.llen(f"{prefix}{QUEUE}")) == 20

        wait_until(restored, timeout=30, interval=0.2)
        assert r.hlen(f"{prefix}unacked") == 0
        again, _, _ = _consume(other, r, prefix, prefetch=8, ack=True)
    assert sorted(again) == list(range(20))  # every message once more, none lost, none twice
    dead.release()  # what it held is gone from the unacked set: its close restores nothing
    assert r.llen(f"{prefix}{QUEUE}") == 0


def test_a_requeued_message_goes_back_and_comes_again(conn: Connection, r: redis.Redis, prefix: str) -> None:
    _publish(conn, 3)
    bodies, _, messages = _consume(conn, r, prefix, prefetch=3, ack=False)
    assert bodies == [0, 1, 2]
    messages[1].reject(requeue=True)
    messages[0].ack()
    messages[2].ack()
    assert r.hlen(f"{prefix}unacked") == 0
    again, _, _ = _consume(conn, r, prefix, prefetch=3, ack=True)
    assert again == [1]
