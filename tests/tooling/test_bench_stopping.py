"""``kombu-delay bench`` stopped part way: by SIGTERM (``kill``, ``timeout``, a cancelled CI job),
SIGHUP (a closed terminal) or Ctrl-C, it stops what it started, by PID, and ends in one line.

Each run is a small precision scenario on the bench's own Redis, stopped once its Redis and
its mover are up (the scenario waits 20 s and more for its messages: it is under way).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.procs import ROOT, alive, children_of, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


#: ``python -m kombu_delay`` with Python's own SIGINT handler, whatever its parent left.
INTERRUPTIBLE = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'kombu-delay'; runpy.run_module('kombu_delay', run_name='__main__', alter_sys=True)"
)


@contextlib.contextmanager
def bench_running(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], list[int], Path]]:
    """A bench in a process group of its own, and its Redis and mover once both are up; whatever of
    them a failed test left running is stopped on the way out, by PID."""
    out = tmp_path / "bench.json"
    # SIGINT as a terminal leaves it: a test runner's worker may ignore it, and an ignored
    # signal stays ignored across exec (Python then installs no handler of its own).
    args = [sys.executable, "-c", INTERRUPTIBLE, "bench", "--only", "precision", "--precision", "5"]
    args += ["--precision-window", "20", "--json-out", str(out), "--plot-out", str(tmp_path / "b.png")]
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    proc = subprocess.Popen(
        args,
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    children: list[int] = []
    try:

        def up() -> list[int] | None:
            found = children_of(proc.pid)
            commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in found]
            return found if any(b"mover" in c for c in commands) else None

        children.extend(wait_until(up, timeout=120))  # type: ignore[arg-type]
        yield proc, children, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in filter(alive, children):  # only on failure: ours to stop, by PID
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_bench_told_to_stop_stops_its_redis_and_its_mover(tmp_path: Path, signum: int) -> None:
    # Python died at once: its redis-server and its mover ran on, and its directories stayed.
    with bench_running(tmp_path) as (proc, children, out):
        assert len(children) == 2  # its Redis and its mover
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err
        wait_until(lambda: not any(map(alive, children)), timeout=60)
        assert list((tmp_path / "tmp").iterdir()) == []
        assert err.rstrip().splitlines()[-1] == (
            f"bench: interrupted during precision; what it measured before is in {out}; "
            "every process it started is stopped"
        )
        assert json.loads(out.read_text())["meta"]["interrupted"] == "precision"


def test_ctrl_c_stops_the_bench_in_one_line_and_writes_what_it_measured(tmp_path: Path) -> None:
    # A thread's traceback (its Redis had taken the SIGINT too), "Aborted!", and no JSON.
    with bench_running(tmp_path) as (proc, children, out):
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal sends it: to the whole group
        stdout, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err
        assert "Traceback" not in err and "Aborted" not in err, err
        assert "bench: interrupted during precision;" in err.rstrip().splitlines()[-1]
        assert stdout == ""
        report = json.loads(out.read_text())
        assert report["meta"]["interrupted"] == "precision" and report["results"] == {}
        wait_until(lambda: not any(map(alive, children)), timeout=60)
        assert list((tmp_path / "tmp").iterdir()) == []


def test_a_bench_killed_takes_its_redis_and_its_mover_with_it(tmp_path: Path) -> None:
    # SIGKILL (the OOM killer, `kill -9`) runs no handler: its Redis stopped, its mover ran on.
    with bench_running(tmp_path) as (proc, children, _):
        assert len(children) == 2  # its Redis and its mover
        proc.kill()
        proc.wait(timeout=60)
        wait_until(lambda: not any(map(alive, children)), timeout=60)
