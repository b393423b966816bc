"""Counting arrivals honestly: by task id, on Redis's clock, and for a while after the last.

A scenario that stops reading at ``n`` arrivals misses a duplicate that comes later, and one
that counts by number lets a duplicate stand in for a message that never came. A sample
stamped by the bench after it read the list dates an arrival later than it was (an early one
can pass for on time). So here:

- :func:`tally` counts deliveries by id against the ids published;
- :class:`Sampler` reads the list (and the mover's ``moved`` counter) together with Redis's
  ``TIME`` in one ``MULTI``: each figure is stamped with the instant Redis read it;
- :func:`grace` keeps a scenario reading after its ``n``-th distinct arrival, until nothing
  is left scheduled and :data:`GRACE_S` more seconds have passed (bounded).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis

from kombu_delay.store import keys
from kombu_delay.tooling.bench.env import QUEUE, TASK_ID

#: Seconds a scenario keeps reading after its last expected arrival, for a late duplicate.
GRACE_S = 3.0
#: The longest a scenario waits for the store to hold nothing before its grace begins.
SETTLE_LIMIT_S = 30.0


def ids_of(raws: Iterable[bytes | str]) -> list[str]:
    """The task id of each Celery message in ``raws`` (those without one are left out)."""
    found = []
    for raw in raws:
        match = TASK_ID.search(raw if isinstance(raw, bytes) else raw.encode())
        if match:
            found.append(match.group(1).decode())
    return found


def list_ids(client: redis.Redis, key: str = QUEUE, chunk: int = 20_000) -> Counter[str]:
    """How many times each task id is on the list ``key``."""
    seen: Counter[str] = Counter()
    for begin in range(0, int(client.llen(key)), chunk):
        seen.update(ids_of(client.lrange(key, begin, begin + chunk - 1)))  # type: ignore[arg-type]
    return seen


def tally(delivered: Counter[str], published: Iterable[str]) -> dict[str, int]:
    """Deliveries counted by id: ``lost`` (published, never delivered), ``doubled`` (deliveries
    beyond the first of an id), ``stray`` (delivered, never published)."""
    wanted = set(published)
    return {
        "delivered": sum(delivered.values()),
        "distinct": len(wanted & set(delivered)),
        "lost": len(wanted - set(delivered)),
        "doubled": sum(count - 1 for count in delivered.values()),
        "stray": len(set(delivered) - wanted),
    }


def grace(ctx: Any, step: Callable[[], object], grace_s: float = GRACE_S, key: str = QUEUE) -> float:
    """Call ``step`` (a read of the list) until nothing is left scheduled for the list ``key``
    (at most :data:`SETTLE_LIMIT_S`), then for ``grace_s`` more seconds; return how long it read."""
    started = time.monotonic()
    limit = started + SETTLE_LIMIT_S
    while time.monotonic() < limit and ctx.store.pending([key]):
        step()
        time.sleep(0.02)
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        step()
        time.sleep(0.02)
    return time.monotonic() - started


#: How close to a due time a scenario reads the list without a pause between samples, ms: a
#: push between the last sample before a due time and that due time goes unseen, so that gap
#: is kept to a round trip where it matters, and told (:func:`early_seen`).
CLOSE_MS = 25.0


def pause_s(at_ms: float, dues: Sequence[int], far_s: float) -> float:
    """The pause before the next sample taken at Redis ms ``at_ms``: none within
    :data:`CLOSE_MS` before one of ``dues`` (sorted), else ``far_s``."""
    nxt = bisect.bisect_right(dues, at_ms)
    return 0.0 if nxt < len(dues) and dues[nxt] - at_ms <= CLOSE_MS else far_s


def early_seen(samples: Sequence[tuple[float, ...]], dues: Sequence[int], column: int) -> dict[str, float]:
    """Messages seen on the list before their due time: at each sample ``(Redis ms, ...)``, what
    its ``column`` (the list's length) holds beyond the messages due by then (``dues``, sorted,
    each message's own), the most of any sample; and ``early_blind_ms``, the longest a due time
    came after the last sample before it: a push within that gap before its due time is not seen
    (precision times each push by ``MONITOR`` instead, which a herd's pushes would slow)."""
    early, blind = 0, 0.0
    times = [s[0] for s in samples]
    for sample in samples:
        early = max(early, int(sample[column]) - bisect.bisect_right(dues, sample[0]))
    for due in sorted(set(dues)):
        before = bisect.bisect_left(times, due) - 1  # (samples are in time order)
        blind = max(blind, due - times[before] if before >= 0 else math.inf)
    return {"early": early, "early_blind_ms": blind}


class Sampler:
    """Reads keys in one ``MULTI`` with ``TIME``: each sample is ``(Redis ms, values...)``.

    ``reads`` are ``(command, key)``: ``llen``, ``zcard``, or ``moved`` (the mover's lifetime
    ``moved`` counter, its own record of what it pushed).
    """

    def __init__(self, ctx: Any, reads: list[tuple[str, str]]) -> None:
        self.client = ctx.probe.client
        self.totals = keys.totals(ctx.store.prefix)
        self.reads = reads

    def __call__(self) -> tuple[float, ...]:
        pipe = self.client.pipeline(transaction=True)
        pipe.time()
        for command, key in self.reads:
            if command == "moved":
                pipe.hget(self.totals, "moved")
            else:
                getattr(pipe, command)(key)
        (sec, usec), *values = pipe.execute()
        return (sec * 1000 + usec / 1000, *(int(v or 0) for v in values))


def move_span(samples: list[tuple[float, ...]], column: int, n: int) -> dict[str, Any]:
    """From samples ``(Redis ms, ...)`` whose ``column`` is the mover's ``moved`` counter:
    the Redis-clock span from the last sample before the first move to the first sample that
    saw ``n`` moved (an outer bound: never shorter than the move), its rate, and the largest
    gap between samples inside it (the resolution: a span of one or two gaps is not resolved)."""
    unmeasured: dict[str, Any] = {
        "move_span_ms": math.nan,
        "moved_per_s": math.nan,
        "move_sample_gap_ms": 0.0,
    }
    if not samples:
        return {**unmeasured, "move_resolved": False}
    start = samples[0][column]
    before = next((i for i, s in enumerate(samples) if s[column] > start), None)
    full = next((i for i, s in enumerate(samples) if s[column] - start >= n), None)
    if before is None or full is None:
        return {**unmeasured, "move_resolved": False}
    first = max(0, before - 1)
    span = samples[full][0] - samples[first][0]
    gaps = [samples[i + 1][0] - samples[i][0] for i in range(first, full)]
    return {
        "first_move_redis_ms": samples[first][0],
        "last_move_redis_ms": samples[full][0],
        "move_span_ms": span,
        "moved_per_s": n / (span / 1000) if span > 0 else math.nan,
        "move_sample_gap_ms": max(gaps, default=0.0),
        # Seen under way by at least two samples; else the move fell between two samples (a
        # herd handed over whole by one RENAME does) and its rate is a lower bound.
        "move_resolved": full - first >= 3,
    }


class PushMonitor:
    """Every push onto ``key`` by a script, with Redis's clock, by ``MONITOR``: an independent
    record of when each message reached the list (``pushes``: ``(Redis ms, task id)``).
    Cheap for a few hundred messages; not for a burst (every command is copied to it)."""

    def __init__(self, url: str, key: str = QUEUE) -> None:
        self.reader, self.other = redis.Redis.from_url(url), redis.Redis.from_url(url)
        self.key = key
        self.marker = f"bench-monitor-{uuid.uuid4()}"
        self.pushes: list[tuple[float, str]] = []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PushMonitor:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.started.wait(0.05):  # echoed until seen: from then on all is recorded
            if time.monotonic() > deadline:
                raise RuntimeError("MONITOR did not start")
            self.other.echo(f"{self.marker}-start")
        return self

    def _run(self) -> None:
        with self.reader.monitor() as monitor:  # type: ignore[no-untyped-call]
            while True:
                line = monitor.next_command()
                command = str(line["command"])
                if self.marker in command:
                    if command.endswith("-end"):
                        return
                    self.started.set()
                elif self._is_push(command):
                    at = float(line["time"]) * 1000
                    found = TASK_ID.findall(command.encode())
                    self.pushes += [(at, task_id.decode()) for task_id in found]

    def _is_push(self, command: str) -> bool:
        name, _, rest = command.partition(" ")
        return name.upper() in ("LPUSH", "RPUSH") and rest.partition(" ")[0] == self.key

    def __exit__(self, *exc: object) -> None:
        self.other.echo(f"{self.marker}-end")  # the last line the reader needs
        self.thread.join(60)
        self.reader.close()
        self.other.close()
