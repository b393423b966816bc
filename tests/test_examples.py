"""The runnable examples under examples/, against the suite's own Redis."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from .conftest import ROOT, wait_until

EXAMPLES = ROOT / "examples"
PROJECT = EXAMPLES / "celery_project"


def test_kombu_xdelay_example_delivers_every_message_after_its_delay(r, redis_server, start_mover):
    start_mover()
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "kombu_xdelay.py"), redis_server.delay_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all 4 messages arrived, 0 early" in done.stdout
    waits = re.findall(r"received message \d+ after (\d+) ms \(x-delay (\d+) ms\)", done.stdout)
    assert len(waits) == 4
    assert all(int(waited) >= int(delay) for waited, delay in waits)


def test_kombu_xdelay_example_reads_the_broker_from_the_environment(r, redis_server, start_mover):
    start_mover()
    env = {**os.environ, "KOMBU_DELAY_BROKER": redis_server.delay_url}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "kombu_xdelay.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 early" in done.stdout


def test_celery_project_example_runs_tasks_after_their_countdown(r, redis_server, spawn):
    env = {"CELERY_BROKER_URL": redis_server.delay_url, "PYTHONPATH": str(PROJECT)}
    celery = [sys.executable, "-m", "celery", "-A", "proj"]
    quiet = ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    worker = spawn(
        [*celery, "worker", "--pool", "solo", *quiet, "--loglevel", "INFO"], env=env, name="worker"
    )
    mover = spawn([*celery, "delay", "mover"], env=env, name="mover")
    done = subprocess.run(
        [sys.executable, "-m", "proj.schedule", "2"],
        cwd=PROJECT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("scheduled reminder") == 2

    def reminded() -> list[str]:
        return re.findall(r"'user (\d+) reminded (-?\d+) ms after its ETA'", worker.output())

    wait_until(lambda: len(reminded()) >= 2, timeout=120)
    assert sorted(user for user, _ in reminded()) == ["1", "2"], worker.output()
    assert all(int(late) >= 0 for _, late in reminded())
    assert mover.popen.poll() is None, mover.output()
