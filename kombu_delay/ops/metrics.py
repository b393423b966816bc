"""Prometheus metrics for a mover (the optional ``kombu-delay[metrics]`` extra).

Series (counters carry the ``_total`` suffix on the wire):

* ``kombu_delay_scheduled_messages{queue}``: gauge, messages waiting per queue (all priorities).
  Bounded (:mod:`kombu_delay.ops.series`): the 200 queues with the most waiting have a series
  each, the rest are summed under ``queue="(other)"`` (a series that appears once there are
  more), and a queue that emptied reads 0 for 5 minutes, then its series is dropped. So
  thousands of short-lived queues cost a few hundred series, not one each.
* ``kombu_delay_moved_total``: counter, messages moved onto their queue lists.
* ``kombu_delay_lateness_seconds``: histogram, due time to LPUSH of each moved message.
* ``kombu_delay_oldest_overdue_seconds``: gauge, how long the oldest due message has waited,
  in either space (a compressed one is read every :data:`COLD_REFRESH_S`; both are read while
  move calls fail, as often); ``NaN`` where it cannot be read, and until Redis has answered.
* ``kombu_delay_last_move_timestamp_seconds``: gauge, Unix time by Redis's clock of the last
  call that moved something (``NaN`` until this mover's first);
  ``kombu_delay_last_pass_timestamp_seconds``: of the last
  successful move call (moving or not), the liveness signal to alert on.
* ``kombu_delay_redis_errors_total``: counter, failed calls to Redis (the mover retries);
  ``kombu_delay_mover_errors_total``: counter, any other error in the mover loop (a bug:
  logged with its traceback, and retried too).
* ``kombu_delay_dead_letters_total``, ``kombu_delay_expired_total``: counters of anomalies.
* ``kombu_delay_thawed_total``: counter, compressed messages restored ahead of their due time.
* ``kombu_delay_eviction_policy_unsafe``: gauge, 1 while Redis's ``maxmemory-policy`` lets it
  delete scheduled messages (anything but ``noeviction``).
* ``kombu_delay_redis_at_maxmemory``: gauge, 1 while Redis, under ``noeviction``, has less than
  64 KB left below its ``maxmemory``, so refuses publishes (read with the policy, every minute).
* ``kombu_delay_redis_persistence_off``: gauge, 1 while Redis keeps nothing on disk (no AOF, no
  RDB save rules), so a Redis restart loses every scheduled message.
* ``kombu_delay_stranded_messages``, ``kombu_delay_stranded_prefixes``: gauges, messages (and
  key prefixes) in this database under another ``global_keyprefix`` that no mover serves.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from kombu_delay.errors import needs_extra
from kombu_delay.mover.threads import stop_signals_blocked
from kombu_delay.ops.checks import Findings
from kombu_delay.ops.series import QueueSeries
from kombu_delay.store import Store, spaces
from kombu_delay.store.replies import MoveResult, SweepResult, ThawResult

logger = logging.getLogger(__name__)

#: Lateness buckets (due -> LPUSH), seconds: the mover aims at milliseconds.
LATENESS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: How often, at most, the per-queue scheduled counts are re-read, seconds.
SCHEDULED_REFRESH_S = 1.0
#: How often, at most, the compressed space is read for a message overdue there, seconds.
COLD_REFRESH_S = 5.0
#: Most compressed buckets begun by now that the read looks at (a mover that keeps up leaves one).
COLD_BUCKETS = 100
#: How long past its longest sleep a mover may go without a move call's result or error before
#: the gauges read from Redis are unknown (NaN), seconds: a call that waits on a Redis that
#: does not answer (stopped, paused, cut off) reports nothing until its socket timeout, and the
#: gauges read on as they were meanwhile (0 overdue while messages fell due).
SILENT_S = 5.0


def serve_metrics(store: Store | None, port: int, addr: str = "127.0.0.1") -> MoverMetrics:
    """Start the ``/metrics`` HTTP server and return its series; a mover feeds them through
    their :meth:`~MoverMetrics.hooks`. ``store`` may come later (:attr:`MoverMetrics.store`):
    a mover serves its metrics while it waits for Redis, counting each failed try."""
    try:
        import prometheus_client as prom
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SystemExit(needs_extra("--metrics-port", "metrics")) from exc

    metrics = MoverMetrics(store, prom)
    with stop_signals_blocked():  # its threads leave SIGTERM and SIGINT to the main one
        prom.start_http_server(port, addr=addr, registry=metrics.registry)
    logger.info("metrics on http://%s:%d/metrics", addr, port)
    return metrics


class MoverMetrics:
    """The series of one mover, in their own registry, and the hooks of
    :class:`~kombu_delay.mover.loop.Mover` that feed them."""

    def __init__(self, store: Store | None, prom: Any) -> None:
        #: Where the per-queue counts are read; ``None`` until Redis has answered.
        self.store = store
        # Held while a result's series change together (moved and the lateness count), and while
        # a scrape reads them: one scrape read 8 moved and 9 latenesses, a move between the two.
        self._lock = threading.Lock()
        self.registry = _snapshot_registry(prom, self._lock)
        self._series = QueueSeries()
        #: When each paced read (:meth:`_paced`) was last made, monotonic s.
        self._last_read = {"counts": float("-inf"), "overdue": float("-inf")}
        self._reading = False  # (a failed read tells on_error, which must not read again)
        #: The due time of the oldest compressed message overdue (epoch ms), as last read
        #: (:meth:`read_cold_overdue`, every :data:`COLD_REFRESH_S`); ``None``: none; ``NaN``:
        #: the read failed (a cold index of another type, say: its thaw fails too).
        self._cold_overdue_ms: float | None = None
        self._last_cold_read = float("-inf")
        #: When the mover last told a move call's result or error (:data:`SILENT_S`).
        self._heard = time.monotonic()
        #: Its longest sleep, seconds (:meth:`attach`).
        self._max_sleep_s = 1.0
        # Registered before the series, so each scrape runs it first (a registry collects in
        # the order its collectors came).
        self.registry.register(_SilenceCheck(self))
        self._define_counters(prom)
        self._define_gauges(prom)
        self._unknown()  # until read: 0 overdue and 0 dead letters would be claims
        self.last_move.set(math.nan)  # (0 read as a move 57 years ago)

    def attach(self, store: Store, max_sleep_s: float) -> None:
        """Read the counts from ``store``, for a mover that sleeps at most ``max_sleep_s``."""
        self.store, self._max_sleep_s = store, max_sleep_s
        self._heard = time.monotonic()

    def unknown_while_silent(self) -> None:
        """Set the gauges read from Redis unknown (NaN) where the mover has told nothing for
        longer than its longest sleep and :data:`SILENT_S`: its call waits on Redis."""
        if self.store is not None and time.monotonic() - self._heard > self._max_sleep_s + SILENT_S:
            self._unknown()

    def _unknown(self) -> None:
        for gauge in (self.dead_kept, self.overdue_age, *map(self._queue_gauge, self._series.labels())):
            gauge.set(math.nan)

    def _define_counters(self, prom: Any) -> None:
        def counter(name: str, doc: str) -> Any:
            return prom.Counter(name, doc, registry=self.registry)

        self.moved = counter("kombu_delay_moved", "Messages moved onto their queue lists.")
        self.dead = counter(
            "kombu_delay_dead_letters",
            "Compressed messages that could not be restored, moved to the dead-letter list.",
        )
        self.thawed = counter(
            "kombu_delay_thawed", "Compressed messages restored into the buckets movers move."
        )
        self.expired = counter(
            "kombu_delay_expired", "Scheduled messages lost to an expired or deleted bucket."
        )
        self.errors = counter("kombu_delay_redis_errors", "Errors talking to Redis.")
        self.other_errors = counter(
            "kombu_delay_mover_errors", "Errors in the mover loop other than Redis errors."
        )
        self.lateness = prom.Histogram(
            "kombu_delay_lateness_seconds",
            "Due time to LPUSH onto the queue list.",
            buckets=LATENESS_BUCKETS,
            registry=self.registry,
        )

    def _define_gauges(self, prom: Any) -> None:
        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return prom.Gauge(name, doc, labels, registry=self.registry)

        self.last_move = gauge(
            "kombu_delay_last_move_timestamp_seconds", "Unix time of the last move call that moved messages."
        )
        self.last_pass = gauge(
            "kombu_delay_last_pass_timestamp_seconds",
            "Unix time of the last successful move call, whether or not anything was due.",
        )
        self.overdue_age = gauge(
            "kombu_delay_oldest_overdue_seconds",
            "Age of the oldest due message still scheduled (mover lag); 0 when none.",
        )
        self.scheduled = gauge(
            "kombu_delay_scheduled_messages", "Messages scheduled, per queue (all priorities).", ("queue",)
        )
        self.unsafe = gauge(
            "kombu_delay_eviction_policy_unsafe",
            "1 while Redis's maxmemory-policy lets it delete scheduled messages (set noeviction).",
        )
        self.at_memory = gauge(
            "kombu_delay_redis_at_maxmemory",
            "1 while Redis (under noeviction) has less than 64 KB left below its maxmemory, so "
            "refuses publishes.",
        )
        self.volatile = gauge(
            "kombu_delay_redis_persistence_off",
            "1 while Redis keeps nothing on disk, so a restart loses every scheduled message "
            "(set appendonly yes).",
        )
        self.stranded = gauge(
            "kombu_delay_stranded_messages",
            "Messages in this database under another key prefix that no mover serves.",
        )
        self.dead_kept = gauge(
            "kombu_delay_dead_letters_kept",
            "Dead letters in the dead-letter list now, until removed (kombu-delay dead lists them).",
        )
        self.stranded_prefixes = gauge(
            "kombu_delay_stranded_prefixes",
            "Other key prefixes in this database holding messages that no mover serves.",
        )

    def hooks(self) -> dict[str, Any]:
        """The keyword arguments of :class:`~kombu_delay.mover.loop.Mover` that feed these series."""
        return {
            "on_result": self.on_result,
            "on_error": self.on_error,
            "on_thaw": self.on_thaw,
            "on_sweep": self.on_sweep,
            "on_findings": self.on_findings,
        }

    def on_result(self, result: MoveResult) -> None:
        # By Redis's clock, as every due time: a mover host's own may be off (it needs no sync),
        # and an alert that takes these from Prometheus's clock would page for a healthy mover
        # whose host is behind, or stay quiet for one ahead.
        redis_s = result.now_ms / 1000
        self._heard = time.monotonic()
        with self._lock:
            self.last_pass.set(redis_s)
            if result.moved:
                self.moved.inc(result.moved)
                self.last_move.set(redis_s)
                for ms in result.lateness_ms:
                    self.lateness.observe(ms / 1000)
            if result.expired:
                self.expired.inc(result.expired)
        now = time.monotonic()
        if now - self._last_cold_read >= COLD_REFRESH_S:
            self._last_cold_read = now
            self.read_cold_overdue(result.now_ms)
        cold = self._cold_overdue_ms
        dues = [d for d in (result.next_due_ms, cold) if d is not None and d <= result.now_ms]
        unread = cold is not None and math.isnan(cold)
        self.overdue_age.set(math.nan if unread else (result.now_ms - min(dues)) / 1000 if dues else 0)
        self._paced("counts", SCHEDULED_REFRESH_S, self.collect_scheduled)

    def _paced(self, what: str, every_s: float, read: Callable[[], None]) -> None:
        """Make the read ``what`` where it was last made ``every_s`` ago or more, and no read is
        in hand (a failed read tells :meth:`on_error`, which must not read again)."""
        now = time.monotonic()
        if now - self._last_read[what] >= every_s and not self._reading:
            self._last_read[what], self._reading = now, True
            try:
                read()
            finally:
                self._reading = False

    def read_cold_overdue(self, now_ms: int) -> None:
        """Re-read the due time of the oldest compressed message due by ``now_ms`` (Redis's
        clock), not thawed yet: overdue (its thaw fails, or lags), though no move sees it. One
        script call, which reads only the compressed buckets begun by then."""
        if self.store is None:
            return
        try:
            found, _ = self.store.overdue(now_ms, COLD_BUCKETS, (spaces.COLD,))
            self._cold_overdue_ms = min((oldest for _, oldest in found.values()), default=None)
        except Exception as exc:
            self._cold_overdue_ms = math.nan
            self.on_error(exc)
            logger.debug("metrics: reading the compressed space failed", exc_info=True)

    def read_overdue(self) -> None:
        """Read how long the oldest due message has waited, in both spaces (one script call
        each, by Redis's clock), where no move call's result tells it: while they fail, as
        where Redis refuses writes (a failover under way) but answers reads, the gauge read 0
        with messages overdue. ``NaN`` where the read fails too."""
        if self.store is None:
            return
        try:
            now_ms = self.store.time_ms()
            found, _ = self.store.overdue(now_ms, COLD_BUCKETS)
        except Exception:
            logger.debug("metrics: reading what is overdue failed", exc_info=True)
            self.overdue_age.set(math.nan)
            return
        oldest = min((due for _, due in found.values()), default=None)
        self.overdue_age.set(0 if oldest is None else max(0, now_ms - oldest) / 1000)

    def collect_scheduled(self) -> None:
        """Re-read the per-queue scheduled counts (bounded series: :class:`QueueSeries`) and
        how many dead letters are kept."""
        if self.store is None:
            return
        try:
            current = self.store.counts()
            self.dead_kept.set(self.store.dead_count(or_none=True))
        except Exception as exc:
            self.on_error(exc)
            logger.debug("metrics: reading counts failed", exc_info=True)
            # Unknown (NaN), not the last value read: a Redis gone, or emptied by a failover,
            # read on as holding what it held.
            self._unknown()
            return
        per_queue: dict[str, int] = {}
        for dest, n in current.items():
            queue = self.store.queue_of(dest)
            per_queue[queue] = per_queue.get(queue, 0) + n
        shown, dropped = self._series.values(per_queue, time.monotonic())
        for queue in dropped:
            self.scheduled.remove(queue)
        for queue, n in shown.items():
            self.scheduled.labels(queue=queue).set(n)

    def on_thaw(self, result: ThawResult) -> None:
        with self._lock:
            if result.thawed:
                self.thawed.inc(result.thawed)
            if result.dead:  # lost to delivery too, as the totals count them (thaw.lua)
                self.dead.inc(result.dead)
            if result.expired or result.dead:
                self.expired.inc(result.expired + result.dead)

    def on_sweep(self, result: SweepResult) -> None:
        if result.lost:
            self.expired.inc(result.lost)

    def on_findings(self, findings: Findings) -> None:
        self.unsafe.set(1 if findings.evicting else 0)
        self.at_memory.set(1 if findings.memory_problem else 0)
        self.volatile.set(1 if findings.volatile else 0)
        self.stranded.set(sum(findings.stranded.values()))
        self.stranded_prefixes.set(len(findings.stranded))

    def _queue_gauge(self, queue: str) -> Any:
        return self.scheduled.labels(queue=queue)

    def on_error(self, exc: BaseException) -> None:
        self._heard = time.monotonic()
        (self.errors if isinstance(exc, redis.RedisError) else self.other_errors).inc()
        if isinstance(exc, redis.RedisError):
            # No result comes to refresh the gauges from: they are read here (a Redis that
            # refuses writes still answers), or set unknown where they cannot be.
            self._paced("counts", SCHEDULED_REFRESH_S, self.collect_scheduled)
            self._paced("overdue", COLD_REFRESH_S, self.read_overdue)


class _SilenceCheck:
    """A collector that yields no series: it runs :meth:`MoverMetrics.unknown_while_silent` as
    a scrape begins."""

    def __init__(self, metrics: MoverMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> list[Any]:
        self._metrics.unknown_while_silent()
        return []


def _snapshot_registry(prom: Any, lock: threading.Lock) -> Any:
    """A registry whose scrape reads every series under ``lock``, at one instant of the
    mover's (read whole, then sent: a scrape cut short must not keep the lock)."""

    class Snapshot(prom.CollectorRegistry):  # type: ignore[misc,name-defined]
        def collect(self) -> Any:
            with lock:
                families = list(super().collect())
            yield from families

    return Snapshot()
