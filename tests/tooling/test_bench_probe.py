"""The bench's probe: the floors it times on a Redis of its own, which it leaves as it found."""

from __future__ import annotations

import pytest
import redis

from kombu_delay.tooling.bench.env import FLOOR_LIBRARY, Probe
from kombu_delay.tooling.redis_server import RedisServer


@pytest.mark.parametrize("server", ["redis_server", "server7"])
def test_the_publish_floor_sends_each_way_once_per_message(
    server: str, request: pytest.FixtureRequest
) -> None:
    """A bare LPUSH, a bare ZADD and a script call of one ZADD (a function on Redis 7, a
    script on 6) per message, and nothing left behind: no key, no function library."""
    found: RedisServer = request.getfixturevalue(server)
    client = found.client()
    client.flushall()
    client.config_resetstat()
    probe = Probe(found.url)
    payloads = [f'{{"body": "m{i}"}}' for i in range(12)]
    spent = probe.floor_publish(payloads, rounds=5)
    stats = client.info("commandstats")
    calls = {
        name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
        for name in ("lpush", "zadd", "fcall", "evalsha")
    }
    functions = int(client.info("server")["redis_version"].split(".")[0]) >= 7
    # Scripts' commands count in commandstats too: the bare ZADDs and the script's.
    assert calls == {
        "lpush": 12,
        "zadd": 24,
        "fcall": 12 if functions else 0,
        "evalsha": 0 if functions else 12,
    }
    assert set(spent) == {"lpush", "zadd", "script"} and all(s >= 0 for s in spent.values())
    assert client.dbsize() == 0
    if functions:
        # Each library a RESP2 map: a flat list of names and values (another test's may be there).
        names = {
            dict(zip(lib[::2], lib[1::2], strict=True))[b"library_name"] for lib in client.function_list()
        }
        assert FLOOR_LIBRARY.encode() not in names
    probe.close()
    client.close()


def test_the_publish_floor_leaves_nothing_where_it_fails(r: redis.Redis, redis_server: RedisServer) -> None:
    """A key of another type in the way (the bare ZADD's, as text) fails the run, and its keys
    are deleted all the same."""
    r.set("kombu_delay_bench:floor:zadd", "text")
    probe = Probe(redis_server.url)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        probe.floor_publish(["a", "b", "c"], rounds=1)
    assert r.dbsize() == 0
    probe.close()
