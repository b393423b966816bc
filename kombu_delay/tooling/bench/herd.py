"""The compressed-herd scenarios: ``thaw`` (a mover's thaw, measured) and ``herd`` (a million
compressed Celery messages due at one instant, default settings: all on the list on time).

The ``herd`` messages are Celery's own with varied, realistic arguments (ids, addresses,
amounts, free text), not padding: what a nightly reminder job or a campaign publishes, and
what the compressed layout must restore byte for byte.
"""

from __future__ import annotations

import base64
import copy
import json
import random
import statistics
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from kombu_delay.config import Settings
from kombu_delay.mover import thaw_plan
from kombu_delay.store import cold, keys
from kombu_delay.tooling.bench.arrivals import (
    Sampler,
    early_seen,
    grace,
    ids_of,
    list_ids,
    move_span,
    pause_s,
    tally,
)
from kombu_delay.tooling.bench.ctx import Ctx
from kombu_delay.tooling.bench.env import QUEUE, TASK, celery_app, eta_of, fill, now_ms, rss_mb

#: Messages a herd's fill is timed on first, to schedule the herd far enough ahead that it is
#: all published, compressed, before its planned thaw must begin.
CALIBRATION = 3000

_DOMAINS = ("example.com", "mail.example.org", "corp.example.net", "shop.example.io")
_TEMPLATES = ("reminder", "renewal", "digest", "invoice_due", "trial_ending", "cart_abandoned")
_LOCALES = ("en", "en-GB", "fr", "de", "es", "pt-BR", "ja", "nl")
_WORDS = [
    "your",
    "subscription",
    "renews",
    "soon",
    "please",
    "review",
    "the",
    "plan",
    "you",
    "chose",
    "and",
    "the",
    "payment",
    "method",
    "on",
    "file",
    "thanks",
    "for",
    "being",
    "with",
    "us",
    "the",
    "order",
    "ships",
    "tomorrow",
    "tracking",
    "follows",
    "by",
    "mail",
]


class VariedPayloads:
    """Celery protocol 2 messages with varied arguments, as ``apply_async`` builds them.

    One real message is captured from a real ``send_task``; each copy gets its own id, ETA,
    delivery tag and arguments (the body, ``argsrepr`` and ``kwargsrepr`` made as Celery
    makes them).
    """

    def __init__(self, ctx: Ctx, seed: int = 7) -> None:
        app = celery_app(ctx.url)
        queue = "kombu_delay_bench_capture"
        app.send_task(TASK, args=[1, "a@b"], kwargs={"k": "v"}, countdown=60, queue=queue)
        app.close()
        raw = ctx.probe.client.rpop(queue)
        assert raw is not None, "the captured message did not arrive"
        self.template: dict[str, Any] = json.loads(bytes(raw))  # type: ignore[arg-type]
        self._embed = json.loads(base64.b64decode(self.template["body"]))[2]
        self._random = random.Random(seed)

    def make(self, due_ms: int) -> tuple[str, str]:
        """Return ``(task_id, payload)`` of a message due at ``due_ms``."""
        rnd = self._random
        task_id = str(uuid.uuid4())
        args = [rnd.randrange(10**7), f"user{rnd.randrange(10**6)}@{rnd.choice(_DOMAINS)}"]
        kwargs = {
            "template": rnd.choice(_TEMPLATES),
            "locale": rnd.choice(_LOCALES),
            "campaign": f"spring-{rnd.randrange(1000)}",
            "amount": round(rnd.uniform(1, 500), 2),
            "items": [rnd.randrange(10**5) for _ in range(rnd.randrange(1, 6))],
            "note": " ".join(rnd.choice(_WORDS) for _ in range(rnd.randrange(3, 14))),
        }
        message = copy.copy(self.template)
        message["body"] = base64.b64encode(json.dumps([args, kwargs, self._embed]).encode()).decode()
        headers = message["headers"] = dict(self.template["headers"])
        headers.update(
            id=task_id,
            root_id=task_id,
            eta=eta_of(due_ms).isoformat(timespec="microseconds"),
            argsrepr=repr(args),
            kwargsrepr=repr(kwargs),
        )
        properties = message["properties"] = dict(self.template["properties"])
        properties.update(correlation_id=task_id, delivery_tag=str(uuid.uuid4()))
        return task_id, json.dumps(message)


def _watch(
    ctx: Ctx, cold_set: str, stored: int, ids: list[str], due: int, timeout_s: float, staged: str = ""
) -> dict[str, Any]:
    """Sample the compressed set, the herd's staged copy (``staged``, its key), the list and the
    mover's ``moved`` counter, each sample stamped by Redis's clock (see arrivals.py), until all
    ``n`` are on the list and for a grace period after; then count the list by id. Reports when
    the thaw began and ended, when the copy began and was whole, how many were on the list
    before ``due`` (early), when all were, and the move's span and rate by the mover's counter."""
    n = len(ids)
    cpu = ctx.probe.redis_cpu_s()
    renames = ctx.probe.calls("rename")
    sample = Sampler(ctx, [("zcard", cold_set), ("llen", QUEUE), ("llen", staged or QUEUE), ("moved", "")])
    samples: list[tuple[float, ...]] = []  # (Redis ms, still compressed, on the list, copied, moved)
    began_at = done_at = staging_at = staged_at = 0.0
    left_at_first, thaw_cpu, peak_memory, next_memory = 0, 0.0, 0, 0.0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples.append(sample())
        at, left, length, copied, _ = samples[-1]
        if staged and copied and not staging_at:
            staging_at = at
        if staged and copied >= n and not staged_at:
            staged_at = at
        if left < stored and not began_at:
            began_at, left_at_first = at, int(left)
        if left == 0 and not done_at:
            done_at, thaw_cpu = at, ctx.probe.redis_cpu_s() - cpu
        if time.monotonic() >= next_memory:
            peak_memory, next_memory = max(peak_memory, ctx.probe.used_memory()), time.monotonic() + 0.5
        if length >= n:
            break
        time.sleep(pause_s(at, [due], 0.005 if abs(at - due) < 5000 or left else 0.1))
    grace(ctx, lambda: samples.append(sample()))  # read on: a late duplicate is counted
    counted = tally(list_ids(ctx.probe.client), ids)
    thaw_s = (done_at - began_at) / 1000 if done_at else float("nan")
    # All on the list: the first sample holding every delivery (a duplicate standing in for a
    # message never delivered is no end); early: on the list at a Redis time before due.
    listed_at = 0.0
    if counted["lost"] == 0:
        listed_at = next((s[0] for s in samples if s[2] >= counted["delivered"]), 0.0)
    series = [(round(s[0] - due, 2), int(s[1]), int(s[2])) for s in samples]
    return {
        "thaw_started_ms_before_due": due - began_at if began_at else float("nan"),
        "thaw_s": thaw_s,
        # Counted from the first sample that saw a batch gone, so that batch is left out.
        "thawed_per_s": left_at_first / thaw_s if thaw_s > 0 else float("nan"),
        "thaw_done_before_due": bool(done_at) and done_at < due,
        "thaw_done_ms_before_due": due - done_at if done_at else float("nan"),
        "thaw_redis_cpu_us_per_msg": thaw_cpu * 1e6 / max(stored, 1),
        "peak_used_memory_mb": peak_memory / 2**20,
        "all_on_list_s_after_due": (listed_at - due) / 1000 if listed_at else float("nan"),
        "staging_began_ms_before_due": due - staging_at if staging_at else float("nan"),
        "staged_ms_before_due": due - staged_at if staged_at else float("nan"),
        "renames": ctx.probe.calls("rename") - renames,
        **early_seen(samples, [due] * n, 2),
        **move_span(samples, 4, n),
        "series": series[:: max(1, len(series) // 400)] + series[-1:],
        **counted,
    }


def thaw(ctx: Ctx) -> dict[str, Any]:
    """N messages due at one instant, stored compressed, one mover started after they are:
    the thaw (when it began, rate, largest script call, Redis CPU), then due -> all on the list."""
    ctx.fresh()
    n = ctx.sizes.thaw
    # A short thaw horizon keeps the run short; a large herd is begun earlier (the plan).
    settings = replace(ctx.settings, compress_after_ms=11_000, thaw_ahead_ms=10_000)
    due = int(now_ms() + ctx.lead_ms(n) + settings.compress_after_ms + 1000)
    count, fill_s, payloads = ctx.fill_celery(iter([due] * n), settings)
    if now_ms() > due - settings.compress_after_ms:
        raise RuntimeError("the fill ended too close to the due time to store it compressed; rerun")
    cold_set = keys.queue_set(ctx.store.prefix, due - due % settings.bucket_width_ms, QUEUE, keys.COLD)
    stored_cold = int(ctx.probe.client.zcard(cold_set))
    if stored_cold != count:
        raise RuntimeError(f"only {stored_cold} of {count} messages were stored compressed")
    ctx.probe.reset_stats(slower_than_us=0)
    mover = ctx.movers.start("--thaw-ahead", str(settings.thaw_ahead_ms / 1000))
    watched = _watch(ctx, cold_set, stored_cold, ids_of(payloads), due, (due - now_ms()) / 1000 + 120)
    slowest = ctx.probe.slowest_script_ms()
    ctx.movers.stop(mover)
    ctx.probe.flush()
    ctx.probe.reset_stats()
    drain_s = watched["all_on_list_s_after_due"]
    return {
        "messages": count,
        "payload_bytes": ctx.payloads.size,
        "fill_s": fill_s,
        "stored_cold": stored_cold,
        "thaw_ahead_ms": settings.thaw_ahead_ms,
        **watched,
        "largest_thaw_script_call_ms": slowest,
        "drain_s": drain_s,
    }


def _fill_ms_per_message(ctx: Ctx, payloads: VariedPayloads, settings: Settings) -> float:
    """Milliseconds a fill of compressed herd messages takes per message, on this machine now."""
    due = int(now_ms()) + 3_600_000
    made = (payloads.make(due) for _ in range(CALIBRATION))
    _, seconds = fill(ctx.store, settings, ((due, task_id, p) for task_id, p in made), dest="calibration")
    return seconds * 1000 / CALIBRATION


def _cold_herd(ctx: Ctx, n: int, ahead_s: float | None) -> dict[str, Any]:
    """``n`` compressed messages due at one instant, published while the movers run."""
    ctx.fresh()
    settings: Settings = ctx.settings
    extra: tuple[str, ...] = ()
    if ahead_s is not None:
        settings = replace(settings, thaw_ahead_ms=int(ahead_s * 1000))
        extra = ("--thaw-ahead", f"{ahead_s:g}")
    payloads = VariedPayloads(ctx)
    fill_ms = 1.3 * n * _fill_ms_per_message(ctx, payloads, settings)
    ctx.probe.flush()
    procs = [ctx.movers.start(*extra) for _ in range(ctx.sizes.herd_movers)]
    # Published whole before the plan (at the rate a mover assumes before it has measured
    # its own) begins the thaw, and at least delay_compress_after ahead: all compressed.
    lead = max(settings.compress_after_ms, thaw_plan.lead_ms(n, thaw_plan.DEFAULT_RATE))
    due = int(now_ms() + fill_ms + lead + 10_000)
    sizes: list[int] = []
    members: list[int] = []
    ids: list[str] = []

    def messages() -> Iterator[tuple[int, str, str]]:
        for i in range(n):
            task_id, payload = payloads.make(due)
            ids.append(task_id)
            if i % 100 == 0:
                sizes.append(len(payload))
                members.append(len(cold.pack(payload, task_id) or b""))
            yield due, task_id, payload

    before = ctx.probe.used_memory()
    count, fill_s = fill(ctx.store, settings, messages())
    filled_at = now_ms()
    cold_set = keys.queue_set(ctx.store.prefix, due - due % settings.bucket_width_ms, QUEUE, keys.COLD)
    totals = ctx.store.totals()
    cold_at_fill_end = int(ctx.probe.client.zcard(cold_set))
    staged = keys.staged(ctx.store.prefix, due - due % settings.bucket_width_ms, QUEUE)
    watched = _watch(ctx, cold_set, cold_at_fill_end, ids, due, (due - now_ms()) / 1000 + 300, staged)
    left = sum(ctx.store.counts().values())
    rss = [rss_mb(p.pid) for p in procs]
    for proc in procs:
        ctx.movers.stop(proc)
    # The same run's floor: how fast a bare Lua move of this whole herd goes on this machine now.
    floor_n, floor_s, floor_cpu = ctx.probe.floor_move_list(ctx.movers.batch_size)
    ctx.probe.flush()
    return {
        "messages": count,
        "movers": len(procs),
        "thaw_ahead_ms": settings.thaw_ahead_ms,
        "payload_bytes_mean": statistics.fmean(sizes),
        "compressed_member_bytes_mean": statistics.fmean(members),
        "fill_s": fill_s,
        "fill_ended_s_before_due": (due - filled_at) / 1000,
        "all_published_compressed": due - filled_at > settings.compress_after_ms,
        "scheduled": totals.get("scheduled", 0),
        "still_compressed_at_fill_end": cold_at_fill_end,
        "used_memory_before_mb": before / 2**20,
        **watched,
        "on_list": watched["delivered"],
        "distinct_on_list": watched["distinct"],
        "still_scheduled": left,
        "mover_rss_mb": max(rss, default=0.0),
        "floor_move_s": floor_s,
        "floor_move_per_s": floor_n / floor_s if floor_s > 0 else float("nan"),
        "floor_move_redis_cpu_us": floor_cpu * 1e6 / max(floor_n, 1),
    }


def herd(ctx: Ctx) -> dict[str, Any]:
    """A herd of compressed messages due at one instant, default settings, then a smaller one
    with a short ``delay_thaw_ahead``: every message on its list within 2 s of due. A size of 0
    leaves its case out (``--herd 0 --herd-short 300000`` runs the short one alone)."""
    s = ctx.sizes
    result: dict[str, Any] = {}
    if s.herd:
        result["default"] = _cold_herd(ctx, s.herd, None)
    if s.herd_short:
        result["short_ahead"] = _cold_herd(ctx, s.herd_short, s.herd_short_ahead_s)
    return result
