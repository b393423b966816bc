"""Shared fixtures: one private redis-server per test session, real processes for the rest.

Nothing here talks to a Redis the suite did not start, and every process the
suite starts is stopped by its PID.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

import kombu_delay  # noqa: F401  (registers the delay* schemes)
from kombu_delay.tooling.redis_server import RedisServer, stop_process

ROOT = Path(__file__).resolve().parent.parent


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


def wait_until(predicate: Callable[[], object], timeout: float = 60.0, interval: float = 0.02) -> object:
    """Poll ``predicate`` until it is truthy; fail after a generous ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


class Proc:
    """A child process of the suite, stopped by PID."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> None:
        self.log = log
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
        self.popen = subprocess.Popen(
            args, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, timeout: float = 30.0) -> int:
        stop_process(self.popen, timeout)
        return int(self.popen.returncode)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log else ""


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
