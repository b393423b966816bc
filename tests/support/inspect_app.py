"""A Celery app for the inspection tests' real worker, configured from the environment.

``INSPECT_BROKER`` is the worker's broker URL (plain ``redis://``: the worker
needs nothing from kombu-delay), ``INSPECT_OPTIONS`` a JSON object of
``broker_transport_options`` and ``INSPECT_LEDGER`` a ``redis://`` URL where
``inspect.record`` appends one JSON line per run (task id, tag, the ETA it
carried and the worker clock at the run, epoch ms).
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from typing import Any

import redis
from celery import Celery

LEDGER_KEY = "inspect:ledger"

app = Celery("inspect", broker=os.environ.get("INSPECT_BROKER", "redis://127.0.0.1:1/0"))
app.conf.update(
    broker_transport_options=json.loads(os.environ.get("INSPECT_OPTIONS", "{}")),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
)


@app.task(bind=True, name="inspect.record")
def record(self: Any, tag: str = "") -> None:
    ran_ms = int(time.time() * 1000)
    eta = self.request.eta
    if isinstance(eta, datetime):
        eta = eta.isoformat()
    entry = {"id": self.request.id, "tag": tag, "eta": eta, "ran_ms": ran_ms}
    redis.Redis.from_url(os.environ["INSPECT_LEDGER"]).rpush(LEDGER_KEY, json.dumps(entry))
