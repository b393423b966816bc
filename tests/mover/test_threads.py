"""The threads kombu-delay starts leave SIGTERM and SIGINT to the main thread, whose wait on a
socket a stop signal must interrupt (see kombu_delay/mover/threads.py)."""

from __future__ import annotations

import re
import signal
import sys
import threading
from pathlib import Path

import pytest

from kombu_delay.mover.threads import STOP_SIGNALS, start_daemon
from kombu_delay.mover.watch import Watch
from kombu_delay.store import Store

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def blocked_signals(native_id: int) -> set[int]:
    """The signals a thread of this process blocks, from Linux's /proc."""
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    mask = int(re.search(r"^SigBlk:\s*([0-9a-f]+)$", status, re.M).group(1), 16)  # type: ignore[union-attr]
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def test_a_daemon_thread_leaves_the_stop_signals_to_the_main_thread() -> None:
    started, done = threading.Event(), threading.Event()
    ids: list[int] = []

    def target() -> None:
        ids.append(threading.get_native_id())
        started.set()
        done.wait(60)

    thread = start_daemon(target, "test-daemon")
    try:
        assert started.wait(60)
        assert blocked_signals(ids[0]) >= STOP_SIGNALS
        assert not STOP_SIGNALS & blocked_signals(threading.get_native_id())  # the main one's mask is back
        assert not STOP_SIGNALS & signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        done.set()
        thread.join(60)


def test_a_movers_background_checks_leave_the_stop_signals_to_the_main_thread(r) -> None:
    watch = Watch(Store(r), "test-watch")
    watch.start()
    try:
        assert len(watch._threads) == 2  # its checks, and its walk of the id index
        for thread in watch._threads:
            assert thread.native_id is not None
            assert blocked_signals(thread.native_id) >= STOP_SIGNALS
    finally:
        watch.stop()
