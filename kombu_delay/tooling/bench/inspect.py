"""Benchmark of inspection and control: cancel, find, reschedule, ls and stats latency by size.

:func:`measure` fills Redis with scheduled messages (pipelined ``schedule.lua``
calls, small payloads, due over the next day, Celery-style uuid task ids) up to
each size in turn, and times the operations from one client on loopback. The
figures show whether cost grows with the number scheduled; they are not tests.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kombu_delay.config import Settings
from kombu_delay.control import DelayControl
from kombu_delay.message import Due
from kombu_delay.tooling.redis_server import RedisServer

#: Key prefix of the benchmark's data, so it never mixes with an app's.
PREFIX = "kdbench:"
QUEUES = ("celery", "emails", "reports")


def _ms(fn: Callable[[], object], runs: int) -> dict[str, float]:
    times = []
    for _ in range(runs):
        begun = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begun) * 1000)
    ordered = sorted(times)
    return {
        "median_ms": round(statistics.median(ordered), 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
        "runs": runs,
    }


@contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    with RedisServer() as server:
        yield server.url


def _fill(ctl: DelayControl, count: int, ids: list[str], spread_ms: int, chunk: int = 10_000) -> float:
    """Schedule ``count`` more messages; return the seconds it took."""
    store = ctl.store
    settings = Settings()
    begun = time.perf_counter()
    done = 0
    while done < count:
        now = store.time_ms()
        items = []
        for _ in range(min(chunk, count - done)):
            task_id = str(uuid.uuid4())
            ids.append(task_id)
            due = now + 600_000 + random.randrange(spread_ms)
            payload = json.dumps({"id": task_id, "pad": "x" * 16})
            items.append((Due(due, task_id=task_id), PREFIX + random.choice(QUEUES), payload))
        store.schedule_many(items, settings, chunk=1000)
        done += len(items)
    return time.perf_counter() - begun


def measure(
    url: str | None = None,
    sizes: tuple[int, ...] = (10_000, 1_000_000),
    samples: int = 200,
    spread_hours: float = 24.0,
    seed: int = 6,
) -> dict[str, Any]:
    """Time cancel, find, reschedule, ls and stats at each size; return the figures.

    Without ``url`` a private redis-server is started and discarded. With ``url``,
    data goes under the ``kdbench:`` key prefix and is left there: flush afterwards.
    """
    state = random.getstate()  # the process's, for the scenarios after this one
    random.seed(seed)
    try:
        return _measured(url, sizes, samples, spread_hours)
    finally:
        random.setstate(state)


def _measured(url: str | None, sizes: tuple[int, ...], samples: int, spread_hours: float) -> dict[str, Any]:
    results: dict[str, Any] = {
        "method": __doc__,
        "samples": samples,
        "spread_hours": spread_hours,
        "sizes": {},
    }
    spread_ms = int(spread_hours * 3_600_000)
    with _redis(url) as where, DelayControl(where, {"global_keyprefix": PREFIX}) as ctl:
        store = ctl.store
        ids: list[str] = []
        for size in sorted(sizes):
            fill_s = _fill(ctl, size - ctl.stats(hours=1).scheduled, ids, spread_ms)
            stats = ctl.stats()
            victims = random.sample(ids, min(samples, len(ids)))  # (a size under the sample count)
            queue = iter(victims)
            row: dict[str, Any] = {
                "scheduled": stats.scheduled,
                "fill_s": round(fill_s, 1),
                "stats": _ms(ctl.stats, 20),
                # _ms calls each lambda right away, in this iteration: the loop variables are current.
                "find": _ms(lambda: ctl.find(random.choice(ids)), samples),  # noqa: B023
                "cancel": _ms(lambda: ctl.cancel(next(queue)), len(victims)),  # noqa: B023
                "cancel_missing": _ms(lambda: ctl.cancel(str(uuid.uuid4())), samples),
                "reschedule": _ms(
                    lambda: ctl.reschedule(
                        random.choice(ids),  # noqa: B023
                        countdown=600 + random.random() * spread_ms / 1000,
                    ),
                    samples,
                ),
                "ls_page_100": _ms(lambda: ctl.scheduled(limit=100), 20),
                "ls_queue_page_100": _ms(lambda: ctl.scheduled(queue="emails", limit=100), 20),
            }
            cancelled = set(victims)
            ids = [i for i in ids if i not in cancelled]
            index_bytes, entries = store.index_memory()
            row["id_index_bytes"] = index_bytes
            row["id_index_bytes_per_message"] = round(index_bytes / max(entries, 1), 1)
            results["sizes"][str(size)] = row
    return results


def run(ctx: Any) -> dict[str, Any]:
    """The ``inspect`` scenario of ``kombu-delay bench`` (its context gives URL and sizes)."""
    ctx.fresh()
    try:
        return measure(ctx.url, sizes=(ctx.sizes.scale_small, ctx.sizes.scale_large))
    finally:
        ctx.fresh()


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(measure(), indent=2))
