"""A mover's thaw: restore compressed messages into the ordinary space before they are due.

One batch per step, between the mover's drains, so a due message never waits behind more
than one. How far ahead a step reaches comes from :mod:`kombu_delay.mover.thaw_plan`: at
least ``delay_thaw_ahead``, and further for a cold bucket too large to thaw in that time.
Several movers may thaw at once: ``thaw.lua`` takes each member with ``ZREM``, so a member
two movers list is restored by one of them only.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Protocol

import redis

from kombu_delay.config import Settings
from kombu_delay.errors import FATAL_ERRORS, OverMaxmemory, RedisRefused
from kombu_delay.mover import thaw_plan
from kombu_delay.mover.pacing import FAILURE_REPEAT_S, Repeats, failure_kind
from kombu_delay.mover.tally import tell_damaged
from kombu_delay.store import Store, keys, spaces
from kombu_delay.store.replies import BucketCounts, ThawResult

logger = logging.getLogger(__name__)

#: Most compressed messages one thaw step restores: a step is one short script call
#: (a few ms), so a message due meanwhile waits at most that long for its move.
THAW_BATCH = 100
#: Seconds before a thaw that failed on a key of another type (written by hand) is tried again.
DAMAGED_RETRY_S = 10.0
#: How often a mover looks for compressed messages come due while Redis is over maxmemory,
#: seconds: then they are thawed only once due (see :meth:`Thawer._thaw_batch`).
PAST_MAXMEMORY_LOOK_S = 0.25
#: Seconds a mover refused a thaw ahead for maxmemory thaws only what is due, before it asks
#: again whether Redis has room.
PAST_MAXMEMORY_FOR_S = 1.0


class ThawCounts(Protocol):
    """The running totals a thaw adds to (the mover's stats)."""

    thawed: int
    dead: int
    expired: int
    errors: int


class Thawer:
    """The thaw of one mover: when to look, how far ahead, one batch per step."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        name: str,
        stats: ThawCounts,
        on_thaw: Callable[[ThawResult], None] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.store = store
        #: Told each error the thaw retries later itself (the metrics count it).
        self.on_error = on_error
        #: The clock that times looks and plans, seconds (a test passes one it drives).
        self.monotonic = monotonic
        self.settings = settings
        self.name = name
        self.stats = stats
        self.on_thaw = on_thaw
        self.rate = thaw_plan.Rate()
        #: How far the thaw reaches, epoch ms (Redis clock). It never moves back, so a herd
        #: whose thaw has begun is thawed to its end even if the plan, measuring a faster
        #: rate meanwhile, would now begin it later.
        self.horizon_ms = 0
        #: The lead of the steps until the next plan, ms. With ``delay_look_ahead`` the moves
        #: come that much before due, and so must the thaws before them.
        self.ahead_ms = settings.thaw_ahead_ms + settings.look_ahead_ms
        self._next_look = float("-inf")
        self._next_plan = float("-inf")
        self._next_start_ms: int | None = None
        self._run: tuple[float, int] | None = None  # (began, thawed) of a step that left more
        #: A thaw refused or failing, told once a minute while it lasts, and its end; and Redis
        #: over maxmemory, told once a minute while thaws ahead are refused.
        self._failures, self._over_maxmemory = Repeats(logger), Repeats(logger)
        #: Thawed messages dead-lettered for their bucket's keys of another type (each thaw step
        #: met one or a few: a line each): each key told once a minute while it blocks them
        #: (when told, monotonic s), with the count since the last line.
        self._blocked_told: dict[str, float] = {}
        self._blocked_since: dict[str, int] = {}
        self._past_until = float("-inf")  # monotonic: until then, Redis was over maxmemory

    def wake(self) -> None:
        """Look at the next step: a publish may have stored a compressed message due soon."""
        self._next_look = float("-inf")

    def step(self) -> float:
        """Restore one batch when it is time to look; return the seconds until the next look.

        A compressed message is always stored at least the publisher's ``thaw_ahead`` before
        its due time (the publish refuses it otherwise). A mover looks at least three times in
        its own ``thaw_ahead`` and every :data:`~thaw_plan.PLAN_EVERY_S`, by the earliest
        compressed message it saw and the earliest planned thaw, and whenever a publish wakes
        it: a publish into the first cold bucket does, so a mover that thaws further ahead than
        a publisher is not late either.
        """
        now = self.monotonic()
        if now < self._next_look:
            return self._next_look - now
        if self._run is not None:
            began, thawed = self._run
            self.rate.add(thawed, now - began)
        try:
            if now >= self._next_plan:
                self._plan(now)
            result, past = self._thaw_batch(now)
        except RedisRefused as exc:
            # A read-only replica, a failed background save: moves are refused too.
            self.told(exc)
            self._failures.tell(
                logging.WARNING,
                failure_kind(exc),
                f"mover {self.name}: thaw refused ({exc}); thaws are retried",
                now,
            )
            self._run = None
            self._next_look = now + 1.0
            return 1.0
        except FATAL_ERRORS:
            raise
        except redis.ResponseError as exc:
            # A key of the cold space replaced by hand with one of another type (its index, say),
            # or any other error of the thaw's scripts: moves must go on meanwhile (the thaw
            # runs between move batches); the thaw is retried, and its error logged, every
            # DAMAGED_RETRY_S. Redis unavailable goes to the loop's back-off, as moves fail too.
            self.told(exc)
            named = self.store.misshapen_told()  # (another key of another type: another failure)
            failed = f"thaw failed ({exc}{named})"
            retried = f"moves go on, the thaw is retried every {DAMAGED_RETRY_S:.0f} s"
            kind = (*failure_kind(exc), named)
            self._failures.tell(logging.ERROR, kind, f"mover {self.name}: {failed}; {retried}", now)
            self._run = None
            self._next_look = now + DAMAGED_RETRY_S
            return DAMAGED_RETRY_S
        if self._failures.over():
            logger.info("mover %s: the thaw works again", self.name)
        self._account(result)
        # Only a step that left more is one of a run measured (the next step comes at once):
        # a trickle's few messages a step measured each step's own overhead, far below what a
        # herd's full batches reach, and set leads many times too long (copies too).
        self._run = (now, result.thawed) if result.more and not past else None
        wait = self._wait_after(result)
        if past and not _listed(result):
            wait = PAST_MAXMEMORY_LOOK_S
        self._next_look = now + wait
        return wait

    def _thaw_batch(self, now: float) -> tuple[ThawResult, bool]:
        """Thaw one batch ahead; or, while Redis is over maxmemory, what is due now, past it
        (then ``True``).

        A thaw grows memory and is refused over maxmemory; moves free it and go on. But where
        all that is due is compressed, nothing moves and nothing frees memory: what is due is
        thawed past maxmemory, to reach its queue (see thaw.lua), and for the next
        :data:`PAST_MAXMEMORY_FOR_S` the steps do only that, without asking again first.
        """
        limit = min(THAW_BATCH, self.settings.batch_size)
        if now >= self._past_until:
            try:
                result = self.store.thaw(self.ahead_ms, limit)
                # (Only one that wrote shows Redis has room: one with nothing to thaw writes nothing.)
                if result.thawed and self._over_maxmemory.over():
                    logger.info(
                        "mover %s: Redis has room again: compressed messages are thawed ahead", self.name
                    )
                return result, False
            except OverMaxmemory as exc:
                self.told(exc)
                self._past_until = now + PAST_MAXMEMORY_FOR_S
                self._over_maxmemory.tell(
                    logging.WARNING,
                    failure_kind(exc),
                    f"mover {self.name}: Redis is over maxmemory ({exc}): publishes are refused until "
                    "memory frees, moves go on, and compressed messages (if any) are thawed only once "
                    "due, past the limit, so that they reach their queues; raise maxmemory or free memory",
                    now,
                )
        # Due by the move's look-ahead, to the end of this millisecond (a score's fraction).
        return self.store.thaw(self.settings.look_ahead_ms + 1, limit, past_maxmemory=True), True

    def told(self, exc: BaseException) -> None:
        """Count a failed or refused thaw (the mover's :meth:`~kombu_delay.mover.loop.Mover.told`,
        given as ``on_error``; else in this thaw's stats)."""
        if self.on_error is not None:
            self.on_error(exc)
        else:
            self.stats.errors += 1

    def _plan(self, now: float) -> None:
        """Read the cold buckets' counts and set how far the next steps reach."""
        now_ms, buckets = self.store.cold_buckets(thaw_plan.PLAN_BUCKETS)
        minimum = self.settings.thaw_ahead_ms
        # A look-ahead moves each message that long before due: plan as if it were that much
        # later, so every bucket is thawed by the time its moves begin.
        look_ahead = self.settings.look_ahead_ms
        at, rate = now_ms + look_ahead, self.rate.per_s
        # A large bucket begins its lead before its first message, not its start: held
        # thawed (two to three times its memory) no longer than it must be.
        coming = [b for b in thaw_plan.coming(at, buckets, minimum, rate) if b.end_ms > self.horizon_ms]
        firsts = self._firsts_due(coming) if coming else {}
        planned = thaw_plan.plan(at, buckets, minimum, rate, firsts)
        if planned.horizon_ms > self.horizon_ms:
            if planned.horizon_ms > now_ms + look_ahead + minimum:
                logger.info(
                    "mover %s: thawing up to %d ms ahead (%d compressed messages waiting, at %s)",
                    self.name,
                    planned.horizon_ms - now_ms,
                    sum(b.count for b in buckets),
                    self.rate.told(),
                )
            self.horizon_ms = planned.horizon_ms
        self.ahead_ms = max(minimum + look_ahead, self.horizon_ms - now_ms)
        self._next_start_ms = None
        if planned.next_start_ms is not None:
            self._next_start_ms = planned.next_start_ms - (now_ms + look_ahead)
        self._next_plan = now + thaw_plan.PLAN_EVERY_S

    def _firsts_due(self, buckets: list[BucketCounts]) -> dict[int, int]:
        """The due time of each cold bucket's first message, by its start (one read per queue
        it holds); a bucket found empty is left out."""
        firsts: dict[int, int] = {}
        sets = [(bucket.start_ms, dest) for bucket in buckets for dest, _ in bucket.dests]
        for (start, _), due in self.store.heads_due(sets, spaces.COLD).items():
            firsts[start] = min(due, firsts.get(start, due))
        return firsts

    def _account(self, result: ThawResult) -> None:
        self.stats.thawed += result.thawed
        self.stats.dead += result.dead
        self.stats.expired += result.expired
        if self.on_thaw is not None:
            self.on_thaw(result)
        tell_damaged(self.name, result.damaged)
        if result.blocked:
            self._tell_blocked(result)
        if result.expired:
            logger.warning(
                "mover %s: %d compressed scheduled messages were lost: their bucket expired or "
                "was deleted before they were thawed",
                self.name,
                result.expired,
            )
        if result.recounted:
            logger.error(
                "mover %s: %d compressed scheduled messages were missing from their bucket's "
                "counts (a meta hash evicted or deleted, or members added by hand); counted "
                "again, and thawed",
                self.name,
                result.recounted,
            )

    def _tell_blocked(self, result: ThawResult) -> None:
        """Log the messages ``result`` dead-lettered for keys of another type: an ERROR for each
        key that is new, or was last told a minute ago or more, with how many it blocked since;
        else at debug level."""
        now, told, since = self.monotonic(), self._blocked_told, self._blocked_since
        for key, n in result.blocking:
            since[key] = since.get(key, 0) + n
            why = "is of another type (written by hand)"
            if keys.is_meta(key):
                why += ", which this user may not RENAME out of the way"
            text = (
                f"mover {self.name}: {since[key]} thawed message{'s' if since[key] != 1 else ''} could "
                f"not be stored, as their ordinary bucket's {key!r} {why}: they went to the dead-letter "
                f"list {keys.dead(self.store.prefix)!r} as stored (kombu-delay dead lists them), counted "
                "as dead; rename or delete the key"
            )
            if now - told.get(key, -math.inf) < FAILURE_REPEAT_S:
                logger.debug("%s", text)
                continue
            logger.error("%s%s", text, " (still)" if key in told else "")
            told[key], since[key] = now, 0
        for key in [key for key, at in told.items() if now - at >= 10 * FAILURE_REPEAT_S]:
            del told[key]
            since.pop(key, None)

    def _wait_after(self, result: ThawResult) -> float:
        """Seconds until the next look after ``result``."""
        if _listed(result):
            return 0.0  # more to thaw, or thawed messages already due: the next drain moves them
        wait = min(self.settings.thaw_ahead_ms / 3000, thaw_plan.PLAN_EVERY_S)
        if result.next_ms is not None:
            wait = min(wait, max(0.0, (result.next_ms - self.ahead_ms - result.now_ms) / 1000))
        if self._next_start_ms is not None:
            wait = min(wait, max(0.0, self._next_start_ms / 1000))
        return wait


def _listed(result: ThawResult) -> bool:
    """Whether a step found anything to thaw: then the next may find more (a step whose
    members another mover restored first thaws none itself, and may say no ``more``)."""
    return result.more or result.thawed + result.dead + result.gone > 0
