"""A mover's staging: each herd copied, ahead of its due time, into the list a move hands
over whole.

A move pushes due messages in batches, some 100,000 a second: a million due at one instant
would reach their list over ten seconds. So a mover looks, once a second, at the first
ordinary buckets for a run of at least :data:`MIN_RUN` messages due at one millisecond
(a nightly job's reminders, a campaign), and copies it, a batch per step between its
drains, into a list that ``move.lua`` renames onto the destination when the run is due:
the whole herd arrives at once, on time (``_staged.lua`` says what keeps the copy right).

A run is staged no earlier than it must be: its lead grows with its size, as a thaw's does,
at a rate assumed low (:data:`RATE`), or at the mover's own, measured, where that is lower:
its copies' rate once it has made one, and before that its thaws' (a copy is the cheaper of
the two per message: on a machine too busy to copy at :data:`RATE`, a herd just thawed is
then copied at once). Not earlier, since the copy holds the herd twice in Redis's memory
until it is due. Nor while the run changes from one plan to the next: a herd still being
published would drop its copy with each publish due at its millisecond. Under ``maxmemory`` a
run is staged only when its copy fits in what is free below :data:`MEMORY_SHARE` of it, as
``MEMORY USAGE`` estimates its set (from a sample: a herd whose first members are small reads
smaller than it is), and each step looks again: a copy that has taken Redis past that share
is dropped, and its herd moves in batches; with ``delay_max_rate`` or
``delay_max_queue_length`` nothing is (a handover would pass either). Several movers may
stage the same run: each call goes on where the last one stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kombu_delay.config import Settings
from kombu_delay.errors import RedisRefused, WrongTypeKey
from kombu_delay.mover import thaw_plan
from kombu_delay.store import Store
from kombu_delay.store.replies import Staged

logger = logging.getLogger(__name__)

#: A run of fewer messages due at one millisecond is left to the batches, which move it in
#: a fraction of a second.
MIN_RUN = 10_000
#: Members one staging step copies: one script call of some 10 ms.
STAGE_BATCH = 2_000
#: Staging rate a plan assumes, messages/s (one mover copies more than 100,000 a second on a
#: 2-core machine, some 35,000 with six busy processes beside it): low, so a herd's copy is
#: ready early rather than late. A mover that measures a lower rate plans with that.
RATE = 20_000.0
#: Ordinary buckets a plan reads, earliest first (one ``HGETALL`` each, once a second).
PLAN_BUCKETS = 64
#: A copy is made only while Redis's memory stays under this share of ``maxmemory`` with it.
MEMORY_SHARE = 0.8


class Stager:
    """The staging of one mover: which runs to copy, one batch per step."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        name: str,
        monotonic: Callable[[], float] = time.monotonic,
        min_run: int = MIN_RUN,
        thaw_rate: thaw_plan.Rate | None = None,
        told: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.store = store
        self.name = name
        #: Counts a refused call (the mover's errors, and the metrics').
        self.told = told
        self.monotonic = monotonic
        self.min_run = min_run
        #: With ``delay_look_ahead`` a run is moved that long before its due time, and so must
        #: be copied that much earlier, ms.
        self.look_ahead_ms = settings.look_ahead_ms
        #: Off with a rate cap or a queue-length cap, and once the ACL has refused a handover.
        self.enabled = not settings.max_rate and not settings.max_queue_length
        #: Runs (bucket start, destination) to copy now, first first.
        self._work: list[tuple[int, str]] = []
        #: Runs staged whole or found too small, by their destination's count then: looked at
        #: again only when that count changes.
        self._settled: dict[tuple[int, str], int] = {}
        #: Each destination's count in each bucket, as the last plan read them.
        self._count_of: dict[tuple[int, str], int] = {}
        #: Members in the copy of the run in hand after its last step.
        self._copied = 0
        #: Whether the last plan found Redis under ``maxmemory``: each copy step looks again.
        self._capped = False
        #: The run (its due ms and size) each destination's set held when last looked at.
        self._seen: dict[tuple[int, str], tuple[int, int]] = {}
        #: Runs told as not copied for Redis's memory (told once each).
        self._unfit: set[tuple[int, str]] = set()
        self._next_plan = float("-inf")
        self._refused_logged_at = float("-inf")
        #: This mover's copy rate, measured over its back-to-back copy steps.
        self.rate = thaw_plan.Rate(RATE)
        #: Its thaw's, which stands for it until a copy has been measured.
        self.thaw_rate = thaw_rate
        self._step: tuple[float, int] | None = None  # (began, copied) of a step that left more

    def step(self) -> float:
        """Copy one batch of the first run that needs it; return the seconds until the next step."""
        if not self.enabled:
            return thaw_plan.PLAN_EVERY_S * 60
        now = self.monotonic()
        if self._step is not None:
            began, copied = self._step
            self.rate.add(copied, now - began)
            self._step = None
        try:
            if not self._work and now >= self._next_plan:
                self._plan()
                self._next_plan = now + thaw_plan.PLAN_EVERY_S
            if not self._work:
                return max(0.0, self._next_plan - now)
            copied = self._copy(*self._work[0])
            if copied:
                self._step = (now, copied)
        except (RedisRefused, WrongTypeKey) as exc:
            # maxmemory, say: a copy grows memory; or the set replaced by a key of another type
            # (by hand) since the plan: moves go on, and the plan is made again.
            if self.told is not None:
                self.told(exc)
            if now - self._refused_logged_at >= thaw_plan.PLAN_EVERY_S * 10:
                logger.warning("mover %s: staging refused (%s); herds move in batches", self.name, exc)
                self._refused_logged_at = now
            self._work.clear()
            self._copied = 0
            self._next_plan = now + thaw_plan.PLAN_EVERY_S
        return 0.0 if self._work else max(0.0, self._next_plan - now)

    def _copy(self, start_ms: int, dest: str) -> int:
        """Copy one batch of the run; return how many it copied when the run has more to copy."""
        run = (start_ms, dest)
        if not self._copied:
            # Before a copy begins: its run must be what the last plan found, or it may be a
            # herd still being published, each of whose publishes would drop the copy.
            looked = self.store.stage(start_ms, dest, 0, self.min_run)
            seen, self._seen[run] = self._seen.get(run), (looked.due_ms, looked.run)
            if looked.outcome is Staged.MORE and not looked.staged and seen != (looked.due_ms, looked.run):
                self._work.pop(0)  # looked at again in the next plan
                return 0
        if self._capped and not self.store.memory_free(MEMORY_SHARE):
            self._drop(run)
            return 0
        result = self.store.stage(start_ms, dest, STAGE_BATCH, self.min_run)
        if result.outcome is Staged.MORE and result.staged > self._copied:
            if not self._copied:
                logger.info(
                    "mover %s: copying a herd of %d messages for %r, due in %.1f s, to hand it over whole",
                    self.name,
                    result.run,
                    dest,
                    (result.due_ms - self.store.time_ms()) / 1000,
                )
            copied, self._copied = result.staged - self._copied, result.staged
            return copied
        # Done, or no run, or refused; or the copy began again (a publish at the run's
        # millisecond dropped it): then the plans wait until the run has settled.
        self._work.pop(0)
        self._copied = 0
        if result.outcome is Staged.REFUSED:
            self.enabled = False
            logger.warning(
                "mover %s: the ACL refuses what a herd's handover needs (RENAME, UNLINK, PERSIST, "
                "PEXPIRE, LINDEX, ZRANGESTORE); herds move in batches",
                self.name,
            )
        elif result.outcome is not Staged.MORE:
            self._settled[run] = self._count_of.get(run, -1)
        return 0

    def _drop(self, run: tuple[int, str]) -> None:
        """Give up the copy of ``run``, which has taken Redis past :data:`MEMORY_SHARE` of its
        ``maxmemory``: delete it (it would hold that memory until its herd is due), and leave
        the run to the batches until its count changes."""
        start_ms, dest = run
        self._work.pop(0)
        self._copied = 0
        self._settled[run] = self._count_of.get(run, -1)
        self.store.drop_staged(start_ms, dest)
        logger.warning(
            "mover %s: Redis's memory passed %d %% of its maxmemory while copying a herd for %r; "
            "its copy is dropped, and it moves in batches",
            self.name,
            MEMORY_SHARE * 100,
            dest,
        )

    def assumed_rate(self) -> float:
        """The copy rate a plan assumes, messages/s: :data:`RATE`, or the lower rate this mover
        measured, of its copies, or before it has measured one, of its thaws."""
        if self.rate.measured:
            return min(RATE, self.rate.per_s)
        if self.thaw_rate is not None and self.thaw_rate.measured:
            return min(RATE, self.thaw_rate.per_s)
        return RATE

    def _tell_unfit(self, run: tuple[int, str], size: int | None, free: int) -> None:
        """Say once that ``run`` is not copied for Redis's memory: its herd moves in batches."""
        if run in self._unfit:
            return
        self._unfit.add(run)
        why = (
            "its size cannot be read (MEMORY USAGE refused)"
            if size is None
            else f"its copy ({size / 2**20:,.1f} MB) would take Redis past {MEMORY_SHARE:.0%} of its "
            f"maxmemory ({free / 2**20:,.1f} MB free below it)"
        )
        logger.info(
            "mover %s: a herd of %d messages for %r is not copied ahead, as %s: it moves in batches",
            self.name,
            self._count_of.get(run, 0),
            run[1],
            why,
        )

    def _plan(self) -> None:
        """Read the first ordinary buckets' counts and list the runs to copy now."""
        now_ms, buckets = self.store.ordinary_buckets(PLAN_BUCKETS)
        counts = {(b.start_ms, dest): n for b in buckets for dest, n in b.dests}
        self._settled = {run: n for run, n in self._settled.items() if counts.get(run) == n}
        self._seen = {run: seen for run, seen in self._seen.items() if run in counts}
        self._unfit &= counts.keys()
        self._count_of = counts
        rate = self.assumed_rate()

        def ahead(run: tuple[int, str], at: int) -> bool:  # its lead has come, were it due at ``at``
            return at - self.look_ahead_ms - now_ms <= thaw_plan.lead_ms(counts[run], rate)

        # By its bucket's start first (nothing in it is due sooner), then by the set's first
        # message: a herd late in its bucket is copied its lead before its own due time, not
        # the bucket's start, which held it twice in memory up to a bucket's width longer.
        due = [
            run
            for run, n in counts.items()
            if n >= self.min_run and run not in self._settled and ahead(run, run[0])
        ]
        # A set found empty, gone or of another type (by hand) has no head, and nothing to copy.
        heads = self.store.heads_due(due) if due else {}
        due = [run for run in due if run in heads and ahead(run, heads[run])]
        free = self.store.memory_free(MEMORY_SHARE) if due else None
        self._capped = free is not None
        for start_ms, dest in due:
            if free is not None:
                size = self.store.set_memory(start_ms, dest)
                if size is None or size > free:
                    self._tell_unfit((start_ms, dest), size, free)
                    continue
                free -= size
            self._work.append((start_ms, dest))
