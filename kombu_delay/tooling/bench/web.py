"""Benchmark of the dashboard: server time of its pages with a million messages scheduled.

Fills Redis with Celery's own messages (three queues, due over the next day, so both storage
spaces hold some) and times each page in the app's process, as its ``Server-Timing`` header
reports it: from the request's arrival to the rendered page, Redis round trips included, the
network to the browser not. The overview is read fresh for every sample (no sharing between
requests), so each sample pays its full census. The figures are not tests.
"""

from __future__ import annotations

import random
import re
import statistics
import time
from typing import Any

from kombu_delay.control import DelayControl
from kombu_delay.tooling.bench.env import fill

QUEUES = ("celery", "emails", "reports")
#: Each page and how it is asked for.
PAGES = {
    "overview_hours": "/",
    "overview_minutes": "/?range=minutes",
    "overview_days": "/?range=days",
    "overview_refresh": "/overview/part",
    "scheduled_page_50": "/scheduled",
    "scheduled_queue_page_50": "/scheduled?queue=emails",
}


def _figures(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": round(statistics.median(ordered), 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
        "max_ms": round(ordered[-1], 2),
        "runs": len(ordered),
    }


def _server_ms(client: Any, path: str) -> float:
    reply = client.get(path)
    if reply.status_code not in (200, 404):
        raise RuntimeError(f"GET {path}: HTTP {reply.status_code}")
    found = re.search(r"dur=([0-9.]+)", reply.headers.get("Server-Timing", ""))
    if found is None:
        raise RuntimeError(f"GET {path}: no Server-Timing header")
    return float(found.group(1))


def run(ctx: Any, size: int | None = None, samples: int = 100) -> dict[str, Any]:
    """The ``web`` scenario of ``kombu-delay bench``: ``size`` (default: the large scale size)
    messages scheduled, then each page timed ``samples`` times."""
    from kombu_delay.web.app import create_app

    size = size or ctx.sizes.scale_large
    ctx.fresh()
    try:
        rng = random.Random(9)
        now = ctx.store.time_ms()
        ids: list[str] = []

        begun = time.perf_counter()
        for i, queue in enumerate(QUEUES):
            share = size // len(QUEUES) + (1 if i < size % len(QUEUES) else 0)
            due = (now + 600_000 + rng.randrange(86_400_000) for _ in range(share))

            def gen(due: Any = due) -> Any:
                for due_ms in due:
                    task_id, payload = ctx.payloads.make(due_ms)
                    if len(ids) < 10_000:
                        ids.append(task_id)
                    yield due_ms, task_id, payload

            fill(ctx.store, ctx.settings, gen(), dest=queue)
        fill_s = time.perf_counter() - begun
        with DelayControl(ctx.delay_url) as control:
            app = create_app(control, share_s=0)
            client = app.test_client()
            scheduled = control.stats(hours=1).scheduled
            for path in PAGES.values():  # warm: scripts loaded, templates compiled
                _server_ms(client, path)
            pages = {}
            for name, path in PAGES.items():
                pages[name] = _figures([_server_ms(client, path) for _ in range(samples)])
            pages["task_detail"] = _figures(
                [_server_ms(client, f"/task?id={rng.choice(ids)}") for _ in range(samples)]
            )
        return {"method": __doc__, "scheduled": scheduled, "fill_s": round(fill_s, 1), "pages": pages}
    finally:
        ctx.fresh()
