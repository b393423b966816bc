"""The scale scenario: with 10,000 scheduled and with millions (a bulk fill, pipelined
``schedule.lua`` calls), the cost of a publish (kombu's own and pipelined) and of a move,
memory per message, and the latency of inspection (stats, ls, find, cancel, health).

Two layouts (``--scale-layout``): ``spread``, what a deployment holds with the default
settings (reminders over the next 90 days, one-minute buckets, compressed beyond
``delay_compress_after``), and ``one-set``, every message in one uncompressed sorted set:
the worst case for the O(log n) parts, which no default setting makes.
"""

from __future__ import annotations

import math
import random
import signal
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kombu_delay.config import Settings
from kombu_delay.control import DelayControl
from kombu_delay.message import Due
from kombu_delay.ops import health
from kombu_delay.store import keys
from kombu_delay.tooling.bench.ctx import Ctx, sleep_until, wait_for
from kombu_delay.tooling.bench.env import QUEUE, TASK, celery_app, eta_of, fill, now_ms, rss_mb

#: A bucket so wide that every message of the ``one-set`` layout shares one sorted set:
#: the worst case for the O(log n) members of the cost.
ONE_BUCKET_MS = 10**12
#: How far ahead the ``spread`` layout's fill is due: the next 90 days, from an hour on.
SPREAD_MS = 90 * 86_400_000
#: The layouts a scale run can fill.
LAYOUTS = ("spread", "one-set")
#: Messages published through kombu, one at a time, per round.
KOMBU_PROBE = 500
#: Runs of each timed inspection.
RUNS = 50
#: Seconds over which an idle mover's own Redis CPU is measured (its plans, sweeps, checks).
IDLE_S = 10.0


def _median_ms(fn: Callable[[], object], runs: int = RUNS) -> float:
    times = []
    for _ in range(runs):
        begun = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begun) * 1000)
    return statistics.median(times)


def _inspection(ctx: Ctx, settings: Settings) -> dict[str, float]:
    """Median latency, ms, of what an operator runs: stats, the first page of ls, find,
    cancel (of Celery messages stored among the fill) and the health probe."""
    due = int(now_ms()) + 3_600_000
    ids = []
    items = []
    for _ in range(RUNS):
        task_id, payload = ctx.payloads.make(due + random.randrange(3_600_000))
        ids.append(task_id)
        items.append((Due(due, task_id=task_id), QUEUE, payload))
    ctx.store.schedule_many(items, settings)
    victims = iter(ids)
    with DelayControl(ctx.delay_url) as ctl:
        return {
            "stats": _median_ms(ctl.stats, 30),
            "ls_first_page": _median_ms(lambda: ctl.scheduled(limit=100), 30),
            "find": _median_ms(lambda: ctl.find(random.choice(ids))),
            "find_missing": _median_ms(lambda: ctl.find(str(uuid.uuid4()))),
            "cancel": _median_ms(lambda: ctl.cancel(next(victims))),
            "health": _median_ms(lambda: health.check(ctl.store), 30),
        }


def _layout(ctx: Ctx) -> tuple[Settings, dict[str, Any], int]:
    """The settings a publish uses in this run's layout, kombu's transport options for them,
    and how far beyond an hour from now the fill is due, ms."""
    if ctx.sizes.scale_layout == "one-set":
        # Uncompressed, whatever the due time: the layout movers move from.
        wide = Settings(bucket_width_ms=ONE_BUCKET_MS, compress_after_ms=0)
        return wide, {"delay_bucket_width": ONE_BUCKET_MS / 1000, "delay_compress_after": 0}, 3_600_000
    return ctx.settings, {}, SPREAD_MS


def _scale_one(ctx: Ctx, size: int) -> dict[str, Any]:
    ctx.fresh()
    settings, options, span = _layout(ctx)
    # Memory per message is what the fill adds: the empty database's 1 to 2 MB, divided by
    # 10,000 messages, was a large share of the small size's figure, and made the ratio of the
    # sizes fall far below 1 whatever a message costs.
    empty = int(ctx.probe.info("memory")["used_memory"])
    base = int(now_ms()) + 3_600_000
    pad = "x" * 40

    def filler() -> Iterator[tuple[int, str, str]]:
        for i in range(size):  # distinct payloads: a bucket stores one copy of a payload per queue
            yield base + random.randrange(span), f"fill-{i}", f'{{"body":"{pad}","n":{i}}}'

    _, fill_s = fill(ctx.store, settings, filler(), chunk=5000)
    memory = ctx.probe.info("memory")
    inspection = _inspection(ctx, settings)
    mover = ctx.movers.start()
    walk_s = _walked(ctx)
    idle_cpu_ms_per_s = _idle_mover_cpu(ctx)
    # A round times a few milliseconds of Redis CPU, so one round is at the mercy of a cache
    # miss or a timer tick: the figures are the median of several rounds on the same fill.
    filled = (base, span)
    rounds = [_scale_round(ctx, settings, options, mover, filled) for _ in range(ctx.sizes.scale_rounds)]
    result = summary(rounds)
    result.update(
        layout=ctx.sizes.scale_layout,
        scheduled=size,
        fill_s=fill_s,
        rounds=rounds,
        # A mover that died has no RSS: 0.0 MB read as a small one.
        mover_rss_mb=rss_mb(mover.pid) if mover.poll() is None else math.nan,
        mover_exit=mover.poll(),
        walk_s=walk_s,
        mover_idle_redis_cpu_ms_per_s=idle_cpu_ms_per_s,
        used_memory_mb=int(memory["used_memory"]) / 2**20,
        used_memory_per_msg=(int(memory["used_memory"]) - empty) / size,
        redis_rss_mb=int(memory["used_memory_rss"]) / 2**20,
        inspection_ms=inspection,
    )
    ctx.movers.stop(mover)
    _flush(ctx)
    return result


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure of the rounds, and the timed messages they did not move, in
    all; a figure that a round could not measure (NaN: its move never ended) is NaN."""
    found: dict[str, Any] = {}
    for name in rounds[0]:
        values = [one[name] for one in rounds]
        if name in ("moved_all", "not_moved"):
            continue
        found[name] = math.nan if any(math.isnan(v) for v in values) else statistics.median(values)
    found["not_moved"] = sum(one["not_moved"] for one in rounds)
    found["moved_all"] = found["not_moved"] == 0
    return found


def _flush(ctx: Ctx) -> None:
    """Empty the database of millions of messages: freed in the background (a synchronous
    FLUSHDB takes longer than a client's socket timeout), and waited for."""
    ctx.probe.client.flushdb(asynchronous=True)

    def freed() -> bool:
        return int(ctx.probe.info("memory").get("lazyfree_pending_objects", 0)) == 0

    if not wait_for(freed, timeout=600, interval=0.2):
        raise RuntimeError("the flush did not finish")


def _walked(ctx: Ctx) -> float:
    """Wait for the walk of the id index that the mover just started begins with (see
    ``forget.lua``: one an hour, whichever mover, paced to a sixth of Redis's time; minutes
    at ten million), so that the rounds time moves, not the walk; return its seconds."""
    started = time.monotonic()
    walk = keys.walk(ctx.store.prefix)
    if not wait_for(lambda: ctx.probe.client.hexists(walk, "done"), timeout=3600, interval=0.5):
        raise RuntimeError("the mover's walk of the id index did not end")
    return time.monotonic() - started


def _idle_mover_cpu(ctx: Ctx) -> float:
    """Redis CPU ms per second that a running mover costs while nothing is due: its thaw plan,
    its sweep of every bucket, its checks; fixed per second, whatever is published."""
    time.sleep(IDLE_S / 2)  # past its start: script loading, the first sweep and checks
    cpu = ctx.probe.redis_cpu_s()
    time.sleep(IDLE_S)
    return (ctx.probe.redis_cpu_s() - cpu) * 1000 / IDLE_S


@contextmanager
def _paused(mover: subprocess.Popen[bytes]) -> Iterator[None]:
    """Hold the mover (SIGSTOP) while publishes are timed: its own per-second work (see
    :func:`_idle_mover_cpu`) would be counted as theirs, more of it the more buckets there are."""
    mover.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        mover.send_signal(signal.SIGCONT)


def _scale_round(
    ctx: Ctx,
    settings: Settings,
    options: dict[str, Any],
    mover: subprocess.Popen[bytes],
    filled: tuple[int, int],
) -> dict[str, Any]:
    """With the mover held, publish ``scale_probe`` messages (pipelined, then ``KOMBU_PROBE``
    one by one through kombu) due among the fill (``filled``: its first due time and span),
    as the fill's are: into its buckets, at its size; they stay scheduled. Then publish as
    many due at one instant soon (untimed) and time their move; the list is emptied after."""
    k = ctx.sizes.scale_probe
    first, span = filled
    items = []
    for _ in range(k):
        among = first + random.randrange(span)
        task_id, payload = ctx.payloads.make(among)
        items.append((Due(among, task_id=task_id), QUEUE, payload))
    due = int(now_ms() + ctx.lead_ms(k + KOMBU_PROBE) + 500)
    near = []
    for _ in range(k + KOMBU_PROBE):
        task_id, payload = ctx.payloads.make(due)
        near.append((Due(due, task_id=task_id), QUEUE, payload))
    landed_among = _bucket_members(ctx, settings, [when.ms for when, _, _ in items])
    with _paused(mover):
        ctx.probe.reset_stats()
        cpu, started = ctx.probe.redis_cpu_s(), time.perf_counter()
        ctx.store.schedule_many(items, settings)
        publish_wall = time.perf_counter() - started
        publish_cpu = ctx.probe.redis_cpu_s() - cpu
        publish_stats = ctx.probe.evalsha_stats()
        kombu_cpu, one_by_one = _kombu_publish(ctx, options, filled)
        ctx.store.schedule_many(near, settings)
    sleep_until(due - 100)
    ctx.probe.reset_stats()
    cpu = ctx.probe.redis_cpu_s()
    moving = k + KOMBU_PROBE
    wait_for(lambda: ctx.probe.llen() >= moving or mover.poll() is not None, timeout=120)
    not_moved = max(0, moving - ctx.probe.llen())
    move_cpu = ctx.probe.redis_cpu_s() - cpu
    move_stats = ctx.probe.evalsha_stats()
    ctx.probe.client.delete(QUEUE)
    # A move that never ended has no cost: its CPU was the wait's polls (196x the small size's).
    moved = not_moved == 0
    return {
        "publish_server_us": publish_stats["usec"] / max(publish_stats["calls"], 1),
        "publish_pipelined_client_us": publish_wall / k * 1e6,
        "publish_kombu_us_p50": statistics.median(one_by_one) * 1e6,
        "publish_kombu_redis_cpu_us": kombu_cpu / KOMBU_PROBE * 1e6,
        "move_server_us_per_msg": move_stats["usec"] / moving if moved else math.nan,
        "publish_redis_cpu_us": publish_cpu / k * 1e6,
        "move_redis_cpu_us_per_msg": move_cpu / moving * 1e6 if moved else math.nan,
        "moved_all": moved,
        "not_moved": not_moved,
        "publish_bucket_members_mean": landed_among,
    }


def _bucket_members(ctx: Ctx, settings: Settings, dues: list[int]) -> float:
    """How many messages, on average, the sorted set each of ``dues`` goes into already holds
    (its bucket's, compressed or not): what a timed publish measures itself against."""
    width = settings.bucket_width_ms
    pipe = ctx.probe.client.pipeline(transaction=False)
    for due in dues:
        for space in ("", keys.COLD):
            pipe.zcard(keys.queue_set(ctx.store.prefix, due - due % width, QUEUE, space))
    counts = [int(x) for x in pipe.execute()]
    return sum(counts) / max(len(dues), 1)


def _kombu_publish(ctx: Ctx, options: dict[str, Any], filled: tuple[int, int]) -> tuple[float, list[float]]:
    """Publish ``KOMBU_PROBE`` messages through kombu, one at a time, as a producer makes them,
    each due at random among the fill (``filled``: its first due time and span), into its
    buckets; return (Redis CPU seconds, seconds per publish)."""
    first, span = filled
    app = celery_app(ctx.delay_url)
    app.conf.broker_transport_options = options
    app.send_task(TASK, kwargs={"pad": ""}, eta=eta_of(first), queue="warmup")
    dues = [eta_of(first + random.randrange(span)) for _ in range(KOMBU_PROBE)]
    one_by_one = []
    cpu = ctx.probe.redis_cpu_s()
    for eta in dues:
        started = time.perf_counter()
        app.send_task(TASK, kwargs={"pad": ctx.payloads.pad}, eta=eta)
        one_by_one.append(time.perf_counter() - started)
    kombu_cpu = ctx.probe.redis_cpu_s() - cpu
    app.close()
    return kombu_cpu, one_by_one


def scale(ctx: Ctx) -> dict[str, Any]:
    """Publish and move cost, memory and inspection latency with a small and a large number
    already scheduled (and a middle one, when asked)."""
    small = _scale_one(ctx, ctx.sizes.scale_small)
    middle = _scale_one(ctx, ctx.sizes.scale_middle) if ctx.sizes.scale_middle else None
    large = _scale_one(ctx, ctx.sizes.scale_large)
    before, after = small["inspection_ms"], large["inspection_ms"]
    slower = {op: after[op] / max(before[op], 1e-9) for op in before}

    def per_msg(side: dict[str, Any]) -> float:
        return float(side["used_memory_per_msg"])

    sides = {"small": small, "middle": middle, "large": large}
    broken = [
        f"{name}: {side['not_moved']:,} not moved"
        + ("" if side["mover_exit"] is None else f", its mover exited with {side['mover_exit']}")
        for name, side in sides.items()
        if side and (side["not_moved"] or side["mover_exit"] is not None)
    ]
    return {
        **({"failed": f"the mover did not move every timed message ({'; '.join(broken)})"} if broken else {}),
        "small": small,
        **({"middle": middle} if middle else {}),
        "large": large,
        "inspection_ratio": slower,
        "inspection_ratio_max": max(slower.values()),
        # Only with a middle size (--scale-middle): its target is the large size's against it.
        **({"memory_per_msg_ratio": per_msg(large) / per_msg(middle)} if middle else {}),
        # Cost is Redis CPU per message: wall time inside Redis also counts the moments a
        # busy shared machine took the CPU away from it.
        "publish_ratio": large["publish_redis_cpu_us"] / max(small["publish_redis_cpu_us"], 1e-9),
        "kombu_publish_ratio": large["publish_kombu_redis_cpu_us"]
        / max(small["publish_kombu_redis_cpu_us"], 1e-9),
        "move_ratio": large["move_redis_cpu_us_per_msg"] / max(small["move_redis_cpu_us_per_msg"], 1e-9),
        "publish_server_ratio": large["publish_server_us"] / max(small["publish_server_us"], 1e-9),
        "move_server_ratio": large["move_server_us_per_msg"] / max(small["move_server_us_per_msg"], 1e-9),
    }
