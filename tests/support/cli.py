"""Driving ``kombu-delay`` (in-process, or as a process as a probe does) and publishing through
the delay transport, with or without a key prefix."""

from __future__ import annotations

import os
import subprocess
import sys

from celery import Celery
from click.testing import CliRunner

from kombu_delay.cli import main
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.procs import ROOT


def options(prefix: str) -> dict[str, object]:
    return {"global_keyprefix": prefix} if prefix else {}


def publish(
    redis_server: RedisServer, prefix: str, n: int = 3, queue: str = "celery", countdown: float = 600
) -> list[str]:
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = options(prefix)
    ids = [app.send_task("inspect.record", (i,), countdown=countdown + i, queue=queue).id for i in range(n)]
    app.close()
    return ids


def kd(redis_server: RedisServer, prefix: str, *args: str) -> tuple[int, str]:
    """Run ``kombu-delay`` in-process; return (exit code, stdout + stderr without the line that
    names the broker: test_every_command_names_its_broker_on_stderr covers that)."""
    base = ["--broker", redis_server.url, "--log-level", "warning"]
    if prefix:
        base += ["--prefix", prefix]
    result = CliRunner().invoke(main, [*base, *args], catch_exceptions=False)
    lines = result.output.splitlines(keepends=True)
    return result.exit_code, "".join(line for line in lines if not line.startswith("kombu-delay: broker "))


def health(server: RedisServer, prefix: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """Run ``kombu-delay health`` as a process, as a liveness probe does."""
    args = [sys.executable, "-m", "kombu_delay", "-b", server.delay_url]
    if prefix:
        args += ["--prefix", prefix]
    return subprocess.run(
        [*args, "health", *flags], cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=120
    )
