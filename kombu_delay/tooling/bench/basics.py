"""The basic scenarios: publish rate, idle precision, and a burst due at one instant."""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

from kombu_delay.message import parse_iso_ms
from kombu_delay.tooling.bench.ctx import Ctx, pct, sleep_until, wait_for
from kombu_delay.tooling.bench.env import QUEUE, TASK, celery_app, eta_of, now_ms, rss_mb

#: The publish scenario's countdowns, s: far enough to be stored compressed at the default
#: ``delay_compress_after`` (60 s), and near enough to be stored as it is.
FAR_S, NEAR_S = 3600, 30


def publish(ctx: Ctx) -> dict[str, Any]:
    """Publishes/s of the same ``send_task`` call, with the same countdown, through plain
    ``redis://`` (which pushes it at once) and through ``delayredis://`` (which stores it):
    only the broker differs, so Celery's own work for a countdown weighs on both sides. The
    delayed side runs twice: a far countdown (stored compressed) and a near one."""
    ctx.fresh()
    n = ctx.sizes.publish
    kwargs = {"pad": ctx.payloads.pad}
    plain, delayed = celery_app(ctx.url), celery_app(ctx.delay_url)
    sides = {"plain": (plain, FAR_S), "far": (delayed, FAR_S), "near": (delayed, NEAR_S)}
    for app, countdown in sides.values():  # connections, script loading, imports
        for _ in range(50):
            app.send_task(TASK, kwargs=kwargs, countdown=countdown)
    rounds = 5
    per = max(1, n // rounds)
    wall, cpu = dict.fromkeys(sides, 0.0), dict.fromkeys(sides, 0.0)
    for _ in range(rounds):  # interleaved, so a noisy neighbour hits every side alike
        for side, (app, countdown) in sides.items():
            cpu_before, started = ctx.probe.redis_cpu_s(), time.perf_counter()
            for _ in range(per):
                app.send_task(TASK, kwargs=kwargs, countdown=countdown)
            wall[side] += time.perf_counter() - started
            cpu[side] += ctx.probe.redis_cpu_s() - cpu_before
    held = sum(ctx.store.counts().values())
    plain.close()
    delayed.close()
    total = per * rounds
    return {
        "messages": total,
        "payload_bytes": ctx.payloads.size,
        "plain_per_s": total / wall["plain"],
        "delayed_per_s": total / wall["far"],
        "near_per_s": total / wall["near"],
        "ratio": wall["plain"] / wall["far"],
        "near_ratio": wall["plain"] / wall["near"],
        "plain_us_per_publish": wall["plain"] / total * 1e6,
        "delayed_us_per_publish": wall["far"] / total * 1e6,
        "near_us_per_publish": wall["near"] / total * 1e6,
        "plain_redis_cpu_us": cpu["plain"] / total * 1e6,
        "delayed_redis_cpu_us": cpu["far"] / total * 1e6,
        "near_redis_cpu_us": cpu["near"] / total * 1e6,
        "delayed_held": held,
    }


def precision(ctx: Ctx) -> dict[str, Any]:
    """Messages due at random over a window, an idle mover, a BRPOP consumer: lateness."""
    ctx.fresh()
    n, window_ms = ctx.sizes.precision, ctx.sizes.precision_window_s * 1000
    ctx.movers.start()
    arrivals: list[tuple[float, bytes | str]] = []
    stop = threading.Event()
    conn = ctx.probe.consumer()

    def consume() -> None:
        while not stop.is_set() and len(arrivals) < n:
            item = conn.brpop([QUEUE], timeout=1)
            if item:
                arrivals.append((now_ms(), item[1]))

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    app = celery_app(ctx.delay_url)
    app.send_task(TASK, kwargs={"pad": ""}, countdown=3600, queue="warmup")
    base = now_ms() + 2000
    dues = [int(base + random.uniform(0, window_ms)) for _ in range(n)]
    for due in dues:
        app.send_task(TASK, kwargs={"pad": ctx.payloads.pad}, eta=eta_of(due), queue=QUEUE)
    published_by = now_ms()
    wait_for(lambda: len(arrivals) >= n, timeout=(base + window_ms - now_ms()) / 1000 + 60, interval=0.1)
    stop.set()
    thread.join(timeout=5)
    conn.close()
    app.close()
    headers = [(at, json.loads(raw)["headers"]) for at, raw in arrivals]
    late = [at - parse_iso_ms(h["eta"]) for at, h in headers]
    distinct = len({h["id"] for _, h in headers})
    return {
        "messages": n,
        "arrived": len(late),
        "lost": n - distinct,
        "doubled": len(arrivals) - distinct,
        "window_s": ctx.sizes.precision_window_s,
        "publish_done_before_first_due_ms": base - published_by,
        "early": sum(1 for x in late if x < 0),
        "p50_ms": pct(late, 50),
        "p99_ms": pct(late, 99),
        "max_ms": max(late, default=0.0),
        "min_ms": min(late, default=0.0),
        "lateness_ms": sorted(round(x, 3) for x in late),
    }


#: A burst's messages are due within this many ms, the same number at each: fewer than a herd's
#: 10,000 at one millisecond (kombu_delay/mover/stage.py), so the burst measures the batches.
BURST_SPREAD_MS = 20


def burst(ctx: Ctx) -> dict[str, Any]:
    """N messages due within :data:`BURST_SPREAD_MS`, one mover: due -> all on the list (moved
    in batches: no millisecond holds a herd, which would be handed over whole); LPUSH ceiling."""
    ctx.fresh()
    n = ctx.sizes.burst
    mover = ctx.movers.start()
    due = int(now_ms() + ctx.lead_ms(n))
    count, fill_s, payloads = ctx.fill_celery(due + i % BURST_SPREAD_MS for i in range(n))
    if now_ms() > due - 300:
        raise RuntimeError("the fill ended too close to the due time; rerun")
    sleep_until(due - 200)
    ctx.probe.reset_stats(slower_than_us=0)
    cpu = ctx.probe.redis_cpu_s()
    series: list[tuple[float, int]] = []
    deadline = time.monotonic() + 120
    done_at = 0.0
    while time.monotonic() < deadline:
        length = ctx.probe.llen()
        at = now_ms()
        series.append((round(at - due, 2), length))
        if length >= n:
            done_at = at
            break
        time.sleep(0.002)
    cpu = ctx.probe.redis_cpu_s() - cpu
    stats = ctx.probe.evalsha_stats()
    slowest = ctx.probe.slowest_script_ms()
    mover_rss = rss_mb(mover.pid)
    total, distinct = ctx.probe.distinct_on_list()
    ctx.movers.stop(mover)
    first = next((t for t, length in series if length > 0), None)
    # On the list before the first due time: early (one due within the spread and moved before
    # its own millisecond is not seen here; the tests see to that).
    early = max((length for t, length in series if t < 0), default=0)
    drain_s = (done_at - due) / 1000 if done_at else float("nan")
    ctx.probe.flush()
    ctx.probe.reset_stats()
    ceiling_s = ctx.probe.lpush_ceiling(payloads)
    lpush_us = ctx.probe.command_usec_per_call("lpush")
    ctx.probe.flush()
    floor_s, floor_cpu = ctx.probe.floor_move(payloads, ctx.movers.batch_size)
    rate = n / drain_s if done_at else 0.0
    ceiling = n / ceiling_s
    return {
        "messages": count,
        "payload_bytes": ctx.payloads.size,
        "batch_size": ctx.movers.batch_size,
        "fill_s": fill_s,
        "first_on_list_ms": first,
        "early": early,
        "lost": n - distinct,
        "doubled": total - distinct,
        "drain_s": drain_s,
        "moved_per_s": rate,
        "lpush_ceiling_per_s": ceiling,
        "ratio_to_ceiling": rate / ceiling,
        "script_calls": stats["calls"],
        "script_server_us_per_msg": stats["usec"] / max(count, 1),
        "largest_script_call_ms": slowest,
        "lpush_server_us": lpush_us,
        "redis_cpu_us_per_msg": cpu * 1e6 / max(count, 1),
        "floor_per_s": n / floor_s,
        "floor_redis_cpu_us_per_msg": floor_cpu * 1e6 / max(count, 1),
        "mover_rss_mb": mover_rss,
        "series": series[:: max(1, len(series) // 400)] + series[-1:],
    }
