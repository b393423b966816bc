"""What a mover tells of its calls: its running totals, for the metrics, and the log lines of
each move and sweep result, paced so that what a mover sees at every poll is said once per
:data:`LOG_EVERY_S`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kombu_delay.store import keys
from kombu_delay.store.replies import MoveResult, SweepResult

logger = logging.getLogger("kombu_delay.mover.loop")  # (the loop's lines, under the loop's name)

#: How often, at most, a mover logs its progress at INFO, seconds.
LOG_EVERY_S = 10.0

#: The ERROR for buckets a move call or the sweep let go that had vanished whole.
VANISHED = (
    "mover %s: %d buckets vanished whole: their meta hash, which counts their messages, is gone, and "
    "no sorted set of theirs was found for the queues the per-queue counts name (deleted by hand, "
    "evicted, or expired after no mover ran for delay_grace plus a day); what they held is lost, "
    "and cannot be counted (see Limitations)"
)
#: The WARNING of a mover that finds its heartbeat gone from Redis at its next one.
HEARTBEAT_GONE = (
    "mover %s: its heartbeat was gone from Redis: Redis's data was flushed (FLUSHALL, FLUSHDB) or "
    "replaced (a switch to another server, a restart that kept nothing on disk), or the movers key "
    "evicted or deleted by hand; whatever was scheduled there and is gone with it is lost, counted nowhere"
)
#: The ERRORs for a bucket's key a move call found of another type (written by hand): a meta
#: hash renamed out of the way, its bucket counted again; anything else, what it held lost.
DAMAGED_ASIDE = (
    "mover %s: the bucket key %r held another type than its own (written by hand): renamed to %r, "
    "kept as it was; the bucket was counted again from its sorted sets, and its messages move on time"
)
DAMAGED_SET = (
    "mover %s: the bucket's sorted set %r holds another type (written by hand): the messages it held "
    "are gone with it, counted as expired; rename or delete the key"
)
DAMAGED_LOST = (
    "mover %s: the bucket key %r holds another type than a hash (written by hand), and this user may "
    "not RENAME it out of the way: the bucket's messages are lost, counted as expired; grant +rename, "
    "and rename the key"
)

DAMAGED_COLD = (
    "mover %s: the compressed bucket's meta hash %r holds another type than a hash (written by hand): "
    "nothing of the bucket can be counted or thawed, and its messages are lost, counted as expired; "
    "rename or delete the key"
)


def tell_damaged(name: str, damaged: list[tuple[str, str]]) -> None:
    """Log the keys a move or a thaw found of another type (``damaged``: each with the name it
    was set aside as, or '')."""
    for key, aside in damaged:
        if aside:
            logger.error(DAMAGED_ASIDE, name, key, aside)
        elif keys.is_meta(key):
            logger.error(DAMAGED_COLD if keys.is_cold_meta(key) else DAMAGED_LOST, name, key)
        else:
            logger.error(DAMAGED_SET, name, key)


@dataclass
class MoverStats:
    """Running totals of one mover, for logs and metrics."""

    moved: int = 0
    dead: int = 0
    expired: int = 0
    held: int = 0
    wrongtype: int = 0
    refused: int = 0  #: due messages whose destination this user's ACL refuses
    thawed: int = 0  #: compressed messages restored into the ordinary buckets
    renewed: int = 0  #: buckets whose expiry a sweep pushed out
    errors: int = 0
    calls: int = 0
    last_move_at: float = 0.0  #: Redis's clock (epoch s) at the last call that moved something
    lag_ms: int = 0  #: Redis now minus the oldest due message still waiting (0 if none)


class Tally:
    """The totals and the log lines of one mover's move and sweep results."""

    def __init__(
        self,
        name: str,
        batch_size: int,
        on_result: Callable[[MoveResult], None] | None = None,
        on_sweep: Callable[[SweepResult], None] | None = None,
    ) -> None:
        self.name = name
        self.batch_size = batch_size
        self.stats = MoverStats()
        self._on_result = on_result
        self._on_sweep = on_sweep
        self._last_log = time.monotonic()
        self._stuck_logged_at = float("-inf")
        #: The destinations whose due messages it said stay scheduled, until none do.
        self._held: set[str] = set()
        #: Whether the next call scans the due buckets from the first: a call goes on after
        #: where the last stopped (``scan_after``) when held buckets used up its visits.
        self._from_first = True
        self._logged_moved = 0

    def sweep(self, result: SweepResult) -> None:
        """Count and tell one sweep page's result."""
        self.stats.renewed += result.renewed
        self.stats.expired += result.lost
        if result.lost:
            logger.warning(
                "mover %s: %d scheduled messages were lost: their bucket expired or was evicted "
                "(see Redis's maxmemory-policy) or deleted",
                self.name,
                result.lost,
            )
        if result.rebuilt:
            logger.error(
                "mover %s: %d buckets held messages their counts missed (a meta hash evicted or "
                "deleted, or members added by hand); counted again from their sorted sets",
                self.name,
                result.rebuilt,
            )
        if result.vanished:  # (a bucket due later: the sweep reaches it before any move)
            logger.error(VANISHED, self.name, result.vanished)
        if self._on_sweep is not None:
            self._on_sweep(result)

    def move(self, result: MoveResult) -> None:
        """Count and tell one move call's result."""
        stats = self.stats
        stats.calls += 1
        stats.moved += result.moved
        stats.expired += result.expired
        stats.held += result.held
        stats.wrongtype += result.wrongtype
        stats.refused += result.refused
        if result.moved:
            stats.last_move_at = result.now_ms / 1000
        if result.moved > self.batch_size:  # only a herd handed over whole moves more
            # (the call's count: other queues' messages moved in the same call are in it too)
            logger.info("mover %s: moved %d messages in one call, a herd whole", self.name, result.moved)
        waiting = result.next_due_ms is not None and result.next_due_ms <= result.now_ms
        stats.lag_ms = result.now_ms - result.next_due_ms if waiting else 0  # type: ignore[operator]
        tell_damaged(self.name, result.damaged)
        if result.expired:
            logger.warning(
                "mover %s: %d scheduled messages were lost: their bucket expired or "
                "was deleted%s before it was moved",
                self.name,
                result.expired,
                ", or a key of it was written over (the ERROR above)" if result.damaged else "",
            )
        if result.recounted:
            logger.error(
                "mover %s: %d scheduled messages were missing from their bucket's counts (a meta "
                "hash evicted, deleted or set aside, or members added by hand); counted again, and moved",
                self.name,
                result.recounted,
            )
        if result.vanished:
            logger.error(VANISHED, self.name, result.vanished)
        now = time.monotonic()
        from_first, self._from_first = self._from_first, result.scan_after is None
        # Polled every HELD_POLL_S (pacing.py) while they wait: said once per LOG_EVERY_S, not per poll.
        if (result.wrongtype or result.refused) and now - self._stuck_logged_at >= LOG_EVERY_S:
            self.tell_stuck(result)
            self._stuck_logged_at = now
            self._held.update(result.wrongtype_dests, result.refused_dests)
        elif self._held and from_first and not (result.wrongtype or result.refused or result.more):
            # A call that looked at every due bucket, from the first, and found none held: the
            # end is told too. (One that went on after held buckets saw none of them.)
            logger.info(
                "mover %s: no due message stays scheduled for %s any more: moved, or removed",
                self.name,
                ", ".join(map(repr, sorted(self._held))),
            )
            self._held.clear()
            self._stuck_logged_at = float("-inf")  # (a new cause is told at once)
        logger.debug("mover %s: %s", self.name, result)
        if self._on_result is not None:
            self._on_result(result)
        if now - self._last_log >= LOG_EVERY_S:
            moved = stats.moved - self._logged_moved
            if moved or stats.lag_ms:
                # (How late the moves were is the lateness metric's; this is what waits now.)
                waits = (
                    f"the oldest due message waits {stats.lag_ms:,} ms" if stats.lag_ms else "none due waits"
                )
                logger.info(
                    "mover %s: moved %d messages in the last %.0f s; %s",
                    self.name,
                    moved,
                    now - self._last_log,
                    waits,
                )
            self._last_log, self._logged_moved = now, stats.moved

    def tell_stuck(self, result: MoveResult) -> None:
        """Say which due messages stay scheduled, and why (the other queues' messages move on)."""
        if result.wrongtype:
            logger.warning(
                "mover %s: %d due messages stay scheduled: their destination key is not a list: %s "
                "(rename it out of the way, and they move)",
                self.name,
                result.wrongtype,
                ", ".join(map(repr, result.wrongtype_dests)),  # (a key name may hold a newline)
            )
        if result.refused:
            logger.warning(
                "mover %s: %d due messages stay scheduled: this user's ACL refuses LPUSH onto %s "
                "(grant it those keys, `ACL SETUSER <user> ~<key>`); the other queues' messages move",
                self.name,
                result.refused,
                ", ".join(map(repr, result.refused_dests)),
            )
