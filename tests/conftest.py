"""Shared fixtures: one private redis-server per test session (so one per xdist worker: workers
share no server and no port), real processes for the rest. Helpers live in ``tests/support``.

Nothing here talks to a Redis the suite did not start, and every process the
suite starts is stopped by its PID.
"""

from __future__ import annotations

import os
import signal
import sys

# pytest's hook for exceptions raised where none can propagate (a finalizer, during garbage
# collection) imports tracemalloc on its first call; a second such exception during that import
# finds it half made and fails the test it happens in. Imported here, it is whole before then.
import tracemalloc  # noqa: F401
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

import kombu_delay  # noqa: F401  (registers the delay* schemes)
from kombu_delay.store import cold
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.procs import Proc
from tests.support.sentinel import SentinelCluster
from tests.support.servers import binary_from


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The session's redis-server, on a free loopback port, with the AOF on as Operations asks
    (``appendonly yes``): so only a test that wants it (on a ``RedisServer()`` of its own, which
    keeps nothing on disk) sees the warning for a Redis a restart would empty."""
    with RedisServer(persistence=True) as server:
        yield server


@pytest.fixture(scope="session")
def server7() -> Iterator[RedisServer]:
    """A redis-server 7 or later, for what Redis 6 lacks (functions, ``redis.acl_check_cmd``);
    else the test skips."""
    with RedisServer(binary=binary_from(7)) as server:
        yield server


@pytest.fixture
def r7(server7: RedisServer) -> Iterator[redis.Redis]:
    """A client on :func:`server7`, flushed (functions too) and its statistics reset."""
    client = server7.client()
    client.flushall()
    client.function_flush()
    client.config_resetstat()
    yield client
    client.close()


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A redis-server of the test's own, for a test that reconfigures it (ACL users, its client
    limit) or stops it."""
    with RedisServer() as started:
        yield started


@pytest.fixture
def silent_server() -> Iterator[RedisServer]:
    """A redis-server of the test's own that accepts connections but never answers (SIGSTOP);
    continued and stopped by its PID afterwards."""
    server = RedisServer().start()
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield server
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.cleanup()


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client on the session server, flushed before each test."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


#: The ``prefix`` argument: no ``global_keyprefix``, and one (the harder path: every key is rewritten).
PREFIXES = {"noprefix": "", "prefix": "app1:"}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Give a test that takes ``prefix`` both layouts, or only the prefixed one if it runs real
    processes (it uses ``spawn``, or is marked ``process``): scripts and key maths are checked
    both ways, while a process-level test proves its point with one, and a prefix is the harder
    of the two."""
    if "prefix" not in metafunc.fixturenames or _parametrizes(metafunc, "prefix"):
        return
    process = "spawn" in metafunc.fixturenames or metafunc.definition.get_closest_marker("process")
    ids = ["prefix"] if process else list(PREFIXES)
    metafunc.parametrize("prefix", [PREFIXES[i] for i in ids], ids=ids)


def _parametrizes(metafunc: pytest.Metafunc, name: str) -> bool:
    """Whether the test's own ``parametrize`` marks already give ``name``."""
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if name in names:
            return True
    return False


@pytest.fixture
def large_cold_members(monkeypatch: pytest.MonkeyPatch) -> None:
    """Publishes compress a message of any size, as 1.0.0's did: the cold space still meets
    such members, which publishers now store as they are (``cold.MAX_PACKED_BYTES``)."""
    monkeypatch.setattr(cold, "MAX_PACKED_BYTES", cold.MAX_MESSAGE_BYTES)


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


@pytest.fixture(scope="module")
def _sentinel_cluster() -> Iterator[SentinelCluster]:
    with SentinelCluster() as cluster:
        yield cluster


@pytest.fixture
def sentinel_cluster(_sentinel_cluster: SentinelCluster) -> SentinelCluster:
    """A master, a replica and three sentinels, shared by a module's tests (it takes seconds to
    settle): whole again for each test (a sentinel a test stopped is started) and flushed. A test
    that fails the master over starts its own :class:`SentinelCluster`."""
    cluster = _sentinel_cluster
    for sentinel in cluster.sentinels:
        if sentinel.process is None or sentinel.process.poll() is not None:
            sentinel.start()
    cluster.wait_ready(cluster.master.port)
    with cluster.master.client() as client:
        client.flushall()
    return cluster
