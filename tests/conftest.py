"""Shared fixtures: one private redis-server per test session, real processes for the rest.

Nothing here talks to a Redis the suite did not start, and every process the
suite starts is stopped by its PID.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

import kombu_delay  # noqa: F401  (registers the delay* schemes)
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.procs import Proc


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client on the session server, flushed before each test."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture(params=["", "app1:"], ids=["noprefix", "prefix"])
def prefix(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """Start child processes; all are stopped by PID at the end of the test."""
    procs: list[Proc] = []

    def start(args: list[str], env: dict[str, str] | None = None, name: str = "proc") -> Proc:
        proc = Proc(args, env, tmp_path / f"{name}-{len(procs)}.log")
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture
def start_mover(spawn: Callable[..., Proc], redis_server: RedisServer) -> Callable[..., Proc]:
    """Start ``kombu-delay mover`` as a real process against the session server."""

    def start(*extra: str, prefix: str = "", env: dict[str, str] | None = None) -> Proc:
        args = [
            sys.executable,
            "-m",
            "kombu_delay",
            "--broker",
            redis_server.delay_url,
            "--log-level",
            "debug",
        ]
        if prefix:
            args += ["--prefix", prefix]
        return spawn([*args, "mover", *extra], env=env, name="mover")

    return start
