"""The backpressure scenario: messages due at one instant under ``--max-rate``, then under
``--max-queue-length`` with a consumer slower than the movers."""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

from kombu_delay.tooling.bench.arrivals import grace, ids_of, list_ids, tally
from kombu_delay.tooling.bench.ctx import Ctx, sleep_until
from kombu_delay.tooling.bench.env import QUEUE, now_ms


def _ramp(ctx: Ctx, extra: tuple[str, ...], consume_per_s: int, expected_per_s: int) -> dict[str, Any]:
    """Messages due at one instant through a mover with ``extra``, a consumer taking
    ``consume_per_s`` (0: none). Deliveries are counted by task id, from what the consumer took
    and what is left on the list, after a grace period: ``lost`` (published, never delivered)
    and ``doubled`` (delivered more than once); ``delivered`` counts every delivery."""
    ctx.fresh()
    n = ctx.sizes.backpressure
    mover = ctx.movers.start(*extra)
    due = int(now_ms() + ctx.lead_ms(n))
    _, _, payloads = ctx.fill_celery(iter([due] * n))
    published = ids_of(payloads)
    sleep_until(due)
    taken: Counter[str] = Counter()
    longest = 0
    intervals: list[int] = []
    last_total, next_mark = 0, time.monotonic() + 0.5
    tick = 0.05

    def consume() -> int:
        """Read the list's length (for the longest), then take what this tick's share allows;
        return the length after."""
        nonlocal longest
        longest = max(longest, ctx.probe.llen())
        if consume_per_s:
            got = ctx.probe.client.rpop(QUEUE, int(consume_per_s * tick))
            taken.update(ids_of(got or []))  # type: ignore[arg-type]
        return ctx.probe.llen()

    deadline = time.monotonic() + 30 + 3 * n / max(1, expected_per_s)
    while time.monotonic() < deadline:
        length = consume()
        total = sum(taken.values()) + length
        if time.monotonic() >= next_mark:
            intervals.append(total - last_total)
            last_total, next_mark = total, next_mark + 0.5
        if total >= n and (not consume_per_s or length == 0):
            intervals.append(total - last_total)
            break
        time.sleep(tick)
    grace(ctx, consume)  # read on: a late duplicate is counted
    ctx.movers.stop(mover)
    left = sum(ctx.store.counts().values())
    counted = tally(taken + list_ids(ctx.probe.client), published)
    return {
        "messages": n,
        **counted,
        "delivered_minus_messages": counted["delivered"] - n,
        "still_scheduled": left,
        "longest_list": longest,
        "peak_per_s": 2 * max(intervals, default=0),
        # The limiter begins with a second's allowance: the mean over the whole half-seconds
        # after the first second (the last is a part; each alone moves with the sampling's
        # jitter). None: not measured.
        "per_s_after_first_s": 2 * sum(intervals[2:-1]) / len(intervals[2:-1])
        if intervals[2:-1]
        else math.nan,
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
        "max_rate": {
            "cap_per_s": s.backpressure_rate,
            "rate_over_cap": rate["per_s_after_first_s"] / s.backpressure_rate,
            **rate,
        },
        "max_queue_length": {
            "cap": s.backpressure_max_len,
            "consumer_per_s": s.backpressure_consume_rate,
            "longest_over_cap": held["longest_list"] / s.backpressure_max_len,
            **held,
        },
    }
