"""Inspection: find a task's messages, list them in due order a page at a time, and the counts,
census and health facts that ``stats`` and ``health`` show. Nothing here writes a message."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import redis

from kombu_delay.errors import CorruptMember, WrongTypeKey, is_wrong_type, translated_errors
from kombu_delay.message import as_read, id_arg, index_id
from kombu_delay.store import cold, keys, listing, spaces
from kombu_delay.store.base import as_text, whole
from kombu_delay.store.census import Counting
from kombu_delay.store.listing import Cursor
from kombu_delay.store.replies import Stored

#: How often :meth:`Inspecting.earliest_due_ms` reads a space's first bucket, where it finds no
#: head (it changed between the reads, or its messages vanished).
FIRST_DUE_READS = 3
#: The queue heads one round trip reads (:meth:`Inspecting.earliest_due_ms`).
HEADS_PER_TRIP = 100


class Inspecting(Counting):
    """What inspection (DelayControl, the CLI, health and metrics) reads."""

    def stranded(
        self, fresh_ms: int, page: int = 10_000, stopping: Callable[[], bool] | None = None
    ) -> dict[str, int]:
        """Return the other key prefixes in this database whose kombu-delay data holds scheduled
        messages (either space) and no mover heartbeat younger than ``fresh_ms``: prefix ->
        messages. A publisher whose ``global_keyprefix`` no mover shares strands them.

        A full ``SCAN`` for the index keys, ``page`` keys per call (about a second for a million
        keys), so it belongs in a background check, never in a probe; it ends early, with what
        it found so far, once ``stopping()`` is true (see :meth:`scan_keys`).
        """
        prefixes: set[str] = set()
        with translated_errors():
            for key in self.scan_keys(f"*{keys.NAMESPACE}*index", page, stopping):
                other = spaces.prefix_of_index(as_text(key))
                if other is not None and other != self.prefix:
                    prefixes.add(other)
        return self.still_stranded(prefixes, fresh_ms)

    def still_stranded(self, prefixes: Iterable[str], fresh_ms: int, reader: Any = None) -> dict[str, int]:
        """Of the key prefixes ``prefixes``, those whose messages no mover with a heartbeat
        younger than ``fresh_ms`` serves: prefix -> messages. Two reads a prefix through
        ``reader`` (the client, or a pipeline watching), no ``SCAN``."""
        reader = reader or self.client
        with translated_errors():
            now = self.time_ms(reader)
            found: dict[str, int] = {}
            for other in sorted(prefixes):
                try:
                    waiting = sum(max(0, whole(n)) for n in reader.hvals(keys.counts(other)))
                    served = self._served(reader, other, now, fresh_ms)
                except redis.exceptions.NoPermissionError:  # another app's (an ACL per app): its own
                    continue  # movers' business
                except redis.ResponseError as exc:  # counts of another type: no kombu-delay prefix (a
                    if is_wrong_type(exc):  # queue named "x.kombu_delay:index"), or damaged by hand,
                        continue  # its own movers' to tell; either way not this check's end
                    raise
                if waiting > 0 and not served:
                    found[other] = waiting
        return found

    def stranded_databases(self, fresh_ms: int) -> dict[int, int]:
        """Return the server's other databases that hold messages scheduled under this key
        prefix and no mover heartbeat younger than ``fresh_ms``: database -> messages. A
        publisher whose URL names another database than its movers' strands them.

        The databases holding keys are read from ``INFO keyspace``; each is read in one
        ``MULTI`` that selects it and this one again, so the connection goes back to the pool as
        it came (a refusal as the commands are queued, an ACL's of ``SELECT``, runs none of
        them). ``{}`` where ``INFO`` is refused; a database whose read is refused is left out."""
        own = int(self.client.connection_pool.connection_kwargs.get("db") or 0)
        with translated_errors():
            try:
                held = self.client.info("keyspace")
            except redis.ResponseError:
                return {}
            now, found = self.time_ms(), {}
            for db in sorted(int(name[2:]) for name in held if name[:2] == "db" and name[2:].isdigit()):
                if db == own:
                    continue
                pipe: Any = self.client.pipeline(transaction=True)
                pipe.execute_command("SELECT", db)
                pipe.hvals(self._counts)
                pipe.zcount(keys.movers(self.prefix), now - fresh_ms, now + keys.FUTURE_BEAT_MS)
                pipe.execute_command("SELECT", own)
                try:
                    _, counts, movers, _ = pipe.execute()
                except redis.ResponseError:  # refused, or a key of another type there
                    continue
                waiting = sum(max(0, whole(n)) for n in counts)
                if waiting > 0 and not movers:
                    found[db] = waiting
        return found

    #: True once the ACL refused this store ``WATCH`` (:meth:`renew_stranded`).
    _watch_refused = False

    def renew_stranded(
        self, found: Iterable[str], fresh_ms: int, keep_ms: int, told: Callable[[dict[str, int]], str | None]
    ) -> dict[str, int]:
        """Look again at the other key prefixes recorded as stranded (:func:`keys.stranded`,
        shared by this prefix's movers) and at ``found``, record those still stranded (kept
        ``keep_ms``) with the alert ``told`` words for them (field :data:`keys.STRANDED_ALERT`
        of :func:`keys.alerts`, ``<epoch ms> <text>``, read by :meth:`alerts`), and return
        them: prefix -> messages. The record is watched from its read to its write, so a finding
        another mover records meanwhile is looked at again, never written over (three tries at
        most, then what is recorded is returned)."""
        key, alerts = keys.stranded(self.prefix), keys.alerts(self.prefix)
        with translated_errors(), self.client.pipeline(transaction=True) as pipe:
            for _ in range(3):
                try:
                    try:
                        if not self._watch_refused:
                            pipe.watch(key)  # type: ignore[no-untyped-call]
                    except redis.exceptions.NoPermissionError:  # an ACL without WATCH: unwatched, its
                        pipe.reset()  # connection let go (the reads below take one of their own),
                        # and not asked again: each refusal is an entry of Redis's ACL LOG, which
                        # a mover filled every 15 s (pushing out the refusals worth reading)
                        self._watch_refused = True
                    reader = pipe if pipe.watching else self.client
                    recorded = {as_text(name) for name in reader.hkeys(key)}
                    # (on the watching connection: another from the pool is one more held)
                    stranded = self.still_stranded(recorded | set(found), fresh_ms, reader)
                    now, text = self.time_ms(reader), told(stranded)
                    pipe.multi()
                    pipe.delete(key)
                    if stranded:  # (a dict of Any: redis-py's Mapping is invariant in its keys)
                        fields: dict[Any, Any] = dict(stranded)
                        pipe.hset(key, mapping=fields)
                        pipe.pexpireat(key, now + keep_ms)
                        pipe.hset(alerts, keys.STRANDED_ALERT, f"{now} {text}")
                        pipe.pexpireat(alerts, now + keep_ms)
                    else:
                        pipe.hdel(alerts, keys.STRANDED_ALERT)
                    pipe.execute()
                    return stranded
                except redis.WatchError:
                    continue
            raw = self.client.hgetall(key)
        return {as_text(name): whole(n) for name, n in raw.items()}

    @staticmethod
    def _served(reader: Any, prefix: str, now: int, fresh_ms: int) -> bool:
        """Whether a mover of ``prefix`` has a heartbeat younger than ``fresh_ms`` (one far ahead
        of Redis's clock, written by hand, is none; a heartbeat key of another type, written by
        hand too, is no mover's: none can beat there)."""
        try:
            fresh: int = reader.zcount(keys.movers(prefix), now - fresh_ms, now + keys.FUTURE_BEAT_MS)
            return fresh > 0
        except redis.ResponseError as exc:
            if is_wrong_type(exc):
                return False
            raise

    def alerts(self, max_age_ms: int) -> dict[str, str]:
        """Return the alerts recorded within ``max_age_ms``: name -> text."""
        with translated_errors():
            raw = self.client.hgetall(keys.alerts(self.prefix))
        now = self.time_ms()
        found = {}
        for name, value in raw.items():
            at, _, text = as_text(value).partition(" ")
            if at.isdigit() and now - int(at) <= max_age_ms:
                found[as_text(name)] = text
        return found

    def counts(self) -> dict[str, int]:
        """Return the scheduled count per destination list key (kept by the scripts)."""
        with translated_errors():
            raw = self.client.hgetall(self._counts)
        return {as_text(k): n for k, n in ((k, whole(v)) for k, v in raw.items()) if n > 0}

    def pending(self, dests: Iterable[str]) -> int:
        """Return how many messages are scheduled for ``dests`` (list keys), by ``counts``."""
        wanted = list(dests)
        if not wanted:
            return 0
        with translated_errors():
            raw = self.client.hmget(self._counts, wanted)
        return sum(max(0, whole(v)) for v in raw)

    def heartbeats(self) -> dict[str, int]:
        """Return mover id -> last heartbeat (epoch ms, Redis clock)."""
        with translated_errors():
            raw: list[Any] = self.client.zrange(keys.movers(self.prefix), 0, -1, withscores=True)
        return {as_text(member): keys.due_of(score) for member, score in raw}  # (±inf: by hand)

    def earliest_due_ms(self) -> int | None:
        """Return the due time of the earliest scheduled message, or ``None``.

        A bucket whose messages vanished (expired or deleted) is reported by its start, so that
        it shows as overdue rather than hiding. Compressed messages (the cold space) count too.
        """
        with translated_errors():
            dues = [d for d in map(self._first_due, spaces.ALL) if d is not None]
        return min(dues) if dues else None

    def _first_due(self, space: spaces.Space) -> int | None:
        """The earliest due time in the index (as move.lua's ``next_due``: buckets of a
        narrower width that start before the best found so far are looked at too)."""
        index = space.index(self.prefix)
        first = self._first_bucket(index, space)
        if first is None:
            return None
        start, best = first
        later: list[Any] = self.client.zrangebyscore(index, f"({start}", best, 0, 16)
        for raw in later:
            at = keys.start_of(raw)
            due = None if at is None else self._earliest_in(at, space)
            if due is not None and due < best:
                best = due
        return best

    def _first_bucket(self, index: str, space: spaces.Space) -> tuple[int, int] | None:
        """The first bucket of ``index`` that names one, and its earliest due time; ``None``
        when there is none."""
        for _ in range(FIRST_DUE_READS):
            start = self._first_start(index)
            if start is None:
                return None
            best = self._earliest_in(start, space)
            if best is not None:
                return start, best
            # No head: its messages vanished (told by its start, as overdue since then), or it
            # changed between the reads (a move or a thaw drained it, a publish put it back, a
            # queue's first message came after its meta hash was read): read again.
            if self._vanished(start, space):
                return start, start
        return None  # changing at every read: a mover is at work on it

    def _vanished(self, start: int, space: spaces.Space) -> bool:
        """Whether bucket ``start`` counts messages for a destination whose sorted set is gone,
        by one atomic read (``MULTI``) of its meta hash and its sets: read apart, a set drained
        between them looked gone."""
        dests = self.dests(start, space)
        if not dests:
            return False
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(space.meta(self.prefix, start))
        for dest in dests:
            pipe.exists(space.queue_set(self.prefix, start, dest))
        raw, *exists = pipe.execute()
        counted = {as_text(k)[2:] for k, v in raw.items() if as_text(k).startswith("q:") and whole(v) > 0}
        return any(dest in counted and not there for dest, there in zip(dests, exists, strict=True))

    def _first_start(self, index: str) -> int | None:
        """The first member of ``index`` that names a bucket: one written by hand is passed
        over (a mover retires it)."""
        offset = 0
        while True:
            members: list[Any] = self.client.zrange(index, offset, offset + 15)
            for start in map(keys.start_of, members):
                if start is not None:
                    return start
            if len(members) < 16:
                return None
            offset += 16

    def _earliest_in(self, start: int, space: spaces.Space) -> int | None:
        # Each queue's head with its score, HEADS_PER_TRIP queues a round trip: one each cost a
        # probe seconds with 20,000 queues, all at once held every head in memory together.
        # The message is read with its score: Redis has no cheaper way to the first score. (A
        # ZCOUNT that counts a member compares it with itself, byte by byte: a search by
        # ZCOUNT cost Redis three times this read's time with a head of 50 MB.)
        dues = self.heads_due([(start, dest) for dest in self.dests(start, space)], space)
        return min(dues.values()) if dues else None

    def heads_due(
        self, sets: list[tuple[int, str]], space: spaces.Space = spaces.ORDINARY
    ) -> dict[tuple[int, str], int]:
        """The due time (epoch ms) of the first message of each ``(bucket start, destination)``
        set of ``space``, :data:`HEADS_PER_TRIP` sets a round trip; one empty, gone or of another
        type (by hand: lost to delivery, the others go on) is left out."""
        found: dict[tuple[int, str], int] = {}
        for at in range(0, len(sets), HEADS_PER_TRIP):
            some = sets[at : at + HEADS_PER_TRIP]
            with translated_errors():
                pipe = self.client.pipeline(transaction=False)
                for start, dest in some:
                    pipe.zrange(space.queue_set(self.prefix, start, dest), 0, 0, withscores=True)
                for one, head in zip(some, pipe.execute(raise_on_error=False), strict=True):
                    if isinstance(head, redis.ResponseError) and not is_wrong_type(head):
                        raise head
                    if head and not isinstance(head, redis.ResponseError):
                        found[one] = keys.due_of(head[0][1])
        return found

    def dests(
        self, start: int, space: spaces.Space = spaces.ORDINARY, among: Iterable[str] | None = None
    ) -> list[str]:
        """Return the destinations a bucket's meta hash counts messages for, sorted; with
        ``among``, only those of them, whose counts alone are read (a bucket of many queues'
        meta hash holds a count for each)."""
        meta = space.meta(self.prefix, start)
        with self.types_named({meta: "hash"}):  # one written by hand: an operator renames it
            if among is not None:
                named = sorted(among)
                counts = self.client.hmget(meta, [f"q:{dest}" for dest in named]) if named else []
                return [dest for dest, n in zip(named, counts, strict=True) if whole(n) > 0]
            raw = self.client.hgetall(meta)
        return sorted(
            name[2:]
            for name, n in ((as_text(k), whole(v)) for k, v in raw.items())
            if name.startswith("q:") and n > 0
        )

    def find(self, task_id: str, unreadable: bool = False) -> list[Stored]:
        """Return the messages stored under ``task_id``, via the id index (one script call).

        A ref names a bucket and an exact score; the message found there is kept only if it
        carries ``task_id`` (a ref of a moved message lingers until its bucket's clean-up).
        A compressed message that cannot be restored is left out (a mover's thaw moves it to
        the dead-letter list), unless ``unreadable``, where the id it carries in the clear is
        ``task_id`` (for a cancel: it is scheduled still).
        """
        self._check_format_once()
        with self.types_named({}):  # the id index of another type, written by hand
            flat: list[Any] = self._scripts["find"](keys=[self._ids], args=[self.ns, id_arg(task_id)])
        found: dict[Stored, None] = {}  # in ref order, once each, without a quadratic search
        for i in range(0, len(flat), 4):
            start, score, dest, member = flat[i : i + 4]
            space, start_ms = spaces.of_bucket(as_text(start))
            stored = Stored(start_ms, float(score), as_text(dest), bytes(member), space.compressed)
            try:
                message = stored.message
            except CorruptMember:
                # With ``unreadable`` (a cancel), a compressed message that cannot be restored
                # but carries the id in the clear: still scheduled, and the mover's thaw would
                # only dead-letter it.
                if unreadable and stored.cold and cold.task_id_of(stored.payload) == as_read(task_id):
                    found.setdefault(stored)
                continue
            if index_id(message) == as_read(task_id):
                found.setdefault(stored)
        return list(found)

    def page(
        self, after: Cursor | None, limit: int, dests: Iterable[str] | None = None, examine: int = 10_000
    ) -> tuple[list[Stored], Cursor | None]:
        """Return up to ``limit`` messages after ``after``, earliest due first across both spaces,
        and the cursor of the next page (``None`` at the end); see :mod:`kombu_delay.store.listing`.

        With ``dests``, only messages bound for those lists are read. At most about ``examine``
        members are read per call, so a page may come back short.
        """
        self._check_format_once()
        with translated_errors():
            return listing.page(self, after, limit, None if dests is None else set(dests), examine)

    def dead_count(self, or_none: bool = False) -> int:
        """How many dead letters there are (one ``LLEN``). ``or_none``: 0 where the key is of
        another type (written by hand: no list holds any; :meth:`misshapen` tells of it), not
        :class:`~kombu_delay.errors.WrongTypeKey`, for what reads it beside other counts
        (``stats``, the metrics)."""
        try:
            with translated_errors():
                return int(self.client.llen(keys.dead(self.prefix)))
        except WrongTypeKey:
            if or_none:
                return 0
            raise

    def dead_letters(self, offset: int, limit: int) -> tuple[int, list[bytes]]:
        """Return how many dead letters there are and up to ``limit`` of them from ``offset``
        (newest first, as stored: what a mover could not restore)."""
        key = keys.dead(self.prefix)
        with translated_errors():
            pipe = self.client.pipeline(transaction=False)
            pipe.llen(key)
            pipe.lrange(key, offset, offset + limit - 1)
            total, items = pipe.execute()
        return int(total), [bytes(item) for item in items]

    def totals(self) -> dict[str, int]:
        """Return the lifetime counters (scheduled, moved, cancelled, ...)."""
        self._check_format_once()
        with translated_errors():
            raw = self.client.hgetall(self._totals)
        found = {as_text(k): v for k, v in raw.items()}
        return {k: whole(v) for k, v in found.items() if k != keys.FORMAT_FIELD}

    def index_memory(self) -> tuple[int, int]:
        """Return (bytes, entries) of the id index hash (``MEMORY USAGE``, all samples)."""
        with translated_errors():
            used = self.client.memory_usage(self._ids, samples=0)
            entries = self.client.hlen(self._ids)
        return int(used or 0), int(entries)
