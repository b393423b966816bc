"""Over maxmemory, compressed messages due now are thawed past the limit, so that they reach
their queues; but a message expands when restored, many times over where it compresses well,
so the thaws take Redis only so far past where they began. Beyond, the rest wait, compressed,
counted and logged, until consumers free memory; then they go on. Nothing is lost.

Time is driven through a fake clock (see ``FakeClock``) and the thaw's own clock, held still.
"""

from __future__ import annotations

import logging

import redis

from kombu_delay.config import Settings
from kombu_delay.errors import OverMaxmemory
from kombu_delay.message import Due
from kombu_delay.mover.loop import MoverStats
from kombu_delay.mover.thaw import Thawer
from kombu_delay.store import Store, keys
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.stored import FakeClock, fill_to_maxmemory, kombu_payload

JUST_COLD = Settings(compress_after_ms=2050, thaw_ahead_ms=2000)
N = 60
#: A message of 1 MB that compresses to a few KB.
BODY = "A" * 2**20


def _cold(client: redis.Redis) -> int:
    return sum(client.zcard(key) for key in client.scan_iter(match=keys.ns("") + "cz:*"))


def test_thaws_past_maxmemory_stop_a_share_past_where_they_began_and_go_on_as_memory_frees(caplog):
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as server:
        client = server.client()
        clock = FakeClock(client)
        store = Store(client, clock=clock)
        due = clock() + 2100
        for i in range(N):
            store.schedule(Due(due, task_id=f"m{i}"), "q", kombu_payload(f"m{i}", body=BODY), JUST_COLD)
        assert _cold(client) == N and client.info("memory")["used_memory"] < 10 * 2**20
        # A limit of some 100 MB, filled: its 25 % share lets the thaw go on past it for about
        # two calls of 16 MB.
        limit = fill_to_maxmemory(client, 100 * 2**20, 2**16)
        clock.ms = due  # every message due, and Redis at its limit: the thaw ahead is refused
        told: list[BaseException] = []
        thawer = Thawer(store, JUST_COLD, "t", MoverStats(), monotonic=lambda: 1000.0, on_error=told.append)

        def step() -> None:
            thawer.wake()
            thawer.step()

        delivered = 0
        with caplog.at_level(logging.ERROR, logger="kombu_delay"):
            for _ in range(5):
                step()  # past maxmemory, about 16 MB a call, up to a quarter of it past
            first = N - _cold(client)
            assert 16 <= first < N  # (one call past that quarter at most: 16 or 17 of these)
            used = client.info("memory")["used_memory"]
            assert limit * 1.25 <= used < limit * 1.25 + 20 * 2**20
            for _ in range(3):
                step()
            assert N - _cold(client) == first  # no further, however often it looks
            assert "the rest wait, compressed, until memory frees" in caplog.text
            assert told and all(isinstance(exc, OverMaxmemory) for exc in told)
            while _cold(client):  # a consumer takes what is on the list: the thaws go on
                moved = store.move_due(1000).moved
                assert moved > 0
                delivered += moved
                client.delete("q")
                step()
        while moved := store.move_due(1000).moved:  # (about 16 MB a call)
            delivered += moved
        assert delivered == N and store.counts() == {}
        client.config_set("maxmemory", 0)
