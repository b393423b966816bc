"""The benchmark's end-to-end scenario: stock Celery workers on plain ``redis://``.

This module is also the Celery app those workers run (``celery -A
kombu_delay.tooling.bench.e2e worker``): one task that records when it started. The
scenario measures due -> task start through a mover, and worker RSS while many
tasks are pending: held in Redis by kombu-delay, against held in the worker's
memory by stock Celery, in the same run.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from typing import Any

import redis
from celery import Celery

from kombu_delay.cli.common import without_celery_servers
from kombu_delay.tooling.bench.env import QUEUE, TASK, celery_app, eta_of, now_ms, rss_mb
from kombu_delay.tooling.redis_server import dying_with_us, stop_process

#: The queue of the stock worker (ETA messages straight onto its list).
STOCK_QUEUE = "bench-stock"
#: List the task appends its start records to.
STARTS = "kombu_delay_bench:starts"
BROKER_ENV = "KOMBU_DELAY_BENCH_BROKER"
#: The plain Redis URL the task records into, when the broker is not one (a worker on
#: ``delayredis://``, in the drain scenario); unset, the broker's.
RECORD_ENV = "KOMBU_DELAY_BENCH_RECORD"

app = Celery("kombu_delay_bench", broker=os.environ.get(BROKER_ENV, "redis://127.0.0.1:1/0"))
app.conf.update(worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)
_recorder: redis.Redis | None = None


@app.task(name=TASK, bind=True)  # type: ignore[untyped-decorator]
def record(self: Any, pad: str = "") -> None:
    """Record ``[task id, eta, start ms]``: the start is taken first thing."""
    started = now_ms()
    global _recorder
    if _recorder is None:
        _recorder = redis.Redis.from_url(os.environ.get(RECORD_ENV) or os.environ[BROKER_ENV])
    _recorder.lpush(STARTS, json.dumps([self.request.id, self.request.eta, started]))


def _worker(url: str, queue: str, log: str) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "celery", "-A", "kombu_delay.tooling.bench.e2e", "worker", "--pool", "solo"]
    args += ["-Q", queue, "-l", "warning", "--without-heartbeat", "--without-mingle", "--without-gossip"]
    out = open(log, "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        dying_with_us(args),
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**without_celery_servers(os.environ), BROKER_ENV: url},
    )
    out.close()
    return proc


def _ready(ctx: Any, sender: Celery, queue: str, timeout: float = 120) -> None:
    """Wait until a worker on ``queue`` has run one task."""
    before = ctx.probe.client.llen(STARTS)
    sender.send_task(TASK, kwargs={"pad": ""}, queue=queue)
    deadline = time.monotonic() + timeout
    while ctx.probe.client.llen(STARTS) <= before:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no worker on {queue!r} started within {timeout} s")
        time.sleep(0.1)
    time.sleep(1.0)  # let its memory settle after the first task


def _settled_rss(pid: int, seconds: float = 3.0) -> float:
    """The largest RSS seen over a few seconds (the worker may still be reading)."""
    seen, deadline = 0.0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen = max(seen, rss_mb(pid))
        time.sleep(0.2)
    return seen


def e2e(ctx: Any) -> dict[str, Any]:
    """Due -> task start through a mover and a stock worker; worker RSS, delay vs stock."""
    from kombu_delay.tooling.bench.ctx import pct as _pct
    from kombu_delay.tooling.bench.ctx import wait_for as _wait

    ctx.fresh()
    n, pending = ctx.sizes.e2e_precision, ctx.sizes.e2e_tasks
    plain, delayed = celery_app(ctx.url), celery_app(ctx.delay_url)
    logdir = str(ctx.movers.log_dir)
    procs = []
    try:
        ctx.movers.start()
        worker = _worker(ctx.url, QUEUE, f"{logdir}/worker-delay.log")
        procs.append(worker)
        _ready(ctx, plain, QUEUE)
        ctx.probe.client.delete(STARTS)
        base = now_ms() + 2000
        for _ in range(n):
            due = int(base + random.uniform(0, 10_000))
            delayed.send_task(TASK, kwargs={"pad": ctx.payloads.pad}, eta=eta_of(due), queue=QUEUE)
        _wait(lambda: ctx.probe.client.llen(STARTS) >= n, timeout=90, interval=0.2)
        from kombu_delay.message import parse_iso_ms

        records = [json.loads(x) for x in ctx.probe.client.lrange(STARTS, 0, -1)]
        late = [start - parse_iso_ms(eta) for _, eta, start in records if eta]

        # The pending tasks go through delayredis://, as an application sends them (apply_async
        # with a countdown): were the transport to push one onto the list, the worker would
        # fetch it and hold it in memory until its ETA, and its RSS would grow as stock's does.
        base_delay = _settled_rss(worker.pid)
        held_before = sum(ctx.store.counts().values())
        for _ in range(pending):
            delayed.send_task(TASK, kwargs={"pad": ctx.payloads.pad}, countdown=3600, queue=QUEUE)
        after_delay = _settled_rss(worker.pid)
        delay_held = sum(ctx.store.counts().values()) - held_before
        delay_unacked = int(ctx.probe.client.hlen("unacked"))

        stock = _worker(ctx.url, STOCK_QUEUE, f"{logdir}/worker-stock.log")
        procs.append(stock)
        _ready(ctx, plain, STOCK_QUEUE)
        base_stock = _settled_rss(stock.pid)
        # The same call through plain redis://: the ETA message goes onto the list at once.
        for _ in range(pending):
            plain.send_task(TASK, kwargs={"pad": ctx.payloads.pad}, countdown=3600, queue=STOCK_QUEUE)
        _wait(lambda: ctx.probe.llen(STOCK_QUEUE) == 0, timeout=300, interval=0.2)
        after_stock = _settled_rss(stock.pid, seconds=5.0)
        stock_unacked = int(ctx.probe.client.hlen("unacked")) - delay_unacked
    finally:
        for proc in procs:
            stop_process(proc)
        plain.close()
        delayed.close()
    return {
        "lateness": {
            "tasks": n,
            "started": len(late),
            "not_started": n - len({task_id for task_id, _, _ in records}),
            "early": sum(1 for x in late if x < 0),
            "p50_ms": _pct(late, 50),
            "p99_ms": _pct(late, 99),
            "max_ms": max(late, default=math.nan),
        },
        "pending_tasks": pending,
        "pending_published_through": "delayredis://",
        "delay_held_in_redis": delay_held,
        "delay_not_held_in_redis": pending - delay_held,
        "delay_unacked_by_worker": delay_unacked,
        "stock_unacked_by_worker": stock_unacked,
        "delay_rss_mb": [base_delay, after_delay],
        "stock_rss_mb": [base_stock, after_stock],
        "delay_rss_growth_mb": after_delay - base_delay,
        "stock_rss_growth_mb": after_stock - base_stock,
        "stock_kb_per_task": (after_stock - base_stock) * 1024 / max(pending, 1),
    }
