"""The one layer that talks to Redis: kombu-delay's keys, scripts and replies.

Everything above it (transport, mover, inspection, CLI) calls these methods
and never builds a Redis command. Script replies become the Python values of
:mod:`kombu_delay.store.replies` here, and ``redis.ConnectionError`` becomes
:class:`~kombu_delay.errors.RedisUnavailable`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis

from kombu_delay.config import Settings
from kombu_delay.errors import CorruptMember, DelayTooLong, PayloadTooLarge
from kombu_delay.eta import Due
from kombu_delay.payload import index_id
from kombu_delay.store import cold, keys, listing
from kombu_delay.store.listing import Cursor
from kombu_delay.store.replies import (
    Census,
    MoveResult,
    Rescheduled,
    Scheduled,
    ScheduleResult,
    Stored,
    SweepResult,
    ThawResult,
    translated_errors,
)
from kombu_delay.store.scripts import Scripts

logger = logging.getLogger(__name__)

#: Redis's default limit for one string argument (``proto-max-bulk-len``), bytes.
MAX_PAYLOAD_BYTES = 512 * 2**20


class Store:
    """kombu-delay's data in one Redis database, under one ``global_keyprefix``."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str = "",
        sep: str = keys.KOMBU_PRIORITY_SEP,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self.client = client
        #: Where "now" comes from, epoch ms: ``None`` (production) means the Redis clock, read
        #: inside each script. Tests pass a clock of their own to drive time instead of
        #: waiting for it; it must never run behind Redis's clock by more than ``delay_grace``,
        #: or the expiries it sets delete what they should keep.
        self.clock = clock
        self.prefix = prefix
        #: kombu's ``sep`` transport option, between a queue name and its priority step.
        self.sep = sep
        self.ns = keys.ns(prefix)
        self._scripts = Scripts(client)
        self._index = keys.index(prefix)
        self._cold_index = keys.cold_index(prefix)
        #: Each space and its index, the cold one first: a message a mover thaws during a walk
        #: over both (purge, census) moves into the part still to come.
        self.spaces = ((keys.COLD, self._cold_index), ("", self._index))
        self._gc = keys.drained(prefix)
        self._ids = keys.ids(prefix)
        self._counts = keys.counts(prefix)
        self._totals = keys.totals(prefix)
        #: Where the last move call's scan of started buckets stopped short (see move.lua).
        self._scan_after: int | None = None

    def _now(self) -> str:
        """The ``now_ms`` argument of every script: '' for the Redis clock."""
        return "" if self.clock is None else str(int(self.clock()))

    def queue_of(self, dest: str) -> str:
        """Return the queue name of a destination list key."""
        return keys.queue_of(dest, self.prefix, self.sep)

    # -- publishing ---------------------------------------------------------------

    def schedule(
        self,
        due: Due,
        dest: str,
        payload: str,
        settings: Settings,
        expires_ms: int = 0,
        movers_fresh_ms: int = 0,
    ) -> ScheduleResult:
        """Store ``payload`` for ``dest`` until ``due``, or push it now if already due.

        ``expires_ms``: the queue's ``x-expires``. The mover then renews the expiry of
        ``dest`` when it pushes the message, as kombu's own publish would.

        A message due further ahead than ``settings.compress_after_ms`` is stored
        compressed, in the cold space (see :mod:`kombu_delay.store.cold`).

        Raises :class:`DelayTooLong` when the due time is past ``max_delay`` or the
        year-2109 ceiling; nothing is written then.

        ``movers_fresh_ms``: when positive, the same call counts the movers whose heartbeat is
        that fresh (``ScheduleResult.movers``), at no extra round trip.
        """
        member = self._cold_member(due, payload, settings)
        with translated_errors():
            reply = self._scripts["schedule"](
                *self._schedule_call(due, dest, payload, settings, expires_ms, member, movers_fresh_ms)
            )
            if int(reply[0]) == Scheduled.TOO_SOON_FOR_COLD:  # this clock runs behind Redis's
                plain = self._schedule_call(due, dest, payload, settings, expires_ms, None, movers_fresh_ms)
                reply = self._scripts["schedule"](*plain)
        result = ScheduleResult.from_reply(reply)
        if result.outcome is Scheduled.TOO_FAR:
            limit = (
                f"delay_max_delay is {settings.max_delay_ms / 1000:g} s"
                if settings.max_delay_ms
                else "the latest supported ETA is in the year 2109"
            )
            raise DelayTooLong(
                f"message {due.task_id!r} is due in {(result.due_ms - result.now_ms) / 1000:.0f} s; {limit}"
            )
        return result

    def schedule_many(
        self, items: Iterable[tuple[Due, str, str]], settings: Settings, chunk: int = 1000
    ) -> list[ScheduleResult]:
        """Run :meth:`schedule` for many ``(due, dest, payload)`` items, pipelined.

        For bulk loads (tests, benchmarks). Each item is still one atomic script
        call; a ``TOO_FAR`` outcome is returned, not raised, and writes nothing.
        """
        script = self._scripts["schedule"]
        results: list[ScheduleResult] = []
        batch = list(items)
        with translated_errors():
            for begin in range(0, len(batch), chunk):
                pipe = self.client.pipeline(transaction=False)
                part = batch[begin : begin + chunk]
                for due, dest, payload in part:
                    member = self._cold_member(due, payload, settings)
                    call_keys, call_args = self._schedule_call(due, dest, payload, settings, 0, member)
                    script(keys=call_keys, args=call_args, client=pipe)
                for (due, dest, payload), reply in zip(part, pipe.execute(), strict=True):
                    if int(reply[0]) == Scheduled.TOO_SOON_FOR_COLD:
                        call_keys, call_args = self._schedule_call(due, dest, payload, settings)
                        reply = script(keys=call_keys, args=call_args)
                    results.append(ScheduleResult.from_reply(reply))
        return results

    def _cold_member(self, due: Due, payload: str, settings: Settings) -> bytes | None:
        """The compressed member of ``payload`` when it is due far enough ahead, else ``None``.

        The local clock is good enough here: the script checks against Redis's clock, and
        a message refused there (``TOO_SOON_FOR_COLD``) is sent again uncompressed.
        """
        if not settings.compress_after_ms:
            return None
        now = time.time() * 1000 if self.clock is None else self.clock()
        ahead = due.ms if due.relative else due.ms - now
        # Never within the thaw horizon: the script would refuse it (see schedule.lua).
        if ahead <= max(settings.compress_after_ms, settings.thaw_ahead_ms):
            return None
        return cold.pack(payload, due.task_id)

    def _schedule_call(
        self,
        due: Due,
        dest: str,
        payload: str,
        settings: Settings,
        expires_ms: int = 0,
        member: bytes | None = None,
        movers_fresh_ms: int = 0,
    ) -> tuple[list[str], list[Any]]:
        """The keys and arguments of ``schedule.lua``; ``member``: the cold member to store
        instead of ``payload``."""
        # Redis drops the connection on a longer argument; kombu would take that for an
        # outage and send the same message again and again.
        if len(payload) > MAX_PAYLOAD_BYTES // 4 and len(payload.encode()) > MAX_PAYLOAD_BYTES:
            raise PayloadTooLarge(
                f"a {len(payload.encode()):,}-byte message is over Redis's limit for one string "
                f"({MAX_PAYLOAD_BYTES:,} bytes, proto-max-bulk-len); nothing was stored"
            )
        call_keys = [self._index, self._ids, self._counts, self._totals, dest, keys.movers(self.prefix)]
        call_args: list[Any] = [
            self.ns,
            settings.bucket_width_ms,
            settings.grace_ms,
            due.ms,
            1 if due.relative else 0,
            due.task_id,
            dest,
            payload if member is None else member,
            keys.wake_channel(self.prefix),
            settings.max_delay_ms,
            keys.MAX_DUE_MS,
            expires_ms,
            0 if member is None else 1,
            settings.thaw_ahead_ms,
            self._now(),
            movers_fresh_ms,
        ]
        return call_keys, call_args

    def renew_expiry(self, lists: Iterable[str], expires_ms: int) -> None:
        """Set the expiry of the existing ``lists`` to ``expires_ms`` (a queue's x-expires),
        in one pipelined round trip, as kombu's own publish does."""
        with translated_errors():
            pipe = self.client.pipeline(transaction=False)
            for key in lists:
                pipe.pexpire(key, expires_ms)
            pipe.execute()

    def count(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to a lifetime counter (for example a fallback taken at publish)."""
        with translated_errors():
            self.client.hincrby(self._totals, counter, n)

    # -- moving ---------------------------------------------------------------

    def move_due(self, limit: int, max_queue_length: int = 0, look_ahead_ms: int = 0) -> MoveResult:
        """Move up to ``limit`` due messages onto their lists (one atomic script call);
        with ``look_ahead_ms``, also those due within that many ms from now.

        When held buckets ahead use up a call's bucket visits, the next call on this store
        goes on after them (``MoveResult.scan_after``), so the buckets behind them get their
        turn.
        """
        with translated_errors():
            reply = self._scripts["move"](
                keys=[self._index, self._ids, self._counts, self._totals, self._gc],
                args=[
                    self.ns,
                    limit,
                    max_queue_length,
                    "" if self._scan_after is None else self._scan_after,
                    self._now(),
                    look_ahead_ms,
                ],
            )
        result = MoveResult.from_reply(reply)
        self._scan_after = result.scan_after
        return result

    def thaw(self, ahead_ms: int, limit: int) -> ThawResult:
        """Restore up to ``limit`` cold messages due within ``ahead_ms`` into the ordinary
        buckets (``thaw_scan.lua``, :func:`cold.unpack` here, then ``thaw.lua``).

        A member that cannot be restored goes to the dead-letter list, counted as dead,
        and is logged; each message is taken from the cold space and stored in the
        ordinary one in one atomic call, so a crash in between loses nothing.
        """
        with translated_errors():
            reply = self._scripts["thaw_scan"](
                keys=[self._cold_index, self._counts, self._totals],
                args=[self.ns, ahead_ms, limit, self._now()],
            )
            now_ms, next_ms, more, expired = (int(x) for x in reply[:4])
            items: list[Any] = []
            for i in range(4, len(reply), 4):
                start, score, dest, member = reply[i : i + 4]
                try:
                    message: bytes = cold.unpack(bytes(member))[1]
                except CorruptMember as exc:
                    logger.error(
                        "cold message in bucket %s for %s cannot be restored (%s); it goes to the "
                        "dead-letter list %s",
                        _text(start),
                        _text(dest),
                        exc,
                        keys.dead(self.prefix),
                    )
                    message = b""
                items += [start, score, dest, member, message]
            thawed = dead = gone = 0
            if items:
                done = self._scripts["thaw"](
                    keys=[
                        self._index,
                        self._ids,
                        self._counts,
                        self._totals,
                        self._cold_index,
                        keys.dead(self.prefix),
                    ],
                    args=[self.ns, keys.wake_channel(self.prefix), self._now(), *items],
                )
                thawed, dead, gone = (int(x) for x in done)
        return ThawResult(
            thawed=thawed,
            dead=dead,
            gone=gone,
            expired=expired,
            now_ms=now_ms,
            next_ms=None if next_ms < 0 else next_ms,
            more=bool(more),
        )

    def sweep(self, after: str, limit: int) -> SweepResult:
        """Visit up to ``limit`` buckets of both spaces after ``after`` (``""``: from the first):
        give each its grace again from now, so nothing a running mover holds expires, and
        settle the counts of those whose messages are gone (``sweep.lua``). Pass the reply's
        cursor back until it is ``""``."""
        with translated_errors():
            reply = self._scripts["sweep"](
                keys=[self._index, self._cold_index, self._ids, self._counts, self._totals, self._gc],
                args=[self.ns, after, limit, self._now()],
            )
        return SweepResult.from_reply(reply)

    def eviction_policy(self) -> str | None:
        """Return the server's ``maxmemory-policy``, or ``None`` when it cannot be read.

        ``INFO memory`` carries it and is allowed where ``CONFIG`` is not (managed Redis, ACL
        users): a policy other than ``noeviction`` lets Redis delete scheduled messages.
        """
        with translated_errors():
            try:
                info: dict[str, Any] = self.client.info("memory")
            except redis.ResponseError:  # INFO refused by an ACL: nothing to judge by
                return None
        policy = info.get("maxmemory_policy")
        return None if policy is None else _text(policy)

    def heartbeat(self, mover_id: str, forget_after_ms: int = 86_400_000) -> int:
        """Record a mover heartbeat; return the Redis clock in epoch ms."""
        with translated_errors():
            return int(
                self._scripts["heartbeat"](
                    keys=[keys.movers(self.prefix)], args=[mover_id, forget_after_ms, self._now()]
                )
            )

    def forget_mover(self, mover_id: str) -> None:
        """Remove a mover's heartbeat (on a clean shutdown)."""
        with translated_errors():
            self.client.zrem(keys.movers(self.prefix), mover_id)

    def wake_subscription(self) -> redis.client.PubSub:
        """Return a pub/sub connection subscribed to the wake channel."""
        with translated_errors():
            pubsub: redis.client.PubSub = self.client.pubsub(  # type: ignore[no-untyped-call]
                ignore_subscribe_messages=True
            )
            pubsub.subscribe(keys.wake_channel(self.prefix))
        return pubsub

    def stranded(self, fresh_ms: int, page: int = 10_000) -> dict[str, int]:
        """Return the other key prefixes in this database whose kombu-delay data holds scheduled
        messages (either space) and no mover heartbeat younger than ``fresh_ms``: prefix ->
        messages. A publisher whose ``global_keyprefix`` no mover shares strands them.

        A full ``SCAN`` for the index keys, ``page`` keys per call (about a second for a million
        keys), so it belongs in a background check, never in a probe.
        """
        prefixes: set[str] = set()
        with translated_errors():
            for key in self.client.scan_iter(match=f"*{keys.NAMESPACE}*index", count=page):
                other = keys.prefix_of_index(_text(key))
                if other is not None and other != self.prefix:
                    prefixes.add(other)
            now = self.time_ms()
            found: dict[str, int] = {}
            for other in sorted(prefixes):
                waiting = sum(int(n) for n in self.client.hvals(keys.counts(other)))
                beats: list[Any] = self.client.zrevrange(keys.movers(other), 0, 0, withscores=True)
                served = bool(beats) and now - int(beats[0][1]) <= fresh_ms
                if waiting > 0 and not served:
                    found[other] = waiting
        return found

    def set_alert(self, name: str, text: str | None, keep_ms: int) -> None:
        """Record (or, with ``text`` ``None``, clear) an alert for ``stats`` and ``health``; the
        record vanishes ``keep_ms`` after the last write, so a mover that stopped checking
        leaves no stale alert behind."""
        key = keys.alerts(self.prefix)
        with translated_errors():
            if text is None:
                self.client.hdel(key, name)
                return
            now = self.time_ms()
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(key, name, f"{now} {text}")
            pipe.pexpireat(key, now + keep_ms)
            pipe.execute()

    def alerts(self, max_age_ms: int) -> dict[str, str]:
        """Return the alerts recorded within ``max_age_ms``: name -> text."""
        with translated_errors():
            raw = self.client.hgetall(keys.alerts(self.prefix))
        now = self.time_ms()
        found = {}
        for name, value in raw.items():
            at, _, text = _text(value).partition(" ")
            if at.isdigit() and now - int(at) <= max_age_ms:
                found[_text(name)] = text
        return found

    def counts(self) -> dict[str, int]:
        """Return the scheduled count per destination list key (kept by the scripts)."""
        with translated_errors():
            raw = self.client.hgetall(self._counts)
        return {_text(k): int(v) for k, v in raw.items() if int(v) > 0}

    def heartbeats(self) -> dict[str, int]:
        """Return mover id -> last heartbeat (epoch ms, Redis clock)."""
        with translated_errors():
            raw: list[Any] = self.client.zrange(keys.movers(self.prefix), 0, -1, withscores=True)
        return {_text(member): int(score) for member, score in raw}

    def earliest_due_ms(self) -> int | None:
        """Return the due time of the earliest scheduled message, or ``None``.

        A bucket whose messages vanished (expired or deleted) is reported by its start,
        so an unreconciled bucket shows up as overdue rather than hiding. Compressed messages
        (the cold space) count too.
        """
        with translated_errors():
            firsts = (self._first_due(), self._first_due(keys.COLD))
            dues = [d for d in firsts if d is not None]
        return min(dues) if dues else None

    def _first_due(self, space: str = "") -> int | None:
        """The earliest due time in the index (as move.lua's ``next_due``: buckets of a
        narrower width that start before the best found so far are looked at too)."""
        index = dict(self.spaces)[space]
        first: list[Any] = self.client.zrange(index, 0, 0)
        if not first:
            return None
        start = int(first[0])
        best = self._earliest_in(start, space) or start
        later: list[Any] = self.client.zrangebyscore(index, f"({start}", best, 0, 16)
        for raw in later:
            due = self._earliest_in(int(raw), space)
            if due is not None and due < best:
                best = due
        return best

    def _earliest_in(self, start: int, space: str = "") -> int | None:
        heads = [head for dest in self.dests(start, space) for head in self._head(start, dest, space)]
        return min(heads) if heads else None

    def dests(self, start: int, space: str = "") -> list[str]:
        """Return the destinations a bucket's meta hash counts messages for, sorted."""
        raw = self.client.hgetall(keys.meta(self.prefix, start, space))
        return sorted(
            name[2:]
            for name, n in ((_text(k), int(v)) for k, v in raw.items())
            if name.startswith("q:") and n > 0
        )

    def _head(self, start: int, dest: str, space: str = "") -> list[int]:
        head: list[Any] = self.client.zrange(
            keys.queue_set(self.prefix, start, dest, space), 0, 0, withscores=True
        )
        return [int(head[0][1])] if head else []

    def time_ms(self) -> int:
        """Return the Redis clock in epoch ms (this store's own clock, when it has one)."""
        if self.clock is not None:
            return int(self.clock())
        with translated_errors():
            sec, usec = self.client.time()
        return int(sec) * 1000 + int(usec) // 1000

    # -- inspection and control ---------------------------------------------------

    def find(self, task_id: str) -> list[Stored]:
        """Return the messages stored under ``task_id``, via the id index (one script call).

        A ref names a bucket and an exact score; the message found there is kept only if it
        carries ``task_id`` (a ref of a moved message lingers until its bucket's clean-up).
        A compressed message that cannot be restored is left out (a mover's thaw moves it to
        the dead-letter list).
        """
        with translated_errors():
            flat: list[Any] = self._scripts["find"](keys=[self._ids], args=[self.ns, task_id])
        found: dict[Stored, None] = {}  # in ref order, once each, without a quadratic search
        for i in range(0, len(flat), 4):
            start, score, dest, member = flat[i : i + 4]
            space, start_ms = keys.split_bucket(_text(start))
            stored = Stored(start_ms, float(score), _text(dest), bytes(member), bool(space))
            try:
                message = stored.message
            except CorruptMember:
                continue
            if index_id(message) == task_id:
                found.setdefault(stored)
        return list(found)

    def cancel(self, task_id: str) -> int:
        """Remove every message of ``task_id``; return how many were removed.

        A compressed message a mover thawed between the find and its removal is looked for
        again, in the ordinary buckets (a thaw only ever moves a message there).
        """
        done = 0
        with translated_errors():
            missed = False
            for stored in self.find(task_id):
                removed = self._cancel_one(task_id, stored)
                done += removed
                missed = missed or (stored.cold and not removed)
            if missed:
                done += sum(self._cancel_one(task_id, again) for again in self.find(task_id))
        return done

    def _cancel_one(self, task_id: str, stored: Stored) -> int:
        return int(
            self._scripts["cancel"](
                keys=[self._index, self._ids, self._counts, self._totals, self._gc],
                args=[self.ns, task_id, stored.bucket, stored.dest, stored.ref, stored.payload, self._now()],
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
        self, old: Stored, task_id: str, payload: str, due_ms: int, settings: Settings
    ) -> Rescheduled:
        """Replace ``old`` by ``payload`` due at ``due_ms``, atomically (see ``reschedule.lua``).

        ``payload`` is the message itself; it is stored compressed when due far enough ahead,
        as :meth:`schedule` does.
        """
        member = self._cold_member(Due(due_ms, task_id=task_id), payload, settings)
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
                        self._now(),
                    ],
                )
                if int(reply[0]) != Rescheduled.TOO_SOON_FOR_COLD:
                    return Rescheduled(int(reply[0]))
                member = None  # this clock runs behind Redis's: send the message as it is

    def purge(self, dests: Iterable[str], limit: int = 1000) -> int:
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
                        args=[self.ns, limit, cursor, space, self._now(), *wanted],
                    )
                    total += int(reply[0])
                    if int(reply[1]):
                        break
                    cursor = _text(reply[2])
        return total

    def page(
        self, after: Cursor | None, limit: int, dests: Iterable[str] | None = None, examine: int = 10_000
    ) -> tuple[list[Stored], Cursor | None]:
        """Return up to ``limit`` messages after ``after``, earliest due first across both spaces,
        and the cursor of the next page (``None`` at the end); see :mod:`kombu_delay.store.listing`.

        With ``dests``, only messages bound for those lists are read. At most about ``examine``
        members are read per call, so a page may come back short.
        """
        with translated_errors():
            return listing.page(self, after, limit, None if dests is None else set(dests), examine)

    def census(self, now_ms: int, slot_ms: int, slots: int, max_buckets: int = 10_000) -> Census:
        """Return the overdue count and a due-time histogram from ``now_ms`` on (``census.lua``).

        Costs one ZCARD (and one ZCOUNT for a started bucket) per bucket, never a
        read of members; at most ``max_buckets`` buckets are examined.
        Compressed messages (the cold space) are counted too, in a second call.
        """
        totals = [0] * (3 + int(slots))
        with translated_errors():
            for space, index in self.spaces:
                reply = self._scripts["census"](
                    keys=[index], args=[self.ns, int(now_ms), int(slot_ms), int(slots), max_buckets, space]
                )
                totals = [a + int(b) for a, b in zip(totals, reply, strict=True)]
        return Census(truncated=bool(totals[0]), overdue=totals[1], vanished=totals[2], slots=totals[3:])

    def totals(self) -> dict[str, int]:
        """Return the lifetime counters (scheduled, moved, cancelled, ...)."""
        with translated_errors():
            raw = self.client.hgetall(self._totals)
        return {_text(k): int(v) for k, v in raw.items()}

    def index_memory(self) -> tuple[int, int]:
        """Return (bytes, entries) of the id index hash (``MEMORY USAGE``, all samples)."""
        with translated_errors():
            used = self.client.memory_usage(self._ids, samples=0)
            entries = self.client.hlen(self._ids)
        return int(used or 0), int(entries)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
