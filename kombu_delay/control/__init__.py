"""See and control what is scheduled: stats, listing, cancel, reschedule and purge by task id.

:class:`DelayControl` is the public API; the CLI (``kombu-delay stats|ls|cancel|reschedule|purge``)
is a thin layer over it. Every operation goes through the id index or per-bucket counters, never a scan.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from kombu.connection import Connection

from kombu_delay.config import Settings, seconds_shown
from kombu_delay.connect import SOCKET_TIMEOUT_S, check_options, connection, default_channel, store_of
from kombu_delay.control import args
from kombu_delay.control.gate import Once, gate_of, gated
from kombu_delay.control.results import DeadLetter, Page, ScheduledMessage, Slot, Stats, histogram_slots
from kombu_delay.errors import CorruptMember, DelayTooLong, EditConflict, RedisRefused
from kombu_delay.message import carries_eta, index_id, task_name, to_ms, with_eta
from kombu_delay.ops.health import dangers
from kombu_delay.store import Store, keys
from kombu_delay.store.edit import EDIT_LOOKS
from kombu_delay.store.replies import Rescheduled, Stored

__all__ = ["DeadLetter", "DelayControl", "Page", "ScheduledMessage", "Slot", "Stats", "histogram_slots"]

#: The last list position Redis reads (a signed 64-bit integer): a page must end by it.
_MAX_POSITION = 2**63 - 1

#: Connections a :class:`DelayControl` made from a URL may open at once (the transport option
#: ``max_connections``, when not given): one per thread sharing it.
SHARED_CONNECTIONS = 64


class DelayControl:
    """Inspect and control kombu-delay's scheduled messages.

    Build it from a broker URL (``delayredis://``, or plain ``redis://``, ``rediss://``,
    ``sentinel://`` of the same server) plus ``broker_transport_options`` (for
    ``global_keyprefix``), or from a kombu :class:`~kombu.Connection`, for example
    ``app.connection_for_write()``; ``ssl`` is kombu's ``ssl`` argument (Celery's
    ``broker_use_ssl``) for a URL. It connects on first use, is safe to share between
    threads, and should be closed (or used as a context manager) when it owns the connection.

    Example::

        control = DelayControl("delayredis://localhost:6379/0")
        control.cancel(result.id)                    # -> 1
        control.reschedule(task_id, countdown=60)    # -> 1
    """

    def __init__(
        self, broker: str | Connection, transport_options: dict[str, Any] | None = None, ssl: Any = None
    ) -> None:
        if isinstance(broker, str):
            # Shared by threads (the dashboard's, up to 64), each call holding one connection:
            # kombu's pool has 10 and refuses the 11th, which read as Redis being away.
            # And a Redis that accepts connections but never answers (stopped, behind a
            # black-holed network) fails a call instead of hanging it, and the app's request.
            options = {
                "max_connections": SHARED_CONNECTIONS,
                "socket_timeout": SOCKET_TIMEOUT_S,
                "socket_connect_timeout": SOCKET_TIMEOUT_S,
                **(transport_options or {}),
            }
            self._conn = connection(broker, options, ssl)
            self._owned = True
        elif isinstance(broker, Connection):
            check_options(broker.transport_options or {})
            self._conn, self._owned = broker, False
        else:  # a Celery app, say: its connection_for_write() is one
            raise TypeError(
                "DelayControl takes a broker URL or a kombu Connection (of a Celery app: "
                f"app.connection_for_write()), not {type(broker).__name__}"
            )
        self._gate = gate_of(self._conn)  # each call holds one connection at a time
        self._opened: Once[Store] = Once()
        self._settings = Settings.from_options(self._conn.transport_options)

    @property
    def store(self) -> Store:
        """The :class:`~kombu_delay.store.Store` behind this control (opened on first use)."""
        return self._opened.get(lambda: store_of(default_channel(self._conn, at_once=self._owned)))

    def close(self) -> None:
        """Release the connection, if this control opened it."""
        if self._owned:
            self._conn.release()

    def __enter__(self) -> DelayControl:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @gated
    def time_ms(self) -> int:
        """Return the Redis clock, epoch ms."""
        return self.store.time_ms()

    @gated
    def queue_of(self, dest: str) -> str:
        """Return the queue name of a destination list key."""
        return self.store.queue_of(dest)

    @gated
    def cancel(self, task_id: str) -> int:
        """Unschedule every pending message of ``task_id``; return how many were removed.

        A retry reuses its task id, so one id can have several pending messages: all of them are
        cancelled. 0 means nothing was scheduled under that id (never published with an ETA, already
        moved to its queue, or already cancelled). Raises :class:`~kombu_delay.EditConflict` where
        other edits kept moving its messages (other threads rescheduling the same id over and over)
        and some are still scheduled."""
        return self.store.cancel(task_id)

    @gated
    def find(self, task_id: str, unreadable: bool = False) -> list[ScheduledMessage]:
        """``task_id``'s pending messages (id index, O(log n)); ``unreadable``: damaged ones too."""
        return [self._message(s) for s in self.store.find(task_id, unreadable=unreadable)]

    @gated
    def reschedule(self, task_id: str, eta: datetime | None = None, countdown: float | None = None) -> int:
        """Move every pending message of ``task_id`` to a new due time; return how many.

        Give ``eta`` (an aware datetime; naive ones raise :class:`~kombu_delay.BadETA`) or ``countdown``
        (seconds from now, by the Redis clock). The ETA carried inside a Celery message is rewritten
        too, so a worker runs it at the new time. A new time already past, however far, sends the
        message to its queue now (a time before 1970 is written into it as 1970-01-01). Raises
        :class:`~kombu_delay.DelayTooLong` past ``delay_max_delay`` or the year-2109 ceiling (the
        message then stays as it was), ``ValueError`` for a ``countdown`` that is not finite, and
        :class:`~kombu_delay.RedisRefused` when a time already past would send it to a key that is
        not a list (the message then stays as it was; each error says how many of the id's
        messages in other queues it rescheduled before). Raises :class:`~kombu_delay.EditConflict`
        where other edits kept moving its messages (other threads rescheduling the same id over and
        over) and some are still at another time.
        """
        if (eta is None) == (countdown is None):
            raise TypeError("give exactly one of eta= or countdown=")
        store = self.store
        due_ms = self._new_due_ms(eta, countdown)
        # Checked before with_eta as well as by the script: far enough past the ceiling the ETA
        # cannot even be formatted (datetime ends with the year 9999), and the script would
        # refuse it anyway.
        found = store.find(task_id)
        if due_ms > keys.MAX_DUE_MS and found:
            raise self._too_far(task_id, due_ms)
        # A message another edit rescheduled between the find and its own reschedule is in its new
        # bucket: looked for again (EDIT_LOOKS in all), as a cancel does, so the reschedule that ends
        # last wins. A look again reschedules every message not yet at the new time, counts those
        # another edit put there (two editors, one time: one answered 0), but no more than were
        # missed, and is made once more after it moved one (two editors, two messages: each moved
        # the other's, and both answered 2, the times swapped).
        done = self._reschedule_each(task_id, found, due_ms, 0)
        missed = contended = len(found) - done
        for _ in range(EDIT_LOOKS - 1):
            if not contended:
                return done
            now_found = store.find(task_id)
            again = [stored for stored in now_found if stored.due_ms != due_ms]
            there = max(0, len(now_found) - len(again) - done)  # (at the new time: not all this one's)
            counted = min(missed, self._reschedule_each(task_id, again, due_ms, done) + there)
            done, missed, contended = done + counted, missed - counted, len(again)
        left = [stored for stored in store.find(task_id) if stored.due_ms != due_ms] if contended else []
        if left:
            raise EditConflict(
                f"cannot reschedule {task_id!r}: other edits moved its messages each of {EDIT_LOOKS} "
                f"times it looked; {done} rescheduled, {len(left)} still at another time (try again)"
            )
        return done

    def _reschedule_each(self, task_id: str, found: list[Stored], due_ms: int, done: int) -> int:
        """Reschedule each of ``found`` (``done`` of the id's rescheduled before); return how
        many were. A message refused (its queue being purged, a key that is not a list, a
        limit) raises saying how many of the id's others were rescheduled before it."""
        count = 0
        for stored in found:
            try:
                count += self._reschedule_one(task_id, stored, due_ms)
            except (EditConflict, RedisRefused, DelayTooLong) as exc:
                if done + count:
                    raise type(exc)(f"{exc}; {done + count} of its messages rescheduled before") from None
                raise
        return count

    def _reschedule_one(self, task_id: str, stored: Stored, due_ms: int) -> bool:
        """Reschedule one found message; False when it left its place meanwhile."""
        store = self.store
        payload = with_eta(stored.message, due_ms)
        own_eta = carries_eta(payload)
        outcome = store.reschedule(stored, task_id, payload, due_ms, self._settings, own_eta=own_eta)
        if outcome is Rescheduled.GONE and (copy := store.thawed_copy(task_id, stored)) is not None:
            # A mover thawed it between the find and now: the same message, uncompressed.
            outcome = store.reschedule(copy, task_id, payload, due_ms, self._settings, own_eta=own_eta)
        if outcome is Rescheduled.PURGING:  # it would outlive the purge (purging.lua)
            why = "is being purged, or a purge of it stopped less than a minute ago (try again)"
            raise EditConflict(f"cannot reschedule {task_id!r}: {stored.dest!r} {why}")
        if outcome is Rescheduled.TOO_FAR:
            raise self._too_far(task_id, due_ms)
        if outcome is Rescheduled.NOT_A_LIST:
            raise RedisRefused(
                f"cannot send {task_id!r} to {stored.dest!r} now: that key holds something other "
                "than a list (WRONGTYPE); the message stays scheduled at its old time"
            )
        return outcome is not Rescheduled.GONE

    @gated
    def purge(self, queue: str) -> int:
        """Remove every scheduled message bound for ``queue`` (all its priority lists).

        Returns how many were removed. Messages already moved onto the queue's lists
        are not touched; ``celery purge`` removes those (and, with kombu-delay, these too).
        """
        return self.store.purge(self._dests_of(args.queue_name(queue)))

    def _dests_of(self, queue: str) -> set[str]:
        """``queue``'s lists: those ``<ns>counts`` names, and one per priority step (evicted from it too)."""
        store = self.store
        dests = {d for d in store.counts() if self.queue_of(d) == queue}
        return dests | {keys.destination(store.prefix, queue, p, store.sep) for p in store.steps}

    @gated
    def look_alikes(self, queue: str) -> dict[str, int]:
        """Return the destinations, with their scheduled counts, that look like priority lists
        of ``queue`` under a separator or priority steps other than this control's
        (``celery:9`` for ``celery`` where the separator is kombu's default): an app that sets
        ``sep`` or ``priority_steps`` in its transport options, read by a control that was not
        given them; or a queue of its own that only looks so (``tenant:7``). :meth:`purge` and
        :meth:`scheduled` do not take them as ``queue``'s; the CLI names them, so that no
        message is left behind unseen."""
        shape = re.compile(re.escape(queue) + r"[^0-9A-Za-z]{1,4}[0-9]{1,3}")
        prefix = self.store.prefix
        return {
            dest: n
            for dest, n in self.store.counts().items()
            if dest.startswith(prefix)
            and shape.fullmatch(dest[len(prefix) :])
            and self.queue_of(dest) != queue
        }

    @gated
    def scheduled(self, queue: str | None = None, limit: int = 100, cursor: str | None = None) -> Page:
        """Return one page of scheduled messages, earliest bucket first.

        Pass the returned ``cursor`` back for the next page. The cursor is a position by
        due time, not by rank, so pages neither repeat nor skip messages while a mover
        moves due ones away. With ``queue``, a page may come back short (the read per
        call is bounded); keep paging until ``cursor`` is ``None``.
        """
        limit, after = args.whole("limit", limit), args.cursor(cursor)
        dests = None if queue is None else self._dests_of(args.queue_name(queue))
        found, nxt = self.store.page(after, limit, dests)
        items = [self._message(s) for s in found]
        return Page(items, str(nxt) if nxt is not None else None)

    @gated
    def stats(self, hours: float = 12, slot_minutes: float = 60, max_buckets: int = 10_000) -> Stats:
        """Return counts per queue, the earliest due time, overdue messages (mover lag),
        a due-time histogram for the next ``hours`` and the movers' last heartbeats.

        Cost is per bucket of the histogram's window (its counts, see
        :meth:`~kombu_delay.store.Store.census`), never per message; the histogram's
        resolution is one bucket width.
        """
        slot_ms, slots = histogram_slots(hours, slot_minutes)
        max_buckets = args.whole("max_buckets", max_buckets)
        store = self.store
        now, movers = store.time_ms(), store.heartbeats()  # (after the census, "-1.8 s ago")
        by_dest = store.counts()
        by_queue: dict[str, int] = {}
        for dest, n in by_dest.items():
            name = self.queue_of(dest)
            by_queue[name] = by_queue.get(name, 0) + n
        census = store.census(now, slot_ms, slots, max_buckets, dests=by_dest)
        overdue, counts = census.overdue, census.slots
        total = sum(by_dest.values()) - census.vanished
        earliest = store.earliest_due_ms()
        oldest = now - earliest if earliest is not None and earliest <= now and overdue else 0
        return Stats(
            now_ms=now,
            scheduled=total,
            by_destination=by_dest,
            by_queue=by_queue,
            earliest_due_ms=earliest,
            overdue=overdue,
            oldest_overdue_ms=oldest,
            histogram=[Slot(now + i * slot_ms, now + (i + 1) * slot_ms, c) for i, c in enumerate(counts)],
            later=max(0, total - overdue - sum(counts)),
            truncated=census.truncated,
            movers=movers,
            totals=store.totals(),
            dead_letters=store.dead_count(or_none=True),
            vanished=census.vanished,
            warnings=list(dangers(store)),
        )

    def _new_due_ms(self, eta: datetime | None, countdown: float | None) -> int:
        """The epoch ms of a reschedule's ``eta``, or of ``countdown`` seconds from the Redis
        clock's now; never before the epoch."""
        if eta is not None:
            due_ms = to_ms(eta)
        else:  # the countdown checked before anything reaches Redis
            due_ms = round(args.countdown_seconds(countdown) * 1000) + self.store.time_ms()
        # Any time before the epoch is as past as the epoch: the message goes to its queue now
        # either way. Clamped, so the ETA written into it can be formatted (fromtimestamp
        # fails before the year 1, and on some platforms before 1970) and read by any worker.
        return max(due_ms, 0)

    @gated
    def overdue(self, max_buckets: int = 1000) -> tuple[dict[str, tuple[int, int]], bool]:
        """Return, per queue, (messages due but not moved yet, due time of the oldest in epoch
        ms), and whether ``max_buckets`` cut the count short. Reads only buckets already
        started, never a message."""
        store = self.store
        by_dest, truncated = store.overdue(store.time_ms(), max_buckets)
        by_queue: dict[str, tuple[int, int]] = {}
        for dest, (n, oldest) in by_dest.items():
            name = self.queue_of(dest)
            had, first = by_queue.get(name, (0, oldest))
            by_queue[name] = (had + n, min(first, oldest))
        return by_queue, truncated

    @gated
    def dead_letters(self, offset: int = 0, limit: int = 50) -> tuple[int, list[DeadLetter]]:
        """Return how many dead letters there are, and up to ``limit`` from ``offset`` (newest
        first): members a mover could not restore, kept as stored, never delivered. Raises
        ``ValueError`` for a page Redis cannot address (past a 64-bit list position)."""
        offset, limit = args.whole("offset", offset, 0), args.whole("limit", limit)
        if offset + limit > _MAX_POSITION:
            raise ValueError(f"offset {offset} and limit {limit} reach past any list position")
        total, members = self.store.dead_letters(offset, limit)
        return total, [DeadLetter(m, offset + i) for i, m in enumerate(members)]

    @gated
    def dead_letter(
        self, digest: str, near: int = 0, window: int = 100, reach: int | None = None
    ) -> DeadLetter | None:
        """The dead letter whose :attr:`DeadLetter.digest` is ``digest``, looked for first in
        ``window`` entries around position ``near`` (where a page showed it), then in the whole
        list (or ``reach`` entries either side of ``near``), ``window`` at a time (dead letters
        added since push it further on, removed ones bring it nearer); ``None`` if not there."""

        def look(offset: int) -> tuple[int, DeadLetter | None]:
            total, found = self.dead_letters(offset, window)
            return total, next((letter for letter in found if letter.digest == digest), None)

        first = max(0, near - window // 2)
        total, letter = look(first)
        offset, end = (0, total) if reach is None else (max(0, near - reach), near + reach)
        while letter is None and offset < min(total, end):
            if offset != first:
                total, letter = look(offset)
            offset += window
        return letter

    @gated
    def remove_dead_letter(self, digest: str, near: int = 0, window: int = 100) -> int:
        """Remove the dead letter :meth:`dead_letter` finds; return 1, or 0 when it is not there."""
        letter = self.dead_letter(digest, near, window)
        return 0 if letter is None else self.store.remove_dead_letter(letter.member)

    def _too_far(self, task_id: str, due_ms: int) -> DelayTooLong:
        """The refusal of a reschedule to ``due_ms``, naming the limit it passes."""
        if due_ms > keys.MAX_DUE_MS:  # also a countdown clamped on its way (_new_due_ms)
            where, limit = f"after {keys.MAX_DUE_TEXT}", "the latest supported ETA"
        else:
            where = datetime.fromtimestamp(due_ms / 1000, UTC).isoformat(timespec="milliseconds")
            limit = f"delay_max_delay ({seconds_shown(self._settings.max_delay_ms)} from now)"
        return DelayTooLong(f"cannot reschedule {task_id!r} to {where}: past {limit}; it stays as it was")

    def _message(self, stored: Stored) -> ScheduledMessage:
        try:
            message = stored.message
        except CorruptMember:  # listed as it is; a mover's thaw moves it to the dead letters
            return ScheduledMessage(
                task_id="",
                task=None,
                queue=self.queue_of(stored.dest),
                dest=stored.dest,
                due_ms=stored.due_ms,
                size=len(stored.payload),
            )
        return ScheduledMessage(
            task_id=index_id(message),
            task=task_name(message),
            queue=self.queue_of(stored.dest),
            dest=stored.dest,
            due_ms=stored.due_ms,
            size=len(message),
            message=message,
        )
