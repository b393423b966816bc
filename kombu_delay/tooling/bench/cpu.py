"""The cpu scenario: Redis CPU per delayed message, from Redis's own CPU counters, split per
step (schedule, thaw where it applies, move), against a plain kombu publish of the same
number of the same messages, in the same run.

Every publish is kombu's own (``send_task``, one message at a time). One mover runs from the
first delayed publish on (its start-up, script loading and checks are not counted), idle while
the messages are published: the schedule figures hold no move or thaw, only its looks (a few
a second, each well under a millisecond). A move figure runs from just before the due time
until all are on the list and the mover has dropped their id-index refs (the clean-up of a
drained bucket, after its end); the thaw figure from the end of the publish until nothing is
left compressed. Every delayed message goes into one-second buckets, so that clean-up and the
thaw follow the due time closely.
"""

from __future__ import annotations

import time
from typing import Any

from kombu_delay.mover import thaw_plan
from kombu_delay.store import keys
from kombu_delay.tooling.bench.ctx import Ctx, sleep_until, wait_for
from kombu_delay.tooling.bench.env import QUEUE, TASK, celery_app, eta_of, now_ms

#: The cold path's spans: short, so that the scenario waits seconds, not minutes.
COMPRESS_AFTER_S = 5.0
THAW_AHEAD_S = 2.0
#: Seconds a mover is given after its first heartbeat before anything is measured.
SETTLE_S = 2.0
#: Bucket width of every delayed message here, s: a mover cleans up a bucket once it has
#: ended, and a plan begins a bucket's thaw by its start, so both follow the due time closely.
BUCKET_S = 1


def _publish(ctx: Ctx, url: str, n: int, due: int | None, options: dict[str, Any]) -> tuple[float, float]:
    """Publish ``n`` messages through kombu at ``url`` (due at ``due``, or now); return
    (Redis CPU seconds, wall seconds)."""
    app = celery_app(url)
    app.conf.broker_transport_options = options
    kwargs = {"pad": ctx.payloads.pad}
    eta = None if due is None else eta_of(due)
    for _ in range(20):  # connections, script loading, imports
        app.send_task(TASK, kwargs=kwargs, queue="warmup", countdown=None if due is None else 3600)
    cpu, started = ctx.probe.redis_cpu_s(), time.perf_counter()
    for _ in range(n):
        app.send_task(TASK, kwargs=kwargs, eta=eta)
    wall = time.perf_counter() - started
    cpu = ctx.probe.redis_cpu_s() - cpu
    app.close()
    return cpu, wall


def _settled(ctx: Ctx) -> None:
    """Wait until the mover just started runs its loop (its heartbeat is written), and its
    start (script loading, the first sweep and checks) is over: not counted as a publish's."""
    if not wait_for(lambda: bool(ctx.store.heartbeats()), timeout=60, interval=0.05):
        raise RuntimeError("the mover did not start")
    time.sleep(SETTLE_S)


def _moved(ctx: Ctx, due: int, n: int) -> float:
    """Redis CPU seconds from just before ``due`` until all ``n`` are on the list and their
    bucket is cleaned up: a mover drops a drained bucket's id-index refs once the bucket has
    ended (one second after ``due``, in :data:`BUCKET_S` buckets), so that work is part of
    each message's cost, and is not left to fall into a later step's figure."""
    sleep_until(due - 200)
    cpu = ctx.probe.redis_cpu_s()
    if not wait_for(lambda: ctx.probe.llen() >= n, timeout=120, interval=0.002):
        raise RuntimeError("the messages did not all arrive")
    tasks = keys.task_ids(ctx.store.prefix, due - due % (BUCKET_S * 1000))
    if not wait_for(lambda: not ctx.probe.client.exists(tasks), timeout=120, interval=0.002):
        raise RuntimeError("the mover did not clean up the drained bucket")
    return ctx.probe.redis_cpu_s() - cpu


def _compressed(ctx: Ctx, n: int, plain_s: float) -> dict[str, float]:
    """Publish ``n`` messages stored compressed, wait for their thaw and their move; return
    the Redis CPU seconds of each step (``schedule``, ``thaw``, ``move``), the publish's wall
    seconds, the due time, and whether the thaw was done before it."""
    # Compressed: the mover thaws them (as planned: a few seconds ahead) before due. A plan
    # begins a bucket's thaw by its start, not by its first message: one-second buckets keep
    # that start next to the due time, so the thaw cannot begin during the publish.
    options = {
        "delay_compress_after": COMPRESS_AFTER_S,
        "delay_thaw_ahead": THAW_AHEAD_S,
        "delay_bucket_width": BUCKET_S,
    }
    # Far enough ahead that the planned thaw begins after the publish ends.
    lead = thaw_plan.lead_ms(n, thaw_plan.DEFAULT_RATE)
    due = int(now_ms() + COMPRESS_AFTER_S * 1000 + 3 * plain_s * 1000 + lead + 5000)
    cold_cpu, cold_s = _publish(ctx, ctx.delay_url, n, due, options)
    if now_ms() >= due - COMPRESS_AFTER_S * 1000:
        raise RuntimeError("the publish ended too close to the due time to store it compressed; rerun")
    cold_set = keys.queue_set(ctx.store.prefix, due - due % (BUCKET_S * 1000), QUEUE, keys.COLD)
    stored_cold = int(ctx.probe.client.zcard(cold_set))
    if stored_cold != n:
        raise RuntimeError(f"{stored_cold} of {n} messages were still compressed after the publish; rerun")
    cpu_before = ctx.probe.redis_cpu_s()
    if not wait_for(lambda: int(ctx.probe.client.zcard(cold_set)) == 0, timeout=120):
        raise RuntimeError("the thaw did not finish")
    thaw_cpu = ctx.probe.redis_cpu_s() - cpu_before
    thawed_before_due = now_ms() < due
    move_cold_cpu = _moved(ctx, due, n)
    return {
        "schedule": cold_cpu,
        "wall": cold_s,
        "thaw": thaw_cpu,
        "move": move_cold_cpu,
        "due": due,
        "thawed_before_due": float(thawed_before_due),
    }


def cpu(ctx: Ctx) -> dict[str, Any]:
    """Redis CPU µs per message: plain publish (first and last, the baseline their mean);
    delayed schedule + move; compressed schedule + thaw + move; and the floor of a move (a
    bare Lua ZRANGE/ZREM/LPUSH)."""
    ctx.fresh()
    n = ctx.sizes.cpu
    per = 1e6 / n
    plain_cpu, plain_s = _publish(ctx, ctx.url, n, None, {})
    ctx.probe.client.delete(QUEUE)

    # Uncompressed: due soon after the publish ends (the plain side's time, three times over).
    mover = ctx.movers.start("--thaw-ahead", f"{THAW_AHEAD_S:g}")
    _settled(ctx)
    due = int(now_ms() + 3 * plain_s * 1000 + 3000)
    hot_options = {"delay_compress_after": 0, "delay_bucket_width": BUCKET_S}
    hot_cpu, hot_s = _publish(ctx, ctx.delay_url, n, due, hot_options)
    if now_ms() >= due:
        raise RuntimeError("the publish ended after the due time; rerun")
    move_cpu = _moved(ctx, due, n)
    ctx.probe.client.delete(QUEUE)

    cold = _compressed(ctx, n, plain_s)
    cold_cpu, cold_s, thaw_cpu, move_cold_cpu = cold["schedule"], cold["wall"], cold["thaw"], cold["move"]
    due = int(cold["due"])
    ctx.movers.stop(mover)
    ctx.probe.flush()
    floor_payloads = [ctx.payloads.make(due)[1] for _ in range(n)]
    _, floor_cpu = ctx.probe.floor_move(floor_payloads, ctx.movers.batch_size)
    ctx.probe.flush()
    # The plain side again, last: a machine whose speed drifts during the run (a shared host)
    # then weighs on both sides alike; the baseline is the mean of the two.
    plain_last_cpu, plain_last_s = _publish(ctx, ctx.url, n, None, {})
    ctx.probe.flush()

    plain_us = (plain_cpu + plain_last_cpu) / 2 * per
    delayed_us = (hot_cpu + move_cpu) * per
    compressed_us = (cold_cpu + thaw_cpu + move_cold_cpu) * per
    return {
        "messages": n,
        "payload_bytes": ctx.payloads.size,
        "plain_redis_cpu_us": plain_us,
        "plain_redis_cpu_us_first": plain_cpu * per,
        "plain_redis_cpu_us_last": plain_last_cpu * per,
        "schedule_redis_cpu_us": hot_cpu * per,
        "move_redis_cpu_us": move_cpu * per,
        "delayed_redis_cpu_us": delayed_us,
        "delayed_ratio": delayed_us / plain_us,
        "stored_compressed": n,
        "schedule_compressed_redis_cpu_us": cold_cpu * per,
        "thaw_redis_cpu_us": thaw_cpu * per,
        "thawed_before_due": bool(cold["thawed_before_due"]),
        "move_after_thaw_redis_cpu_us": move_cold_cpu * per,
        "compressed_redis_cpu_us": compressed_us,
        "compressed_ratio": compressed_us / plain_us,
        "floor_move_redis_cpu_us": floor_cpu * per,
        # Not interleaved, so a noisy neighbour may favour either side: the publish scenario
        # compares the rates (in alternating rounds).
        "plain_per_s": 2 * n / (plain_s + plain_last_s),
        "delayed_per_s": n / hot_s,
        "compressed_per_s": n / cold_s,
        "publish_ratio": (plain_s + plain_last_s) / 2 / hot_s,
        "compressed_publish_ratio": (plain_s + plain_last_s) / 2 / cold_s,
    }
