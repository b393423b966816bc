"""The demo's Celery app: a stock worker on plain ``redis://`` that records when each task ran.

``python -m kombu_delay demo`` starts ``celery -A kombu_delay.tooling.demo.app worker`` with
the broker URL in ``KOMBU_DELAY_DEMO_BROKER``. Nothing here knows about kombu-delay:
the worker consumes the ordinary Celery list, exactly as it would without it.

For every task the worker appends two JSON records to a list in the same Redis:
``received`` (the message reached the worker) and ``started`` (the task body began),
each with the task id, its ETA (epoch ms) and the worker clock (epoch ms).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import task_received

from kombu_delay.message import parse_iso_ms

BROKER_ENV = "KOMBU_DELAY_DEMO_BROKER"
#: The demo's own record list (not a kombu-delay key: the demo reads it, nothing else does).
RUNS_KEY = "kombu_delay_demo:runs"
TASK_NAME = "kombu_delay.tooling.demo.app.fire"

# Without the variable (the demo process imports this module only for its names) the app
# gets kombu's in-memory transport, so nothing can ever connect to a Redis that is not ours.
app = Celery("kombu_delay_demo", broker=os.environ.get(BROKER_ENV) or "memory://")
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(str(app.conf.broker_url))
    return _client


class Runs:
    """The demo's reader of the records the worker appends."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.seen = 0

    def new(self) -> list[dict[str, Any]]:
        """Return the records appended since the last call."""
        raw: list[bytes] = self.client.lrange(RUNS_KEY, self.seen, -1)  # type: ignore[assignment]
        self.seen += len(raw)
        return [json.loads(item) for item in raw]

    def started_ids(self) -> set[str]:
        raw: list[bytes] = self.client.lrange(RUNS_KEY, 0, -1)  # type: ignore[assignment]
        return {r["id"] for r in map(json.loads, raw) if r["event"] == "started"}


def _record(event: str, task_id: str, eta: Any) -> None:
    # floor to whole ms, as kombu-delay does with ETAs: "early" is judged at ms resolution
    now_ms = int(time.time() * 1000)
    if hasattr(eta, "isoformat"):
        eta = eta.isoformat()
    eta_ms = parse_iso_ms(eta) if isinstance(eta, str) else None
    record = {"event": event, "id": task_id, "eta_ms": eta_ms, "at_ms": now_ms, "pid": os.getpid()}
    _redis().rpush(RUNS_KEY, json.dumps(record))


@task_received.connect  # type: ignore[untyped-decorator,misc,unused-ignore]
def _on_received(request: Any = None, **kwargs: Any) -> None:
    if request is not None and request.name == TASK_NAME:
        _record("received", request.id, request.eta)


@app.task(bind=True, name=TASK_NAME)  # type: ignore[untyped-decorator,misc,unused-ignore]
def fire(self: Any, number: int) -> int:
    """Record that task ``number`` started, with the ETA its message carried."""
    _record("started", self.request.id, self.request.eta)
    return number
