"""Redis's clock as a publisher sees it, without asking Redis on every publish.

Whether a message is due is Redis's clock's to say: a publish asks it (``TIME``, inside
``schedule.lua``) before it pushes a message due now. That question is a good part of a
publish's Redis CPU, and almost every delayed message is due minutes or days ahead, where the
answer is certain. So a publisher reads Redis's clock once every :data:`REFRESH_S` seconds,
keeps its offset from this machine's monotonic clock, and gives the script the estimate as the
time to judge by when the message is due at least :data:`MARGIN_MS` after it. The script then
stores the message and never pushes it, whatever the estimate's error: a message is never
delivered early. Were the estimate late by more than the margin (a clock stepped since the
last reading), a message already due would be stored rather than pushed, and the mover would
push it at once. A nearer due time, or no estimate, leaves the judging to Redis's own clock.
The same estimate lets a publisher push a message due at least :data:`MARGIN_MS` before it at
once, as plain kombu would, without a script call; one due later than that goes through the
script, which judges it by Redis's clock. Only a step back of Redis's own clock (or a failover
to a server whose clock is behind) by more than the margin since the last reading could make
that push early.
The clock is read again as soon as this machine's wall clock and its monotonic one part (a
suspended machine, whose monotonic clock stood still, or a wall clock stepped); a step of
Redis's own clock, or a failover to a server whose clock differs, goes unseen until the next
reading. Whatever the error, the expiries a publish sets are set by Redis's clock: a
message the estimate took for one due ahead that is long overdue (by more than
``delay_grace``) is still kept until the mover pushes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

#: Seconds between two readings of Redis's clock (one ``TIME`` round trip each).
REFRESH_S = 10.0
#: A message due at least this many ms after the estimate is judged by it (see the module's
#: docstring); a nearer one by Redis's clock, inside the script.
MARGIN_MS = 1000
#: A reading whose round trip took longer than this many seconds is not used: the estimate is
#: off by up to half a round trip.
MAX_ROUND_TRIP_S = 0.1
#: Seconds by which this machine's wall clock and monotonic clock may part between two readings
#: before the estimate is read again.
MAX_PARTING_S = 0.5


class RedisClock:
    """Redis's clock, estimated from one reading every :data:`REFRESH_S` seconds."""

    def __init__(
        self,
        client: redis.Redis,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self._monotonic = monotonic
        self._wall = wall
        #: Redis's clock minus this machine's monotonic one, ms (``None``: no usable reading).
        self._offset_ms: float | None = None
        #: This machine's monotonic and wall clocks at the last reading.
        self._read_at: tuple[float, float] | None = None

    def estimate_ms(self) -> float | None:
        """Redis's clock now, epoch ms, as estimated here; ``None`` when there is no usable
        reading (the last round trip was too slow)."""
        now = self._monotonic()
        if self._stale(now):
            self._read()
            now = self._monotonic()
        return None if self._offset_ms is None else now * 1000 + self._offset_ms

    def _stale(self, now: float) -> bool:
        if self._read_at is None:
            return True
        monotonic_at, wall_at = self._read_at
        elapsed = now - monotonic_at
        return elapsed >= REFRESH_S or abs(self._wall() - wall_at - elapsed) > MAX_PARTING_S

    def judge_by(self, due_ms: int) -> int | None:
        """The time a publish of a message due at ``due_ms`` is judged by: the estimate (epoch
        ms) when the message is due at least :data:`MARGIN_MS` after it, else ``None`` (Redis's
        clock)."""
        estimate = self.estimate_ms()
        if estimate is None or due_ms < estimate + MARGIN_MS:
            return None
        return int(estimate)

    def surely_past(self, due_ms: int) -> bool:
        """True when a message due at ``due_ms`` is due by the estimate with :data:`MARGIN_MS`
        to spare: a publisher then pushes it itself, as plain kombu would, with no script call.
        False when nearer, or with no usable reading: the script judges it by Redis's clock."""
        estimate = self.estimate_ms()
        return estimate is not None and due_ms <= estimate - MARGIN_MS

    def _read(self) -> None:
        before = self._monotonic()
        sec, usec = self.client.time()
        after = self._monotonic()
        self._read_at = (after, self._wall())
        if after - before > MAX_ROUND_TRIP_S:
            self._offset_ms = None
            return
        self._offset_ms = int(sec) * 1000 + int(usec) / 1000 - (before + after) / 2 * 1000


#: How long after it is sent a move call may still run, at first, ms: far longer than a call
#: waits for its turn on a Redis that answers, far shorter than a failover takes.
LEAST_WAIT_MS = 1000
#: The longest it may, where the client has no ``socket_timeout``, ms.
NO_TIMEOUT_WAIT_MS = 60_000


class GiveUp:
    """How late a move call may run, by Redis's clock: its deadline.

    A call sent to a server that then stops answering for a while (paused, a frozen VM, a
    network cut) runs when the server reads it, however late; by then a failover may have
    promoted a replica, where its mover, once it finds the new master, moves the same messages
    again, while a worker still waiting on the old server takes what the late call pushed
    there: both run. So a call moves nothing past its deadline (``move.lua``):
    :data:`LEAST_WAIT_MS` after it is sent, by Redis's clock as the last reply told it (read
    before Redis sent that reply, so the deadline comes no later than meant, unless Redis's
    clock steps back, or a failover brings a server whose clock is behind). A call refused so
    has its mover ask for the master again; the next allows twice as long, up to the client's
    ``socket_timeout``, when it gives up anyway (so a Redis too busy to run calls within a
    second still has them run), and a call in time brings it back to the least.
    """

    def __init__(self, client: redis.Redis, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
        #: The longest a call may wait for its turn, ms: until its client gives up.
        self.longest_ms = (
            NO_TIMEOUT_WAIT_MS if not timeout else max(LEAST_WAIT_MS, int(float(timeout) * 1000))
        )
        #: How long the next call may, ms.
        self.allowed_ms = LEAST_WAIT_MS
        self._heard: tuple[int, float] | None = None  # (Redis's clock, ms; monotonic s)

    def heard(self, redis_ms: int, late: bool | None = None) -> None:
        """Note Redis's clock as a reply told it, just received; ``late``: a move call's, which
        came past its deadline (so moved nothing), or in time (``False``); ``None``: another
        call's, which tells nothing of how long a move may wait."""
        self._heard = (redis_ms, self._monotonic())
        if late is not None:
            self.allowed_ms = min(self.longest_ms, 2 * self.allowed_ms) if late else LEAST_WAIT_MS

    def deadline(self, sent_ms: int | None = None) -> str:
        """The deadline of a call sent now (at ``sent_ms`` by the clock it judges by, when that
        is not Redis's own), as a script argument: '' for none (no reply heard yet)."""
        if sent_ms is None:
            if self._heard is None:
                return ""
            at, received = self._heard
            sent_ms = at + int((self._monotonic() - received) * 1000)
        return str(sent_ms + self.allowed_ms)
