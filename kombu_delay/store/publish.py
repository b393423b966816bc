"""Publishing: store a message in its time bucket, or push it now when it is already due."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis

from kombu_delay.config import Settings, seconds_shown
from kombu_delay.errors import (
    DelayTooLong,
    KombuDelayError,
    PayloadTooLarge,
    RedisPermissionError,
    WrongTypeKey,
    translated_errors,
)
from kombu_delay.message import Due, id_arg
from kombu_delay.store import keys, spaces
from kombu_delay.store.base import MIN_BULK_BYTES, StoreBase, as_text
from kombu_delay.store.replies import Scheduled, ScheduleResult

#: Destinations a publisher keeps as allowed by its ACL (:meth:`Publishing._may_publish`);
#: past this many, it forgets them and asks again.
MAX_ALLOWED_KEPT = 10_000
#: How long a totals hash made by a counter alone (:meth:`Publishing.count`) lives, ms: a day.
COUNTER_ALONE_MS = 86_400_000


class Publishing(StoreBase):
    """What a publisher calls (the transport's ``_put``)."""

    def schedule(
        self,
        due: Due,
        dest: str,
        payload: str,
        settings: Settings,
        expires_ms: int = 0,
        movers_fresh_ms: int = 0,
        now_ms: int | None = None,
        push_due: bool = True,
        siblings: Sequence[str] = (),
    ) -> ScheduleResult:
        """Store ``payload`` for ``dest`` until ``due``, or push it now if already due.

        ``push_due``: false leaves a message already due to the caller (outcome
        ``DUE_NOW``, nothing written), for one that pushes it in a publish batch.

        ``expires_ms``: the queue's ``x-expires``. The mover then renews the expiry of
        ``dest`` when it pushes the message, and of ``siblings``, the queue's other lists (its
        other priority steps), as kombu's own publish renews every list of the queue.

        A message due further ahead than ``settings.compress_after_ms`` is stored
        compressed, in the cold space (see :mod:`kombu_delay.store.cold`).

        Raises :class:`DelayTooLong` when the due time is past ``max_delay`` or the
        year-2109 ceiling; nothing is written then.

        ``movers_fresh_ms``: when positive, the same call counts the movers whose heartbeat is
        that fresh (``ScheduleResult.movers``), at no extra round trip.

        ``now_ms``: the time to judge by, epoch ms (default: the store's clock, else Redis's).
        """

        def send(to: spaces.Space) -> Any:
            call = self._schedule_call(
                to,
                due,
                dest,
                payload,
                settings,
                expires_ms,
                movers_fresh_ms,
                now_ms,
                leave_due=not push_due,
                siblings=siblings,
            )
            return self._scripts["schedule"](*call)

        with self._asked_again_if_refused(), translated_errors():
            self._must_fit(payload, "nothing was stored")
            self._may_publish([dest])
            space = self._space_for(due, settings, now_ms, payload)
            reply = self._sent(
                payload,
                "nothing was stored",
                lambda: spaces.placed(space, send(space), send, _too_soon),
                lambda: self._bucket_keys(due, dest, settings),
            )
        result = ScheduleResult.from_reply(reply, due.ms)
        if result.outcome is Scheduled.TOO_FAR:  # a refusal's reply is whole: it has the clock
            limit = (
                f"delay_max_delay is {seconds_shown(settings.max_delay_ms)}"
                if settings.max_delay_ms
                else f"the latest supported ETA is {keys.MAX_DUE_TEXT}"
            )
            # To the ms: a message due 60.4 s ahead was "due in 60 s", past a limit of 60 s.
            ahead = f"{(result.due_ms - (result.now_ms or 0)) / 1000:.3f}".rstrip("0").rstrip(".")
            raise DelayTooLong(f"message {due.task_id!r} is due in {ahead} s; {limit}")
        return result

    def schedule_many(
        self,
        items: Iterable[tuple[Due, str, str]],
        settings: Settings,
        chunk: int = 1000,
        now_ms: int | None = None,
    ) -> list[ScheduleResult]:
        """Run :meth:`schedule` for many ``(due, dest, payload)`` items, pipelined.

        For bulk loads (tests, benchmarks). Each item is still one atomic script
        call; a ``TOO_FAR`` outcome is returned, not raised, and writes nothing. A call Redis
        refuses (maxmemory, say) raises its error once its chunk is done, saying how many of
        the items were refused, stored (the others of its chunk and those before it may be)
        and not sent (the chunks after it).
        """
        script = self._scripts["schedule"]
        results: list[ScheduleResult] = []
        refused: list[Exception] = []
        with self._asked_again_if_refused(), translated_errors():
            batch = [
                (self._space_for(due, settings, now_ms, payload), due, dest, payload)
                for due, dest, payload in items
            ]
            for _, _, _, payload in batch:  # before anything is written
                self._must_fit(payload, "nothing was stored")
            self._may_publish({dest for _, _, dest, _ in batch})
            for begin in range(0, len(batch), chunk):
                pipe = self.client.pipeline(transaction=False)
                part = batch[begin : begin + chunk]
                for space, due, dest, payload in part:
                    call_keys, call_args = self._schedule_call(
                        space, due, dest, payload, settings, now_ms=now_ms
                    )
                    script(keys=call_keys, args=call_args, client=pipe)
                for (space, due, dest, payload), reply in zip(
                    part, pipe.execute(raise_on_error=False), strict=True
                ):
                    if isinstance(reply, Exception):
                        refused.append(reply)
                        continue

                    def send(
                        to: spaces.Space, due: Due = due, dest: str = dest, payload: str = payload
                    ) -> Any:
                        return script(*self._schedule_call(to, due, dest, payload, settings, now_ms=now_ms))

                    placed = spaces.placed(space, reply, send, _too_soon)
                    results.append(ScheduleResult.from_reply(placed, due.ms))
                if refused:
                    written = sum(r.outcome in (Scheduled.STORED, Scheduled.PUSHED_NOW) for r in results)
                    _raise_partly_stored(refused, written, len(batch) - begin - len(part), len(batch))
        return results

    def _may_publish(self, dests: Iterable[str], edit: bool = False) -> None:
        """Raise :class:`RedisPermissionError`, writing nothing, where this user's ACL refuses
        a command a delayed publish to one of ``dests`` may run: Redis keeps what a script
        wrote before a refusal, so a publish refused halfway would leave its message stored
        but unindexed or uncounted, and kombu's retry would store it again. Asked once per
        destination and client, and again after a refusal (``publish_allowed.lua``: Redis 7;
        Redis 6 cannot be asked, and is not asked again). ``edit``: a reschedule's, which also
        runs what takes the old message out before it stores the new one."""
        for dest in dests:
            asked = (dest, edit)
            if asked in self._publish_allowed:
                continue
            reply = self._scripts["publish_allowed"](keys=[], args=[self.ns, dest, *([1] if edit else [])])
            if len(reply) == 2:
                command, key = (as_text(part) for part in reply)
                what, unchanged = (
                    ("a reschedule", "the message stays as it was")
                    if edit
                    else ("a delayed publish", "nothing was stored")
                )
                raise RedisPermissionError(
                    f"Redis's ACL refused this user: {command} on {key!r}, which {what} may need (see "
                    f"the publisher's ACL line in the docs' Security page); {unchanged}"
                )
            if len(self._publish_allowed) >= MAX_ALLOWED_KEPT:
                self._publish_allowed.clear()
            self._publish_allowed.add(asked)

    @contextmanager
    def _asked_again_if_refused(self) -> Iterator[None]:
        """Forget which destinations the ACL allowed when it refuses something in the block: it
        was narrowed since :meth:`_may_publish` asked, and a retry must be asked again (and
        refused before writing) rather than refused halfway once more."""
        try:
            yield
        except RedisPermissionError:
            self._publish_allowed.clear()
            raise

    def _space_for(self, due: Due, settings: Settings, now_ms: int | None, payload: str) -> spaces.Space:
        """The space a message goes to, judged by this store's clock, else by its estimate of
        Redis's (see :func:`spaces.for_due`): this machine's wall clock, where it is wrong,
        would store a message compressed that the script then refuses as due too soon, and
        the publish would take two calls."""
        if now_ms is None and self.clock is not None:
            now_ms = int(self.clock())
        if now_ms is None and settings.compress_after_ms and not due.relative:  # (a delay needs none)
            estimate = self.redis_clock.estimate_ms()
            now_ms = None if estimate is None else int(estimate)
        return spaces.for_due(due, settings, now_ms, len(payload))

    def _sent(
        self,
        payload: str,
        unchanged: str,
        call: Callable[[], Any],
        bucket: Callable[[], dict[str, str]] | None = None,
    ) -> Any:
        """``call()``, which sends ``payload``. Where Redis cuts the send off, its limit for one
        string is read again (:meth:`sending`): one lowered since it was read raises
        :class:`PayloadTooLarge` (ending with ``unchanged``) here and now. Redis's raw
        ``WRONGTYPE`` from a script, which names no key, is told with the keys of another type,
        shared ones and those ``bucket`` names (:meth:`_bucket_keys`), asked only then."""
        try:
            with self.sending(_size(payload)):
                return call()
        except (redis.ConnectionError, redis.ResponseError) as exc:
            self._must_fit(payload, unchanged)
            if isinstance(exc, redis.ResponseError) and "Operation against a key" in str(exc):
                raise WrongTypeKey(f"{exc}{self.misshapen_told(bucket and bucket())}") from exc
            raise

    def _bucket_keys(self, due: Due, dest: str, settings: Settings) -> dict[str, str]:
        """The keys, and their types, of the buckets of either space that a message due at ``due``
        for ``dest`` goes into (none for a delay, whose due time Redis's clock sets)."""
        if due.relative:
            return {}
        start = keys.bucket_start(due.ms, settings.bucket_width_ms)
        found = {keys.task_ids(self.prefix, start): "list"}
        for space in (spaces.ORDINARY, spaces.COLD):
            found[space.meta(self.prefix, start)] = "hash"
            found[space.queue_set(self.prefix, start, dest)] = "zset"
        return found

    def _must_fit(self, payload: str, unchanged: str) -> None:
        """Raise :class:`PayloadTooLarge` (ending with ``unchanged``) for a message over Redis's
        limit for one argument: Redis drops the connection on it, which kombu takes for an
        outage and sends the same message again and again. A compressed message is measured
        as what its thaw sends back."""
        size = _size(payload)
        if size > MIN_BULK_BYTES:
            limit = self.over_bulk_limit(size)
            if limit is not None:
                raise PayloadTooLarge(
                    f"a {size:,}-byte message is over Redis's limit for one string "
                    f"({limit}, proto-max-bulk-len); {unchanged}"
                )

    def _schedule_call(
        self,
        space: spaces.Space,
        due: Due,
        dest: str,
        payload: str,
        settings: Settings,
        expires_ms: int = 0,
        movers_fresh_ms: int = 0,
        now_ms: int | None = None,
        leave_due: bool = False,
        siblings: Sequence[str] = (),
    ) -> tuple[list[str], list[Any]]:
        """The keys and arguments of ``schedule.lua`` storing ``payload`` in ``space`` (its size is
        the caller's to check first: :meth:`_must_fit`)."""
        # Only kombu's list is a key: schedule.lua names the others from the namespace.
        call_keys = [dest]
        call_args: list[Any] = [
            self.ns,
            settings.bucket_width_ms,
            settings.grace_ms,
            due.ms,
            id_arg(due.task_id),
            space.member(payload, due.task_id),
        ]
        # The optional arguments, each at its default when 0 or '': only those up to the last
        # one needed are sent (each costs Redis work in every call).
        optional: list[Any] = [
            *self._judge_by(due, now_ms),
            int(settings.max_delay_ms),  # schedule.lua reads "0" as no limit
            1 if due.relative else 0,
            1 if space.compressed else 0,
            settings.thaw_ahead_ms if space.compressed else 0,
            expires_ms,
            movers_fresh_ms,
            1 if leave_due else 0,
            self.db,
            json.dumps(list(siblings)) if expires_ms and siblings else "",
        ]
        while optional and optional[-1] in (0, ""):
            optional.pop()
        call_args += optional
        return call_keys, call_args

    def surely_due(self, due: Due) -> bool:
        """True when ``due`` is past by Redis's clock as estimated here, with a margin (see
        :mod:`kombu_delay.store.clock`), or by this store's own clock when it has one: the
        transport then pushes the message itself, as plain kombu would. False leaves the
        judging to :meth:`schedule`, by Redis's clock. At most one ``TIME`` round trip, once
        every few seconds; none for a relative delay."""
        if due.relative:
            return False
        if self.clock is not None:
            return due.ms <= self.clock()
        with translated_errors():
            return self.redis_clock.surely_past(due.ms)

    def _judge_by(self, due: Due, now_ms: int | None) -> tuple[str, int]:
        """schedule.lua's ``now_ms`` and ``estimated``: as :meth:`_now`, but in production (no
        clock of this store's own) Redis's clock as estimated here for a due time well ahead
        of it, which spares the script its ``TIME`` call (see :mod:`kombu_delay.store.clock`)."""
        if now_ms is None and self.clock is None and not due.relative:
            estimate = self.redis_clock.judge_by(due.ms)
            if estimate is not None:
                return str(estimate), 1
        return self._now(now_ms), 0

    def renew_expiry(self, lists: Iterable[str], expires_ms: int) -> None:
        """Set the expiry of the existing ``lists`` to ``expires_ms`` (a queue's x-expires),
        in one pipelined round trip, as kombu's own publish does."""
        with translated_errors():
            pipe = self.client.pipeline(transaction=False)
            for key in lists:
                pipe.pexpire(key, expires_ms)
            pipe.execute()

    def count(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to a lifetime counter (for example a fallback taken at publish), in one
        call of ``count.lua``. Where that makes the totals hash, in a namespace nothing else
        uses, it lives a day, as after a mover's last heartbeat; a later expiry stays, and the
        other scripts extend it as they use it."""
        with translated_errors():
            self._scripts["count"](keys=[self._totals], args=[counter, n, COUNTER_ALONE_MS])


def _raise_partly_stored(refused: list[Exception], written: int, unsent: int, items: int) -> None:
    """Raise the first of ``refused`` (as :func:`translated_errors` names it, or as it came),
    saying that of a bulk call's ``items``, ``written`` were stored or pushed and ``unsent``
    not sent: each is a call of its own, and one refused wrote nothing."""
    told = (
        f"{len(refused)} of the {items} messages given were refused, {written} stored or pushed, "
        f"{unsent} not sent"
    )
    try:
        with translated_errors():
            raise refused[0]
    except KombuDelayError as exc:
        text = str(exc).removesuffix("; nothing was written")
        raise type(exc)(f"{text}; {told}") from refused[0]
    except redis.RedisError as exc:
        raise type(exc)(f"{exc}; {told}") from refused[0]


def _too_soon(reply: list[Any] | int) -> bool:
    return not isinstance(reply, int) and int(reply[0]) == Scheduled.TOO_SOON_FOR_COLD


def _size(payload: str) -> int:
    """Bytes ``payload`` is sent as, counted only where that can pass the lowest limit Redis
    accepts for one string (a character is at most 4 bytes); else its length in characters."""
    if len(payload) > MIN_BULK_BYTES // 4:
        return len(payload.encode("utf-8", "surrogatepass"))
    return len(payload)
