from __future__ import annotations

import json

from celery import Celery

from kombu_delay.store import Store
from tests.support.procs import wait_until
from tests.support.stored import stored


def test_countdown_is_held_then_moved_by_mover_process(r, redis_server, start_mover):
    app = Celery("smoke", broker=redis_server.delay_url)
    sent = app.send_task("smoke.add", (1, 2), countdown=5)  # held, however slow the publish
    assert r.llen("celery") == 0
    store = Store(r)
    [held] = stored(r)
    mover = start_mover()
    raw = wait_until(lambda: r.rpop("celery"), timeout=60)
    assert store.time_ms() >= held.due_ms  # not before due, by the Redis clock
    assert json.loads(raw)["headers"]["id"] == sent.id
    assert Store(r).totals()["moved"] == 1  # moved by the mover, not pushed at publish
    assert mover.stop() == 0, mover.output()
