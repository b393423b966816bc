"""Redis at its ``maxclients``: a mover keeps moving on the connection it holds, and its
wake-up subscription, which only saves polling, waits until Redis has room for it.

Each test starts its own redis-server, lowers its client limit, and stops what it starts by PID.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import Store, keys
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.procs import Proc, wait_until
from tests.support.stored import kombu_payload

#: Generous: the suite shares two cores with other work.
DEADLINE_S = 120.0
QUEUE = "limited"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as started:
        yield started


def connected(admin: redis.Redis) -> int:
    return int(admin.info("clients")["connected_clients"])


def subscribed(admin: redis.Redis) -> int:
    return int(dict(admin.pubsub_numsub(keys.wake_channel("")))[keys.wake_channel("").encode()])


@pytest.mark.parametrize("cut", ["subscription", "every-connection"])
def test_a_mover_at_maxclients_moves_with_what_it_has_and_subscribes_when_it_can(
    server: RedisServer, spawn: Callable[..., Proc], cut: str
) -> None:
    """``subscription``: its connection is cut while Redis has no room for another. The new
    subscription took the idle connection of the mover's calls from their pool, and each call
    then needed one that Redis refused: nothing moved until a client went away.
    ``every-connection``: all the mover's connections are cut (as by a restart), and Redis has
    room for one. The subscription, made first, took it, and each round's calls were refused.
    Now the calls come first and the subscription waits for room; the mover polls meanwhile."""
    admin = server.client()  # one connection, used by this test alone
    mover = spawn([sys.executable, "-m", "kombu_delay", "--broker", server.delay_url, "mover"], name="mover")
    wait_until(lambda: admin.zcard(keys.movers("")) == 1 and subscribed(admin) == 1, timeout=DEADLINE_S)
    if cut == "subscription":  # no room for one more client; then the subscription's is cut
        admin.config_set("maxclients", connected(admin) - 1)
        admin.client_kill_filter(_type="pubsub")
    else:  # room for this test's connection and one more; then all the others are cut
        admin.config_set("maxclients", 2)
        admin.client_kill_filter(skipme=True)
    wait_until(lambda: "no wake-up subscription" in mover.output(), timeout=DEADLINE_S)

    store = Store(admin)
    due = store.time_ms() + 2000
    store.schedule(Due(due, task_id="t"), QUEUE, kombu_payload("t", QUEUE), Settings())
    raw = wait_until(lambda: admin.lpop(QUEUE), timeout=DEADLINE_S)
    assert json.loads(raw)["properties"]["delivery_tag"] == "t"
    assert subscribed(admin) == 0 and mover.popen.poll() is None

    # Room again: the mover subscribes anew, and a publish due soon wakes it.
    admin.config_set("maxclients", 1000)
    wait_until(lambda: subscribed(admin) == 1, timeout=DEADLINE_S)
    assert "subscribed to wake-ups again" in mover.output()
    assert "Traceback" not in mover.output(), mover.output()
    assert mover.stop() == 0, mover.output()
