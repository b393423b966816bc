"""Thaw planning: how far ahead a mover thaws, from what the cold space holds.

A cold bucket must be entirely in the ordinary space by its first message's due time, or
its first messages are late. Thawing it takes time in proportion to its size, so a fixed
lead (``delay_thaw_ahead``) is right for small buckets only. A mover therefore
reads the counts of the first cold buckets (and of those noted as large further on) and its
own measured thaw rate, and begins a bucket when everything due up to it (it and the buckets
before it, which a thaw restores first) would take, at :data:`SAFETY` times the time the rate
predicts, longer than what is left before its first message is due. ``delay_thaw_ahead``
becomes the minimum lead.

Pure functions and a small meter: no Redis here, so a test drives time and sizes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from kombu_delay.store.replies import BucketCounts

#: A plan allows this many times the thaw time its rate predicts: the moves between thaw
#: steps, other movers, a noisy neighbour and a rate measured on a lighter load take the rest.
SAFETY = 2.0
#: Thaw rate assumed until a mover has measured its own, messages/s (one mover thaws 8,000 to
#: 30,000 a second on a busy 2-core machine): low, so a first herd starts early rather than
#: late. A thaw once begun runs to its bucket's end, so the first measurement can only make
#: the lead longer, never let it begin too late.
DEFAULT_RATE = 5_000.0
#: Lowest rate a plan assumes, messages/s: one slow window (the machine paused) must not set
#: leads of hours, which would thaw, and hold uncompressed, far more than needed.
MIN_RATE = 1_000.0
#: Lead added to the thaw time: a plan is made again every :data:`PLAN_EVERY_S` only, and the
#: last batch must reach the ordinary space before its due time, ms.
MARGIN_MS = 2_000
#: How often a mover reads the cold buckets' counts again while it looks, seconds.
PLAN_EVERY_S = 1.0
#: Cold buckets a plan reads, earliest first (one ``HGETALL`` each, once a second), and as many
#: again of those noted as large (1,000 messages or more for a queue, ``keys.large``) further
#: on: a herd is planned however many small buckets come before it.
PLAN_BUCKETS = 256
#: Seconds of back-to-back thaw steps that make one rate measurement.
RATE_WINDOW_S = 0.5


@dataclass(frozen=True)
class ThawPlan:
    """Where a mover's thaw should reach now, and when a plan changes its mind next."""

    #: Thaw every cold message due no later than this, epoch ms (the Redis clock).
    horizon_ms: int
    #: When the earliest bucket beyond the horizon must start its thaw, epoch ms; ``None``
    #: when no bucket the plan read is beyond it.
    next_start_ms: int | None


def lead_ms(count: int, rate: float) -> int:
    """How long before its due time a thaw of ``count`` messages must begin, at ``rate``/s."""
    return int(count / max(rate, MIN_RATE) * SAFETY * 1000) + MARGIN_MS


def _begins(
    buckets: list[BucketCounts], min_lead_ms: int, rate: float, firsts: Mapping[int, int]
) -> Iterator[tuple[int, BucketCounts]]:
    """Each bucket whose lead is longer than the minimum, with when its thaw must begin: its
    lead before its first message's due time (``firsts``, by bucket start), or before its
    start where that is not known."""
    waiting = 0
    for bucket in buckets:
        waiting += bucket.count
        lead = lead_ms(waiting, rate)
        if lead > min_lead_ms:
            yield firsts.get(bucket.start_ms, bucket.start_ms) - lead, bucket


def coming(now_ms: int, buckets: list[BucketCounts], min_lead_ms: int, rate: float) -> list[BucketCounts]:
    """The buckets whose thaw would begin by ``now_ms`` were their first messages due at their
    start: those whose first due time a plan needs, to begin no earlier than it must."""
    return [bucket for begin, bucket in _begins(buckets, min_lead_ms, rate, {}) if begin <= now_ms]


def plan(
    now_ms: int,
    buckets: list[BucketCounts],
    min_lead_ms: int,
    rate: float,
    firsts: Mapping[int, int] | None = None,
) -> ThawPlan:
    """Plan the thaw at ``now_ms`` of ``buckets`` (earliest first, as the cold index orders
    them) at ``rate`` messages/s, with ``min_lead_ms`` (``delay_thaw_ahead``) the least lead,
    and ``firsts`` the due time of the first message of some of them, by their start.

    A thaw restores messages in due order, so a bucket's lead counts the messages of every
    bucket before it too. A bucket whose lead is longer than the minimum, and whose thaw
    should have begun (that lead before its first message is due, or before its start where
    ``firsts`` does not say), is covered to its end; a smaller one is thawed ``min_lead_ms``
    ahead of each of its messages, as ever.
    """
    horizon = now_ms + min_lead_ms
    begins = list(_begins(buckets, min_lead_ms, rate, firsts or {}))
    for begin, bucket in begins:
        if begin <= now_ms:
            horizon = max(horizon, bucket.end_ms)
    later = [begin for begin, bucket in begins if bucket.end_ms > horizon]
    next_start = min(later, default=None)
    return ThawPlan(horizon, next_start)


class Rate:
    """A mover's own rate of a step it repeats (a thaw's, a herd's copy): messages per second
    of wall time, over runs of back-to-back steps (the moves and sweeps between them included,
    as they will be when it matters), a window of :data:`RATE_WINDOW_S` at a time."""

    def __init__(self, per_s: float = DEFAULT_RATE) -> None:
        #: The current estimate, messages/s: ``per_s`` until a window has been measured.
        self.per_s = per_s
        self.measured = False
        #: The estimate without :data:`MIN_RATE` under it, as measured (damped the same way).
        self.measured_per_s = per_s
        self._count = 0
        self._seconds = 0.0

    def add(self, count: int, seconds: float) -> None:
        """Count ``count`` messages restored in ``seconds`` of a run of steps."""
        self._count += count
        self._seconds += max(0.0, seconds)
        if self._seconds < RATE_WINDOW_S:
            return
        window = self._count / self._seconds
        # Half the weight to the newest window: it follows a change of load within seconds,
        # and one odd window moves the estimate by half at most.
        self.per_s = max(MIN_RATE, window if not self.measured else (self.per_s + window) / 2)
        self.measured_per_s = window if not self.measured else (self.measured_per_s + window) / 2
        self.measured = True
        self._count, self._seconds = 0, 0.0

    def told(self) -> str:
        """The rate a plan assumes, as a log line tells it: assumed, measured, or the floor
        under a slower measurement (a plan's lead is then shorter than that rate would ask)."""
        if not self.measured:
            return f"{self.per_s:.0f}/s, assumed until measured"
        if self.measured_per_s < MIN_RATE:
            return f"{self.per_s:.0f}/s, the lowest a plan assumes; measured {self.measured_per_s:.0f}/s"
        return f"{self.per_s:.0f}/s measured"
