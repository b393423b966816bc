"""Prometheus metrics for a mover (the optional ``kombu-delay[metrics]`` extra)."""

from __future__ import annotations

import logging
import time
from typing import Any

from .store import MoveResult, Store

logger = logging.getLogger(__name__)

#: Lateness buckets (due -> LPUSH), seconds: the mover aims at milliseconds.
LATENESS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
        "kombu_delay_dead_letters", "Corrupt envelopes moved to the dead-letter list.", registry=registry
    )
    expired = prom.Counter(
        "kombu_delay_expired", "Scheduled messages lost to an expired or deleted bucket.", registry=registry
    )
    errors = prom.Counter("kombu_delay_redis_errors", "Errors talking to Redis.", registry=registry)
    lateness = prom.Histogram(
        "kombu_delay_lateness_seconds",
        "Due time to LPUSH onto the queue list.",
        buckets=LATENESS_BUCKETS,
        registry=registry,
    )
    last_move = prom.Gauge(
        "kombu_delay_last_move_timestamp_seconds", "Unix time of the last move.", registry=registry
    )
    overdue_age = prom.Gauge(
        "kombu_delay_oldest_overdue_seconds",
        "Age of the oldest due message still scheduled (mover lag); 0 when none.",
        registry=registry,
    )
    scheduled = prom.Gauge(
        "kombu_delay_scheduled_messages",
        "Messages scheduled, per queue list key.",
        ["queue"],
        registry=registry,
    )

    def collect_scheduled() -> None:
        try:
            current = store.counts()
        except Exception:
            errors.inc()
            logger.debug("metrics: reading counts failed", exc_info=True)
            return
        scheduled.clear()
        for dest, n in current.items():
            scheduled.labels(queue=dest).set(n)

    last_refresh = [0.0]

    def on_result(result: MoveResult) -> None:
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
        if now - last_refresh[0] >= 1.0:
            last_refresh[0] = now
            collect_scheduled()

    def on_error(exc: BaseException) -> None:
        errors.inc()

    prom.start_http_server(port, addr=addr, registry=registry)
    logger.info("metrics on http://%s:%d/metrics", addr, port)
    return {"on_result": on_result, "on_error": on_error}
