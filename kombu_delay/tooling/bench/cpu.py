"""The cpu scenario: Redis CPU per delayed message, from Redis's own CPU counters, split per
step (schedule, thaw where it applies, move), against a plain kombu publish of the same
number of the same messages, in the same run.

Every publish is kombu's own (``send_task``, one message at a time). The plain and the delayed
publishes alternate in :data:`ROUNDS` rounds, so a machine whose speed drifts during the run
(a shared host) weighs on both sides alike, and each ratio is taken against the plain rounds
beside it. One mover runs from the first delayed publish on (its start-up, script loading and
checks are not counted), idle while the messages are published: the schedule figures hold no
move or thaw, only its looks (a few a second, each well under a millisecond). A move figure
runs from the end of the publish (or of the thaw) until all are on the list and the mover has
dropped their id-index refs (the clean-up of a drained bucket, after its end), and counts the
whole Redis process: the messages of each side are due at one instant, a herd, which a mover
copies ahead of its due time and hands over whole (see kombu_delay/mover/stage.py), and whose
sorted set Redis frees in a background thread; both are part of the move's cost. The thaw
figure runs from the end of the publish until nothing is left compressed. Every delayed
message goes into one-second buckets, so that the clean-up follows the due time closely.

Redis spends CPU every second whatever is stored: its own timers, and the idle mover's looks
and heartbeat. That is a cost per second, not per message, and each window here is seconds
long (a move's window waits for the due time), so before anything is published the scenario
measures it for :data:`IDLE_S` s, with the mover running and nothing else (no poll of this
scenario's), and reports each figure net of it (the rate times the window's length), the
plain side's as well as the delayed one's. The polls by which the thaw's and the move's
windows wait are counted, and what each costs Redis (measured by :func:`_poll_cost`, polls
back to back) is taken off the window that made them, and only from it: a publish window
makes none. The gross ratios, with nothing taken off, are reported
beside the net ones.

Almost all of a plain publish's Redis CPU is the kernel's share of one round trip, which moves
with whatever else the machine runs, and the delayed side's does not move in step with it: a
run whose plain rounds spread by more than :data:`MAX_SPREAD` (max / min), or whose two halves'
plain figures differ by more than :data:`MAX_HALVES_DIFFER`, says so (``steady``: false), and
its ratios are not to be judged by.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kombu_delay.mover import thaw_plan
from kombu_delay.store import keys
from kombu_delay.tooling.bench.ctx import Ctx, wait_for
from kombu_delay.tooling.bench.env import QUEUE, TASK, celery_app, eta_of, now_ms

#: The cold path's spans: short, so that the scenario waits seconds, not minutes.
COMPRESS_AFTER_S = 5.0
THAW_AHEAD_S = 2.0
#: Seconds a mover is given after its first heartbeat before anything is measured.
SETTLE_S = 2.0
#: Bucket width of every delayed message here, s: a mover cleans up a bucket once it has
#: ended, so the clean-up follows the due time closely.
BUCKET_S = 1
#: Rounds of plain and delayed publishes, alternating.
ROUNDS = 5
#: Plain publishes timed before a run, to place its due time after its publishes.
CALIBRATION = 200
#: Seconds over which Redis's CPU is measured with the mover idle (see the module's docstring).
IDLE_S = 5.0
#: Seconds between this scenario's polls while it waits: a poll costs Redis CPU too.
POLL_S = 0.05
#: The plain publish's rounds (max / min) and its two halves (the one beside the schedule, the
#: one beside the compressed schedule) may differ by at most this much for a run to judge its
#: ratios by: beyond it, the machine's load changed during the run.
MAX_SPREAD = 1.5
MAX_HALVES_DIFFER = 0.15


@dataclass
class Side:
    """What one side of an interleaved publish cost Redis, and took."""

    cpu_s: float = 0.0
    user_s: float = 0.0
    wall_s: float = 0.0
    #: Each round's CPU seconds, in order.
    rounds: list[float] = field(default_factory=list)
    #: This scenario's polls of Redis during the window (see :func:`_poll`).
    polls: int = 0

    def net(self, idle: Idle) -> Side:
        """This side less what Redis's main thread would have spent over its wall time anyway."""
        return Side(self.less(idle.main_per_s), self.user_s - idle.user_per_s * self.wall_s, self.wall_s)

    def less(self, per_s: float, per_poll: float = 0.0) -> float:
        """CPU seconds less ``per_s`` over this window's wall time and ``per_poll`` per poll."""
        return self.cpu_s - per_s * self.wall_s - per_poll * self.polls


@dataclass
class Idle:
    """Redis's CPU per second with nothing to do but the idle mover's looks: of its main
    thread (the publishes' and the thaw's figures; ``user``: in user space) and of the whole
    process (a move's figure); and what one of this scenario's polls costs it, main thread and
    whole process (taken off the windows that polled, per poll)."""

    main_per_s: float
    user_per_s: float
    process_per_s: float
    poll_main_s: float = 0.0
    poll_process_s: float = 0.0


#: Polls timed back to back to learn what one costs Redis.
POLL_PROBE = 2000


def _idle(ctx: Ctx) -> Idle:
    """Measure :class:`Idle` over :data:`IDLE_S` seconds, with no poll (the bench only sleeps),
    then the cost of a poll."""
    (user, system), process = ctx.probe.redis_cpu_split_s(), ctx.probe.redis_process_cpu_s()
    started = time.monotonic()
    time.sleep(IDLE_S)
    took = time.monotonic() - started
    user_after, system_after = ctx.probe.redis_cpu_split_s()
    idle = Idle(
        (user_after + system_after - user - system) / took,
        (user_after - user) / took,
        (ctx.probe.redis_process_cpu_s() - process) / took,
    )
    return _poll_cost(ctx, idle)


def _poll(polled: Side, read: Callable[[], int]) -> int:
    """One poll of Redis by a waiting window (``read``), counted on ``polled``."""
    polled.polls += 1
    return read()


def _poll_cost(ctx: Ctx, idle: Idle) -> Idle:
    """What one poll (an ``LLEN``, a ``ZCARD`` or an ``EXISTS``: a round trip each) costs Redis,
    main thread and whole process, net of ``idle``: :data:`POLL_PROBE` of them back to back."""
    main, process, started = ctx.probe.redis_cpu_s(), ctx.probe.redis_process_cpu_s(), time.monotonic()
    for _ in range(POLL_PROBE):
        ctx.probe.llen()
    took = time.monotonic() - started
    main = ctx.probe.redis_cpu_s() - main - idle.main_per_s * took
    process = ctx.probe.redis_process_cpu_s() - process - idle.process_per_s * took
    return replace(
        idle, poll_main_s=max(0.0, main / POLL_PROBE), poll_process_s=max(0.0, process / POLL_PROBE)
    )


def _calibrate(ctx: Ctx) -> float:
    """Seconds one plain ``send_task`` takes here (connections and imports warmed up)."""
    app = celery_app(ctx.url)
    kwargs = {"pad": ctx.payloads.pad}
    for _ in range(20):
        app.send_task(TASK, kwargs=kwargs, queue="warmup")
    started = time.perf_counter()
    for _ in range(CALIBRATION):
        app.send_task(TASK, kwargs=kwargs, queue="warmup")
    app.close()
    ctx.probe.client.delete("warmup")
    return (time.perf_counter() - started) / CALIBRATION


def _interleaved(ctx: Ctx, n: int, due: int, options: dict[str, Any]) -> tuple[Side, Side]:
    """Publish ``n`` messages through plain ``redis://`` (due now) and ``n`` through kombu-delay
    (due at ``due``, with these transport options) in alternating rounds; return what each side
    cost. The plain side's messages are deleted afterwards: only the delayed ones reach the list
    later."""
    plain, delayed = celery_app(ctx.url), celery_app(ctx.delay_url)
    delayed.conf.broker_transport_options = options
    kwargs = {"pad": ctx.payloads.pad}
    for _ in range(20):  # connections, script loading, imports
        plain.send_task(TASK, kwargs=kwargs, queue="warmup")
        delayed.send_task(TASK, kwargs=kwargs, queue="warmup", countdown=3600)
    sides = (Side(), Side())
    for _ in range(ROUNDS):
        # The same message on both sides, its ETA header too: plain redis:// pushes it at once.
        for side, app in ((sides[0], plain), (sides[1], delayed)):
            user, system = ctx.probe.redis_cpu_split_s()
            started = time.perf_counter()
            for _ in range(n // ROUNDS):
                app.send_task(TASK, kwargs=kwargs, eta=eta_of(due))
            side.wall_s += time.perf_counter() - started
            user_after, system_after = ctx.probe.redis_cpu_split_s()
            side.user_s += user_after - user
            side.cpu_s += user_after + system_after - user - system
            side.rounds.append(user_after + system_after - user - system)
    plain.close()
    delayed.close()
    ctx.probe.client.delete(QUEUE)
    return sides


def _settled(ctx: Ctx) -> None:
    """Wait until the mover just started runs its loop (its heartbeat is written), and its
    start (script loading, the first sweep and checks) is over: not counted as a publish's."""
    if not wait_for(lambda: bool(ctx.store.heartbeats()), timeout=60, interval=0.05):
        raise RuntimeError("the mover did not start")
    time.sleep(SETTLE_S)


def _moved(ctx: Ctx, due: int, n: int) -> Side:
    """Redis process CPU seconds from now (the end of the publish or of the thaw) until all
    ``n`` are on the list and their bucket is cleaned up, and that window's length: the copy
    of a herd made ahead of its due time is part of its move, and so is the clean-up, in which
    a mover drops a drained bucket's id-index refs once the bucket has ended (one second after
    ``due``, in :data:`BUCKET_S` buckets), not left to fall into a later step's figure."""
    side = Side()
    cpu, started = ctx.probe.redis_process_cpu_s(), time.monotonic()
    while now_ms() < due - 200:  # no poll before the move can begin
        time.sleep(min(1.0, max(0.0, (due - 200 - now_ms()) / 1000)))
    if not wait_for(lambda: _poll(side, ctx.probe.llen) >= n, timeout=120, interval=POLL_S):
        raise RuntimeError("the messages did not all arrive")
    tasks = keys.task_ids(ctx.store.prefix, due - due % (BUCKET_S * 1000))
    exists = lambda: int(ctx.probe.client.exists(tasks))  # noqa: E731
    if not wait_for(lambda: not _poll(side, exists), timeout=120, interval=POLL_S):
        raise RuntimeError("the mover did not clean up the drained bucket")
    side.cpu_s, side.wall_s = ctx.probe.redis_process_cpu_s() - cpu, time.monotonic() - started
    return side


def _compressed(ctx: Ctx, n: int, publish_s: float) -> dict[str, Any]:
    """Publish ``n`` messages stored compressed (beside as many plain ones), wait for their
    thaw and their move; return both sides of the publish, the Redis CPU of the thaw and of
    the move with their windows (:class:`Side`), and whether the thaw was done before the due
    time."""
    # Compressed: the mover thaws them (as planned: a few seconds ahead) before due, its lead
    # before their due time, so the thaw cannot begin during the publish.
    options = {
        "delay_compress_after": COMPRESS_AFTER_S,
        "delay_thaw_ahead": THAW_AHEAD_S,
        "delay_bucket_width": BUCKET_S,
    }
    # Far enough ahead that the planned thaw begins after the publish ends.
    lead = thaw_plan.lead_ms(n, thaw_plan.DEFAULT_RATE)
    due = int(now_ms() + COMPRESS_AFTER_S * 1000 + publish_s * 1000 + lead + 5000)
    plain, cold = _interleaved(ctx, n, due, options)
    if now_ms() >= due - COMPRESS_AFTER_S * 1000:
        raise RuntimeError("the publish ended too close to the due time to store it compressed; rerun")
    cold_set = keys.queue_set(ctx.store.prefix, due - due % (BUCKET_S * 1000), QUEUE, keys.COLD)
    stored_cold = int(ctx.probe.client.zcard(cold_set))
    if stored_cold != n:
        raise RuntimeError(f"{stored_cold} of {n} messages were still compressed after the publish; rerun")
    thaw = Side()
    cpu_before, started = ctx.probe.redis_cpu_s(), time.monotonic()
    zcard = lambda: int(ctx.probe.client.zcard(cold_set))  # noqa: E731
    if not wait_for(lambda: _poll(thaw, zcard) == 0, timeout=120, interval=POLL_S):
        raise RuntimeError("the thaw did not finish")
    thaw.cpu_s, thaw.wall_s = ctx.probe.redis_cpu_s() - cpu_before, time.monotonic() - started
    thawed_before_due = now_ms() < due
    return {
        "plain": plain,
        "schedule": cold,
        "thaw": thaw,
        "move": _moved(ctx, due, n),
        "thawed_before_due": thawed_before_due,
    }


def cpu(ctx: Ctx) -> dict[str, Any]:
    """Redis CPU µs per message: plain publish beside delayed schedule + move, and beside
    compressed schedule + thaw + move; and the floors of a move (a bare Lua ZRANGE/ZREM/LPUSH)
    and of a scripted publish (a script call of one ZADD, beside a bare LPUSH)."""
    ctx.fresh()
    n = ctx.sizes.cpu - ctx.sizes.cpu % ROUNDS
    # How long both sides' publishes take, with a margin (a delayed one takes a little longer).
    publish_s = 1.5 * 2 * n * _calibrate(ctx)

    mover = ctx.movers.start("--thaw-ahead", f"{THAW_AHEAD_S:g}")
    _settled(ctx)
    idle = _idle(ctx)
    # The herd's copy (kombu_delay/mover/stage.py) begins its lead before due: after the publish.
    due = int(now_ms() + publish_s * 1000 + thaw_plan.lead_ms(n, thaw_plan.DEFAULT_RATE) + 3000)
    plain, hot = _interleaved(ctx, n, due, {"delay_compress_after": 0, "delay_bucket_width": BUCKET_S})
    if now_ms() >= due:
        raise RuntimeError("the publish ended after the due time; rerun")
    move = _moved(ctx, due, n)
    ctx.probe.client.delete(QUEUE)

    cold = _compressed(ctx, n, publish_s)
    ctx.movers.stop(mover)
    ctx.probe.flush()
    floor_payloads = [ctx.payloads.make(due)[1] for _ in range(n)]
    _, floor_cpu = ctx.probe.floor_move(floor_payloads, ctx.movers.batch_size)
    ctx.probe.flush()
    floor_publish = ctx.probe.floor_publish(floor_payloads)
    figures = _figures(n, idle, (plain, hot, move), cold)
    return {
        "messages": n,
        "rounds": ROUNDS,
        "payload_bytes": ctx.payloads.size,
        "idle_redis_cpu_ms_per_s": idle.main_per_s * 1000,
        "idle_redis_process_cpu_ms_per_s": idle.process_per_s * 1000,
        "poll_redis_cpu_us": idle.poll_main_s * 1e6,
        "poll_redis_process_cpu_us": idle.poll_process_s * 1e6,
        "plain_publish_has_eta": True,
        **figures,
        "floor_move_redis_cpu_us": floor_cpu * 1e6 / n,
        **_floors(n, figures["plain_redis_cpu_us_beside_schedule"], floor_publish, floor_cpu),
    }


def _floors(n: int, plain_us: float, publish: dict[str, float], move_s: float) -> dict[str, float]:
    """The floor of a scripted publish (``floor_publish``'s CPU seconds for ``n`` messages,
    by way), and the ratio a delayed message would reach were its schedule that script call
    of one ZADD and its move the bare Lua move (``move_s``): the plain publish (``plain_us``,
    net, µs) with its LPUSH swapped for the script call, plus that move, over the plain
    publish. No design that stores a message by a script comes below it."""
    per = 1e6 / n
    script_over_lpush_us = (publish["script"] - publish["lpush"]) * per
    return {
        "floor_lpush_redis_cpu_us": publish["lpush"] * per,
        "floor_zadd_redis_cpu_us": publish["zadd"] * per,
        "floor_script_zadd_redis_cpu_us": publish["script"] * per,
        "floor_script_over_lpush_us": script_over_lpush_us,
        "floor_delayed_ratio": (plain_us + script_over_lpush_us + move_s * per) / plain_us,
    }


def _measured(cpu_s: float) -> float:
    """``cpu_s``, a part's CPU net of idle, where it is above zero; else NaN (not measured)."""
    return cpu_s if cpu_s > 0 else math.nan


def _figures(n: int, idle: Idle, hot: tuple[Side, Side, Side], cold: dict[str, Any]) -> dict[str, Any]:
    """The per-message figures, net of ``idle``, and the gross ratios beside them."""
    per = 1e6 / n
    plain_gross, schedule_gross, move_gross = hot
    plain_cold_gross, cold_gross = cold["plain"], cold["schedule"]
    thaw_gross, cold_move_gross = cold["thaw"], cold["move"]
    plain, schedule = plain_gross.net(idle), schedule_gross.net(idle)
    plain_cold, cold_side = plain_cold_gross.net(idle), cold_gross.net(idle)
    # Net of idle, a part at or below zero was not measured (the idle taken off was more than
    # it): NaN, which misses every target it enters, where it read as a cheap part, and "met".
    move = _measured(move_gross.less(idle.process_per_s, idle.poll_process_s))
    thaw = _measured(thaw_gross.less(idle.main_per_s, idle.poll_main_s))
    cold_move = _measured(cold_move_gross.less(idle.process_per_s, idle.poll_process_s))
    delayed_us = (_measured(schedule.cpu_s) + move) * per
    compressed_us = (_measured(cold_side.cpu_s) + thaw + cold_move) * per
    # The same plain publish, measured in each half: almost all of it is the kernel's share of
    # a round trip, which moves with whatever else the machine runs, and the delayed side's
    # does not move with it. Where its rounds or its halves disagree, so would the ratios.
    plain_rounds = [c for c in plain_gross.rounds + plain_cold_gross.rounds if c > 0]
    spread = max(plain_rounds) / min(plain_rounds) if plain_rounds else float("inf")
    halves = max(plain.cpu_s, plain_cold.cpu_s) / max(1e-12, min(plain.cpu_s, plain_cold.cpu_s))
    gross_delayed = schedule_gross.cpu_s + move_gross.cpu_s
    gross_compressed = cold_gross.cpu_s + thaw_gross.cpu_s + cold_move_gross.cpu_s
    return {
        "plain_redis_cpu_us": (plain.cpu_s + plain_cold.cpu_s) * per / 2,
        "plain_redis_cpu_us_beside_schedule": plain.cpu_s * per,
        "plain_redis_cpu_us_beside_compressed": plain_cold.cpu_s * per,
        "plain_redis_user_us": plain.user_s * per,
        "plain_rounds_spread": spread,
        "plain_halves_differ_pct": (halves - 1) * 100,
        "steady": spread <= MAX_SPREAD and halves - 1 <= MAX_HALVES_DIFFER,
        "schedule_redis_cpu_us": schedule.cpu_s * per,
        "schedule_redis_user_us": schedule.user_s * per,
        "move_redis_cpu_us": move * per,
        "move_window_s": move_gross.wall_s,
        "move_polls": move_gross.polls,
        "delayed_redis_cpu_us": delayed_us,
        "delayed_minus_plain_us": delayed_us - plain.cpu_s * per,
        "delayed_ratio": delayed_us / (_measured(plain.cpu_s) * per),
        "delayed_ratio_gross": gross_delayed / plain_gross.cpu_s,
        "stored_compressed": n,
        "schedule_compressed_redis_cpu_us": cold_side.cpu_s * per,
        "thaw_redis_cpu_us": thaw * per,
        "thawed_before_due": bool(cold["thawed_before_due"]),
        "move_after_thaw_redis_cpu_us": cold_move * per,
        "compressed_redis_cpu_us": compressed_us,
        "compressed_ratio": compressed_us / (_measured(plain_cold.cpu_s) * per),
        "compressed_ratio_gross": gross_compressed / plain_cold_gross.cpu_s,
        "plain_per_s": 2 * n / (plain.wall_s + plain_cold.wall_s),
        "delayed_per_s": n / schedule.wall_s,
        "compressed_per_s": n / cold_side.wall_s,
        "publish_ratio": plain.wall_s / schedule.wall_s,
        "compressed_publish_ratio": plain_cold.wall_s / cold_side.wall_s,
    }
