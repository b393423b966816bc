"""The one layer that talks to Redis: kombu-delay's keys, scripts and replies.

Everything above it (transport, mover, inspection, CLI) calls these methods
and never builds a Redis command. Script replies become Python values here,
and ``redis.ConnectionError`` becomes :class:`~kombu_delay.errors.RedisUnavailable`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis

from . import keys
from .config import Settings
from .errors import DelayTooLong, KombuDelayError, RedisUnavailable
from .eta import Due
from .scripts import Scripts


class RedisRefused(KombuDelayError):
    """Redis refused a write (for example ``maxmemory`` reached under ``noeviction``)."""


class Scheduled(enum.IntEnum):
    """What ``schedule.lua`` did with a message."""

    TOO_FAR = -1
    PUSHED_NOW = 0
    STORED = 1
    DUPLICATE = 2


@dataclass(frozen=True)
class ScheduleResult:
    outcome: Scheduled
    due_ms: int
    now_ms: int


@dataclass(frozen=True)
class MoveResult:
    """One ``move.lua`` call."""

    moved: int
    #: Earliest due time still scheduled, epoch ms; ``None`` when nothing is.
    next_due_ms: int | None
    #: The Redis clock at the call, in ms plus the microseconds past that ms.
    now_ms: int
    now_us: int
    dead: int
    held: int
    expired: int
    wrongtype: int
    #: True when the call stopped at its limit: more may be due right now.
    more: bool
    #: ``now - due`` for each moved message, ms.
    lateness_ms: list[int] = field(default_factory=list)

    @classmethod
    def from_reply(cls, reply: list[Any]) -> MoveResult:
        head = [int(x) for x in reply[:9]]
        return cls(
            moved=head[0],
            next_due_ms=None if head[1] < 0 else head[1],
            now_ms=head[2],
            now_us=head[3],
            dead=head[4],
            held=head[5],
            expired=head[6],
            wrongtype=head[7],
            more=bool(head[8]),
            lateness_ms=[int(x) for x in reply[9:]],
        )


@contextmanager
def translated_errors() -> Iterator[None]:
    """Turn redis-py's connection failures and refusals into kombu-delay errors."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        if isinstance(exc, RedisUnavailable):
            raise
        raise RedisUnavailable(f"Redis is unavailable: {exc}") from exc
    except redis.ResponseError as exc:
        text = str(exc)
        if "OOM" in text or "READONLY" in text or "MISCONF" in text:
            raise RedisRefused(f"Redis refused the write: {text}") from exc
        raise


class Store:
    """kombu-delay's data in one Redis database, under one ``global_keyprefix``."""

    def __init__(self, client: redis.Redis, prefix: str = "") -> None:
        self.client = client
        self.prefix = prefix
        self.ns = keys.ns(prefix)
        self._scripts = Scripts(client)
        self._index = keys.buckets(prefix)
        self._ids = keys.ids(prefix)
        self._counts = keys.counts(prefix)
        self._totals = keys.totals(prefix)

    # -- publishing ---------------------------------------------------------------

    def schedule(self, due: Due, dest: str, payload: str, settings: Settings) -> ScheduleResult:
        """Store ``payload`` for ``dest`` until ``due``, or push it now if already due.

        Raises :class:`DelayTooLong` when the due time is past ``max_delay`` or the
        year-2109 ceiling; nothing is written then.
        """
        with translated_errors():
            reply = self._scripts["schedule"](*self._schedule_call(due, dest, payload, settings))
        result = ScheduleResult(Scheduled(int(reply[0])), int(reply[1]), int(reply[2]))
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
                for due, dest, payload in batch[begin : begin + chunk]:
                    call_keys, call_args = self._schedule_call(due, dest, payload, settings)
                    script(keys=call_keys, args=call_args, client=pipe)
                for reply in pipe.execute():
                    results.append(ScheduleResult(Scheduled(int(reply[0])), int(reply[1]), int(reply[2])))
        return results

    def _schedule_call(
        self, due: Due, dest: str, payload: str, settings: Settings
    ) -> tuple[list[str], list[Any]]:
        call_keys = [self._index, self._ids, self._counts, self._totals, dest]
        call_args: list[Any] = [
            self.ns,
            settings.bucket_width_ms,
            settings.grace_ms,
            due.ms,
            1 if due.relative else 0,
            due.task_id,
            dest,
            payload,
            keys.wake_channel(self.prefix),
            settings.max_delay_ms,
            keys.MAX_DUE_MS,
        ]
        return call_keys, call_args

    def count(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to a lifetime counter (for example a fallback taken at publish)."""
        with translated_errors():
            self.client.hincrby(self._totals, counter, n)

    # -- moving ---------------------------------------------------------------

    def move_due(self, limit: int, max_queue_length: int = 0) -> MoveResult:
        """Move up to ``limit`` due messages onto their lists (one atomic script call)."""
        with translated_errors():
            reply = self._scripts["move"](
                keys=[self._index, self._ids, self._counts, self._totals, keys.dead(self.prefix)],
                args=[self.ns, limit, max_queue_length],
            )
        return MoveResult.from_reply(reply)

    def heartbeat(self, mover_id: str, forget_after_ms: int = 86_400_000) -> int:
        """Record a mover heartbeat; return the Redis clock in epoch ms."""
        with translated_errors():
            return int(
                self._scripts["heartbeat"](keys=[keys.movers(self.prefix)], args=[mover_id, forget_after_ms])
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

    def foreign_indexes(self, scan_limit: int = 100_000) -> list[str]:
        """Return bucket indexes under other key prefixes (a bounded ``SCAN``).

        A mover whose ``global_keyprefix`` differs from the publisher's would
        strand their messages; the mover warns when it sees such an index.
        """
        found: list[str] = []
        with translated_errors():
            pattern = f"*{keys.NAMESPACE}buckets"
            for seen, key in enumerate(self.client.scan_iter(match=pattern, count=1000)):
                name = key.decode() if isinstance(key, bytes) else str(key)
                if name != self._index:
                    found.append(name)
                if seen >= scan_limit:
                    break
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

        A bucket that vanished (expired or deleted) is reported by its start,
        so an unreconciled bucket shows up as overdue rather than hiding.
        """
        with translated_errors():
            first: list[Any] = self.client.zrange(self._index, 0, 0)
            if not first:
                return None
            start = _text(first[0])
            head: list[Any] = self.client.zrange(keys.bucket(self.prefix, int(start)), 0, 0, withscores=True)
        return int(head[0][1]) if head else int(start)

    def time_ms(self) -> int:
        """Return the Redis clock in epoch ms."""
        with translated_errors():
            sec, usec = self.client.time()
        return int(sec) * 1000 + int(usec) // 1000


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
