"""The overview is built once per moment and shared by every request waiting for it, a
failure included."""

from __future__ import annotations

import pytest
import redis

from kombu_delay.control import DelayControl
from kombu_delay.errors import WrongTypeKey
from kombu_delay.store import keys
from kombu_delay.tooling.redis_server import RedisServer
from kombu_delay.web import overview


def wrongtype_errors(client: redis.Redis) -> int:
    """How many WRONGTYPE errors Redis has answered since its statistics were reset."""
    stat = client.info("errorstats").get("errorstat_WRONGTYPE", {"count": 0})
    return int(stat["count"])


def test_a_failed_overview_is_shared_with_the_requests_that_waited_for_it(
    r: redis.Redis, redis_server: RedisServer
) -> None:
    # Behind a Redis that stalled, each waiting request built the overview again in turn, and
    # each waited out its own socket timeout: four open tabs answered after 10, 20, 30, 40 s.
    # Any failure is shared so; here a key written over by hand, which Redis refuses each time
    # the overview is built, and counts (INFO errorstats): Redis itself tells how often it was.
    with DelayControl(redis_server.delay_url) as control:
        overview.build(control, "hours", 10)  # connected: every build below costs the same calls
        r.set(keys.movers(""), "written over by hand")
        r.config_resetstat()
        shared = overview.Shared(control, max_buckets=10, share_s=3600)
        with pytest.raises(WrongTypeKey):
            shared.get("hours")
        per_build = wrongtype_errors(r)
        assert per_build >= 1  # built, and refused
        for _ in range(2):  # the requests that waited for it: the same failure, not built again
            with pytest.raises(WrongTypeKey):
                shared.get("hours")
        assert wrongtype_errors(r) == per_build
        with pytest.raises(WrongTypeKey):
            shared.get("days")  # another range waits for the same Redis: shared too
        assert wrongtype_errors(r) == per_build
        shared.share_s = 0  # the moment has passed: the next request tries again
        with pytest.raises(WrongTypeKey):
            shared.get("hours")
        assert wrongtype_errors(r) == 2 * per_build
