"""The mover: moves due messages onto their lists, thaws compressed ones, sweeps (:mod:`.loop`).

Here: a mover's name, and how it opens its store once Redis answers.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

from kombu_delay.connect import Target, with_socket_timeouts
from kombu_delay.errors import ConfigError, RedisRefused, RedisUnavailable, waits_out
from kombu_delay.mover.pacing import Backoff, Repeats, failure_kind
from kombu_delay.store import Store

logger = logging.getLogger(__name__)


#: Connections of its pool a mover holds at once: its moves, its checks and its walk of the id
#: index (the Operations page's "Connections"). The subscription that wakes it has its own.
CONNECTIONS = 3


def check_pool(target: Target) -> None:
    """Raise :class:`ConfigError` where the transport option ``max_connections`` leaves a mover
    fewer connections than it holds at once: its threads would find the pool empty, and each
    such call would be told as Redis unavailable ("Too many connections"), and retried."""
    given = target.transport_options.get("max_connections")
    # 0 (or None, False) is redis-py's default pool; True, one connection.
    if isinstance(given, int) and given < 0:
        raise ConfigError(f"max_connections={given} is no number of connections: give at least {CONNECTIONS}")
    if isinstance(given, int) and given and given < CONNECTIONS:
        raise ConfigError(
            f"max_connections={given} is too few for a mover, which holds up to {CONNECTIONS} "
            "connections of its pool at once (its moves, its checks and its walk of the id index): "
            f"give it at least {CONNECTIONS}, or leave kombu's default (10)"
        )


def mover_id() -> str:
    """A fresh name for a mover: its host, its process and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@contextmanager
def open_when_reachable(
    target: Target,
    stopping: threading.Event,
    name: str,
    on_error: Callable[[BaseException], None] | None = None,
) -> Iterator[Store | None]:
    """Open ``target``'s store, waiting with backoff while Redis cannot be reached, or
    refuses what waiting may end (a script running too long, a replica cut off from its
    master): a sidecar, or a worker with an embedded mover, may start before its Redis does.
    Other refusals (a wrong password, an ACL, a database the server lacks) are raised. Yields
    ``None`` if ``stopping`` is set before Redis answers. Its connection has socket timeouts (see
    :func:`~kombu_delay.connect.with_socket_timeouts`). ``on_error`` is told of each failed
    try (the metrics count it); the log tells the first, then one a minute (:class:`Repeats`),
    and that Redis answers after them.
    """
    backoff, failures = Backoff(), Repeats(logger)
    target = with_socket_timeouts(target)
    while not stopping.is_set():
        with ExitStack() as stack:
            try:
                store = stack.enter_context(target.open())
            except (RedisUnavailable, RedisRefused) as exc:
                if not isinstance(exc, RedisUnavailable) and not waits_out(exc):
                    raise
                if on_error is not None:
                    on_error(exc)
                delay = backoff.next()
                failures.tell(
                    logging.WARNING, failure_kind(exc), f"mover {name}: {exc}; retrying in {delay:.1f} s"
                )
                stopping.wait(delay)
                continue
            failed_for = backoff.reset()
            if failed_for is not None and failures.over():
                logger.info("mover %s: Redis answers, after %.0f s", name, failed_for)
            yield store
            return
    yield None
