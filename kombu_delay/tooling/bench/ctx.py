"""What every benchmark scenario shares: its sizes, its context, and a few waiting helpers.

Each scenario takes a :class:`Ctx`, starts from an empty database, and returns a
JSON-ready dict. Messages are Celery's own (see :class:`~kombu_delay.tooling.bench.env.Payloads`),
movers are real ``kombu-delay mover`` processes, and arrival is judged where a
worker would see it: on kombu's list.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kombu_delay.config import Settings
from kombu_delay.store import Store
from kombu_delay.tooling.bench.env import Movers, Payloads, Probe, fill, now_ms


@dataclass
class Sizes:
    """Scenario sizes (CLI flags)."""

    publish: int = 3000
    precision: int = 200
    precision_window_s: float = 30.0
    burst: int = 100_000
    memory: int = 100_000
    thaw: int = 100_000
    scale_small: int = 10_000
    scale_large: int = 1_000_000
    #: A size between the two, for memory per message against the large one; 0 skips it.
    scale_middle: int = 0
    scale_probe: int = 2000
    scale_rounds: int = 5
    #: ``spread`` (default settings, due over 90 days) or ``one-set`` (the worst case).
    scale_layout: str = "spread"
    backpressure: int = 100_000
    backpressure_rate: int = 10_000
    backpressure_max_len: int = 5_000
    backpressure_consume_rate: int = 10_000
    #: Compressed messages due at one instant, default settings.
    herd: int = 1_000_000
    #: The same with ``delay_thaw_ahead`` at :attr:`herd_short_ahead_s`; 0 skips it.
    herd_short: int = 300_000
    herd_short_ahead_s: float = 5.0
    herd_movers: int = 1
    #: Messages per side of the Redis CPU split.
    cpu: int = 20_000
    e2e_tasks: int = 20_000
    e2e_precision: int = 200
    drain: int = 20_000
    drain_procs: int = 2
    drain_prefetch: int = 4
    drain_look_ahead: str = "5,10,20"
    drain_variants: str = ""


@dataclass
class Ctx:
    url: str
    delay_url: str
    probe: Probe
    store: Store
    payloads: Payloads
    movers: Movers
    sizes: Sizes
    settings: Settings
    #: Last observed fill rate, messages/s: sets how far ahead a burst is scheduled.
    fill_rate: float = 5000.0

    def fresh(self) -> None:
        self.movers.stop_all()
        self.probe.flush()

    def lead_ms(self, count: int) -> int:
        """How far ahead to schedule ``count`` messages so the fill ends before they are due."""
        return int(3000 + 1.6 * 1000 * count / max(self.fill_rate, 500.0))

    def fill_celery(
        self, due: Iterator[int], settings: Settings | None = None
    ) -> tuple[int, float, list[str]]:
        """Schedule Celery messages due at each time in ``due``; return (count, seconds, payloads)."""
        payloads: list[str] = []

        def gen() -> Iterator[tuple[int, str, str]]:
            for due_ms in due:
                task_id, payload = self.payloads.make(due_ms)
                payloads.append(payload)
                yield due_ms, task_id, payload

        count, secs = fill(self.store, settings or self.settings, gen())
        self.fill_rate = count / max(secs, 1e-6)
        return count, secs, payloads


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values``; NaN (never a target met) when there are none: a
    run where nothing arrived must not read as one where everything was on time."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def wait_for(predicate: Any, timeout: float, interval: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def sleep_until(ms: float) -> None:
    while (left := ms - now_ms()) > 0:
        time.sleep(min(left / 1000, 0.05))
