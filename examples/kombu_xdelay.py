"""Plain kombu, no Celery: publish messages with an ``x-delay`` header, consume them when due.

``x-delay`` is the RabbitMQ delayed-message convention: milliseconds from now. With
``delayredis://`` the transport keeps each message in Redis until it is due (by the
Redis clock), and a mover puts it on the queue's list, where any kombu consumer reads it.

Run a mover next to it, then this script::

    kombu-delay --broker delayredis://localhost:6379/0 mover &
    python examples/kombu_xdelay.py delayredis://localhost:6379/0

The broker URL comes from the first argument, else ``KOMBU_DELAY_BROKER``. The script
exits 0 when every message arrived, none before its delay was up.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from kombu import Connection, Exchange, Queue

import kombu_delay  # noqa: F401  (registers the delayredis:// scheme)

DELAYS_MS = (300, 800, 1500, 2500)
queue = Queue("xdelay_example", Exchange("xdelay_example", type="direct"), routing_key="xdelay_example")


def now_ms() -> int:
    return int(time.time() * 1000)


def produce(conn: Connection) -> None:
    with conn.Producer(serializer="json") as producer:
        for number, delay in enumerate(DELAYS_MS, 1):
            body = {"number": number, "delay_ms": delay, "sent_ms": now_ms()}
            producer.publish(
                body,
                exchange=queue.exchange,
                routing_key=queue.routing_key,
                declare=[queue],
                headers={"x-delay": delay},
            )
            print(f"sent     message {number} with x-delay {delay} ms")


def consume(conn: Connection, timeout_s: float = 60.0) -> int:
    """Consume until every message arrived; return how many arrived before their delay."""
    early = 0
    arrived: set[int] = set()

    def on_message(body: dict[str, int], message: object) -> None:
        nonlocal early
        waited = now_ms() - body["sent_ms"]
        early += waited < body["delay_ms"]
        arrived.add(body["number"])
        print(f"received message {body['number']} after {waited} ms (x-delay {body['delay_ms']} ms)")
        message.ack()  # type: ignore[attr-defined]

    deadline = time.monotonic() + DELAYS_MS[-1] / 1000 + timeout_s
    with conn.Consumer(queue, callbacks=[on_message], accept=["json"]):
        while len(arrived) < len(DELAYS_MS):
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, len(DELAYS_MS) + 1)) - arrived)
                raise SystemExit(f"messages {missing} never arrived: is a mover running?")
            with contextlib.suppress(TimeoutError):  # a quiet second: check the deadline
                conn.drain_events(timeout=1)
    return early


def main() -> int:
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("KOMBU_DELAY_BROKER", "")
    if not url:
        print(__doc__)
        return 2
    with Connection(url) as conn:
        produce(conn)
        early = consume(conn)
    print(f"all {len(DELAYS_MS)} messages arrived, {early} early")
    return 1 if early else 0


if __name__ == "__main__":
    sys.exit(main())
