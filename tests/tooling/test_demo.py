"""The Quickstart demo, run as a user runs it: ``python -m kombu_delay demo``.

The demo starts its own Redis, mover and stock Celery worker, and exits 0 only
when every task ran exactly once and none reached the worker before its ETA.
"""

from __future__ import annotations

import contextlib
import os
import pty
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.procs import ROOT, alive, children_of

pytestmark = pytest.mark.slow  # CI runs it (-m slow); the default run leaves it out

DEMO = [sys.executable, "-m", "kombu_delay", "demo"]
TASKS = 8


def test_demo_without_a_terminal_prints_each_task_and_a_passing_summary():
    # A user's kombu-delay settings are not the demo's: a delay_max_delay of 5 s refused its
    # 10 s task, with a traceback. A broker and key prefix given are not the demo's either (they
    # were ignored unsaid); nothing listens on that port.
    env = {**os.environ, "KOMBU_DELAY_MAX_DELAY": "5"}
    given = ["-b", "delayredis://127.0.0.1:1/0", "--prefix", "zz:", "-o", "visibility_timeout=60"]
    done = subprocess.run(
        [*DEMO[:3], *given, *DEMO[3:]],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # (followed by any other KOMBU_DELAY_ variable of the environment: CI sets one of its own)
    assert "demo: ignoring --broker, --prefix, -o, KOMBU_DELAY_MAX_DELAY" in done.stderr, out
    assert f"fired {TASKS}/{TASKS}, exactly once {TASKS}/{TASKS}, 0 early" in out
    fired = re.findall(r"^fired task (\d+) .* late (-?\d+) ms$", done.stdout, re.MULTILINE)
    assert sorted(int(n) for n, _ in fired) == list(range(1, TASKS + 1))
    assert all(int(late) >= 0 for _, late in fired), out
    assert "\x1b[" not in done.stdout  # no cursor moves or colours in a log
    assert done.stdout.rstrip().endswith("OK")


def test_demo_in_a_terminal_redraws_a_live_table():
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        DEMO,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "xterm"},
    )
    os.close(slave)
    chunks: list[bytes] = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the demo closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    out = b"".join(chunks).decode(errors="replace")
    assert "\x1b[" in out  # redrawn in place
    assert f"ran {TASKS}/{TASKS}" in out
    assert f"fired {TASKS}/{TASKS}, exactly once {TASKS}/{TASKS}, 0 early" in out


@contextlib.contextmanager
def _demo_running(
    env: dict[str, str] | None = None, **popen: Any
) -> Iterator[tuple[subprocess.Popen[bytes], list[int]]]:
    """A demo (quiet, unless ``popen`` says otherwise), and its children (its Redis, mover and
    worker) once all three are up; on the way out, whatever of them a failed test left running
    is stopped, by PID."""
    from tests.support.procs import wait_until

    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    proc = subprocess.Popen(DEMO, cwd=ROOT, env=env, **{**quiet, **popen})  # type: ignore[call-overload]
    children: list[int] = []
    try:
        found = wait_until(
            lambda: children_of(proc.pid) if len(children_of(proc.pid)) >= 3 else None, timeout=120
        )
        children.extend(found)  # type: ignore[call-overload]
        yield proc, children
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in filter(alive, children):  # only on failure: ours to stop, by PID
            os.kill(pid, 9)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_demo_killed_outright_leaves_none_of_its_processes_running():
    # SIGKILL gives the demo no chance to stop its children: its Redis, mover and worker ran on.
    from tests.support.procs import wait_until

    with _demo_running() as (proc, children):
        proc.kill()
        proc.wait()
        wait_until(lambda: not any(map(alive, children)), timeout=120)


def test_a_demo_whose_terminal_closes_stops_everything_and_leaves_no_directory(tmp_path):
    # SIGHUP (the terminal or ssh session closed) killed the demo at once: its children died by
    # the parent-death signal, but its directory (the AOF and the logs) stayed behind.
    from tests.support.procs import wait_until

    with _demo_running({**os.environ, "TMPDIR": str(tmp_path)}) as (proc, children):
        assert next(p.name for p in tmp_path.iterdir()).startswith("kombu-delay-demo-")
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=120) == 130
        wait_until(lambda: not any(map(alive, children)), timeout=120)
        assert list(tmp_path.iterdir()) == []


def _redis_of(children: list[int]) -> int:
    """The demo's redis-server among its children."""
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"redis-server" in f.read():
                return pid
    raise AssertionError(f"no redis-server among {children}")


def test_a_demo_whose_redis_dies_says_so_and_stops_the_rest():
    # It ended in a raw redis-py traceback (ConnectionError), not in "demo failed".
    from tests.support.procs import wait_until

    with _demo_running(stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as (proc, children):
        seen = []
        while not seen or not seen[-1].startswith(b"Scheduled"):  # its tasks are sent: it watches
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, b"".join(seen)  # the demo ended before it scheduled
            seen.append(line)
        os.kill(_redis_of(children), signal.SIGKILL)  # the demo's own Redis: ours, by PID
        out, _ = proc.communicate(timeout=120)
        out = b"".join(seen) + out
        assert proc.returncode == 1, out
        assert b"\ndemo failed: " in out and b"Traceback" not in out, out
        wait_until(lambda: not any(map(alive, children)), timeout=120)


def test_a_demo_that_ignores_sigint_runs_on_through_one_sent_to_its_group():
    # A background job of a script starts with SIGINT ignored. The demo's Redis, in the demo's
    # process group, took a SIGINT sent to the group and shut down: the demo ended in a
    # traceback. Only the demo is in its group now, and it ignores it, as it was started to.
    def ignoring_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    quiet = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    with _demo_running(start_new_session=True, preexec_fn=ignoring_sigint, **quiet) as (proc, _children):
        os.killpg(proc.pid, signal.SIGINT)  # the demo's own group (its own session)
        out, _ = proc.communicate(timeout=280)
        assert proc.returncode == 0, out
        assert f"fired {TASKS}/{TASKS}, exactly once {TASKS}/{TASKS}, 0 early".encode() in out
