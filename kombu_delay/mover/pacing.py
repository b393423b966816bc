"""How fast a mover goes: backoff after a failure, and the ``delay_max_rate`` token bucket."""

from __future__ import annotations

import random
import time

#: Most doublings a backoff applies: past any useful cap, and far from a float overflow.
MAX_DOUBLINGS = 30


class Backoff:
    """Exponential backoff with full jitter, for reconnecting without a crash loop."""

    def __init__(self, base: float = 0.1, cap: float = 5.0) -> None:
        self.base, self.cap, self.attempt = base, cap, 0

    def next(self) -> float:
        """Return the next delay, at most ``cap``; any number of calls is safe.

        The exponent is bounded: an unbounded one overflows a float after about 1024
        failures (an hour of outage), and the error would kill the mover it protects.
        """
        delay = min(self.cap, self.base * 2 ** min(self.attempt, MAX_DOUBLINGS))
        self.attempt += 1
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self.attempt = 0


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
