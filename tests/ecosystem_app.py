"""A Celery app for the ecosystem tests, configured from the environment.

``ECO_BROKER`` is the broker URL, ``ECO_OPTIONS`` a JSON object of
``broker_transport_options``, ``ECO_EMBED_STEP`` (any value) adds the embedded
mover step explicitly, and ``ECO_LEDGER`` a plain ``redis://`` URL where
the ``record`` task appends one JSON line per run (task id, its ETA and the
worker clock, both epoch ms), so a test can count runs and check their timing.
``fan_out`` publishes ``record`` children with a countdown from inside the worker.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from typing import Any

import redis
from celery import Celery

from kombu_delay.message import parse_iso_ms
from kombu_delay.mover.embedded import EmbeddedMoverStep

LEDGER_KEY = "eco:ledger"

app = Celery("eco", broker=os.environ.get("ECO_BROKER", "delayredis://127.0.0.1:1/0"))
app.conf.update(
    broker_transport_options=json.loads(os.environ.get("ECO_OPTIONS", "{}")),
    broker_connection_retry_on_startup=True,
    task_acks_late=False,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
)

if os.environ.get("ECO_EMBED_STEP"):
    # The one-line install of the embedded mover, without the transport option.
    app.steps["worker"].add(EmbeddedMoverStep)

_ledger: redis.Redis | None = None


def ledger() -> redis.Redis:
    global _ledger
    if _ledger is None:
        _ledger = redis.Redis.from_url(os.environ["ECO_LEDGER"])
    return _ledger


@app.task(bind=True, name="eco.record")
def record(self: Any, tag: str = "") -> None:
    eta = self.request.eta
    if isinstance(eta, datetime):
        eta = eta.isoformat()
    eta_ms = parse_iso_ms(eta) if isinstance(eta, str) else None
    entry = {"id": self.request.id, "tag": tag, "eta_ms": eta_ms, "ran_ms": int(time.time() * 1000)}
    ledger().rpush(LEDGER_KEY, json.dumps(entry))


@app.task(bind=True, name="eco.fan_out")
def fan_out(self: Any, n: int, countdown: float) -> None:
    """Publish ``n`` ``eco.record`` children due ``countdown`` s from now, from inside the worker."""
    for i in range(n):
        record.apply_async((f"child:{self.request.id}:{i}",), countdown=countdown)
