"""How the demo and the benchmark stop on a signal: SIGTERM (``kill``, ``timeout``, a CI job
cancelled) and SIGHUP (a closed terminal or ssh connection) end them as Ctrl-C does, so that
their cleanup runs and every process they started is stopped by its PID, and their temporary
directories go.

Without it, Python dies at once on either signal, and whatever the command started runs on.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

#: The signals that end a run as Ctrl-C does.
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # so that the cleanup in the finally blocks on the way out runs


@contextlib.contextmanager
def terminated_as_interrupted() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise :class:`KeyboardInterrupt` in the main thread,
    as SIGINT does; the handlers before are put back on the way out."""
    previous = {signum: signal.signal(signum, _interrupt) for signum in TERMINATING}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
