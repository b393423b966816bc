"""What the README's Limitations section claims, shown on a real Redis and a real worker."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys

from celery import Celery
from kombu import Connection, Exchange, Queue

from kombu_delay.store import Store
from tests.support.procs import ROOT, wait_until

HOUR_MS = 3_600_000


def test_fanout_is_delivered_at_once_even_with_a_delay_and_says_so(r, redis_server, caplog):
    exchange = Exchange("limits_fanout", type="fanout")
    queue = Queue("limits_fanout_q", exchange)
    got: list[dict[str, int]] = []
    with (
        Connection(redis_server.delay_url) as consumer_conn,
        Connection(redis_server.delay_url) as producer_conn,
    ):

        def poll() -> bool:
            with contextlib.suppress(TimeoutError):
                consumer_conn.drain_events(timeout=0.2)
            return bool(got)

        def subscribed() -> bool:
            poll()  # kombu subscribes to the fanout channel when the consumer first polls
            return bool(r.pubsub_channels("/0.limits_fanout*") or r.pubsub_numpat())

        with consumer_conn.Consumer(queue, callbacks=[lambda body, msg: (got.append(body), msg.ack())]):
            wait_until(subscribed, timeout=60)
            with producer_conn.Producer(serializer="json") as producer, caplog.at_level(logging.WARNING):
                producer.publish(
                    {"n": 1}, exchange=exchange, declare=[exchange], headers={"x-delay": HOUR_MS}
                )
                producer.publish({"n": 2}, exchange=exchange, headers={"x-delay": HOUR_MS})
                producer.publish({"n": 3}, exchange=exchange)  # no delay asked: not counted
                # Past the ceiling a held message has: kombu's fanout sends it all the same.
                producer.publish({"n": 4}, exchange=exchange, headers={"x-delay": "1e400"})
                # A delay that cannot be read went at once in silence: told as on a direct exchange.
                producer.publish({"n": 5}, exchange=exchange, headers={"x-delay": "abc", "id": "bad-5"})
                # A batch given up before it is sent sends nothing, and counts nothing.
                with contextlib.suppress(RuntimeError), producer.batch(max_size=10):
                    producer.publish({"n": 6}, exchange=exchange, headers={"x-delay": HOUR_MS})
                    raise RuntimeError("the batch is given up")
            wait_until(lambda: poll() and len(got) == 5, timeout=120)  # far less than the hour asked
    assert got == [{"n": 1}, {"n": 2}, {"n": 3}, {"n": 4}, {"n": 5}]
    assert Store(r).counts() == {}  # nothing was held
    # Not in silence: said once for the exchange, and each such message counted.
    told = [m for m in caplog.messages if "fanout exchange 'limits_fanout' delivers at once" in m]
    assert len(told) == 1, caplog.messages
    assert any("'bad-5' delivered now" in m for m in caplog.messages), caplog.messages
    totals = Store(r).totals()
    assert totals["fanout_at_once"] == 3 and totals["bad_eta"] == 1, totals


def test_inspect_scheduled_does_not_see_delayed_tasks_held_in_redis(r, redis_server, spawn):
    env = {"KOMBU_DELAY_DEMO_BROKER": redis_server.url}
    celery = [sys.executable, "-m", "celery", "-A", "kombu_delay.tooling.demo.app"]
    quiet = ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    spawn([*celery, "worker", "--pool", "solo", *quiet, "--hostname", "limits@%h"], env=env, name="worker")
    # Control: through plain redis:// the worker receives the task at once and holds it.
    plain = Celery("limits_plain", broker=redis_server.url)
    held_by_worker = plain.send_task("kombu_delay.tooling.demo.app.fire", args=(1,), countdown=600).id
    delayed = Celery("limits_delay", broker=redis_server.delay_url)
    held_in_redis = delayed.send_task("kombu_delay.tooling.demo.app.fire", args=(2,), countdown=600).id
    plain.close()
    delayed.close()

    def scheduled_ids() -> set[str]:
        done = subprocess.run(
            [*celery, "inspect", "scheduled", "--json", "--timeout", "5"],
            cwd=ROOT,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            return set()
        replies = json.loads(done.stdout.strip().splitlines()[-1])
        return {entry["request"]["id"] for entries in replies.values() for entry in entries}

    seen = wait_until(lambda: scheduled_ids() or None, timeout=120)
    assert seen == {held_by_worker}
    assert sum(Store(r).counts().values()) == 1  # the delayed one waits in Redis
    assert held_in_redis not in seen


def test_the_fanout_exchanges_told_are_bounded(redis_server, caplog):
    # One name a message (an exchange per tenant or session) grew the set of those told for
    # the life of the process: 20,000 names, 20,000 entries.
    from kombu_delay import transport

    transport._fanouts_told.clear()
    with Connection(redis_server.delay_url) as conn, caplog.at_level(logging.ERROR):
        producer = conn.Producer(serializer="json")
        for n in range(1_500):
            exchange = Exchange(f"told-{n}", type="fanout")
            producer.publish({"n": n}, exchange=exchange, declare=[exchange], headers={"x-delay": 1000})
    assert 0 < len(transport._fanouts_told) <= 1_000
