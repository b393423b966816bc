"""The fault suite's own tools hold up to what the fault tests put them through: a consumer that
died on a Redis restart made a fault test report losses that never happened."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from kombu_delay.tooling.redis_server import RedisServer
from tests.support.faults import Consumer, Ledger, message
from tests.support.procs import wait_until

#: How long the script cache is flushed over and over, at most, s.
FLUSHING_S = 20.0


def test_the_consumer_survives_its_script_vanishing_between_load_and_call(
    r: redis.Redis, redis_server: RedisServer
) -> None:
    """A Redis restart empties the script cache: redis-py can load the pop script on the old
    server and call it on the new one, which answers NOSCRIPT, an error redis-py does not retry.
    ``SCRIPT FLUSH`` over and over empties the cache between the load and the call just the
    same. The consumer goes on through it, and every message pushed meanwhile arrives once."""
    ledger = Ledger()
    flushing = threading.Event()
    flushing.set()

    def flush() -> None:
        with redis_server.client() as flusher:
            while flushing.is_set():
                flusher.script_flush()

    flusher = threading.Thread(target=flush, name="flusher", daemon=True)
    with Consumer(redis_server.client(), "harness", ledger, batch=10) as consumer:
        flusher.start()
        try:
            deadline = time.monotonic() + FLUSHING_S
            pushed = 0
            # Until the race was lost a few times (the consumer counts each NOSCRIPT it saw).
            while time.monotonic() < deadline and consumer.errors < 3:
                mid = f"h{pushed}"
                ledger.published(mid, 0)
                r.lpush("harness", message(mid, queue="harness"))
                pushed += 1
                time.sleep(0.001)
        finally:
            flushing.clear()
            flusher.join(30)
        ledger.published("last", 0)
        r.lpush("harness", message("last", queue="harness"))
        wait_until(ledger.complete, timeout=60)
    assert consumer.noscript >= 3, (consumer.errors, ledger.summary())
    assert ledger.doubled() == [] and ledger.unknown() == []


def test_the_consumer_does_not_swallow_other_errors(r: redis.Redis, redis_server: RedisServer) -> None:
    """An error it was not made to ride out (a key of another type here) ends the consumer,
    and leaving it raises that error: a test then fails with the cause, not with losses."""
    r.set("harness", "not a list")
    consumer = Consumer(redis_server.client(), "harness", Ledger())
    with pytest.raises(RuntimeError, match=r"consumer thread died.*WRONGTYPE"), consumer:
        wait_until(lambda: consumer.failure is not None, timeout=30)
    assert isinstance(consumer.failure, redis.ResponseError)
