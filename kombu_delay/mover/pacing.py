"""How fast a mover goes: backoff after a failure, and the ``delay_max_rate`` token bucket; and
how often it tells a failure that lasts."""

from __future__ import annotations

import logging
import random
import re
import time

import redis

from kombu_delay.config import Settings
from kombu_delay.store.replies import MoveResult

#: Most doublings a backoff applies: past any useful cap, and far from a float overflow.
MAX_DOUBLINGS = 30
#: How often a mover looks while due messages wait (backpressure, a key that is not a list), seconds;
#: and at most this share of its time in those looks: each reads every queue of the buckets that
#: hold them, and with 10,000 queues in one, looks every 50 ms kept Redis 60 to 75 % busy.
HELD_POLL_S = 0.05
HELD_POLL_SHARE = 0.1


def sleep_after(result: MoveResult, settings: Settings, call_s: float) -> float:
    """How long a mover sleeps after a move call that took ``call_s`` and gave ``result``."""
    cap = settings.max_sleep_ms / 1000
    if result.held or result.wrongtype or result.refused or result.more:
        # Messages that must wait (a full list, a key not a list, a refused one) are due: they
        # are the earliest scheduled and no publish of a later one wakes the movers: poll,
        # or every other queue's messages would be up to max_sleep late.
        if result.moved == 0 and not result.more:  # nothing but the waiting: a share of the time
            return min(cap, max(HELD_POLL_S, call_s / HELD_POLL_SHARE))
        return min(cap, HELD_POLL_S)
    if result.next_due_ms is None:
        return cap
    # Redis times the wait, in µs: due_ms is reached when now_ms + now_us/1000 >= due_ms.
    until_due = (result.next_due_ms - settings.look_ahead_ms - result.now_ms) - result.now_us / 1000
    return max(0.0, min(cap, until_due / 1000))


class Backoff:
    """Exponential backoff with full jitter, for reconnecting without a crash loop."""

    def __init__(self, base: float = 0.1, cap: float = 5.0) -> None:
        self.base, self.cap, self.attempt = base, cap, 0
        self.since: float | None = None  # monotonic: the first failure since the last reset

    def next(self, began: float | None = None) -> float:
        """Return the next delay, at most ``cap``; any number of calls is safe. ``began``: when
        the attempt that failed began (monotonic), where it may have waited long to fail (a
        call on a Redis that stopped answering): the failures are timed from there, not from
        when it told.

        The exponent is bounded: an unbounded one overflows a float after about 1024
        failures (an hour of outage), and the error would kill the mover it protects.
        """
        delay = min(self.cap, self.base * 2 ** min(self.attempt, MAX_DOUBLINGS))
        self.attempt += 1
        if self.since is None:
            self.since = time.monotonic() if began is None else began
        return random.uniform(delay / 2, delay)

    def reset(self) -> float | None:
        """Start again from the base; return how long the failures went on, seconds (``None``
        where there was none since the last reset)."""
        since, self.attempt, self.since = self.since, 0, None
        return None if since is None else time.monotonic() - since


#: How often a failure that lasts (Redis away, or refusing writes) is logged again, seconds.
FAILURE_REPEAT_S = 60.0


def failure_kind(exc: BaseException) -> tuple[object, ...]:
    """What makes a failure another one, to be told at once: its class, and for a reply of
    Redis, its error code (``NOREPLICAS``, ``MISCONF``: one class, kombu-delay's ``RedisRefused``,
    holds them all) and the keys it names (a key of another type, then another)."""
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return (type(exc),)  # (its words vary from try to try: "[SSL: ...]", then "EOF occurred")
    text = str(exc)
    code = re.search(r"\b[A-Z][A-Z_]{2,}\b", text)
    return (type(exc), code and code.group(), tuple(re.findall(r"'[^']*' holds", text)))


class Repeats:
    """Tells a failure that lasts: at once where its kind is new, then once per ``every``
    seconds while it lasts, marked "(still)", the tries between at debug level (a Redis that
    refused writes for minutes had a WARNING at every retry, a mover started before its Redis
    one every 5 s). Its end is the caller's to tell, where :meth:`over` says one was told."""

    def __init__(self, logger: logging.Logger, every: float = FAILURE_REPEAT_S) -> None:
        self.logger, self.every = logger, every
        self._told: tuple[object, float] | None = None  # (kind, when: monotonic s)

    def tell(self, level: int, kind: object, text: str, now: float | None = None) -> None:
        """Log ``text`` at ``level`` for a failure of ``kind`` (:func:`failure_kind`, say), or
        at debug level where one of that kind was told less than ``every`` seconds before."""
        now = time.monotonic() if now is None else now
        told = self._told
        if told is not None and told[0] == kind and now - told[1] < self.every:
            self.logger.debug("%s", text)
            return
        self.logger.log(level, "%s%s", text, " (still)" if told is not None and told[0] == kind else "")
        self._told = (kind, now)

    def over(self) -> bool:
        """Forget the failure told, if any: ``True`` where there was one (its end is to be told)."""
        told, self._told = self._told, None
        return told is not None


class RateLimiter:
    """Token bucket for ``delay_max_rate``; ``rate`` 0 means unlimited."""

    def __init__(self, rate: int, burst: int) -> None:
        self.rate = rate
        self.capacity = float(max(1, min(burst, rate or burst)))
        self.tokens = self.capacity
        self.stamp = time.monotonic()

    def allowance(self) -> int:
        """Return how many messages may move now (refilling first)."""
        if not self.rate:
            return int(self.capacity)
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        return int(self.tokens)

    def spend(self, n: int) -> None:
        if self.rate:
            self.tokens -= n

    def wait_for_one(self) -> float:
        """Seconds until one token is available."""
        if not self.rate or self.tokens >= 1:
            return 0.0
        return (1 - self.tokens) / self.rate
