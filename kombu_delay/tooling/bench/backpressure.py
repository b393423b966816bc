"""The backpressure scenario: messages due at one instant under ``--max-rate``, then under
``--max-queue-length`` with a consumer slower than the movers."""

from __future__ import annotations

import time
from typing import Any

from kombu_delay.tooling.bench.ctx import Ctx, sleep_until
from kombu_delay.tooling.bench.env import now_ms


def _ramp(ctx: Ctx, extra: tuple[str, ...], consume_per_s: int, expected_per_s: int) -> dict[str, Any]:
    ctx.fresh()
    n = ctx.sizes.backpressure
    mover = ctx.movers.start(*extra)
    due = int(now_ms() + ctx.lead_ms(n))
    ctx.fill_celery(iter([due] * n))
    sleep_until(due)
    consumed, longest = 0, 0
    intervals: list[int] = []
    last_total, next_mark = 0, time.monotonic() + 0.5
    tick = 0.05
    deadline = time.monotonic() + 30 + 3 * n / max(1, expected_per_s)
    while time.monotonic() < deadline:
        if consume_per_s:
            consumed += ctx.probe.pop_many(int(consume_per_s * tick))
        length = ctx.probe.llen()
        longest = max(longest, length)
        total = consumed + length
        if time.monotonic() >= next_mark:
            intervals.append(total - last_total)
            last_total, next_mark = total, next_mark + 0.5
        if total >= n and (not consume_per_s or length == 0):
            intervals.append(total - last_total)
            break
        time.sleep(tick)
    ctx.movers.stop(mover)
    left = sum(ctx.store.counts().values())
    delivered = consumed + ctx.probe.llen()
    return {
        "messages": n,
        "delivered": delivered,
        "still_scheduled": left,
        "lost": n - delivered - left,
        "longest_list": longest,
        "peak_per_s": 2 * max(intervals, default=0),
        "moved_per_s_by_half_second": [2 * x for x in intervals],
    }


def backpressure(ctx: Ctx) -> dict[str, Any]:
    """Messages due at one instant under --max-rate, then under --max-queue-length."""
    s = ctx.sizes
    rate = _ramp(ctx, ("--max-rate", str(s.backpressure_rate)), 0, s.backpressure_rate)
    held = _ramp(
        ctx,
        ("--max-queue-length", str(s.backpressure_max_len)),
        s.backpressure_consume_rate,
        s.backpressure_consume_rate,
    )
    ctx.probe.flush()
    return {
        "max_rate": {"cap_per_s": s.backpressure_rate, **rate},
        "max_queue_length": {
            "cap": s.backpressure_max_len,
            "consumer_per_s": s.backpressure_consume_rate,
            **held,
        },
    }
