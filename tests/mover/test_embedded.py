"""The embedded mover in real ``celery worker`` processes, with no sidecar."""

from __future__ import annotations

import re

import pytest
from celery import Celery

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import Store, keys
from tests.support.ecosystem_app import LEDGER_KEY
from tests.support.procs import wait_for_exit, wait_until
from tests.support.stored import behind, kombu_payload
from tests.support.workers import check_once_and_on_time, eco_ledger, start_eco_worker


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


def settled(r, prefix: str = "") -> bool:
    """Nothing is left to deliver: nothing stored for a mover to push, nothing on the list."""
    return not r.hgetall(keys.counts(prefix)) and r.llen(f"{prefix}celery") == 0


def moved(r, prefix: str = "") -> int:
    return int(r.hget(keys.totals(prefix), "moved") or 0)


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
    worker = start_eco_worker(spawn, redis_server, "w1", pool, options, **extra)
    (name,) = wait_until(lambda: embedded_movers(r, prefix), timeout=120)  # type: ignore[misc]
    assert f":{worker.pid}:" in name, "the mover must run in the worker's main process"

    # Due 5 s on and later: stored, however slow the publish, so the embedded mover moves them.
    sent = publish(redis_server, options, [5.0 + i * 0.25 for i in range(12)])
    wait_until(lambda: r.llen(LEDGER_KEY) >= len(sent), timeout=120)
    # One push each, and nothing left to push: there is no delivery, so no run, to come.
    wait_until(lambda: settled(r, prefix), timeout=60)
    assert moved(r, prefix) == len(sent)
    check_once_and_on_time(eco_ledger(r), sent)

    # A warm shutdown stops the mover, which removes its heartbeat.
    assert worker.stop(timeout=60) == 0, worker.output()
    assert embedded_movers(r, prefix) == []
    out = worker.output()
    assert "kombu-delay: embedded mover" in out
    assert "Traceback" not in out, out


def test_no_embedded_mover_without_the_option(r, redis_server, spawn):
    """Without the option no mover starts in the worker: none says so at start (before the
    worker is ready), none beats, and a message overdue all along stays stored."""
    clock = behind(r)  # overdue by Redis's clock at once: any mover would move it
    Store(r, clock=clock).schedule(Due(clock() + 500, task_id="o"), "celery", kombu_payload("o"), Settings())
    worker = start_eco_worker(spawn, redis_server, "w0", "prefork", {})
    wait_until(lambda: "ready" in worker.output(), timeout=120)
    # The worker runs what it is sent (so it is up and consuming), and nothing moved meanwhile.
    publish(redis_server, {}, [0])
    wait_until(lambda: r.llen(LEDGER_KEY) == 1, timeout=120)
    assert "kombu-delay: embedded mover" not in worker.output()
    assert embedded_movers(r, "") == []
    assert Store(r).counts() == {"celery": 1} and moved(r) == 0
    assert worker.stop(timeout=60) == 0, worker.output()


def test_two_workers_with_embedded_movers_deliver_once(r, redis_server, spawn):
    options: dict[str, object] = {"delay_embedded_mover": True}
    workers = [start_eco_worker(spawn, redis_server, f"w{i}", "prefork", options) for i in (1, 2)]
    wait_until(lambda: len(embedded_movers(r, "")) == 2, timeout=120)

    n = 300
    # Due 5 to 8 s on: stored, however slow the publish, so the movers move every one.
    sent = publish(redis_server, options, [5.0 + 3.0 * i / n for i in range(n)])
    wait_until(lambda: r.llen(LEDGER_KEY) >= n, timeout=180)
    wait_until(lambda: settled(r), timeout=60)  # nothing left to deliver
    assert moved(r) == n  # one push each
    runs = eco_ledger(r)
    check_once_and_on_time(runs, sent)
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
    worker = start_eco_worker(spawn, redis_server, "wg", "gevent", options, concurrency=20)
    (name,) = wait_until(lambda: embedded_movers(r, ""), timeout=120)  # type: ignore[misc]
    assert f":{worker.pid}:" in name

    # Due 5 s on and later, from outside and from inside: stored, however slow the publishes.
    sent = publish(redis_server, options, [5.0 + i * 0.25 for i in range(12)])
    app = Celery("pub", broker=redis_server.delay_url)
    parents = [app.send_task("eco.fan_out", (10, 5.0)).id for _ in range(20)]
    app.close()
    wait_until(lambda: r.llen(LEDGER_KEY) >= len(sent) + 200, timeout=180)
    wait_until(lambda: settled(r), timeout=60)  # nothing left to deliver
    assert moved(r) == len(sent) + 200  # one push each
    runs = eco_ledger(r)
    check_once_and_on_time([run for run in runs if not run["tag"].startswith("child:")], sent)
    children = [run for run in runs if run["tag"].startswith("child:")]
    assert sorted(run["tag"] for run in children) == sorted(
        f"child:{parent}:{i}" for parent in parents for i in range(10)
    ), "a child ran twice or never"
    for run in children:
        assert run["eta_ms"] is not None and run["ran_ms"] >= run["eta_ms"], run

    assert worker.stop(timeout=60) == 0, worker.output()
    assert embedded_movers(r, "") == []
    assert "concurrency: 20 (gevent)" in worker.output()
    assert "Traceback" not in worker.output(), worker.output()


@pytest.mark.parametrize(
    ("broker", "options", "env", "told"),
    [
        ("redis", {"delay_embedded_mover": True, "delay_max_sleep": "abc"}, {}, "delay_max_sleep"),
        ("redis", {}, {"KOMBU_DELAY_EMBEDDED_MOVER": "1", "KOMBU_DELAY_MAX_SLEEP": "1s"}, "delay_max_sleep"),
        ("redis", {"delay_embedded_mover": "maybe"}, {}, "delay_embedded_mover is on or off"),
        ("memory", {}, {"KOMBU_DELAY_EMBEDDED_MOVER": "1"}, "'memory' is not a Redis scheme"),
    ],
    ids=["bad-option", "bad-variable", "bad-flag", "not-redis"],
)
def test_a_worker_asked_for_an_embedded_mover_it_cannot_run_fails_at_start(
    redis_server, spawn, broker, options, env, told
):
    # On plain redis:// (which only the embedded mover reads the delay_* options of) the error
    # was raised inside Celery's worker_init, which logs it at debug level: the worker ran,
    # with no mover and no word of it. On memory:// the mover's thread retried for ever.
    url = redis_server.url if broker == "redis" else "memory://"
    worker = start_eco_worker(
        spawn, redis_server, "wbad", "solo", options, concurrency=1, ECO_BROKER=url, **env
    )
    assert wait_for_exit(worker) != 0, worker.output()
    out = worker.output()
    assert "ConfigError" in out and told in out, out
    assert "ready" not in out, out
