"""Editing: cancel, reschedule and purge stored messages, each claimed atomically so that a
message is never both delivered and cancelled (or rescheduled)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from itertools import islice
from typing import Any

import redis

from kombu_delay.config import Settings
from kombu_delay.errors import (
    CorruptMember,
    EditConflict,
    KombuDelayError,
    RedisUnavailable,
    translated_errors,
)
from kombu_delay.message import Due, id_arg
from kombu_delay.store import keys, spaces
from kombu_delay.store.base import as_text
from kombu_delay.store.inspection import Inspecting
from kombu_delay.store.publish import Publishing
from kombu_delay.store.replies import Rescheduled, Stored

#: How many times a cancel or a reschedule looks for a task's messages, at most, while each
#: look finds one that left its place before it could be changed. Past that, while some are
#: still there, it raises :class:`EditConflict`: "none scheduled" would not be true.
EDIT_LOOKS = 10
#: How long a purge's mark (``purging.lua``) outlives the last purge call that renewed it, ms:
#: one left by a purger that died refuses reschedules of its queue for this long.
PURGE_MARK_MS = 60_000

logger = logging.getLogger(__name__)


class Editing(Inspecting, Publishing):
    """What DelayControl calls to change what is stored."""

    def cancel(self, task_id: str, now_ms: int | None = None) -> int:
        """Remove every message of ``task_id``; return how many were removed.

        A message that left its place between the find and its removal is looked for again,
        at most :data:`EDIT_LOOKS` times in all: one a mover thawed meanwhile is in the
        ordinary space now, one another edit rescheduled is in its new bucket. (One a mover
        moved is on its list, and found no more.) Raises :class:`EditConflict` when other
        edits moved one each time and it is still scheduled.
        """
        done, cancelling = 0, False
        try:
            with translated_errors():
                for _ in range(EDIT_LOOKS):
                    missed = False
                    for stored in self.find(task_id, unreadable=True):
                        cancelling = True
                        removed = self._cancel_one(task_id, stored, now_ms)
                        cancelling = False
                        done += removed
                        missed = missed or not removed
                    if not missed:
                        return done
                left = len(self.find(task_id, unreadable=True))
        except KombuDelayError as exc:
            # The failed call speaks for itself only: the messages of the id cancelled before it
            # are told too, and that a cancel whose reply was lost may have been made (a retry
            # then finds nothing, and says 0).
            lost = cancelling and isinstance(exc, RedisUnavailable)
            if not (done or lost):
                raise
            told = [f"{done} of its messages were cancelled before it"] if done else []
            if lost:
                told.append("its last cancel may have been made before Redis went away (find tells)")
            raise type(exc)(f"{str(exc).rstrip('.')}; {', and '.join(told)}") from exc
        if left:
            raise EditConflict(
                f"cannot cancel {task_id!r}: other edits moved its messages each of {EDIT_LOOKS} times "
                f"it looked; {done} cancelled, {left} still scheduled (try again)"
            )
        return done

    def _cancel_one(self, task_id: str, stored: Stored, now_ms: int | None) -> int:
        args: list[Any] = [
            self.ns,
            id_arg(task_id),
            stored.bucket,
            stored.dest,
            stored.ref,
            stored.payload,
            self._now(now_ms),
            _taken_mark(stored),
        ]
        call_keys = [self._index, self._ids, self._counts, self._totals, self._gc]
        return int(self._scripts["cancel"](keys=call_keys, args=args))

    def thawed_copy(self, task_id: str, stored: Stored) -> Stored | None:
        """Return the ordinary copy of the compressed message ``stored`` when a mover thawed
        it meanwhile (same destination, due time and message), else ``None``."""
        if not stored.space.compressed:
            return None
        return spaces.thawed_copy(stored, self.find(task_id))

    def reschedule(
        self,
        old: Stored,
        task_id: str,
        payload: str,
        due_ms: int,
        settings: Settings,
        now_ms: int | None = None,
        own_eta: bool = True,
    ) -> Rescheduled:
        """Replace ``old`` by ``payload`` due at ``due_ms``, atomically (see ``reschedule.lua``).

        ``payload`` is the message itself; it is stored compressed when due far enough ahead,
        as :meth:`schedule` does. ``own_eta``: false for a message that carries no ETA of its
        own (an ``x-delay``), which movers then never move ahead of its due time.
        """
        due = Due(due_ms, task_id=task_id)

        def send(to: spaces.Space) -> Any:
            args: list[Any] = [
                self.ns,
                settings.bucket_width_ms,
                settings.grace_ms,
                old.ref,
                old.bucket,
                old.payload,
                id_arg(task_id),
                old.dest,
                to.member(payload, task_id),
                due_ms,
                self.db,
                settings.max_delay_ms,
                keys.MAX_DUE_MS,
                1 if to.compressed else 0,
                settings.thaw_ahead_ms,
                self._now(now_ms),
            ]
            args += [0 if own_eta else 1, _taken_mark(old)]
            call_keys = [
                self._index,
                self._ids,
                self._counts,
                self._totals,
                old.dest,
                self._gc,
                self._purging_key,
            ]
            return self._scripts["reschedule"](keys=call_keys, args=args)

        with self._asked_again_if_refused(), translated_errors():
            self._must_fit(payload, f"{task_id!r} stays as it was")
            # The new message is stored as a publish stores it, once the old one is taken: a
            # command refused after the take would leave the new one unindexed, or the old one
            # taken with nothing stored. So the ACL is asked first (Redis 7; 6 cannot be asked).
            self._may_publish([old.dest], edit=True)
            space = self._space_for(due, settings, now_ms, payload)
            unchanged = f"{task_id!r} stays as it was"
            reply = self._sent(
                payload,
                unchanged,
                lambda: spaces.placed(space, send(space), send, _too_soon),
                lambda: self._bucket_keys(due, old.dest, settings),
            )
        return Rescheduled(int(reply[0]))

    def purge(self, dests: Iterable[str], limit: int = 1000, now_ms: int | None = None) -> int:
        """Remove every message bound for one of ``dests``; return how many (loops ``purge.lua``).
        Raises :class:`StorageFormatError` for data in another storage format, removing none."""
        wanted = sorted(set(dests))
        if not wanted:
            return 0
        self._check_format_once()
        limit = max(2, limit)  # a call's first bucket costs one: with 1 it would remove none, ever
        total = 0
        try:
            with translated_errors(), self._purging(wanted) as renew:
                for space in spaces.ALL:
                    cursor: Any = 0
                    while True:
                        reply = self._scripts["purge"](
                            keys=[space.index(self.prefix), self._counts, self._totals, self._gc, self._ids],
                            args=[self.ns, limit, cursor, space.tag, self._now(now_ms), *wanted],
                        )
                        total += int(reply[0])
                        if int(reply[1]):
                            break
                        cursor = as_text(reply[2])
                        renew()
        except KombuDelayError as exc:
            # The failed call speaks for itself only ("nothing was changed"): the calls before it
            # (the compressed space's first) are told too, and that one whose reply was lost may
            # have removed some.
            lost = isinstance(exc, RedisUnavailable)
            if not (total or lost):
                raise
            told = [f"{total:,} were purged before it"] if total else []
            if lost:
                told.append(
                    f"its last step may have removed {'more' if total else 'some'} before Redis went away"
                )
            raise type(exc)(f"{str(exc).rstrip('.')}; {', and '.join(told)}") from exc
        return total

    @contextmanager
    def _purging(self, dests: list[str]) -> Iterator[Callable[[], None]]:
        """Mark ``dests`` as being purged while the block runs (``purging.lua``: a reschedule
        of their messages is refused meanwhile); yields what renews the mark."""

        def step(n: int) -> None:
            self._scripts["purging"](keys=[self._purging_key], args=[n, PURGE_MARK_MS, *dests])

        step(1)
        try:
            yield lambda: step(0)
        finally:
            try:
                step(-1)
            except redis.RedisError as exc:  # the purge's work stands; the mark expires
                logger.warning("kombu-delay: could not unmark a purge of %s: %s", ", ".join(dests), exc)

    def reindex(
        self, page: int = 10_000, now_ms: int | None = None, stopping: Callable[[], bool] | None = None
    ) -> tuple[int, int]:
        """Put back into their space's index every bucket whose meta hash counts messages but
        that is in no index (the index evicted, or deleted by hand), so movers reach it again;
        return (buckets, messages) put back (``reindex.lua``). One full ``SCAN`` of the meta
        hashes of both spaces, ``page`` keys per call: a background check's work (see
        :meth:`stranded`), never a probe's; it ends early once ``stopping()`` is true."""
        buckets = messages = 0
        with translated_errors():
            for batch in _batched(self._meta_buckets(page, stopping), 1000):
                reply = self._scripts["reindex"](keys=[], args=[self.ns, self._now(now_ms), *batch])
                buckets, messages = buckets + int(reply[0]), messages + int(reply[1])
        return buckets, messages

    def _meta_buckets(self, page: int, stopping: Callable[[], bool] | None) -> Iterator[str]:
        """The buckets of either space that have a meta hash, as reindex.lua names them
        (``"<start>"``, ``"c<start>"``)."""
        tags = "|".join(re.escape(space.tag) for space in spaces.ALL)
        name = re.compile(rf"({tags})m:([0-9]+)")
        # (Of hashes only: a key of another type, written by hand, is nobody's meta hash.)
        for key in self.scan_keys(f"{_glob_escaped(self.ns)}*m:*", page, stopping, type_="hash"):
            text = as_text(key)
            found = name.fullmatch(text[len(self.ns) :]) if text.startswith(self.ns) else None
            if found:
                yield found[1] + found[2]

    def taken_lately(self, mark: bytes, within_s: float) -> bool:
        """Whether an edit took the message ``mark`` names (:func:`keys.taken_mark`) in the
        last ``within_s`` seconds, by Redis's clock (``cancel.lua``, ``reschedule.lua``)."""
        with translated_errors():
            pipe = self.client.pipeline(transaction=False)
            pipe.time()
            pipe.zscore(keys.taken(self.prefix), mark)
            (sec, usec), at = pipe.execute(raise_on_error=False)
        if isinstance(at, redis.ResponseError):  # a key of another type (by hand): no notes
            return False
        return at is not None and at >= int(sec) * 1000 + int(usec) // 1000 - within_s * 1000

    def remove_dead_letter(self, member: bytes) -> int:
        """Remove one dead letter equal to ``member``; return 1, or 0 when it is gone."""
        with translated_errors():
            return int(self.client.lrem(keys.dead(self.prefix), 1, member))  # type: ignore[arg-type]


def _taken_mark(stored: Stored) -> bytes:
    """What an edit notes ``stored`` by once it took it; none for a compressed message that
    cannot be restored (no publish's retry sent what it holds)."""
    try:
        return keys.taken_mark(stored.dest, keys.digest(stored.message))
    except CorruptMember:
        return b""


def _too_soon(reply: list[Any]) -> bool:
    return int(reply[0]) == Rescheduled.TOO_SOON_FOR_COLD


def _glob_escaped(text: str) -> str:
    """``text`` as a SCAN pattern that matches only itself."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    """``items`` in lists of at most ``size``."""
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch
