"""The threads kombu-delay starts beside a process's own: a mover's background checks and
metrics server, and an embedded mover in a Celery worker. None of them takes a stop signal."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: The signals that stop a process: the main thread's to handle, never a background thread's.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


@contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block :data:`STOP_SIGNALS` in this thread meanwhile: the threads started meanwhile
    inherit the mask, and keep it.

    The kernel gives a process's signal to any thread that does not block it. Python runs the
    handler in the main thread only, and only once that thread wakes: a signal the kernel gave
    to a background thread leaves a main thread that waits on a socket (a mover's call to a
    Redis that stopped answering) waiting until its timeout. A signal that arrives while the
    mask is set waits, and is delivered when it is lifted: none is lost.
    """
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: signals go to the main thread
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def start_daemon(target: Callable[[], object], name: str) -> threading.Thread:
    """Start a daemon thread running ``target``, with the stop signals blocked in it."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    with stop_signals_blocked():
        thread.start()
    return thread
