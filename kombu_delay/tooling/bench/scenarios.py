"""The benchmark's scenarios: publish, precision, burst, memory, thaw, scale and herd.

Each scenario takes a :class:`Ctx`, starts from an empty database, and returns a
JSON-ready dict. Messages are Celery's own (see :class:`~kombu_delay.tooling.bench.env.Payloads`),
movers are real ``kombu-delay mover`` processes, and arrival is judged where a
worker would see it: on kombu's list.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from kombu_delay.config import Settings
from kombu_delay.message import Due, parse_iso_ms
from kombu_delay.store import Store, cold, keys
from kombu_delay.tooling.bench.env import (
    QUEUE,
    TASK,
    Movers,
    Payloads,
    Probe,
    celery_app,
    eta_of,
    fill,
    now_ms,
    rss_mb,
)

#: A bucket so wide that every message of the scale scenario shares one sorted set:
#: the worst case for the O(log n) members of the cost.
ONE_BUCKET_MS = 10**12


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
    scale_probe: int = 2000
    scale_rounds: int = 5
    herd: int = 100_000
    herd_rate: int = 10_000
    herd_max_len: int = 5_000
    herd_consume_rate: int = 10_000
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


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def _wait(predicate: Any, timeout: float, interval: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def _sleep_until(ms: float) -> None:
    while (left := ms - now_ms()) > 0:
        time.sleep(min(left / 1000, 0.05))


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
    _wait(lambda: len(arrivals) >= n, timeout=(base + window_ms - now_ms()) / 1000 + 60, interval=0.1)
    stop.set()
    thread.join(timeout=5)
    conn.close()
    app.close()
    import json

    late = [at - parse_iso_ms(json.loads(raw)["headers"]["eta"]) for at, raw in arrivals]
    return {
        "messages": n,
        "arrived": len(late),
        "window_s": ctx.sizes.precision_window_s,
        "publish_done_before_first_due_ms": base - published_by,
        "early": sum(1 for x in late if x < 0),
        "p50_ms": _pct(late, 50),
        "p99_ms": _pct(late, 99),
        "max_ms": max(late, default=0.0),
        "min_ms": min(late, default=0.0),
        "lateness_ms": sorted(round(x, 3) for x in late),
    }


def burst(ctx: Ctx) -> dict[str, Any]:
    """N messages due at one instant, one mover: due -> all on the list; LPUSH ceiling."""
    ctx.fresh()
    n = ctx.sizes.burst
    mover = ctx.movers.start()
    due = int(now_ms() + ctx.lead_ms(n))
    count, fill_s, payloads = ctx.fill_celery(iter([due] * n))
    if now_ms() > due - 300:
        raise RuntimeError("the fill ended too close to the due time; rerun")
    _sleep_until(due - 200)
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


def memory(ctx: Ctx) -> dict[str, Any]:
    """Redis used_memory per scheduled message, beyond its payload, ids index included:
    stored compressed (the default for messages due this far ahead), then uncompressed."""
    ctx.fresh()
    n = ctx.sizes.memory
    start = int(now_ms()) + 600_000
    messages = []
    for _ in range(n):
        due_ms = start + random.randrange(3_600_000)
        messages.append((due_ms, *ctx.payloads.make(due_ms)))
    payloads = [payload for _, _, payload in messages]
    payload = statistics.fmean(len(p.encode()) for p in payloads)
    ns = ctx.store.ns

    # The default settings: due 10-70 min ahead, every message is stored compressed.
    before = ctx.probe.used_memory()
    count, fill_s = fill(ctx.store, ctx.settings, iter(messages))
    per = (ctx.probe.used_memory() - before) / count
    ctx.fill_rate = count / max(fill_s, 1e-6)
    ids_bytes = ctx.probe.sizes_of(f"{ns}ids")
    cold_bytes = ctx.probe.sizes_of(f"{ns}cz:*")
    member = statistics.fmean(len(cold.pack(p, task_id) or b"") for _, task_id, p in messages)
    result: dict[str, Any] = {
        "messages": count,
        "payload_bytes": payload,
        "stored_compressed": _members_of(ctx, f"{ns}cz:*"),
        "used_memory_per_msg": per,
        "overhead_per_msg": per - payload,
        "compressed_member_bytes": member,
        "compressed_sets_per_msg": cold_bytes / count,
        "ids_index_per_msg": ids_bytes / count,
        "other_per_msg": per - (ids_bytes + cold_bytes) / count,
    }

    # The same messages with compression off: the layout movers move from, and the one a
    # message due sooner than delay_compress_after is stored in.
    ctx.probe.flush()
    before = ctx.probe.used_memory()
    count, _ = fill(ctx.store, replace(ctx.settings, compress_after_ms=0), iter(messages))
    per = (ctx.probe.used_memory() - before) / count
    ids_bytes = ctx.probe.sizes_of(f"{ns}ids")
    bucket_bytes = ctx.probe.sizes_of(f"{ns}z:*")
    task_list_bytes = ctx.probe.sizes_of(f"{ns}t:*")
    plain_member = payload  # the member is the payload itself
    result.update(
        {
            "uncompressed_stored": _members_of(ctx, f"{ns}z:*"),
            "uncompressed_used_memory_per_msg": per,
            "uncompressed_overhead_per_msg": per - payload,
            "uncompressed_ids_index_per_msg": ids_bytes / count,
            "uncompressed_buckets_per_msg": bucket_bytes / count,
            "uncompressed_task_id_lists_per_msg": task_list_bytes / count,
            # jemalloc hands out size classes: a member of this length is stored in the next
            # one. (Compressed members vary in length, so one class says nothing about them.)
            "uncompressed_allocator_rounding_bytes": _size_class(plain_member + 6) - plain_member,
            "uncompressed_sorted_set_structure_bytes": bucket_bytes / count - _size_class(plain_member + 6),
            "uncompressed_other_per_msg": per - (ids_bytes + bucket_bytes + task_list_bytes) / count,
        }
    )
    # For scale, the same payloads in the structures a layout can be made of: the list plain
    # kombu pushes them onto; a bare sorted set of them (the floor of any layout that keeps
    # the message itself as a sorted-set member); and a sorted set of task ids alone (the
    # floor of the index of a layout that would keep the payloads elsewhere).
    ctx.probe.flush()
    plain = _grown(ctx, lambda: ctx.probe.lpush_ceiling(payloads))
    ctx.probe.flush()
    bare = _grown(ctx, lambda: ctx.probe.zadd_all(QUEUE, payloads))
    ctx.probe.flush()
    ids = [str(uuid.uuid4()) for _ in range(count)]
    id_set = _grown(ctx, lambda: ctx.probe.zadd_all(QUEUE, ids))
    ctx.probe.flush()
    result["plain_list_overhead_per_msg"] = plain / count - payload
    result["bare_sorted_set_overhead_per_msg"] = bare / count - payload
    result["task_id_sorted_set_per_msg"] = id_set / count
    return result


def _members_of(ctx: Ctx, pattern: str) -> int:
    """How many members the sorted sets matching ``pattern`` hold together."""
    client = ctx.probe.client
    return sum(int(client.zcard(key)) for key in client.scan_iter(match=pattern, count=1000))


def _grown(ctx: Ctx, fill: Callable[[], object]) -> int:
    """Redis ``used_memory`` growth, in bytes, while ``fill`` runs."""
    before = ctx.probe.used_memory()
    fill()
    return ctx.probe.used_memory() - before


def _size_class(size: float) -> int:
    """jemalloc's size class for an allocation of ``size`` bytes (four classes per doubling)."""
    n = math.ceil(size)
    if n <= 16:
        return max(8, 8 * math.ceil(n / 8))
    if n <= 128:
        return 16 * math.ceil(n / 16)
    spacing: int = 1 << (math.ceil(math.log2(n)) - 3)
    return spacing * math.ceil(n / spacing)


def thaw(ctx: Ctx) -> dict[str, Any]:
    """N messages due at one instant, stored compressed, one mover: the thaw ahead of the due
    time (rate, largest script call, Redis CPU), then due -> all on the list."""
    ctx.fresh()
    n = ctx.sizes.thaw
    # A short thaw horizon keeps the run short; the thaw itself is the same at any horizon.
    settings = replace(ctx.settings, compress_after_ms=11_000, thaw_ahead_ms=10_000)
    ahead = settings.thaw_ahead_ms
    mover = ctx.movers.start("--thaw-ahead", str(ahead / 1000))
    due = int(now_ms() + ctx.lead_ms(n) + settings.compress_after_ms + 1000)
    count, fill_s, _ = ctx.fill_celery(iter([due] * n), settings)
    if now_ms() > due - settings.compress_after_ms:
        raise RuntimeError("the fill ended too close to the due time to store it compressed; rerun")
    client = ctx.probe.client
    cold_set = keys.queue_set(ctx.store.prefix, due - due % settings.bucket_width_ms, QUEUE, keys.COLD)
    stored_cold = int(client.zcard(cold_set))
    if stored_cold != count:
        raise RuntimeError(f"only {stored_cold} of {count} messages were stored compressed")
    _sleep_until(due - ahead - 500)
    if int(client.zcard(cold_set)) != stored_cold:
        raise RuntimeError("the thaw began before the fill was measured; rerun")
    ctx.probe.reset_stats(slower_than_us=0)
    cpu = ctx.probe.redis_cpu_s()
    series: list[tuple[float, int, int]] = []  # (ms after due, still compressed, on the list)
    began_at = done_at = listed_at = 0.0
    left_at_first = 0
    slowest = thaw_cpu = 0.0
    early = 0
    deadline = time.monotonic() + ahead / 1000 + 120
    while time.monotonic() < deadline:
        pipe = client.pipeline(transaction=False)
        pipe.zcard(cold_set)
        pipe.llen(QUEUE)
        left, length = (int(x) for x in pipe.execute())
        at = now_ms()  # read after the sample, so a message is never taken for early
        series.append((round(at - due, 2), left, length))
        if at < due:
            early = max(early, length)
        if left < stored_cold and not began_at:
            began_at, left_at_first = at, left
        if left == 0 and not done_at:
            done_at = at
            thaw_cpu = ctx.probe.redis_cpu_s() - cpu
            slowest = ctx.probe.slowest_script_ms()
        if length >= n:
            listed_at = at
            break
        time.sleep(0.005)
    length = ctx.probe.llen()
    ctx.movers.stop(mover)
    ctx.probe.flush()
    ctx.probe.reset_stats()
    thaw_s = (done_at - began_at) / 1000 if done_at else float("nan")
    drain_s = (listed_at - due) / 1000 if listed_at else float("nan")
    return {
        "messages": count,
        "payload_bytes": ctx.payloads.size,
        "fill_s": fill_s,
        "stored_cold": stored_cold,
        "thaw_ahead_ms": ahead,
        "thaw_started_ms_before_due": due - began_at if began_at else float("nan"),
        "thaw_s": thaw_s,
        # Counted from the first sample that saw a batch gone, so that batch is left out.
        "thawed_per_s": left_at_first / thaw_s if thaw_s > 0 else float("nan"),
        "thaw_done_before_due": bool(done_at) and done_at < due,
        "thaw_done_ms_before_due": due - done_at if done_at else float("nan"),
        "largest_thaw_script_call_ms": slowest,
        "thaw_redis_cpu_us_per_msg": thaw_cpu * 1e6 / max(stored_cold, 1),
        "drain_s": drain_s,
        "moved_per_s": n / drain_s if drain_s > 0 else 0.0,
        "early": early,
        "lost": n - length,
        "series": series[:: max(1, len(series) // 400)] + series[-1:],
    }


def _scale_one(ctx: Ctx, size: int) -> dict[str, Any]:
    ctx.fresh()
    # Uncompressed, whatever the due time: this measures the layout movers move from (the
    # cold space, which they thaw from, is measured by the thaw scenario).
    wide = Settings(bucket_width_ms=ONE_BUCKET_MS, compress_after_ms=0)
    base = int(now_ms()) + 3_600_000
    pad = "x" * 40

    def filler() -> Iterator[tuple[int, str, str]]:
        for i in range(size):  # distinct payloads: a bucket stores one copy of a payload per queue
            yield base + random.randrange(3_600_000), f"fill-{i}", f'{{"body":"{pad}","n":{i}}}'

    _, fill_s = fill(ctx.store, wide, filler(), chunk=5000)
    mover = ctx.movers.start()
    # A round times a few milliseconds of Redis CPU, so one round is at the mercy of a cache
    # miss or a timer tick: the figures are the median of several rounds on the same fill.
    rounds = [_scale_round(ctx, wide) for _ in range(ctx.sizes.scale_rounds)]
    result: dict[str, Any] = {
        name: statistics.median(one[name] for one in rounds) for name in rounds[0] if name != "moved_all"
    }
    result.update(
        scheduled=size,
        fill_s=fill_s,
        moved_all=all(one["moved_all"] for one in rounds),
        rounds=rounds,
        mover_rss_mb=rss_mb(mover.pid),
        used_memory_mb=ctx.probe.used_memory() / 2**20,
    )
    ctx.movers.stop(mover)
    ctx.probe.flush()
    return result


def _scale_round(ctx: Ctx, wide: Settings) -> dict[str, Any]:
    """Publish ``scale_probe`` messages due at one instant (pipelined, then 200 one by one)
    and time their publish and their move; the list is emptied afterwards."""
    k = ctx.sizes.scale_probe
    due = int(now_ms() + ctx.lead_ms(k) + 500)
    items = []
    for _ in range(k):
        task_id, payload = ctx.payloads.make(due)
        items.append((Due(due, task_id=task_id), QUEUE, payload))
    ctx.probe.reset_stats()
    cpu, started = ctx.probe.redis_cpu_s(), time.perf_counter()
    ctx.store.schedule_many(items, wide)
    publish_wall = time.perf_counter() - started
    publish_cpu = ctx.probe.redis_cpu_s() - cpu
    publish_stats = ctx.probe.evalsha_stats()
    one_by_one = []
    for _ in range(200):  # single calls, one round trip each, as a producer makes them
        task_id, payload = ctx.payloads.make(due)
        started = time.perf_counter()
        ctx.store.schedule(Due(due, task_id=task_id), QUEUE, payload, wide)
        one_by_one.append(time.perf_counter() - started)
    _sleep_until(due - 100)
    ctx.probe.reset_stats()
    cpu = ctx.probe.redis_cpu_s()
    moved_all = _wait(lambda: ctx.probe.llen() >= k + 200, timeout=120)
    move_cpu = ctx.probe.redis_cpu_s() - cpu
    move_stats = ctx.probe.evalsha_stats()
    ctx.probe.client.delete(QUEUE)
    return {
        "publish_server_us": publish_stats["usec"] / max(publish_stats["calls"], 1),
        "publish_pipelined_client_us": publish_wall / k * 1e6,
        "publish_single_call_us_p50": statistics.median(one_by_one) * 1e6,
        "move_server_us_per_msg": move_stats["usec"] / (k + 200),
        "publish_redis_cpu_us": publish_cpu / k * 1e6,
        "move_redis_cpu_us_per_msg": move_cpu / (k + 200) * 1e6,
        "moved_all": moved_all,
    }


def scale(ctx: Ctx) -> dict[str, Any]:
    """Publish and move cost with a small and a large number already scheduled."""
    small = _scale_one(ctx, ctx.sizes.scale_small)
    large = _scale_one(ctx, ctx.sizes.scale_large)
    return {
        "small": small,
        "large": large,
        # Cost is Redis CPU per message: wall time inside Redis also counts the moments a
        # busy shared machine took the CPU away from it.
        "publish_ratio": large["publish_redis_cpu_us"] / max(small["publish_redis_cpu_us"], 1e-9),
        "move_ratio": large["move_redis_cpu_us_per_msg"] / max(small["move_redis_cpu_us_per_msg"], 1e-9),
        "publish_server_ratio": large["publish_server_us"] / max(small["publish_server_us"], 1e-9),
        "move_server_ratio": large["move_server_us_per_msg"] / max(small["move_server_us_per_msg"], 1e-9),
    }


def _ramp(ctx: Ctx, extra: tuple[str, ...], consume_per_s: int, expected_per_s: int) -> dict[str, Any]:
    ctx.fresh()
    n = ctx.sizes.herd
    mover = ctx.movers.start(*extra)
    due = int(now_ms() + ctx.lead_ms(n))
    ctx.fill_celery(iter([due] * n))
    _sleep_until(due)
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


def herd(ctx: Ctx) -> dict[str, Any]:
    """A herd due at one instant under --max-rate, then under --max-queue-length."""
    s = ctx.sizes
    rate = _ramp(ctx, ("--max-rate", str(s.herd_rate)), 0, s.herd_rate)
    held = _ramp(ctx, ("--max-queue-length", str(s.herd_max_len)), s.herd_consume_rate, s.herd_consume_rate)
    ctx.probe.flush()
    return {
        "max_rate": {"cap_per_s": s.herd_rate, **rate},
        "max_queue_length": {"cap": s.herd_max_len, "consumer_per_s": s.herd_consume_rate, **held},
    }


SCENARIOS = {
    "publish": publish,
    "precision": precision,
    "burst": burst,
    "memory": memory,
    "thaw": thaw,
    "scale": scale,
    "herd": herd,
}
