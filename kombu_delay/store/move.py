"""Moving: push due messages onto their lists, thaw cold ones ahead of time, sweep every bucket
so that nothing a running mover holds expires, and keep the movers' heartbeats."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import redis

from kombu_delay.errors import CorruptMember, RedisPermissionError, is_wrong_type, translated_errors
from kombu_delay.store import keys, replies, spaces
from kombu_delay.store.base import OwnConnection, StoreBase, as_text, format_must_be, whole
from kombu_delay.store.replies import BucketCounts, MoveResult, StageResult, Stored, SweepResult, ThawResult

logger = logging.getLogger(__name__)

#: Most sorted sets (a bucket's, one per queue it holds messages for) one sweep call looks at,
#: after the bucket that reaches it: with 10,000 queues, 500 buckets a call held Redis for 3
#: to 13 s. Some 10 ms of Redis's time.
SWEEP_SETS = 5_000

#: A plan reads a bucket's counts again once what it read is older than this share of the time
#: until the bucket starts: one a day ahead every 72 minutes, an hour ahead every 3, a minute
#: ahead every 3 s, one begun at every plan. Read every second, the first 256 buckets' counts of
#: a million messages over 10,000 queues cost Redis about 70 ms a second.
COUNTS_STALE_SHARE = 1 / 20


class Moving(StoreBase):
    """What a mover calls, each call one bounded script."""

    #: Where the last move call's scan of started buckets stopped short (see move.lua).
    _scan_after: int | None = None
    #: The buckets' counts plans read (``_bucket_counts``): by space and start, when and what.
    _counts_read: dict[str, dict[int, tuple[int, BucketCounts]]] | None = None

    def move_due(
        self,
        limit: int,
        max_queue_length: int = 0,
        now_ms: int | None = None,
        look_ahead_ms: int = 0,
        whole: bool = True,
        exact_ms: int | None = None,
    ) -> MoveResult:
        """Move up to ``limit`` due messages onto their lists (one atomic script call);
        with ``look_ahead_ms``, also those due within that many ms from now. A herd staged
        ahead (:meth:`stage`) is handed over whole, past ``limit``, unless ``whole`` is false
        (a rate-capped mover). ``exact_ms``: ``next_due_ms`` need be exact only within that
        many ms (the caller's longest sleep); further, a lower bound no earlier stands for it.

        When held buckets ahead use up a call's bucket visits, the next call on this store
        goes on after them (``MoveResult.scan_after``), so the buckets behind them get their
        turn.
        """
        now = self._now(now_ms)
        with translated_errors():
            reply = self._scripts["move"](
                keys=[self._index, self._ids, self._counts, self._totals, self._gc],
                args=[
                    self.ns,
                    limit,
                    max_queue_length,
                    "" if self._scan_after is None else self._scan_after,
                    now,
                    look_ahead_ms,
                    1 if whole else 0,
                    "" if exact_ms is None else exact_ms,
                    self.give_up.deadline(int(now) if now else None),
                ],
            )
        result = MoveResult.from_reply(reply)
        self._scan_after = result.scan_after
        self.give_up.heard(result.now_ms, late=result.late)
        return result

    def thaw(
        self, ahead_ms: int, limit: int, now_ms: int | None = None, past_maxmemory: bool = False
    ) -> ThawResult:
        """Restore up to ``limit`` cold messages due within ``ahead_ms`` into the ordinary
        buckets (``thaw_scan.lua``, :func:`cold.unpack` here, then ``thaw.lua``).

        A member that cannot be restored goes to the dead-letter list, counted as dead,
        and is logged; each message is taken from the cold space and stored in the
        ordinary one in one atomic call, so a crash in between loses nothing. Under
        ``maxmemory`` the call is refused (:class:`~kombu_delay.errors.OverMaxmemory`) unless
        ``past_maxmemory``: for the messages due now, which must reach their queues.
        """
        cold_index = spaces.COLD.index(self.prefix)
        with translated_errors():
            reply = self._scripts["thaw_scan"](
                keys=[cold_index, self._counts, self._totals],
                args=[self.ns, ahead_ms, limit, self._now(now_ms), "1" if past_maxmemory else "0"],
            )
            scanned_ms, next_ms, more, expired, recounted = (int(x) for x in reply[:5])
            found = replies.damaged_keys(reply[5])  # cold keys of another type
            items, cut, corrupt = self._restored(reply[6:])
            more = more or cut
            thawed = dead = gone = blocked = 0
            blocking: list[tuple[str, int]] = []
            if items:
                call_keys = [
                    self._index,
                    self._ids,
                    self._counts,
                    self._totals,
                    cold_index,
                    keys.dead(self.prefix),
                ]
                largest = max(len(item) for item in items[6::7])  # the messages restored
                with self.sending(largest):
                    done = self._scripts["thaw"](
                        keys=call_keys,
                        args=[self.ns, self.db, self._now(now_ms), "1" if past_maxmemory else "0", *items],
                    )
                thawed, dead, gone, recounted_after, blocked = (int(x) for x in done[:5])
                recounted += recounted_after
                found += replies.damaged_keys(done[5])  # ordinary meta hashes set aside
                blocking = replies.counted_keys(done[6])  # keys that blocked thawed messages
                self._log_dead(corrupt, dead - blocked)
        return ThawResult(
            thawed=thawed,
            dead=dead,
            gone=gone,
            expired=expired,
            recounted=recounted,
            damaged=found,
            blocked=blocked,
            blocking=blocking,
            now_ms=scanned_ms,
            next_ms=None if next_ms < 0 else next_ms,
            more=bool(more),
        )

    def _log_dead(self, corrupt: list[str], dead: int) -> None:
        """Log the members of a thaw call that could not be restored (``corrupt``: why, each),
        of which the call dead-lettered ``dead``: the others another mover took first, and
        logs."""
        if not corrupt:
            return
        if dead <= 0:
            logger.debug("cold messages another mover took first could not be restored: %s", corrupt)
            return
        logger.error(
            "%d cold scheduled message%s could not be restored (%s); %s to the dead-letter list %s",
            dead,
            "" if dead == 1 else "s",
            "; ".join(corrupt[:5]) + ("; ..." if len(corrupt) > 5 else ""),
            "it goes" if dead == 1 else "they go",
            keys.dead(self.prefix),
        )

    def _restored(self, listed: list[Any]) -> tuple[list[Any], bool, list[str]]:
        """``thaw.lua``'s arguments for the members ``thaw_scan.lua`` listed (start, score, dest,
        member each): start, due time, id-index ref, dest, member and message each, the message
        ``b""`` when it cannot be restored (why, in the list returned last, for
        :meth:`_log_dead` once the call says how many it took): a member that does not decompress, whose
        score is no due time (:func:`_due_ms`), or that restores to a message longer than the
        server takes in one argument (its ``proto-max-bulk-len`` lowered since its publish).
        About :data:`~kombu_delay.store.keys.CALL_BYTES` of restored messages (at least one) go
        in one call: true beside them when the rest, listed, wait for the next (``thaw.lua``
        holds Redis while it stores them, and a highly compressed message restores to many
        times its member)."""
        items: list[Any] = []
        corrupt: list[str] = []
        size = 0
        for i in range(0, len(listed), 4):
            if items and size >= keys.CALL_BYTES:
                return items, True, corrupt
            start, score, dest, member = listed[i : i + 4]
            stored = Stored(int(start), float(score), as_text(dest), bytes(member), cold=True)
            # Kept where nothing can be made of the score: the bucket's start stands for its due
            # time (thaw.lua reads one even of a member it dead-letters), and the bucket alone
            # for its ref, which is no ref and so drops none from the id index (the one put
            # wrote, from the score it had then, is left stale, as a vanished bucket's are).
            due_ms, ref = stored.start_ms, stored.bucket
            try:
                due_ms, ref = _due_ms(stored), stored.ref
                message = stored.message
                limit = self.over_bulk_limit(len(message))
                if limit is not None:
                    raise CorruptMember(
                        f"it restores to {len(message):,} bytes, over Redis's limit for one string "
                        f"({limit}, proto-max-bulk-len), so no thaw can send it"
                    )
            except CorruptMember as exc:
                corrupt.append(f"bucket {as_text(start)} for {stored.dest!r}: {exc}")
                message = b""
            items += [start, due_ms, ref, dest, member, score, message]
            size += len(member) + len(message)
        return items, False, corrupt

    def cold_buckets(self, limit: int) -> tuple[int, list[BucketCounts]]:
        """Return the Redis clock (epoch ms) and the first ``limit`` cold buckets, and the first
        ``limit`` of those noted as large further on (:func:`keys.large`), earliest first, each
        with the compressed messages it still holds, for a mover to plan its thaw.

        Two pipelined round trips of up to ``2 * limit + 3`` reads. Not atomic: a plan is an
        estimate, made again every second, and a bucket ahead is read again only once its counts
        are older than :data:`COUNTS_STALE_SHARE` of the time until it starts.
        """
        return self._bucket_counts(spaces.COLD, limit)

    def ordinary_buckets(self, limit: int) -> tuple[int, list[BucketCounts]]:
        """As :meth:`cold_buckets`, for the first ``limit`` ordinary buckets: where a mover
        looks for herds to stage ahead of their due time."""
        return self._bucket_counts(spaces.ORDINARY, limit)

    def _bucket_counts(self, space: spaces.Space, limit: int) -> tuple[int, list[BucketCounts]]:
        if self._counts_read is None:
            self._counts_read = {}
        read = self._counts_read.setdefault(space.tag, {})
        with translated_errors():
            pipe = self.client.pipeline(transaction=False)
            pipe.time()
            pipe.zrange(space.index(self.prefix), 0, limit - 1)
            pipe.zrange(space.large(self.prefix), 0, limit - 1)
            clock, members, large = pipe.execute(raise_on_error=False)
            for reply in (clock, members):  # (BUSY: a script of another client runs long)
                if isinstance(reply, redis.ResponseError):
                    raise reply
            sec, usec = clock
            now = int(sec) * 1000 + int(usec) // 1000 if self.clock is None else int(self.clock())
            # The large buckets are a hint: one of another type, or refused, hides none of the first.
            if isinstance(large, redis.ResponseError):
                large = []
            # A member that names no bucket (by hand) is passed over; the thaw's scan retires it.
            starts = sorted({start for start in map(keys.start_of, [*members, *large]) if start is not None})
            stale = [
                start
                for start in starts
                if start not in read or now - read[start][0] >= (start - now) * COUNTS_STALE_SHARE
            ]
            pipe = self.client.pipeline(transaction=False)
            for start in stale:
                pipe.hgetall(space.meta(self.prefix, start))
            # A meta hash replaced by a key of another type (by hand) is passed over, as the
            # move and the sweep pass it over: its error must not fail the whole plan.
            metas = dict(zip(stale, pipe.execute(raise_on_error=False) if stale else [], strict=True))
            for meta in metas.values():
                if isinstance(meta, redis.ResponseError) and not is_wrong_type(meta):
                    raise meta
        self._forget_large(space, large, metas, now)
        for start, meta in metas.items():
            if isinstance(meta, redis.ResponseError):
                read.pop(start, None)
                continue
            # A field that is not a whole number (written by hand) counts nothing: the scripts
            # read it so too.
            fields = {as_text(k): whole(v) for k, v in meta.items()}
            dests = tuple((name[2:], n) for name, n in fields.items() if name.startswith("q:") and n > 0)
            count = sum(n for _, n in dests)
            read[start] = (now, BucketCounts(start, fields.get("end") or start, count, dests))
        for start in set(read) - set(starts):
            del read[start]
        return now, [read[start][1] for start in starts if start in read]

    def _forget_large(self, space: spaces.Space, large: list[Any], metas: dict[int, Any], now: int) -> None:
        """Take out of the large buckets' hint those found let go (no meta hash) and begun: a
        mover of 1.0.0 lets a bucket go without it, and the first entries would otherwise
        hide the large buckets behind them from every plan. Only one begun: no publish
        makes it anew then with 1,000 messages for a queue before this write, and were one
        to, it is among the first buckets of its index, which every plan reads anyway."""
        gone = [
            start
            for start in map(keys.start_of, large)
            if start is not None and start <= now and metas.get(start) == {}
        ]
        if gone:  # a key of another type, or refused: a hint only
            with translated_errors(), contextlib.suppress(redis.ResponseError):
                self.client.zrem(space.large(self.prefix), *gone)

    def stage(self, start_ms: int, dest: str, limit: int, min_run: int) -> StageResult:
        """Copy up to ``limit`` more members of the run at the head of bucket ``start_ms``'s
        set for ``dest`` into the list a move hands over whole when the run is due
        (``stage.lua``; see ``_staged.lua``). A head run of fewer than ``min_run`` members is
        left to the batches."""
        with translated_errors():
            reply = self._scripts["stage"](keys=[self._index], args=[self.ns, start_ms, dest, limit, min_run])
        return StageResult.from_reply(reply)

    def drop_staged(self, start_ms: int, dest: str) -> None:
        """Delete the copy of the herd of bucket ``start_ms``'s set for ``dest`` (whole or in
        part): its move then reads the run from the set, in batches."""
        with translated_errors():
            self.client.unlink(keys.staged(self.prefix, start_ms, dest))

    def sweep(self, after: str, limit: int, now_ms: int | None = None) -> SweepResult:
        """Visit up to ``limit`` buckets of both spaces after ``after`` (``""``: from the first):
        give each its grace again from now, so nothing a running mover holds expires, and
        settle the counts of those whose messages are gone (``sweep.lua``). Pass the reply's
        cursor back until it is ``""``."""
        with translated_errors():
            reply = self._scripts["sweep"](
                keys=[
                    self._index,
                    spaces.COLD.index(self.prefix),
                    self._ids,
                    self._counts,
                    self._totals,
                    self._gc,
                ],
                args=[self.ns, after, limit, self._now(now_ms), SWEEP_SETS],
            )
        return SweepResult.from_reply(reply)

    def forget_stale_refs(
        self, cursor: int, count: int, mover: str, every_ms: int, now_ms: int | None = None
    ) -> tuple[int, int, int, int] | float:
        """Walk a page of about ``count`` task ids of the id index from ``cursor`` (``0``: the
        first), dropping the refs that name no bucket and putting back into their index the
        buckets they name that left it (``forget.lua``); return the cursor of the next page
        (``0``: the walk is done), how many refs were dropped, and the buckets put back and the
        messages they count.

        A walk is begun at most once in ``every_ms``, whichever mover asks: where ``cursor``
        is ``0`` and another walk began less than that ago, nothing is read, and the seconds
        until that walk's claim ends are returned."""
        with translated_errors():
            reply = self._scripts["forget"](
                keys=[self._ids, keys.walk(self.prefix)],
                args=[self.ns, cursor, count, every_ms, mover, self._now(now_ms)],
            )
        if int(reply[2]):
            return int(reply[2]) / 1000
        return int(reply[0]), int(reply[1]), int(reply[3]), int(reply[4])

    def walk_by(self) -> str | None:
        """The mover whose walk of the id index holds the claim (:func:`keys.walk`), or None
        (none, or a key of another type)."""
        with translated_errors(), contextlib.suppress(redis.ResponseError):
            by = self.client.hget(keys.walk(self.prefix), "by")
            return None if by is None else as_text(by)
        return None

    def heartbeat(
        self, mover_id: str, forget_after_ms: int = 86_400_000, now_ms: int | None = None
    ) -> tuple[int, bool]:
        """Record a mover heartbeat; return the Redis clock in epoch ms, and whether one of this
        mover was recorded already (not at its first, nor where Redis's data was replaced).

        Raises :class:`StorageFormatError`, writing nothing, when the data is in another
        storage format, and :class:`RedisPermissionError` when this user's ACL refuses a
        command a mover needs (``_mover_acl.lua``: asked at each heartbeat on Redis 7, tried at
        the first on Redis 6): a mover's first heartbeat comes before its first move.
        """
        with translated_errors():
            now, found, *rest = self._scripts["heartbeat"](
                keys=[keys.movers(self.prefix), self._totals],
                args=[
                    mover_id,
                    forget_after_ms,
                    self._now(now_ms),
                    keys.FORMAT,
                    self.ns,
                    int(not self._acl_probed),
                ],
            )
        self.give_up.heard(int(now))  # (a first move call then has a deadline too)
        if len(rest) == 2:  # the ACL refused a command
            command, key = (as_text(part) for part in rest)
            raise RedisPermissionError(
                f"Redis's ACL refused this user: {command} on {key!r}, which a mover needs (see the "
                "ACL line in the docs' Security page); nothing was moved"
            )
        format_must_be(as_text(found), self.prefix)
        self._acl_probed = True
        return int(now), rest == [0]

    def forget_mover(self, mover_id: str) -> None:
        """Remove a mover's heartbeat (on a clean shutdown)."""
        with translated_errors():
            self.client.zrem(keys.movers(self.prefix), mover_id)

    def wake_subscription(self) -> redis.client.PubSub:
        """A pub/sub connection of its own (:class:`OwnConnection`), subscribed to the wake channel."""
        with translated_errors():
            pubsub: redis.client.PubSub = self.client.pubsub(  # type: ignore[no-untyped-call]
                ignore_subscribe_messages=True
            )
            pubsub.connection_pool = OwnConnection(pubsub.connection_pool)
            try:
                pubsub.subscribe(keys.wake_channel(self.prefix))
            except BaseException:
                pubsub.close()
                raise
        return pubsub


def _due_ms(stored: Stored) -> int:
    """The due time of a cold member listed for its thaw; raises :class:`CorruptMember` when its
    score is none the scripts accept (infinite, or past 0 to :data:`keys.MAX_DUE_MS`: set by
    hand), which would otherwise fail every thaw step that lists it, and with it every other
    message's thaw."""
    if not 0 <= stored.score < keys.MAX_DUE_MS + 1:  # false for NaN too
        raise CorruptMember(f"its score {stored.score!r} is no due time")
    return stored.due_ms
