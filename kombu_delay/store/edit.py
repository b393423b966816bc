"""Editing: cancel, reschedule and purge stored messages, each claimed atomically so that a
message is never both delivered and cancelled (or rescheduled)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kombu_delay.config import Settings
from kombu_delay.errors import translated_errors
from kombu_delay.eta import Due
from kombu_delay.store import keys
from kombu_delay.store.base import as_text
from kombu_delay.store.inspection import Inspecting
from kombu_delay.store.publish import Publishing
from kombu_delay.store.replies import Rescheduled, Stored


class Editing(Inspecting, Publishing):
    """What DelayControl calls to change what is stored."""

    def cancel(self, task_id: str, now_ms: int | None = None) -> int:
        """Remove every message of ``task_id``; return how many were removed.

        A compressed message a mover thawed between the find and its removal is looked for
        again, in the ordinary buckets (a thaw only ever moves a message there).
        """
        done = 0
        with translated_errors():
            missed = False
            for stored in self.find(task_id):
                removed = self._cancel_one(task_id, stored, now_ms)
                done += removed
                missed = missed or (stored.cold and not removed)
            if missed:
                done += sum(self._cancel_one(task_id, again, now_ms) for again in self.find(task_id))
        return done

    def _cancel_one(self, task_id: str, stored: Stored, now_ms: int | None) -> int:
        return int(
            self._scripts["cancel"](
                keys=[self._index, self._ids, self._counts, self._totals, self._gc],
                args=[
                    self.ns,
                    task_id,
                    stored.bucket,
                    stored.dest,
                    stored.ref,
                    stored.payload,
                    self._now(now_ms),
                ],
            )
        )

    def thawed_copy(self, task_id: str, stored: Stored) -> Stored | None:
        """Return the ordinary copy of the compressed message ``stored`` when a mover thawed
        it meanwhile (same destination, due time and message), else ``None``."""
        if not stored.cold:
            return None
        wanted = (stored.dest, stored.due_ms, stored.message)
        found = (s for s in self.find(task_id) if not s.cold and (s.dest, s.due_ms, s.payload) == wanted)
        return next(found, None)

    def reschedule(
        self,
        old: Stored,
        task_id: str,
        payload: str,
        due_ms: int,
        settings: Settings,
        now_ms: int | None = None,
    ) -> Rescheduled:
        """Replace ``old`` by ``payload`` due at ``due_ms``, atomically (see ``reschedule.lua``).

        ``payload`` is the message itself; it is stored compressed when due far enough ahead,
        as :meth:`schedule` does.
        """
        member = self._cold_member(Due(due_ms, task_id=task_id), payload, settings, now_ms)
        with translated_errors():
            while True:
                reply = self._scripts["reschedule"](
                    keys=[self._index, self._ids, self._counts, self._totals, old.dest, self._gc],
                    args=[
                        self.ns,
                        settings.bucket_width_ms,
                        settings.grace_ms,
                        old.ref,
                        old.bucket,
                        old.payload,
                        task_id,
                        old.dest,
                        payload if member is None else member,
                        due_ms,
                        keys.wake_channel(self.prefix),
                        settings.max_delay_ms,
                        keys.MAX_DUE_MS,
                        0 if member is None else 1,
                        settings.thaw_ahead_ms,
                        self._now(now_ms),
                    ],
                )
                if int(reply[0]) != Rescheduled.TOO_SOON_FOR_COLD:
                    return Rescheduled(int(reply[0]))
                member = None  # this clock runs behind Redis's: send the message as it is

    def purge(self, dests: Iterable[str], limit: int = 1000, now_ms: int | None = None) -> int:
        """Remove every message bound for one of ``dests``; return how many (loops ``purge.lua``)."""
        wanted = sorted(set(dests))
        if not wanted:
            return 0
        total = 0
        with translated_errors():
            for space, index in self.spaces:  # the cold space first: see _spaces
                cursor: Any = 0
                while True:
                    reply = self._scripts["purge"](
                        keys=[index, self._counts, self._totals, self._gc, self._ids],
                        args=[self.ns, limit, cursor, space, self._now(now_ms), *wanted],
                    )
                    total += int(reply[0])
                    if int(reply[1]):
                        break
                    cursor = as_text(reply[2])
        return total
