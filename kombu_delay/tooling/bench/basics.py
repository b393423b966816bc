"""The basic scenarios: publish rate, idle precision, and a burst due at one instant."""

from __future__ import annotations

import math
import random
import threading
import time
from collections import Counter
from typing import Any

from kombu_delay.tooling.bench.arrivals import (
    PushMonitor,
    Sampler,
    early_seen,
    grace,
    ids_of,
    list_ids,
    pause_s,
    tally,
)
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
    """Messages due at random over a window, an idle mover, a BRPOP consumer: lateness.

    Each arrival is counted by task id and timed by Redis's clock when a script pushed it
    (``MONITOR``); the consumer reads on for a grace period after the last one, so a late
    duplicate is counted. The consumer's own times (after its BRPOP returned: later than the
    push) are reported beside, as ``consumer_*``."""
    ctx.fresh()
    n, window_ms = ctx.sizes.precision, ctx.sizes.precision_window_s * 1000
    ctx.movers.start()
    arrivals: list[tuple[float, bytes | str]] = []
    stop = threading.Event()
    conn = ctx.probe.consumer()

    def consume() -> None:
        while not stop.is_set():
            item = conn.brpop([QUEUE], timeout=1)
            if item:
                arrivals.append((now_ms(), item[1]))

    app = celery_app(ctx.delay_url)
    app.send_task(TASK, kwargs={"pad": ""}, countdown=3600, queue="warmup")
    with PushMonitor(ctx.url) as monitor:
        thread = threading.Thread(target=consume, daemon=True)
        thread.start()
        base = now_ms() + 2000
        dues = [int(base + random.uniform(0, window_ms)) for _ in range(n)]
        published = [
            app.send_task(TASK, kwargs={"pad": ctx.payloads.pad}, eta=eta_of(due), queue=QUEUE).id
            for due in dues
        ]
        published_by = now_ms()
        wanted = set(published)

        def all_in() -> bool:
            return wanted <= set(ids_of(raw for _, raw in list(arrivals)))

        wait_for(all_in, timeout=(base + window_ms - now_ms()) / 1000 + 60, interval=0.1)
        grace(ctx, lambda: None)  # the consumer reads on meanwhile: a late duplicate is counted
        stop.set()
        thread.join(timeout=5)
    conn.close()
    app.close()
    etas = {task_id: float(due) for task_id, due in zip(published, dues, strict=True)}
    pushed = [(at, task_id) for at, task_id in monitor.pushes if task_id in etas]
    late = [at - etas[task_id] for at, task_id in pushed]
    ids = ids_of(raw for _, raw in arrivals)
    consumer_late = [
        at - etas[task_id] for (at, _), task_id in zip(arrivals, ids, strict=True) if task_id in etas
    ]
    counted = tally(Counter(ids), published)
    return {
        "messages": n,
        "arrived": counted["distinct"],
        "consumed": counted["delivered"],
        "pushes": len(pushed),
        "lost": counted["lost"],
        "doubled": max(counted["doubled"], len(pushed) - len({task_id for _, task_id in pushed})),
        "stray": counted["stray"],
        "window_s": ctx.sizes.precision_window_s,
        "publish_done_before_first_due_ms": base - published_by,
        "early": sum(1 for x in late if x < 0),
        "p50_ms": pct(late, 50),
        "p99_ms": pct(late, 99),
        "max_ms": max(late, default=math.nan),
        "min_ms": min(late, default=math.nan),
        "consumer_p50_ms": pct(consumer_late, 50),
        "consumer_p99_ms": pct(consumer_late, 99),
        "consumer_early": sum(1 for x in consumer_late if x < 0),
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
    dues = sorted(due + i % BURST_SPREAD_MS for i in range(n))
    count, fill_s, payloads = ctx.fill_celery(iter(dues))
    if now_ms() > due - 300:
        raise RuntimeError("the fill ended too close to the due time; rerun")
    sleep_until(due - 200)
    ctx.probe.reset_stats(slower_than_us=0)
    cpu = ctx.probe.redis_cpu_s()
    # Each sample is stamped by Redis's clock at the instant it read the list (see arrivals.py).
    sample = Sampler(ctx, [("llen", QUEUE)])
    samples: list[tuple[float, ...]] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        samples.append(sample())
        if samples[-1][1] >= n:
            break
        time.sleep(pause_s(samples[-1][0], dues, 0.002))
    cpu = ctx.probe.redis_cpu_s() - cpu
    stats = ctx.probe.evalsha_stats()
    slowest = ctx.probe.slowest_script_ms()
    mover_rss = rss_mb(mover.pid)
    grace(ctx, lambda: samples.append(sample()))  # read on: a late duplicate is counted
    counted = tally(list_ids(ctx.probe.client), ids_of(payloads))
    ctx.movers.stop(mover)
    series = [(round(at - due, 2), length) for at, length in samples]
    first = next((t for t, length in series if length > 0), None)
    # All on the list: the first sample that held every delivery (duplicates too), when every
    # id came; a duplicate standing in for a message never delivered is no end.
    done_at = 0.0
    if counted["lost"] == 0:
        done_at = next((at for at, length in samples if length >= counted["delivered"]), 0.0)
    early = early_seen(samples, dues, 1)  # each message against its own due time
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
        **early,
        "lost": counted["lost"],
        "doubled": counted["doubled"],
        "delivered": counted["delivered"],
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
