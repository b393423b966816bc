"""The benchmark's drain scenario: a herd due at one instant, run by a real stock worker.

The workers run the end-to-end scenario's Celery app (``celery -A
kombu_delay.tooling.bench.e2e worker``): one task that records when it started.
Every variant runs the same worker (prefork, ``--drain-procs`` processes, Celery's
default prefetch) on the same herd, one after the other in one run:

- ``stock``: plain Celery on ``redis://``; the ETA messages go straight onto the
  list, ahead enough for the worker to fetch them all into its memory before due;
- ``delay``: kombu-delay, the worker on ``redis://``, a mover moving the herd at due;
- ``delay-delayredis``: the same with the worker on ``delayredis://``;
- ``look-ahead-<s>s``: the worker on ``delayredis://``, the mover run with
  ``delay_look_ahead`` (the herd reaches the list that long before due; Celery's timer
  still starts each task at its ETA).

Each reports the finish time after due, the worker's peak RSS growth (the main process
and its pool), early starts, duplicates and lost tasks, the worker's drain rate, and for
kombu-delay the mover's rate (due -> everything on the list).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import click
import redis
from celery import Celery

from kombu_delay.cli.common import without_celery_servers
from kombu_delay.message import parse_iso_ms
from kombu_delay.tooling.bench.e2e import BROKER_ENV, RECORD_ENV, STARTS
from kombu_delay.tooling.bench.env import QUEUE, TASK, now_ms, rss_mb
from kombu_delay.tooling.redis_server import dying_with_us, stop_process


def tree_rss_mb(pid: int) -> float:
    """RSS of a process and its children (the prefork pool), MB."""
    total = rss_mb(pid)
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return total + sum(rss_mb(int(child)) for child in children)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far; 0 where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Worker:
    """One ``celery worker`` process of this app, stopped by PID."""

    def __init__(self, ctx: Any, broker: str, log: Path) -> None:
        args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "kombu_delay.tooling.bench.e2e",
            "worker",
            "--pool",
            "prefork",
        ]
        args += ["-c", str(ctx.sizes.drain_procs), "-Q", QUEUE, "-l", "warning"]
        args += ["--prefetch-multiplier", str(ctx.sizes.drain_prefetch)]
        args += ["--without-heartbeat", "--without-mingle", "--without-gossip"]
        env = {**without_celery_servers(os.environ), BROKER_ENV: broker, RECORD_ENV: ctx.url}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(dying_with_us(args), stdout=out, stderr=subprocess.STDOUT, env=env)
        self.log = log

    def wait_ready(self, ctx: Any, timeout: float = 120) -> None:
        """Wait until the worker has run one task (through plain ``redis://``)."""
        sender = Celery("kombu_delay_bench_drain_ready", broker=ctx.url)
        try:
            sender.send_task(TASK, kwargs={"pad": ""}, queue=QUEUE)
        finally:
            sender.close()
        deadline = time.monotonic() + timeout
        while ctx.probe.client.llen(STARTS) < 1:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the drain worker did not start a task: {tail}")
            time.sleep(0.1)
        time.sleep(1.0)  # let its memory settle after the first task
        ctx.probe.client.delete(STARTS)

    def stop(self) -> None:
        stop_process(self.proc)


class Sampler(threading.Thread):
    """Samples the worker's RSS, the list, and what is still scheduled, every 0.1 s."""

    def __init__(self, ctx: Any, pid: int, due_ms: int, delayed: bool) -> None:
        super().__init__(daemon=True)
        self.ctx, self.pid, self.due_ms, self.delayed = ctx, pid, due_ms, delayed
        self.client = redis.Redis.from_url(ctx.url)
        self.peak_mb = 0.0
        #: CPU seconds of the worker's main process (where messages are read, recorded and
        #: acked) at the start and at the last sample: less noisy than wall time on a shared
        #: machine.
        self.cpu_first = self.cpu_last = cpu_s(pid)
        self.on_list_at_due: int | None = None
        self.moved_all_at: float | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.peak_mb = max(self.peak_mb, tree_rss_mb(self.pid))
            self.cpu_last = max(self.cpu_last, cpu_s(self.pid))
            now = now_ms()
            if self.on_list_at_due is None and now >= self.due_ms:
                self.on_list_at_due = int(self.client.llen(QUEUE))
            waiting = self.delayed and self.moved_all_at is None and now >= self.due_ms - 60_000
            if waiting and sum(self.ctx.store.counts().values()) == 0:
                self.moved_all_at = now
            self.stopping.wait(0.1)
        self.client.close()


def _wait_for(ctx: Any, n: int, due_ms: int, worker: Worker) -> None:
    """Until ``n`` starts are recorded, the worker dies, or nothing starts for 30 s after due."""
    client, last, progress_at = ctx.probe.client, -1, time.monotonic()
    cap = time.monotonic() + (due_ms - now_ms()) / 1000 + 120 + n / 50
    while time.monotonic() < cap and worker.proc.poll() is None:
        got = int(client.llen(STARTS))
        if got >= n:
            time.sleep(2.0)  # long enough for a duplicate to show
            return
        if got != last:
            last, progress_at = got, time.monotonic()
        elif now_ms() > due_ms and time.monotonic() - progress_at > 30:
            return
        time.sleep(0.1)


def _variant(ctx: Any, name: str, worker_url: str, look_ahead_s: float | None) -> dict[str, Any]:
    ctx.fresh()
    n = ctx.sizes.drain
    stock = look_ahead_s is None and name == "stock"
    worker = Worker(ctx, worker_url, ctx.movers.log_dir / f"worker-{name}.log")
    sampler: Sampler | None = None
    exited: int | None = None
    try:
        worker.wait_ready(ctx)
        base_mb = tree_rss_mb(worker.proc.pid)
        ahead_ms = int((look_ahead_s or 0) * 1000)
        if stock:
            # Ahead enough for the worker to fetch the whole herd into its memory first.
            due = int(now_ms() + 10_000 + n * 2.5)
            payloads = [ctx.payloads.make(due)[1] for _ in range(n)]
            ids = {json.loads(p)["headers"]["id"] for p in payloads}
            ctx.probe.lpush_ceiling(payloads)
        else:
            extra = ("-o", f"delay_look_ahead={look_ahead_s:g}") if look_ahead_s else ()
            ctx.movers.start(*extra)
            due = int(now_ms() + ahead_ms + ctx.lead_ms(n))
            _, _, payloads = ctx.fill_celery(iter([due] * n))
            ids = {json.loads(p)["headers"]["id"] for p in payloads}
        sampler = Sampler(ctx, worker.proc.pid, due, delayed=not stock)
        sampler.start()
        _wait_for(ctx, n, due, worker)
        exited = worker.proc.poll()  # it died before every task ran (None: still running)
    finally:
        if sampler is not None:
            sampler.stopping.set()
            sampler.join()
        worker.stop()
    records = [json.loads(x) for x in ctx.probe.client.lrange(STARTS, 0, -1)]
    assert sampler is not None
    # (below zero where it was done before due: a look-ahead's, or an early move's, told as such)
    moved_s = None if sampler.moved_all_at is None else (sampler.moved_all_at - due) / 1000
    return {
        "tasks": n,
        "worker": worker_url.partition("://")[0] + "://",
        "look_ahead_s": look_ahead_s or 0,
        **outcome(n, ids, records, due, sampler.cpu_last - sampler.cpu_first),
        "worker_exit": exited,
        "mover_done_after_due_s": None if stock else moved_s,
        "on_list_at_due": sampler.on_list_at_due,
        "rss_base_mb": round(base_mb, 1),
        "rss_growth_mb": round(sampler.peak_mb - base_mb, 1),
    }


def outcome(n: int, ids: set[str], records: list[Any], due: int, cpu_used_s: float) -> dict[str, Any]:
    """What a variant's ``n`` tasks did, from the starts recorded ``(task id, ETA, start ms)``:
    how many ran once, more than once, never, or early; and its rates, over the tasks that ran
    (a worker killed partway finished its few tasks sooner than a whole herd, and divided by
    the herd that was a win)."""
    counts = Counter(task_id for task_id, _, _ in records if task_id in ids)
    starts = [start for task_id, _, start in records if task_id in ids]
    early = sum(1 for task_id, eta, start in records if task_id in ids and start < parse_iso_ms(eta))
    finish_s = (max(starts) - due) / 1000 if starts else None
    ran = len(counts)
    ran_once = sum(1 for c in counts.values() if c == 1)
    return {
        "started": len(starts),
        "ran": ran,
        "ran_once": ran_once,
        "ran_more_than_once": ran - ran_once,
        "all_ran_once": ran_once == n and not early,
        "finish_after_due_s": finish_s,
        "worker_drain_per_s": round(ran / finish_s) if finish_s and finish_s > 0 else None,
        "worker_main_cpu_ms_per_task": round(cpu_used_s * 1000 / ran, 3) if ran else None,
        "early": early,
        "duplicates": sum(c - 1 for c in counts.values()),
        "lost": n - ran,
    }


def variants(ctx: Any) -> list[tuple[str, str, float | None]]:
    """``(name, worker URL, look-ahead s)`` of every variant, in run order."""
    found: list[tuple[str, str, float | None]] = [
        ("stock", ctx.url, None),
        ("delay", ctx.url, None),
        ("delay-delayredis", ctx.delay_url, None),
    ]
    for raw in str(ctx.sizes.drain_look_ahead).split(","):
        if raw.strip() and float(raw) > 0:
            found.append((f"look-ahead-{float(raw):g}s", ctx.delay_url, float(raw)))
    return found


def drain(ctx: Any) -> dict[str, Any]:
    """A herd due at one instant, one worker: stock Celery against kombu-delay."""
    results: dict[str, Any] = {}
    only = {x.strip() for x in str(ctx.sizes.drain_variants).split(",") if x.strip()}
    for name, url, ahead in variants(ctx):
        if not only or name in only or name == "stock":
            results[name] = _variant(ctx, name, url, ahead)
    ctx.fresh()
    report = {
        "tasks": ctx.sizes.drain,
        "worker_procs": ctx.sizes.drain_procs,
        "prefetch_multiplier": ctx.sizes.drain_prefetch,
        "variants": compare(results),
    }
    failed = [name for name, result in results.items() if not result["all_ran_once"]]
    if failed:
        report["failed"] = f"not every task ran exactly once, none early: {', '.join(failed)}"
    click.echo(table(report))
    return report


def compare(results: dict[str, Any]) -> dict[str, Any]:
    """Give each variant its ratios to stock, where both ran every task exactly once: a
    variant that lost tasks has no speed to compare."""
    stock = results["stock"]
    for result in results.values():
        if not (stock["all_ran_once"] and result["all_ran_once"]):
            continue
        if stock["finish_after_due_s"] and result["finish_after_due_s"] is not None:
            result["finish_vs_stock"] = round(result["finish_after_due_s"] / stock["finish_after_due_s"], 2)
        if stock["rss_growth_mb"] > 0:
            result["rss_vs_stock"] = round(result["rss_growth_mb"] / stock["rss_growth_mb"], 2)
    return results


def table(report: dict[str, Any]) -> str:
    """The drain results, one row per variant."""

    def shown(value: Any, fmt: str) -> str:
        return "-" if value is None else fmt.format(value)

    lines = [
        f"drain: {report['tasks']:,} tasks due at one instant, one worker (prefork, "
        f"{report['worker_procs']} processes, prefetch multiplier {report['prefetch_multiplier']})",
        f"  {'variant':<18} {'worker':<14} {'finish':>8} {'x stock':>8} {'drain/s':>8} "
        f"{'mover':>7} {'cpu ms':>7} {'RSS +MB':>8} {'x stock':>8} {'early':>6} {'dup':>5} {'lost':>5}",
    ]
    failed = []
    for name, r in report["variants"].items():
        lines.append(
            f"  {name:<18} {r['worker']:<14} {shown(r['finish_after_due_s'], '{:.1f} s'):>8} "
            f"{shown(r.get('finish_vs_stock'), '{:.2f}'):>8} {shown(r['worker_drain_per_s'], '{:,}'):>8} "
            f"{shown(r['mover_done_after_due_s'], '{:.1f} s'):>7} "
            f"{shown(r['worker_main_cpu_ms_per_task'], '{:.2f}'):>7} {r['rss_growth_mb']:>8.1f} "
            f"{shown(r.get('rss_vs_stock'), '{:.2f}'):>8} {r['early']:>6} {r['duplicates']:>5} {r['lost']:>5}"
        )
        if not r["all_ran_once"]:
            exit_note = "" if r.get("worker_exit") is None else f"; its worker exited with {r['worker_exit']}"
            failed.append(
                f"  FAILED {name}: {r['ran_once']:,} of {r['tasks']:,} tasks ran once, "
                f"{r['ran_more_than_once']:,} more than once, {r['lost']:,} never, {r['early']:,} early"
                f"{exit_note}; its figures are over the tasks that ran, and not compared with stock"
            )
    lines += failed
    lines.append(
        "  finish: due -> last task start; mover: due -> all on the list; cpu ms: the worker's "
        "main process per task\n  (reading, recording, acking, handing to the pool); RSS: peak "
        "growth of the worker and its pool"
    )
    return "\n".join(lines)
