"""Processes the tests start, and waiting for a condition: a child process is stopped by its PID,
and every wait polls a predicate until a generous deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kombu_delay.tooling.redis_server import stop_process

#: The repository root: the working directory of every process the tests start.
ROOT = Path(__file__).resolve().parents[2]


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


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until truthy; return False (not raise) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def joined(thread: threading.Thread, timeout: float = 60.0) -> None:
    """Join an in-process mover's thread; fail where it outlives ``timeout``: left running on the
    worker's shared server, it would move other tests' messages."""
    thread.join(timeout)
    assert not thread.is_alive(), "the mover did not stop: it would move other tests' messages"


def wait_for_exit(proc: Proc, timeout: float = 120.0) -> int:
    """Wait for ``proc`` to end by itself; return its exit code."""
    wait_until(lambda: proc.popen.poll() is not None, timeout=timeout, interval=0.1)
    return int(proc.popen.returncode)


def _hangup_by_default() -> None:
    """In a child before it runs its program: SIGHUP's default action, not an ignore inherited."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


class Proc:
    """A child process of the suite, stopped by PID."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> None:
        self.log = log
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
        try:
            # SIGHUP as a terminal would leave it, whatever ours is: a suite run under nohup left
            # it ignored in every child, and a mover rightly keeps an ignored SIGHUP ignored.
            self.popen = subprocess.Popen(
                args,
                cwd=ROOT,
                env={**os.environ, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_hangup_by_default,
            )
        finally:
            if log:  # the child writes to its own copy; ours would be left for the GC to close
                out.close()  # type: ignore[union-attr]

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


def stat_of(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command's name (state, ppid, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children_of(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    stats = {int(entry): stat_of(entry) for entry in os.listdir("/proc") if entry.isdigit()}
    return [child for child, stat in stats.items() if stat and int(stat[1]) == pid and stat[0] != "Z"]


def alive(pid: int) -> bool:
    stat = stat_of(pid)
    return stat is not None and stat[0] != "Z"
