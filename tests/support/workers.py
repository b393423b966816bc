"""Real ``celery worker`` processes on the test apps (``tests.support.*_app``), and reading the
ledgers in which those apps record every task run (one JSON object per run, on a Redis list)."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from kombu_delay.tooling.redis_server import RedisServer
from tests.support import ecosystem_app, inspect_app
from tests.support.e2e_app import QUEUE, RECORDS_KEY
from tests.support.procs import Proc, wait_until

E2E_APP = "tests.support.e2e_app"
ECOSYSTEM_APP = "tests.support.ecosystem_app"
INSPECT_APP = "tests.support.inspect_app"


def worker_args(
    app: str, name: str, pool: str = "solo", concurrency: int | None = None, queue: str | None = None
) -> list[str]:
    """A stock ``celery worker`` on ``app``, without gossip, mingle or heartbeat, logging at INFO."""
    args = [sys.executable, "-m", "celery", "-A", app, "worker", "--pool", pool]
    if concurrency is not None:
        args += ["-c", str(concurrency)]
    if queue is not None:
        args += ["-Q", queue]
    args += ["-n", f"{name}@%h", "-l", "info"]
    return [*args, "--without-gossip", "--without-mingle", "--without-heartbeat"]


def ledger(client: redis.Redis, key: str) -> list[dict[str, Any]]:
    """Every run an app recorded on the list ``key``, oldest first."""
    return [json.loads(item) for item in client.lrange(key, 0, -1)]


# -- tests.support.e2e_app: broker from E2E_BROKER, runs recorded at E2E_RECORDS ------------------


def records(client: redis.Redis, tag: str | None = None) -> list[dict[str, Any]]:
    """The runs ``e2e_app`` recorded, those of ``tag`` only if given."""
    return [rec for rec in ledger(client, RECORDS_KEY) if tag is None or rec["tag"] == tag]


def start_worker(
    spawn: Callable[..., Proc], broker: str, records_url: str, name: str, pool: str = "solo"
) -> Proc:
    """An ``e2e_app`` worker on ``broker``'s ``e2e`` queue; ``pool`` is ``solo`` or ``prefork``
    (two processes)."""
    env = {"E2E_BROKER": broker, "E2E_RECORDS": records_url}
    concurrency = 2 if pool == "prefork" else None
    args = worker_args(E2E_APP, name, pool, concurrency, queue=QUEUE)
    return spawn(args, env=env, name=f"worker-{name}")


def wait_worker_ready(r: redis.Redis, broker: str, worker: Proc) -> None:
    """Send an immediate task to an ``e2e_app`` worker and wait until it has run it."""
    app = Celery("ping", broker=broker)
    try:
        app.send_task("e2e.record", ("ready",), queue=QUEUE)
    finally:
        app.close()

    def ran() -> bool:
        assert worker.popen.poll() is None, worker.output()
        return bool(records(r, "ready"))

    wait_until(ran, timeout=120)


# -- tests.support.ecosystem_app: broker and options from the environment --------------------------


def start_eco_worker(
    spawn: Callable[..., Proc],
    redis_server: RedisServer,
    name: str,
    pool: str,
    options: dict[str, object],
    concurrency: int = 2,
    **extra: str,
) -> Proc:
    """An ``ecosystem_app`` worker on the delay broker; ``extra`` overrides its environment."""
    env = {
        "ECO_BROKER": redis_server.delay_url,
        "ECO_OPTIONS": json.dumps(options),
        "ECO_LEDGER": redis_server.url,
        **extra,
    }
    return spawn(worker_args(ECOSYSTEM_APP, name, pool, concurrency), env=env, name=name)


def eco_ledger(client: redis.Redis) -> list[dict[str, Any]]:
    return ledger(client, ecosystem_app.LEDGER_KEY)


def check_once_and_on_time(runs: list[dict[str, Any]], sent: dict[str, float]) -> None:
    """Each task sent ran once, never before its ETA, and not absurdly late."""
    ids = [run["id"] for run in runs]
    assert sorted(ids) == sorted(sent), "a task ran twice or never"
    for run in runs:
        assert run["eta_ms"] is not None
        assert run["ran_ms"] >= run["eta_ms"], f"ran {run['eta_ms'] - run['ran_ms']} ms early"
        assert run["ran_ms"] - run["eta_ms"] < 30_000, "far too late"


# -- tests.support.inspect_app: a plain redis:// worker that knows nothing of kombu-delay ----------


def start_inspect_worker(
    spawn: Callable[..., Proc], redis_server: RedisServer, options: dict[str, object]
) -> Proc:
    env = {
        "INSPECT_BROKER": redis_server.url,
        "INSPECT_OPTIONS": json.dumps(options),
        "INSPECT_LEDGER": redis_server.url,
    }
    return spawn(worker_args(INSPECT_APP, f"inspect-{uuid.uuid4().hex[:6]}"), env=env, name="worker")


def inspect_ledger(client: redis.Redis) -> list[dict[str, Any]]:
    return ledger(client, inspect_app.LEDGER_KEY)
