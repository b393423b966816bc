"""The mover loop: sleep until the next due time, then move due messages in bounded batches.

It keeps a client-side timer (precise to the millisecond, unlike a blocking
Redis timeout) and a pub/sub subscription that a publish uses to wake it for an
earlier message. Its sleep is capped, so a lost wake-up cannot stall it for
long, and its connection has socket timeouts unless the options set their own, so
a server that stops answering cannot either. "Due" is judged inside the move
script by the Redis clock alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from kombu_delay.config import Settings
from kombu_delay.errors import FATAL_ERRORS, RedisRefused, WrongTypeKey, translated
from kombu_delay.mover import mover_id
from kombu_delay.mover.pacing import Backoff, RateLimiter, Repeats, failure_kind, sleep_after
from kombu_delay.mover.stage import Stager
from kombu_delay.mover.tally import HEARTBEAT_GONE, Tally
from kombu_delay.mover.thaw import Thawer
from kombu_delay.mover.threads import start_daemon
from kombu_delay.mover.wake import WakeUps
from kombu_delay.mover.watch import Watch
from kombu_delay.ops.checks import Findings
from kombu_delay.store import Store
from kombu_delay.store.replies import MoveResult, SweepResult, ThawResult

logger = logging.getLogger(__name__)

#: Longest single wait slice, so a stop request is seen promptly, seconds.
STOP_SLICE_S = 0.25
#: Longest a stopping mover waits for Redis to take its heartbeat away, seconds.
FORGET_WAIT_S = 2.0
#: What a mover on a replica is told to do.
ON_A_REPLICA = (
    "give it the master's address (or Sentinel's: delaysentinel://); it moves once this one is promoted"
)
#: How often, at least, a mover sweeps every bucket (sweep.lua: it pushes out the expiry of
#: what it holds, and settles buckets found gone), seconds.
SWEEP_EVERY_S = 60.0
#: Buckets per sweep call (and at most ``SWEEP_SETS`` of their queues' sets, see
#: :mod:`kombu_delay.store.move`): a call of a few queues takes about a millisecond.
SWEEP_PAGE = 500
#: A sweep takes at most this share of a mover's time, however many buckets there are: a
#: cycle that took ``t`` seconds of calls starts again ``t / SWEEP_SHARE`` later at the soonest.
SWEEP_SHARE = 0.02


class Mover:
    """Moves due messages of one :class:`Store` until :meth:`stop` is called."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        *,
        name: str | None = None,
        on_result: Callable[[MoveResult], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        on_thaw: Callable[[ThawResult], None] | None = None,
        on_sweep: Callable[[SweepResult], None] | None = None,
        on_findings: Callable[[Findings], None] | None = None,
        watch: bool = True,
        logged: dict[str, tuple[str, float]] | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.name = name or mover_id()
        #: Its totals (``stats``) and the log lines of its results.
        self.tally = Tally(self.name, settings.batch_size, on_result, on_sweep)
        self.stats = self.tally.stats
        self._stop = threading.Event()
        self._on_error = on_error
        self._limiter = RateLimiter(settings.max_rate, settings.batch_size)
        self._last_beat = float("-inf")  # (-inf until its first heartbeat)
        self._called_at = time.monotonic()
        self._call_s = 0.0  # how long the last move call took
        #: The thaw of compressed messages, planned from what the cold space holds.
        self.thawer = Thawer(store, settings, self.name, self.stats, on_thaw, on_error=self.told)
        #: The copy of each herd, ahead of its due time, that a move hands over whole.
        self.stager = Stager(store, settings, self.name, thaw_rate=self.thawer.rate, told=self.told)
        self._sweep_cursor: str | None = None
        self._next_sweep = float("-inf")
        self._sweep_began = self._sweep_busy = 0.0
        #: The failures of its rounds, told once a minute while they last; and its move calls
        #: that came late.
        self._failures, self._late = Repeats(logger), Repeats(logger)
        #: The background checks (eviction policy, stranded key prefixes); ``None`` when off.
        #: ``logged``: what they told, kept by a caller that runs one Mover after another.
        self.watch = Watch(store, self.name, on_findings, logged) if watch else None

    def stop(self) -> None:
        """Ask the loop to finish the batch in hand and return."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        """Run until :meth:`stop`. Redis trouble is logged, backed off from and retried,
        except what waiting cannot fix: refused credentials (:class:`RedisAuthError`) and an
        ACL that denies a command or key (:class:`RedisPermissionError`) are raised."""
        logger.info("mover %s started (prefix %r)", self.name, self.store.prefix)
        if self.watch is not None:
            self.watch.start()
        try:
            self._loop()
        finally:
            # On every way out, a fatal error's too: the checks use this store's connections,
            # which the caller then closes (an embedded mover starts a new one to retry); and a
            # stopped mover leaves no heartbeat (a silent Redis gets FORGET_WAIT_S; it ages out).
            if self.watch is not None:
                self.watch.stop()
            start_daemon(self._forget, "kombu-delay-forget").join(FORGET_WAIT_S)
        logger.info("mover %s stopped after moving %d messages", self.name, self.stats.moved)

    def _forget(self) -> None:
        try:
            self.store.forget_mover(self.name)
        except Exception:  # the server may be gone at shutdown
            logger.debug("mover %s: could not remove its heartbeat", self.name, exc_info=True)

    def _loop(self) -> None:
        """The loop of :meth:`run`, until :meth:`stop` or a fatal error (raised)."""
        backoff = Backoff()
        wake = WakeUps(self.store, self.name)
        wake.open(quiet=True)  # before the first calls, so a publish made meanwhile wakes it
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                result = self.drain()
                thaw_in = self.thaw()
                sweep_in = self.sweep()
                stage_in = self.stager.step()
                wake.open()  # again after the calls: at maxclients, the connection they need first
                failed_for = backoff.reset()
                if failed_for is not None:  # the end of an outage, or of a refusal, told too
                    self._failures.over()
                    logger.info(
                        "mover %s: Redis calls succeed again, after %.0f s (on %s)",
                        *(self.name, failed_for, self.store.address()),
                    )
                self._wait(wake, min(self._sleep_for(result), thaw_in, sweep_in, stage_in, self._beat_in()))
            except Exception as exc:  # the top of the loop: log, back off, reconnect
                self.told(exc)
                wake.close()
                if isinstance(exc, FATAL_ERRORS):
                    # In kombu-delay's words, which the CLI prints without a traceback: a password
                    # refused on a reconnect (the wake-up subscription's, say) came raw.
                    fatal = translated(exc)
                    logger.error("mover %s: %s; stopping", self.name, fatal)
                    if fatal is exc:
                        raise
                    raise fatal from exc
                if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
                    self.store.close_idle()  # (the next round's connect may need their place)
                    cause = str(exc).removeprefix("Redis is unavailable: ")  # (translated_errors' words)
                    self._tell_failure(exc, logging.WARNING, f"Redis unavailable ({cause})")
                elif isinstance(exc, RedisRefused):  # a read-only replica, maxmemory, a failing
                    # disk: Redis wrote nothing, and waiting may fix it: no unexpected error.
                    self._tell_failure(exc, logging.WARNING, str(exc))
                elif isinstance(exc, WrongTypeKey):  # a key written by hand: named where it can be
                    self._tell_failure(exc, logging.ERROR, f"{exc}{self.store.misshapen_told()}")
                else:
                    logger.exception("mover %s: unexpected error; retrying", self.name)
                # (Timed from the round's last move call, or the round's start: a call may wait
                # long on a Redis that stopped answering before it fails.)
                self._stop.wait(backoff.next(max(began, self._called_at)))
        wake.close()

    def _tell_failure(self, exc: BaseException, level: int, text: str) -> None:
        """Log a failed round, at once where its kind is new, else once a minute (:class:`Repeats`)."""
        self._failures.tell(level, failure_kind(exc), f"mover {self.name}: {text}; retrying")

    def told(self, exc: BaseException) -> None:
        """Count a failed or refused call of this mover, in its errors and the metrics (Redis's
        ``kombu_delay_redis_errors_total``, another's ``kombu_delay_mover_errors_total``)."""
        self.stats.errors += 1
        if self._on_error is not None:
            self._on_error(exc)

    def drain(self) -> MoveResult:
        """Move until nothing is due (or the rate cap or a stop request says wait).

        Heartbeats are written in here, not between drains: a long backlog (a rate cap,
        catching up after an outage) keeps this loop busy for minutes, and a probe must
        not take a working mover for a dead one.
        """
        while True:
            self._beat()
            allowance = self._limiter.allowance()
            if allowance < 1:
                time.sleep(min(self._limiter.wait_for_one(), STOP_SLICE_S))
                continue
            # The reply's Redis clock was read just after this instant; sleeps are timed
            # from here, not from when the reply was parsed, or every wake-up is late by
            # the round trip and the parsing.
            self._called_at = time.monotonic()
            result = self.store.move_due(
                min(self.settings.batch_size, allowance),
                self.settings.max_queue_length,
                look_ahead_ms=self.settings.look_ahead_ms,
                whole=not self.settings.max_rate,
                exact_ms=self.settings.max_sleep_ms,  # (a lower bound past its longest sleep)
            )
            self._call_s = time.monotonic() - self._called_at
            if result.late:
                self._came_late()
            self._account(result)
            self.thaw()  # a long backlog must not keep compressed messages from their thaw
            self.sweep()  # nor what it holds from having its expiry pushed out
            if not result.more or result.moved == 0 or self._stop.is_set():
                return result

    def thaw(self) -> float:
        """Restore one batch of the compressed messages due soon, when it is time to look;
        return the seconds until the next look (see :class:`~kombu_delay.mover.thaw.Thawer`)."""
        return self.thawer.step()

    def sweep(self) -> float:
        """Run one page of the sweep when one is due; return the seconds until the next page.

        A cycle walks every bucket of both spaces, a page per call, between drains: it gives
        each bucket its grace again from now (so nothing this mover holds back expires, however
        long it is held) and settles the counts of buckets found gone. A cycle starts every
        :data:`SWEEP_EVERY_S`, or less often when pages take longer than :data:`SWEEP_SHARE`
        of the time.
        """
        now = time.monotonic()
        if self._sweep_cursor is None:
            if now < self._next_sweep:
                return self._next_sweep - now
            self._sweep_cursor, self._sweep_began, self._sweep_busy = "", now, 0.0
        try:
            result = self.store.sweep(self._sweep_cursor, SWEEP_PAGE)
        except RedisRefused as exc:  # a read-only replica, say: the next cycle tries again
            self.told(exc)
            logger.warning("mover %s: sweep refused (%s); retrying in %.0f s", self.name, exc, SWEEP_EVERY_S)
            self._sweep_cursor, self._next_sweep = None, now + SWEEP_EVERY_S
            return SWEEP_EVERY_S
        except redis.ResponseError as exc:  # a key of another type (by hand), a script's error
            if isinstance(exc, FATAL_ERRORS):
                raise
            self.told(exc)
            logger.error(
                "mover %s: sweep failed (%s%s); moves go on, retrying in %.0f s",
                self.name,
                exc,
                self.store.misshapen_told(),
                SWEEP_EVERY_S,
            )
            self._sweep_cursor, self._next_sweep = None, now + SWEEP_EVERY_S
            return SWEEP_EVERY_S
        self._sweep_busy += time.monotonic() - now
        self.tally.sweep(result)
        if result.cursor:
            self._sweep_cursor = result.cursor
            return 0.0
        self._sweep_cursor = None
        self._next_sweep = self._sweep_began + max(SWEEP_EVERY_S, self._sweep_busy / SWEEP_SHARE)
        return max(0.0, self._next_sweep - time.monotonic())

    def _sleep_for(self, result: MoveResult) -> float:
        return sleep_after(result, self.settings, self._call_s)

    def _wait(self, wake: WakeUps, seconds: float) -> None:
        """Sleep ``seconds`` from the last move call on the local clock, or less if a
        publish wakes us."""
        deadline = self._called_at + seconds
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if not wake.subscribed:
                self._stop.wait(min(left, STOP_SLICE_S))
            elif wake.wait(min(left, STOP_SLICE_S)):
                self.thawer.wake()  # it may announce a compressed message: look
                return

    def _beat_in(self) -> float:
        """Seconds from the last move call (where :meth:`_wait` counts from) until the next
        heartbeat is due: an interval shorter than ``max_sleep`` is kept, and a longer one adds
        no wake-up (counted from now, it woke the mover a call's time before its next look)."""
        return max(0.0, self._last_beat + self.settings.heartbeat_interval_ms / 1000 - self._called_at)

    def _beat(self) -> None:
        """Record a heartbeat if the last is a heartbeat interval old; cheap to call per batch."""
        now = time.monotonic()
        if now - self._last_beat >= self.settings.heartbeat_interval_ms / 1000:
            # A replica that takes writes (replica-read-only no) refuses none of a move's: what
            # moved there stayed scheduled on its master, and ran twice. No mover moves on a
            # replica (one that takes none refuses every move anyway). Told as a refusal.
            replica = self.store.replica_of()
            if replica is not None:
                # Through Sentinel, a connection to a replica is one to a master it demoted: find
                # the master again (a move's READONLY made redis-py do it; this refusal does not).
                self.store.find_master_again()
                self.store.close_idle()
                raise RedisRefused(f"{replica}: a mover moves only on a master; {ON_A_REPLICA}")
            _, recorded = self.store.heartbeat(self.name)
            if not recorded and self._last_beat > float("-inf"):
                logger.warning(HEARTBEAT_GONE, self.name)
            self._last_beat = now

    def _came_late(self) -> None:
        """A move call ran past its deadline, and moved nothing: the server read it late (paused,
        or too busy), and may be a master no more. Told first, then, through Sentinel, the master
        is asked for again (Sentinel may name none yet: that failure goes to the loop's backoff)."""
        self._late.tell(
            logging.WARNING,
            "late",
            f"mover {self.name}: a move call ran {self._call_s:.1f} s after it was sent, past its "
            "deadline, and moved nothing (Redis paused, or too busy to run it: where a failover "
            "promoted a replica meanwhile, what it would have pushed a worker still on the old "
            f"master would take, and the new master's movers move again); it was on "
            f"{self.store.address()}, and the next call allows longer",
        )
        self.store.find_master_again()

    def _account(self, result: MoveResult) -> None:
        self._limiter.spend(result.moved)
        self.tally.move(result)
