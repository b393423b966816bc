"""The demo and the benchmark run on their own Redis whatever the environment says: Celery's
server variables (``CELERY_BROKER_URL`` first), which Celery reads before an app's own
``broker=``, are dropped from their process and from every child they start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kombu_delay.cli.common import CELERY_SERVER_ENV, forget_celery_servers, without_celery_servers
from kombu_delay.tooling.demo import Child
from tests.support.procs import ROOT

#: Prints the names of its environment's CELERY_* variables and Celery's server variables, as JSON.
SHOW_ENV = (
    "import json, os; from kombu_delay.cli.common import CELERY_SERVER_ENV as S; "
    "print(json.dumps(sorted(k for k in os.environ if k.startswith('CELERY_') or k in S)))"
)


def foreign_env(url: str) -> dict[str, str]:
    """Every server variable, naming ``url`` (the suite's server, standing for a production one)."""
    modules = ("CELERY_CONFIG_MODULE", "CELERY_LOADER", "LOADER", "CONFIG_MODULE", "CELERY_CONFIG")
    return {name: url for name in CELERY_SERVER_ENV if name not in modules}


def test_forget_and_without_drop_only_celerys_server_variables():
    env = {"CELERY_BROKER_URL": "redis://prod/0", "CELERY_RESULT_BACKEND": "redis://prod/1", "PATH": "/bin"}
    env["CELERY_WORKER_CONCURRENCY"] = "2"
    assert without_celery_servers(env) == {"PATH": "/bin", "CELERY_WORKER_CONCURRENCY": "2"}
    assert len(env) == 4  # a copy
    assert forget_celery_servers(env) == ["CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"]
    assert env == {"PATH": "/bin", "CELERY_WORKER_CONCURRENCY": "2"}


def test_the_demos_children_never_see_celerys_server_variables(monkeypatch, tmp_path: Path):
    for name in CELERY_SERVER_ENV:
        monkeypatch.setenv(name, "redis://127.0.0.1:1/0")
    child = Child("probe", [sys.executable, "-c", SHOW_ENV], tmp_path / "probe.log", {"CELERY_X": "1"})
    try:
        assert child.popen.wait(timeout=120) == 0, child.tail()
    finally:
        child.stop()
    assert json.loads((tmp_path / "probe.log").read_text()) == ["CELERY_X"]


def test_bench_ignores_celery_broker_url(r, redis_server, tmp_path: Path):
    # Before: Celery published the bench's capture message to CELERY_BROKER_URL's Redis, and
    # the bench failed waiting for it on its own.
    args = [sys.executable, "-m", "kombu_delay", "bench", "--only", "publish", "--publish", "50"]
    args += ["--json-out", str(tmp_path / "b.json"), "--plot-out", str(tmp_path / "b.png")]
    # And the movers it starts read KOMBU_DELAY_*: a KOMBU_DELAY_MAX_RATE=2 made its p99 6 s.
    env = {**os.environ, **foreign_env(redis_server.url), "KOMBU_DELAY_MAX_RATE": "2"}
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "bench: ignoring CELERY_BROKER_URL" in done.stderr
    assert "KOMBU_DELAY_MAX_RATE" in done.stderr.split("bench: ignoring", 1)[1].split("\n", 1)[0]
    assert r.dbsize() == 0, r.keys("*")
    assert json.loads((tmp_path / "b.json").read_text())["errors"] == {}


@pytest.mark.slow  # the whole demo, about 15 s: CI runs it (-m slow)
def test_demo_ignores_celery_broker_url(r, redis_server):
    # Before: the demo published to, and its worker consumed from, CELERY_BROKER_URL's Redis.
    env = {**os.environ, **foreign_env(redis_server.url)}
    done = subprocess.run(
        [sys.executable, "-m", "kombu_delay", "demo", "--no-live"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "demo: ignoring CELERY_BROKER_URL" in done.stderr
    assert r.dbsize() == 0, r.keys("*")
