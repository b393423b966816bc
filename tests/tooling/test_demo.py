"""The Quickstart demo, run as a user runs it: ``python -m kombu_delay demo``.

The demo starts its own Redis, mover and stock Celery worker, and exits 0 only
when every task ran exactly once and none reached the worker before its ETA.
"""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys

import pytest

from tests.support.procs import ROOT

pytestmark = pytest.mark.slow  # CI runs it (-m slow); the default run leaves it out

DEMO = [sys.executable, "-m", "kombu_delay", "demo"]
TASKS = 8


def test_demo_without_a_terminal_prints_each_task_and_a_passing_summary():
    done = subprocess.run(
        DEMO, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=280
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
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
