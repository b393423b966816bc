"""What DelayControl's calls return: scheduled messages, pages, dead letters, stats and the
due-time histogram's slots, as plain frozen values."""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from kombu_delay.store import cold, keys

HOUR_MS = 3_600_000
#: Most rows a due-time histogram may have.
MAX_SLOTS = 1000
#: Longest histogram horizon or slot, ms: nothing can be due further out than the year-2109
#: ceiling of a due time, and longer spans make slot times past what a datetime can hold.
MAX_SPAN_MS = keys.MAX_DUE_MS


@dataclass(frozen=True)
class ScheduledMessage:
    """One scheduled message, as :meth:`DelayControl.scheduled` lists it."""

    #: Celery task id (or kombu message id): the id cancel and reschedule take.
    task_id: str
    #: Celery task name, when the payload is a Celery task.
    task: str | None
    #: Queue name, and the exact list key the mover will push onto.
    queue: str
    dest: str
    #: Due time, epoch ms (Redis clock).
    due_ms: int
    #: Payload size, bytes.
    size: int
    #: The stored kombu message (restored when it waits compressed), as a worker would get it.
    message: bytes = field(default=b"", repr=False, compare=False)

    @property
    def eta(self) -> datetime:
        """The due time as an aware UTC datetime."""
        return datetime.fromtimestamp(self.due_ms / 1000, UTC)


@dataclass(frozen=True)
class Page:
    """One page of :meth:`DelayControl.scheduled`; pass ``cursor`` back for the next."""

    items: list[ScheduledMessage]
    #: Opaque position after the last item; ``None`` when the listing is complete.
    cursor: str | None


@dataclass(frozen=True)
class DeadLetter:
    """One entry of the dead-letter list: a stored member a mover could not restore."""

    #: The member exactly as stored (compressed, and damaged).
    member: bytes
    #: Position in the list when read (0 = newest); it shifts as letters come and go.
    index: int

    @property
    def digest(self) -> str:
        """A name for this member that survives shifts in the list (sha256, hex)."""
        return hashlib.sha256(self.member).hexdigest()

    @property
    def task_id(self) -> str:
        """The task id the member carries in the clear, when it is readable, else ``""``."""
        return cold.task_id_of(self.member) or ""

    def preview(self, limit: int = 400) -> str:
        """The member's first ``limit`` bytes as text: printable ASCII as is, any other byte
        (and the backslash, which would make ``\\x00`` typed out look like a NUL) as ``\\xNN``,
        and ``…`` where it goes on."""
        text = "".join(chr(b) if 32 <= b < 127 and b != 92 else f"\\x{b:02x}" for b in self.member[:limit])
        return text + ("\u2026" if len(self.member) > limit else "")


@dataclass(frozen=True)
class Slot:
    """One row of the due-time histogram: messages due in ``[start_ms, end_ms)``."""

    start_ms: int
    end_ms: int
    count: int


@dataclass(frozen=True)
class Stats:
    """A cheap snapshot of what is scheduled (counters and bucket sizes, no member reads)."""

    #: Redis clock when taken, epoch ms.
    now_ms: int
    #: Messages scheduled in all, per destination list key, and per queue name.
    scheduled: int
    by_destination: dict[str, int]
    by_queue: dict[str, int]
    #: Due time of the earliest scheduled message, epoch ms; ``None`` when none is.
    earliest_due_ms: int | None
    #: Messages already due but not moved yet, and the age of the oldest (mover lag), ms.
    overdue: int
    oldest_overdue_ms: int
    #: Due-time histogram for the coming hours (slot 0 starts now), and what is due after it.
    #: Each slot counts a bucket's messages in the slot its start falls in (so it is accurate to
    #: one bucket width).
    histogram: list[Slot]
    #: Scheduled messages in neither ``overdue`` nor the histogram: due after it, or, when
    #: ``truncated``, also in buckets the census did not reach.
    later: int
    #: True when the census's limits (of buckets, and of the queues' sorted sets in them) cut
    #: the overdue count or the histogram short: both are then lower bounds.
    truncated: bool
    #: Mover id -> last heartbeat, epoch ms (Redis clock).
    movers: dict[str, int]
    #: Lifetime counters: scheduled, moved, cancelled, rescheduled, purged, expired, dead, ...
    totals: dict[str, int] = field(default_factory=dict)
    #: Dead letters kept now, until removed (``dead`` in ``totals`` counts every one there was).
    dead_letters: int = 0
    #: Messages still counted in ``by_destination`` whose sorted set is gone (expired or
    #: evicted) and that no mover has settled yet; not in ``scheduled``.
    vanished: int = 0
    #: What endangers scheduled messages now (an evicting ``maxmemory-policy``, Redis at its
    #: ``maxmemory``, messages stranded under another key prefix, a Redis that keeps nothing on
    #: disk): one sentence each, saying what to do.
    warnings: list[str] = field(default_factory=list)

    @property
    def last_heartbeat_ms(self) -> int | None:
        """The most recent mover heartbeat, epoch ms, or ``None`` if no mover is known (one
        ahead of Redis's clock by more than ``FUTURE_BEAT_MS``, written by hand, is none)."""
        return max(
            (ms for ms in self.movers.values() if ms <= self.now_ms + keys.FUTURE_BEAT_MS), default=None
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the snapshot as JSON-ready data."""
        data = asdict(self)
        data["last_heartbeat_ms"] = self.last_heartbeat_ms
        return data


def histogram_slots(hours: float, slot_minutes: float) -> tuple[int, int]:
    """Return (slot width in ms, slot count) of a ``stats`` histogram; raise ``ValueError``
    for more than ``MAX_SLOTS`` slots, and for an ``hours`` or ``slot_minutes`` that is not
    finite or spans more than ``MAX_SPAN_MS``."""
    if not (math.isfinite(hours) and math.isfinite(slot_minutes)):
        raise ValueError(f"histogram of {hours} hours in {slot_minutes}-minute slots: both must be finite")
    if hours <= 0 or slot_minutes <= 0:  # (a histogram of none drew one 60-minute slot)
        raise ValueError(
            f"histogram of {hours:g} hours in {slot_minutes:g}-minute slots: both must be over 0"
        )
    # Checked as floats, before rounding: round() of an infinite product raises OverflowError,
    # and a slot start past the year 9999 cannot be shown as a time.
    if abs(hours) * HOUR_MS > MAX_SPAN_MS or abs(slot_minutes) * 60_000 > MAX_SPAN_MS:
        raise ValueError(
            f"histogram of {hours:g} hours in {slot_minutes:g}-minute slots: each is at most "
            f"{MAX_SPAN_MS / HOUR_MS:,.0f} hours (nothing is due after the year 2109)"
        )
    # A slot is no wider than the window: a 60-minute row for a window of 3.6 s counted an
    # hour of due times as that window's.
    slot_ms = max(1, min(round(slot_minutes * 60_000), round(hours * HOUR_MS)))
    slots = max(1, round(hours * HOUR_MS / slot_ms))
    if slots > MAX_SLOTS:
        raise ValueError(f"{slots} histogram slots asked for; at most {MAX_SLOTS}")
    return slot_ms, slots
