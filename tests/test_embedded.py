"""The embedded mover in real ``celery worker`` processes, with no sidecar."""

from __future__ import annotations

import json
import re
import sys
import time

import pytest
from celery import Celery

from kombu_delay import keys

from .conftest import wait_until
from .ecosystem_app import LEDGER_KEY

APP = "tests.ecosystem_app"


def worker_args(name: str, pool: str, concurrency: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        APP,
        "worker",
        "-P",
        pool,
        "-c",
        str(concurrency),
        "-n",
        f"{name}@%h",
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]


def start_worker(
    spawn, redis_server, name: str, pool: str, options: dict[str, object], concurrency: int = 2, **extra: str
):
    env = {
        "ECO_BROKER": redis_server.delay_url,
        "ECO_OPTIONS": json.dumps(options),
        "ECO_LEDGER": redis_server.url,
        **extra,
    }
    return spawn(worker_args(name, pool, concurrency), env=env, name=name)


def embedded_movers(r, prefix: str) -> list[str]:
    return [m.decode() for m in r.zrange(keys.movers(prefix), 0, -1) if m.decode().startswith("embedded:")]


def publish(redis_server, options: dict[str, object], countdowns: list[float]) -> dict[str, float]:
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = options
    sent = {}
    for i, countdown in enumerate(countdowns):
        sent[app.send_task("eco.record", (str(i),), countdown=countdown).id] = countdown
    app.close()
    return sent


def ledger(r) -> list[dict]:
    return [json.loads(x) for x in r.lrange(LEDGER_KEY, 0, -1)]


def check_once_and_on_time(runs: list[dict], sent: dict[str, float]) -> None:
    ids = [run["id"] for run in runs]
    assert sorted(ids) == sorted(sent), "a task ran twice or never"
    for run in runs:
        assert run["eta_ms"] is not None
        assert run["ran_ms"] >= run["eta_ms"], f"ran {run['eta_ms'] - run['ran_ms']} ms early"
        assert run["ran_ms"] - run["eta_ms"] < 30_000, "far too late"


@pytest.mark.parametrize(
    ("pool", "how"), [("prefork", "option"), ("threads", "step")], ids=["prefork-option", "threads-step"]
)
def test_embedded_mover_runs_tasks_on_time_once(r, redis_server, spawn, prefix, pool, how):
    options: dict[str, object] = {"global_keyprefix": prefix}
    extra = {}
    if how == "option":
        options["delay_embedded_mover"] = True  # installed by the worker_init hook
    else:
        extra["ECO_EMBED_STEP"] = "1"  # app.steps['worker'].add(EmbeddedMoverStep)
    worker = start_worker(spawn, redis_server, "w1", pool, options, **extra)
    (name,) = wait_until(lambda: embedded_movers(r, prefix), timeout=120)  # type: ignore[misc]
    assert f":{worker.pid}:" in name, "the mover must run in the worker's main process"

    sent = publish(redis_server, options, [1.0 + i * 0.25 for i in range(12)])
    wait_until(lambda: r.llen(LEDGER_KEY) >= len(sent), timeout=120)
    time.sleep(1.0)  # a duplicate would show up here
    check_once_and_on_time(ledger(r), sent)

    # A warm shutdown stops the mover, which removes its heartbeat.
    assert worker.stop(timeout=60) == 0, worker.output()
    assert embedded_movers(r, prefix) == []
    out = worker.output()
    assert "kombu-delay: embedded mover" in out
    assert "Traceback" not in out, out


def test_no_embedded_mover_without_the_option(r, redis_server, spawn):
    worker = start_worker(spawn, redis_server, "w0", "prefork", {})
    wait_until(lambda: "ready" in worker.output(), timeout=120)
    publish(redis_server, {}, [0.5])
    time.sleep(3.0)
    assert r.llen(LEDGER_KEY) == 0, "something moved the message with no mover running"
    assert embedded_movers(r, "") == []
    assert worker.stop(timeout=60) == 0, worker.output()


def test_two_workers_with_embedded_movers_deliver_once(r, redis_server, spawn):
    options: dict[str, object] = {"delay_embedded_mover": True}
    workers = [start_worker(spawn, redis_server, f"w{i}", "prefork", options) for i in (1, 2)]
    wait_until(lambda: len(embedded_movers(r, "")) == 2, timeout=120)

    n = 300
    sent = publish(redis_server, options, [1.0 + 3.0 * i / n for i in range(n)])
    wait_until(lambda: r.llen(LEDGER_KEY) >= n, timeout=180)
    time.sleep(2.0)
    runs = ledger(r)
    check_once_and_on_time(runs, sent)
    assert r.llen("celery") == 0
    assert r.hgetall(keys.counts("")) == {}
    for worker in workers:
        assert worker.stop(timeout=60) == 0, worker.output()
    # Each mover logs its total at shutdown; together they moved each message once.
    totals = [int(m) for w in workers for m in re.findall(r"stopped after moving (\d+) messages", w.output())]
    assert len(totals) == 2 and sum(totals) == n, totals
    print("moved per embedded mover:", totals)


def test_gevent_worker_publishes_countdowns_and_its_embedded_mover_delivers_them(r, redis_server, spawn):
    """``-P gevent``: the mover is a green thread on the worker's hub, and tasks publish
    through the delay transport from green threads. Countdowns sent from outside and from
    20 concurrent tasks inside the worker each run once, none before its ETA."""
    pytest.importorskip("gevent")
    # kombu's channel pool holds 10 connections by default; 20 green threads publishing at
    # once exhaust it, and acks then fail ("Couldn't ack ... MaxConnectionsError") on stock
    # redis:// too. The README's advice for gevent: max_connections above the concurrency.
    options: dict[str, object] = {"delay_embedded_mover": True, "max_connections": 50}
    worker = start_worker(spawn, redis_server, "wg", "gevent", options, concurrency=20)
    (name,) = wait_until(lambda: embedded_movers(r, ""), timeout=120)  # type: ignore[misc]
    assert f":{worker.pid}:" in name

    sent = publish(redis_server, options, [1.0 + i * 0.25 for i in range(12)])
    app = Celery("pub", broker=redis_server.delay_url)
    parents = [app.send_task("eco.fan_out", (10, 1.5)).id for _ in range(20)]
    app.close()
    wait_until(lambda: r.llen(LEDGER_KEY) >= len(sent) + 200, timeout=180)
    time.sleep(1.0)  # a duplicate would show up here
    runs = ledger(r)
    check_once_and_on_time([run for run in runs if not run["tag"].startswith("child:")], sent)
    children = [run for run in runs if run["tag"].startswith("child:")]
    assert sorted(run["tag"] for run in children) == sorted(
        f"child:{parent}:{i}" for parent in parents for i in range(10)
    ), "a child ran twice or never"
    for run in children:
        assert run["eta_ms"] is not None and run["ran_ms"] >= run["eta_ms"], run
    assert r.hgetall(keys.counts("")) == {}

    assert worker.stop(timeout=60) == 0, worker.output()
    assert embedded_movers(r, "") == []
    assert "concurrency: 20 (gevent)" in worker.output()
    assert "Traceback" not in worker.output(), worker.output()
