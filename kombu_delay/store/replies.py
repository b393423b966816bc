"""What the Lua scripts reply, as Python values.

:class:`~kombu_delay.store.Store` turns every script reply into one of these (and Redis's
failures into :mod:`kombu_delay.errors`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kombu_delay.store import keys, spaces
from kombu_delay.store.base import as_text


class Scheduled(enum.IntEnum):
    """What ``schedule.lua`` did with a message."""

    #: A compressed message due too soon for the cold space: nothing was written, and
    #: :class:`~kombu_delay.store.Store` sends the message uncompressed instead.
    TOO_SOON_FOR_COLD = -2
    TOO_FAR = -1
    PUSHED_NOW = 0
    STORED = 1
    DUPLICATE = 2
    #: Due already, and left to the caller to push (``push_due=False``): nothing was written.
    DUE_NOW = 3


@dataclass(frozen=True)
class ScheduleResult:
    """One ``schedule.lua`` call."""

    outcome: Scheduled
    due_ms: int
    #: Redis's clock as the script judged by, epoch ms; ``None`` after the short reply of a
    #: message stored for the due time the caller gave (see ``schedule.lua``).
    now_ms: int | None
    #: Movers with a fresh heartbeat, when the call asked (``movers_fresh_ms``), else ``None``.
    movers: int | None = None
    #: The message was stored, but Redis's ACL refused the ``PUBLISH`` that wakes the movers
    #: (counted in the totals as ``wake_refused``): they find it on their next poll.
    wake_refused: bool = False

    @classmethod
    def from_reply(cls, reply: list[Any] | int, due_ms: int) -> ScheduleResult:
        """The result of ``reply``, for a call that gave the due time ``due_ms`` (or, with a
        relative delay, that delay: the script then always replies with its due time)."""
        if isinstance(reply, int):
            return cls(Scheduled(reply), due_ms, None)
        movers = int(reply[3])
        refused = len(reply) > 4 and int(reply[4]) == 1
        return cls(
            Scheduled(int(reply[0])), int(reply[1]), int(reply[2]), None if movers < 0 else movers, refused
        )


#: Integers at the head of a ``move.lua`` reply; the refused destinations follow, those that are
#: no list, a bucket's keys of another type, then the run-length coded lateness.
MOVE_HEAD = 12


@dataclass(frozen=True)
class MoveResult:
    """One ``move.lua`` call."""

    moved: int
    #: Earliest due time still scheduled, epoch ms; ``None`` when nothing is.
    next_due_ms: int | None
    #: The Redis clock at the call, in ms plus the microseconds past that ms.
    now_ms: int
    now_us: int
    held: int
    expired: int
    wrongtype: int
    #: True when the call stopped at its limit: more may be due right now.
    more: bool
    #: ``now - due`` for each moved message, ms.
    lateness_ms: list[int] = field(default_factory=list)
    #: The bucket start where this call's scan of started buckets stopped short (held
    #: buckets ahead used up its visits); the next call goes on after it. ``None``: the
    #: next call starts from the first bucket.
    scan_after: int | None = None
    #: Members found in a bucket whose counts read zero (added by hand, or counted in a meta
    #: hash that is gone), counted again and moved by a later call.
    recounted: int = 0
    #: Due messages left where they are because this user's ACL refuses LPUSH onto their
    #: destination, and (some of) those destinations.
    refused: int = 0
    refused_dests: list[str] = field(default_factory=list)
    #: Buckets let go that had lost their meta hash and every sorted set (deleted by hand,
    #: evicted, or expired after no mover ran for their grace plus a day): what they held is
    #: lost, with nothing left to count it by.
    vanished: int = 0
    #: Some of the destinations of the ``wrongtype`` messages: keys that are no list.
    wrongtype_dests: list[str] = field(default_factory=list)
    #: Some of the buckets' keys found of another type (written by hand), each with the name
    #: it was renamed to: a meta hash, whose bucket was then counted again from its sorted sets
    #: (in ``recounted``); or ``""``: a sorted set, whose messages are lost (in ``expired``),
    #: or a meta hash that could not be renamed (``RENAME`` refused: lost too).
    damaged: list[tuple[str, str]] = field(default_factory=list)
    #: The call ran past its deadline (the server read it late: paused, or too busy), and moved
    #: nothing (see :class:`~kombu_delay.store.clock.GiveUp`).
    late: bool = False

    @classmethod
    def from_reply(cls, reply: list[Any]) -> MoveResult:
        """Parse a ``move.lua`` reply."""
        head = [int(x) for x in reply[:MOVE_HEAD]]
        return cls(
            moved=head[0],
            next_due_ms=None if head[1] < 0 else head[1],
            now_ms=head[2],
            now_us=head[3],
            held=head[4],
            expired=head[5],
            wrongtype=head[6],
            more=bool(head[7]),
            lateness_ms=_runs(reply[MOVE_HEAD + 3 :]),
            scan_after=head[8] if head[8] >= 0 else None,
            recounted=head[9],
            refused=head[10],
            vanished=head[11],
            refused_dests=[as_text(name) for name in reply[MOVE_HEAD]],
            wrongtype_dests=[as_text(name) for name in reply[MOVE_HEAD + 1]],
            damaged=damaged_keys(reply[MOVE_HEAD + 2]),
            late=head[8] == -2,
        )


def damaged_keys(flat: list[Any]) -> list[tuple[str, str]]:
    """A script's keys found of another type, each followed by its new name or '' (move.lua's
    and thaw.lua's), as pairs."""
    return [(as_text(key), as_text(aside)) for key, aside in zip(flat[::2], flat[1::2], strict=True)]


def counted_keys(flat: list[Any]) -> list[tuple[str, int]]:
    """Keys each followed by a count (thaw.lua's ``blocking``), as pairs."""
    return [(as_text(key), int(n)) for key, n in zip(flat[::2], flat[1::2], strict=True)]


def _runs(coded: list[Any]) -> list[int]:
    """Expand move.lua's run-length coded lateness: ``-n, value`` is ``value`` n times."""
    out: list[int] = []
    values = iter(coded)
    for raw in values:
        value = int(raw)
        if value < 0:
            out += [int(next(values))] * -value
        else:
            out.append(value)
    return out


class Rescheduled(enum.IntEnum):
    """What ``reschedule.lua`` did with one stored message."""

    #: A purge of its queue is under way: nothing written (``purging.lua``).
    PURGING = -4
    #: As :attr:`Scheduled.TOO_SOON_FOR_COLD` (handled inside the store).
    TOO_SOON_FOR_COLD = -3
    NOT_A_LIST = -2
    TOO_FAR = -1
    GONE = 0
    RESCHEDULED = 1
    MERGED = 2
    PUSHED_NOW = 3


@dataclass(frozen=True)
class Stored:
    """One stored message as found in its bucket (for listing, cancel and reschedule)."""

    #: Start of its bucket, epoch ms.
    start_ms: int
    #: Its score, ``due_ms + seq/2048``.
    score: float
    #: The list key it will be pushed onto.
    dest: str
    #: The member, exactly as stored: the message plain kombu would push, or in the cold
    #: space (``cold``) its compressed form (:mod:`kombu_delay.store.cold`).
    payload: bytes
    #: True when it is stored compressed, in the cold space.
    cold: bool = False

    @property
    def space(self) -> spaces.Space:
        """The space it waits in (see :mod:`kombu_delay.store.spaces`)."""
        return spaces.COLD if self.cold else spaces.ORDINARY

    @property
    def due_ms(self) -> int:
        """The due time its score stands for (:func:`keys.due_of`: one written by hand past
        the span of due times, ``±inf`` even, is read at its nearest end)."""
        return keys.due_of(self.score)

    @property
    def bucket(self) -> str:
        """Its bucket as the scripts name it: the start, ``c<start>`` in the cold space."""
        return self.space.bucket(self.start_ms)

    @property
    def ref(self) -> str:
        """The id-index ref ``start:offset:seq`` of this message (``c`` first when cold). A
        score no publish writes (``±inf``, by hand) reads as :func:`keys.due_of` reads it:
        its ref then names none in the id index, which a caller's script leaves as it is."""
        due = keys.due_of(self.score)
        seq = round((self.score - due) * keys.SEQ_SLOTS) if 0 <= self.score - due < 1 else 0
        return f"{self.bucket}:{due - self.start_ms}:{seq}"

    @property
    def message(self) -> bytes:
        """The message plain kombu would push; raises :class:`CorruptMember` for a cold
        member that cannot be restored."""
        return self.space.message(self.payload)


@dataclass(frozen=True)
class ThawResult:
    """One thaw step of a mover: ``thaw_scan.lua``, restoring in Python, ``thaw.lua``."""

    #: Cold messages restored into the ordinary buckets.
    thawed: int
    #: Members that could not be restored, now on the dead-letter list.
    dead: int
    #: Listed members another mover thawed first (or cancelled meanwhile).
    gone: int
    #: Counted cold messages found gone (expired after their grace, or deleted).
    expired: int
    #: The Redis clock at the scan, epoch ms.
    now_ms: int
    #: No cold message not yet thawed is due before this (epoch ms); ``None``: none stored.
    next_ms: int | None
    #: True when the limit cut the step short: more are due within the thaw horizon.
    more: bool
    #: Members found in a cold bucket whose counts read zero (added by hand, or counted in a
    #: meta hash that is gone), counted again, and thawed by a later step.
    recounted: int = 0
    #: Bucket keys found of another type, as :attr:`MoveResult.damaged`: an ordinary bucket's
    #: meta hash set aside, with the name it was renamed to; a cold bucket's meta hash or sorted
    #: set, with '' (its messages counted in ``expired``).
    damaged: list[tuple[str, str]] = field(default_factory=list)
    #: Of the dead, messages whose ordinary bucket had a key of another type (written by hand),
    #: where none can be stored: ``blocking`` names those keys, each with how many it blocked.
    blocked: int = 0
    blocking: list[tuple[str, int]] = field(default_factory=list)


@dataclass(frozen=True)
class BucketCounts:
    """One bucket as a mover plans its thaw or its staging (:meth:`Store.cold_buckets`,
    :meth:`Store.ordinary_buckets`)."""

    #: Its start and end, epoch ms: it holds messages due from ``start_ms`` to before ``end_ms``.
    start_ms: int
    end_ms: int
    #: The messages it still holds (its meta hash's counts).
    count: int
    #: The same per destination list key.
    dests: tuple[tuple[str, int], ...] = ()


class Staged(enum.IntEnum):
    """What one ``stage.lua`` call found (:class:`StageResult`)."""

    DONE = 0  #: the whole run is in its staged list
    MORE = 1  #: part of it is: call again
    NO_RUN = -1  #: the head run is too small to stage, or the set is gone
    REFUSED = -2  #: the ACL refuses what a handover needs (RENAME, UNLINK, ...)


@dataclass(frozen=True)
class StageResult:
    """One ``stage.lua`` call: the run at the head of a bucket's set for one destination."""

    outcome: Staged
    #: Members in the staged list after the call.
    staged: int
    #: The run's size and due time (epoch ms); 0 when the set is gone.
    run: int
    due_ms: int

    @classmethod
    def from_reply(cls, reply: list[Any]) -> StageResult:
        code, staged, run, due = (int(x) for x in reply)
        return cls(Staged(code), staged, run, due)


@dataclass(frozen=True)
class SweepResult:
    """One ``sweep.lua`` page."""

    #: Buckets whose expiry was pushed out to their grace from now.
    renewed: int
    #: Counted messages whose sorted set was gone (expired or evicted), now settled.
    lost: int
    #: Buckets whose counts read zero while their sorted sets held members (a meta hash
    #: evicted or deleted, members added by hand), counted again from the sets.
    rebuilt: int
    #: Where the next page starts; ``""`` when the walk reached the end of both spaces.
    cursor: str
    #: Buckets let go that had vanished whole: no meta hash, and no sorted set found for the
    #: queues the per-queue counts name (what they held cannot be counted).
    vanished: int = 0

    @classmethod
    def from_reply(cls, reply: list[Any]) -> SweepResult:
        cursor = reply[3]
        return cls(
            int(reply[0]),
            int(reply[1]),
            int(reply[2]),
            cursor.decode() if isinstance(cursor, bytes) else cursor,
            int(reply[4]),
        )


@dataclass(frozen=True)
class Census:
    """What ``census.lua`` counted: overdue members and a due-time histogram."""

    #: True when ``max_buckets`` cut the census short.
    truncated: bool
    #: Members already due (``floor(score) <= now``) but not moved.
    overdue: int
    #: Messages still counted whose sorted set is gone (expired or evicted, or written over by
    #: hand as another type), not yet settled.
    vanished: int
    #: Not-yet-due members per histogram slot, slot 0 starting now.
    slots: list[int]
