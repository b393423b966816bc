"""A Celery app for the end-to-end tests, loaded by a real ``celery -A tests.e2e_app worker``.

It deliberately does not import ``kombu_delay``: a worker given a ``delayredis://``
broker must get the scheme from the package's ``celery.commands`` entry point.

Environment of the worker process:

* ``E2E_BROKER``: the broker URL the worker consumes (plain ``redis://`` or ``delayredis://``).
* ``E2E_RECORDS``: a ``redis://`` URL where every task run is recorded.

Every run appends one JSON record to the list :data:`RECORDS_KEY`:
``{"id", "tag", "start_us", "eta", "retries", "pid"}``, where ``start_us`` is the
wall clock (``time.time_ns() // 1000``) when the task body started.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task

#: The list every task run is appended to (RPUSH, so in run order).
RECORDS_KEY = "e2e:runs"
#: The queue the e2e tasks are sent to and the worker consumes.
QUEUE = "e2e"

app = Celery("e2e_app", broker=os.environ.get("E2E_BROKER", "memory://"))
app.conf.update(
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=4,
    task_ignore_result=True,
)

_records: redis.Redis | None = None


def _client() -> redis.Redis:
    global _records
    if _records is None:
        _records = redis.Redis.from_url(os.environ["E2E_RECORDS"])
    return _records


def _record(task: Task, tag: str) -> dict[str, Any]:
    start_us = time.time_ns() // 1000  # first thing: the moment the task body starts
    eta = task.request.eta
    record = {
        "id": task.request.id,
        "tag": tag,
        "start_us": start_us,
        "eta": eta.isoformat() if hasattr(eta, "isoformat") else eta,
        "retries": task.request.retries,
        "pid": os.getpid(),
    }
    _client().rpush(RECORDS_KEY, json.dumps(record))
    return record


@app.task(name="e2e.record", bind=True)
def record(self: Task, tag: str) -> None:
    """Record one run."""
    _record(self, tag)


@app.task(name="e2e.retry_later", bind=True, max_retries=3)
def retry_later(self: Task, tag: str, countdown: float) -> None:
    """Record one run; on the first run, retry after ``countdown`` seconds."""
    _record(self, tag)
    if self.request.retries == 0:
        raise self.retry(countdown=countdown)
