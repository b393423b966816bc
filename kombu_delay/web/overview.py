"""The overview's data: one bounded census per refresh, shared by every browser for a second.

Each refresh costs :meth:`DelayControl.stats` (counters, bucket sizes, heartbeats: never a
message) plus :meth:`DelayControl.overdue` (only buckets already started); both are bounded by
``max_buckets`` however many messages are scheduled. Browsers that refresh within the same
second share one result, so ten open tabs cost Redis what one does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import cached_property

from kombu_delay.control import DelayControl, Stats
from kombu_delay.ops.checks import FRESH_HEARTBEAT_MS, heard, movers_heard, movers_told
from kombu_delay.web.present import Bar, bars

#: The chart's ranges: name -> (hours, slot minutes, label).
RANGES: dict[str, tuple[float, float, str]] = {
    "minutes": (1.0, 1.0, "next hour, per minute"),
    "hours": (24.0, 60.0, "next 24 hours, per hour"),
    "days": (24.0 * 14, 24 * 60.0, "next 14 days, per day"),
}
DEFAULT_RANGE = "hours"
#: How long one census serves every browser, s.
SHARED_FOR_S = 1.0
#: The longest overview refresh, s (a day): well within the 2**31 - 1 ms a browser's timer holds
#: (a longer delay fires at once, and the page would refresh without pause).
MAX_REFRESH_S = 86_400
#: The most queues the overview's table shows: with thousands of queues, each refresh would
#: otherwise send every browser a page of thousands of rows. Past it, the busiest are shown
#: (overdue first, then scheduled) and the rest summed in one line; ``/overview.json`` lists all.
QUEUE_ROWS = 100


@dataclass(frozen=True)
class QueueRow:
    name: str
    scheduled: int
    overdue: int
    #: Age of the oldest overdue message, ms (0 when none is overdue).
    oldest_overdue_ms: int


@dataclass(frozen=True)
class MoverRow:
    name: str
    #: Age of its last heartbeat by the Redis clock, ms (below 0: one ahead of that clock).
    heartbeat_age_ms: int

    @property
    def silent(self) -> bool:
        """Not heard from in time, as ``stats`` and ``health`` judge."""
        return not heard(self.heartbeat_age_ms)


@dataclass(frozen=True)
class Overview:
    stats: Stats
    range: str
    range_label: str
    queues: list[QueueRow]
    movers: list[MoverRow]
    #: The movers as ``stats`` and ``health`` count them: ``1 (1 more silent for over 30 s)``.
    movers_told: str
    bars: list[Bar]
    #: What an operator must not miss, one sentence each.
    warnings: list[str] = field(default_factory=list)
    #: True when the census's limits cut a count short (the figures are then lower bounds).
    truncated: bool = False

    @cached_property
    def _busiest(self) -> list[QueueRow]:
        """The queues, most overdue first, then the busiest."""
        return sorted(self.queues, key=lambda q: (-q.overdue, -q.scheduled, q.name))

    @property
    def shown_queues(self) -> list[QueueRow]:
        """The table's rows: every queue by name, or past :data:`QUEUE_ROWS` the busiest."""
        return self.queues if len(self.queues) <= QUEUE_ROWS else self._busiest[:QUEUE_ROWS]

    @property
    def hidden_queues(self) -> tuple[int, int, int]:
        """How many queues the table leaves out, and how many messages they hold and have overdue."""
        hidden = self._busiest[QUEUE_ROWS:] if len(self.queues) > QUEUE_ROWS else []
        return len(hidden), sum(q.scheduled for q in hidden), sum(q.overdue for q in hidden)


def build(control: DelayControl, range_name: str, max_buckets: int) -> Overview:
    """Read one overview from Redis (see the module docstring for its cost)."""
    hours, slot_minutes, label = RANGES[range_name]
    stats = control.stats(hours=hours, slot_minutes=slot_minutes, max_buckets=max_buckets)
    overdue, cut = control.overdue(max_buckets=max_buckets)
    now = stats.now_ms
    names = sorted(set(stats.by_queue) | set(overdue))
    queues = [
        QueueRow(
            name=name,
            scheduled=stats.by_queue.get(name, 0),
            overdue=overdue.get(name, (0, now))[0],
            oldest_overdue_ms=max(0, now - overdue[name][1]) if name in overdue else 0,
        )
        for name in names
    ]
    movers = sorted(
        (MoverRow(name, now - beat) for name, beat in stats.movers.items()),
        key=lambda row: row.heartbeat_age_ms,
    )
    alive, silent = movers_heard(stats.movers.values(), now)
    warnings = list(stats.warnings)
    if not alive:
        # A mover that stops takes its heartbeat away, and a dead one's is forgotten in time: no
        # heartbeat says nothing of whether one ever ran. (One ahead of Redis's clock, written by
        # hand or kept from a clock set back since, is no sign of life.)
        past = [row.heartbeat_age_ms for row in movers if row.heartbeat_age_ms >= 0]
        seen = f"the last one {min(past) / 1000:.0f} s ago" if past else "none is kept"
        warnings.insert(
            0,
            f"No mover is running (no heartbeat in the last {FRESH_HEARTBEAT_MS // 1000} s; {seen}): "
            "scheduled messages are not delivered. Start `kombu-delay mover`.",
        )
    return Overview(
        stats=stats,
        range=range_name,
        range_label=label,
        queues=queues,
        movers=movers,
        movers_told=movers_told(alive, silent),
        bars=bars(stats.histogram),
        warnings=warnings,
        truncated=stats.truncated or cut,
    )


class Shared:
    """The latest overview per range, reused for ``share_s`` by every request."""

    def __init__(self, control: DelayControl, max_buckets: int, share_s: float = SHARED_FOR_S) -> None:
        self.control = control
        self.max_buckets = max_buckets
        self.share_s = share_s
        self._lock = threading.Lock()
        self._latest: dict[str, tuple[float, Overview | Exception]] = {}

    def get(self, range_name: str) -> Overview:
        with self._lock:  # one census at a time: concurrent refreshes wait for it, then share it
            found = self._latest.get(range_name)
            if found is not None and time.monotonic() - found[0] < self.share_s:
                if isinstance(found[1], Exception):
                    raise found[1]
                return found[1]
            try:
                fresh = build(self.control, range_name, self.max_buckets)
            except Exception as exc:
                # A failure is shared too, by every range: behind a Redis that stalls, each request
                # that waited for this one would otherwise wait out its own socket timeout, one
                # range after another.
                failed = (time.monotonic(), exc)
                self._latest.update(dict.fromkeys({range_name, *RANGES}, failed))
                raise
            self._latest[range_name] = (time.monotonic(), fresh)
            return fresh
