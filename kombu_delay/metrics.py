"""Prometheus metrics for a mover (the optional ``kombu-delay[metrics]`` extra).

Series (counters carry the ``_total`` suffix on the wire):

* ``kombu_delay_scheduled_messages{queue}``: gauge, messages waiting per queue (all priorities).
* ``kombu_delay_moved_total``: counter, messages moved onto their queue lists.
* ``kombu_delay_lateness_seconds``: histogram, due time to LPUSH of each moved message.
* ``kombu_delay_oldest_overdue_seconds``: gauge, how long the oldest due message has waited.
* ``kombu_delay_last_move_timestamp_seconds``: gauge, Unix time of the last call that moved
  something; ``kombu_delay_last_pass_timestamp_seconds``: of the last successful move call
  (moving or not), the liveness signal to alert on.
* ``kombu_delay_redis_errors_total``: counter, failed calls to Redis (the mover retries);
  ``kombu_delay_mover_errors_total``: counter, any other error in the mover loop (a bug:
  logged with its traceback, and retried too).
* ``kombu_delay_dead_letters_total``, ``kombu_delay_expired_total``: counters of anomalies.
* ``kombu_delay_thawed_total``: counter, compressed messages restored ahead of their due time.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from .replies import MoveResult, ThawResult
from .store import Store

logger = logging.getLogger(__name__)

#: Lateness buckets (due -> LPUSH), seconds: the mover aims at milliseconds.
LATENESS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: How often, at most, the per-queue scheduled counts are re-read, seconds.
SCHEDULED_REFRESH_S = 1.0


def serve_metrics(store: Store, port: int, addr: str = "127.0.0.1") -> dict[str, Any]:
    """Start the ``/metrics`` HTTP server; return the mover hooks that feed it."""
    try:
        import prometheus_client as prom
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SystemExit(
            "--metrics-port needs the metrics extra: pip install 'kombu-delay[metrics]'"
        ) from exc

    registry = prom.CollectorRegistry()
    moved = prom.Counter("kombu_delay_moved", "Messages moved onto their queue lists.", registry=registry)
    dead = prom.Counter(
        "kombu_delay_dead_letters",
        "Messages moved to the dead-letter list: corrupt kombu-delay 0.1 envelopes, and compressed "
        "messages that could not be restored.",
        registry=registry,
    )
    thawed = prom.Counter(
        "kombu_delay_thawed", "Compressed messages restored into the buckets movers move.", registry=registry
    )
    expired = prom.Counter(
        "kombu_delay_expired", "Scheduled messages lost to an expired or deleted bucket.", registry=registry
    )
    errors = prom.Counter("kombu_delay_redis_errors", "Errors talking to Redis.", registry=registry)
    other_errors = prom.Counter(
        "kombu_delay_mover_errors", "Errors in the mover loop other than Redis errors.", registry=registry
    )
    lateness = prom.Histogram(
        "kombu_delay_lateness_seconds",
        "Due time to LPUSH onto the queue list.",
        buckets=LATENESS_BUCKETS,
        registry=registry,
    )
    last_move = prom.Gauge(
        "kombu_delay_last_move_timestamp_seconds",
        "Unix time of the last move call that moved messages.",
        registry=registry,
    )
    last_pass = prom.Gauge(
        "kombu_delay_last_pass_timestamp_seconds",
        "Unix time of the last successful move call, whether or not anything was due.",
        registry=registry,
    )
    overdue_age = prom.Gauge(
        "kombu_delay_oldest_overdue_seconds",
        "Age of the oldest due message still scheduled (mover lag); 0 when none.",
        registry=registry,
    )
    scheduled = prom.Gauge(
        "kombu_delay_scheduled_messages",
        "Messages scheduled, per queue (all priorities).",
        ["queue"],
        registry=registry,
    )

    def collect_scheduled() -> None:
        try:
            current = store.counts()
        except Exception as exc:
            on_error(exc)
            logger.debug("metrics: reading counts failed", exc_info=True)
            return
        per_queue: dict[str, int] = dict.fromkeys(seen_queues, 0)  # emptied queues read 0, not vanish
        for dest, n in current.items():
            queue = store.queue_of(dest)
            per_queue[queue] = per_queue.get(queue, 0) + n
        for queue, n in per_queue.items():
            scheduled.labels(queue=queue).set(n)
        seen_queues.update(per_queue)

    seen_queues: set[str] = set()
    last_refresh = [float("-inf")]

    def on_result(result: MoveResult) -> None:
        last_pass.set(time.time())
        if result.moved:
            moved.inc(result.moved)
            last_move.set(time.time())
            for ms in result.lateness_ms:
                lateness.observe(ms / 1000)
        if result.dead:
            dead.inc(result.dead)
        if result.expired:
            expired.inc(result.expired)
        waiting = result.next_due_ms is not None and result.next_due_ms <= result.now_ms
        overdue_age.set((result.now_ms - result.next_due_ms) / 1000 if waiting else 0)  # type: ignore[operator]
        now = time.monotonic()
        if now - last_refresh[0] >= SCHEDULED_REFRESH_S:
            last_refresh[0] = now
            collect_scheduled()

    def on_thaw(result: ThawResult) -> None:
        if result.thawed:
            thawed.inc(result.thawed)
        if result.dead:
            dead.inc(result.dead)
        if result.expired:
            expired.inc(result.expired)

    def on_error(exc: BaseException) -> None:
        (errors if isinstance(exc, redis.RedisError) else other_errors).inc()

    prom.start_http_server(port, addr=addr, registry=registry)
    logger.info("metrics on http://%s:%d/metrics", addr, port)
    return {"on_result": on_result, "on_error": on_error, "on_thaw": on_thaw}
