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


def publish(ctx: Ctx) -> dict[str, Any]:
    """Delayed publishes/s through delayredis:// against immediate ones through redis://."""
    ctx.fresh()
    n = ctx.sizes.publish
    kwargs = {"pad": ctx.payloads.pad}
    plain, delayed = celery_app(ctx.url), celery_app(ctx.delay_url)
    for _ in range(50):  # connections, script loading, imports
        plain.send_task(TASK, kwargs=kwargs)
        delayed.send_task(TASK, kwargs=kwargs, countdown=3600)
    rounds, plain_s, delayed_s, plain_cpu, delayed_cpu = 5, 0.0, 0.0, 0.0, 0.0
    per = max(1, n // rounds)
    for _ in range(rounds):  # interleaved, so a noisy neighbour hits both sides alike
        cpu, started = ctx.probe.redis_cpu_s(), time.perf_counter()
        for _ in range(per):
            plain.send_task(TASK, kwargs=kwargs)
        plain_s += time.perf_counter() - started
        plain_cpu += ctx.probe.redis_cpu_s() - cpu
        cpu, started = ctx.probe.redis_cpu_s(), time.perf_counter()
        for _ in range(per):
            delayed.send_task(TASK, kwargs=kwargs, countdown=3600)
        delayed_s += time.perf_counter() - started
        delayed_cpu += ctx.probe.redis_cpu_s() - cpu
    held = sum(ctx.store.counts().values())
    plain.close()
    delayed.close()
    total = per * rounds
    return {
        "messages": total,
        "payload_bytes": ctx.payloads.size,
        "plain_per_s": total / plain_s,
        "delayed_per_s": total / delayed_s,
        "ratio": plain_s / delayed_s,
        "plain_us_per_publish": plain_s / total * 1e6,
        "delayed_us_per_publish": delayed_s / total * 1e6,
        "plain_redis_cpu_us": plain_cpu / total * 1e6,
        "delayed_redis_cpu_us": delayed_cpu / total * 1e6,
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
    late = [at - parse_iso_ms(json.loads(raw)["headers"]["eta"]) for at, raw in arrivals]
    return {
        "messages": n,
        "arrived": len(late),
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
    ctx.movers.stop(mover)
    first = next((t for t, length in series if length > 0), None)
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
