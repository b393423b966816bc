"""The embedded mover: a Celery worker bootstep that runs a mover thread with its own connection.

For small deployments that don't want a sidecar. The step runs in the worker's
main process (never in prefork children), after the pool has started, and the
thread opens its own kombu connection from the app's broker URL: it never
touches the worker's consuming channel, whose connection is blocked in
``BRPOP`` (sharing it crashes the worker).

Install it with one line, ``app.steps['worker'].add(EmbeddedMoverStep)``, or
set the transport option ``delay_embedded_mover=True``: when this module is
imported (``celery`` imports it at start-up through the ``delay`` command
plugin) a ``worker_init`` handler adds the step for apps with that option.
Several workers with embedded movers are safe: each move is one atomic script,
so a message is delivered once whichever mover takes it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from celery import bootsteps, signals

from kombu_delay import poller
from kombu_delay.config import Settings
from kombu_delay.connect import Target, app_target, connection
from kombu_delay.errors import ConfigError, KombuDelayError
from kombu_delay.mover import check_pool, mover_id, open_when_reachable
from kombu_delay.mover.loop import Mover
from kombu_delay.mover.pacing import Backoff
from kombu_delay.mover.threads import start_daemon

logger = logging.getLogger(__name__)

#: How long a worker shutdown waits for the mover thread, seconds.
STOP_TIMEOUT_S = 10.0
#: The longest wait, seconds, between two tries of a mover that failed on what it does not
#: wait out itself (an ACL that refuses it, data in another storage format).
RETRY_CAP_S = 30.0
#: A mover that ran this long, seconds, before it failed is retried soon again.
HEALTHY_S = 60.0


class EmbeddedMover:
    """A :class:`Mover` in a daemon thread; it reopens its connection after any failure."""

    def __init__(self, target: Target, name: str | None = None, hostname: str | None = None) -> None:
        self.target = target
        #: Its worker's node name, as Celery's ``worker_shutting_down`` names the worker told to
        #: stop (another worker in the same process, rare, stops its own); ``None``: any.
        self.hostname = hostname
        self.name = name or "embedded:" + mover_id()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._mover: Mover | None = None
        self._thread: threading.Thread | None = None
        #: What each try's checks told: the next try tells a problem again only once it
        #: changes, or after LOG_REPEAT_S, not at every try.
        self._logged: dict[str, tuple[str, float]] = {}

    def start(self) -> None:
        """Start the thread (settings and URL are validated first, so a bad one fails the worker)."""
        self.target.settings()
        check_pool(self.target)
        connection(self.target.url, self.target.transport_options, self.target.ssl).release()
        self._thread = start_daemon(self._run, "kombu-delay-mover")
        signals.worker_shutting_down.connect(self._shutting_down, weak=False)
        logger.info("kombu-delay: embedded mover %s started", self.name)

    def _shutting_down(self, sender: Any = None, **kwargs: Any) -> None:
        """The worker was told to stop (TERM, QUIT, Ctrl-C): the mover stops now. Its step's
        stop comes after the consumer's, which may wait for ever on a Redis that does not answer
        (the mover kept retrying it as long). From a signal handler: no lock taken."""
        if self.hostname is not None and sender != self.hostname:
            return
        self._stopping.set()
        mover = self._mover
        if mover is not None:
            mover.stop()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the mover to finish its batch in hand, and wait for the thread."""
        signals.worker_shutting_down.disconnect(self._shutting_down)
        with self._lock:
            self._stopping.set()
            if self._mover is not None:
                self._mover.stop()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("kombu-delay: embedded mover %s did not stop in %.0f s", self.name, timeout)

    @property
    def mover(self) -> Mover | None:
        return self._mover

    def _run(self) -> None:
        settings = self.target.settings()
        backoff = Backoff(cap=RETRY_CAP_S)
        while not self._stopping.is_set():
            began = time.monotonic()
            try:
                # The Mover itself survives Redis outages, and open_when_reachable waits for
                # Redis at worker start; this loop keeps the worker's mover alive through
                # anything else (an ACL refusal fixed later, say).
                with open_when_reachable(self.target, self._stopping, self.name) as store:
                    if store is None:
                        return
                    with self._lock:
                        if self._stopping.is_set():
                            return
                        self._mover = Mover(store, settings, name=self.name, logged=self._logged)
                    self._mover.run()
            except ConfigError as exc:  # an option the connection cannot use: no retry helps
                logger.error(
                    "kombu-delay: embedded mover %s stopped: %s; fix it and restart the worker",
                    self.name,
                    exc,
                )
                return
            except Exception as exc:
                # What reaches here is what the Mover does not wait out itself (an ACL
                # refusal, say), so it fails again at once until someone fixes it: the waits
                # grow, and start again short only after a mover that ran a while. The Mover
                # has logged one of kombu-delay's own errors (as stopping: this one starts it
                # again); anything else is a bug, told with its traceback.
                if time.monotonic() - began >= HEALTHY_S:
                    backoff.reset()
                delay = backoff.next()
                logger.warning(
                    "kombu-delay: embedded mover %s failed (%s); retrying in %.1f s",
                    self.name,
                    exc,
                    delay,
                    exc_info=not isinstance(exc, KombuDelayError),
                )
                self._stopping.wait(delay)


class EmbeddedMoverStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: an :class:`EmbeddedMover` for the worker's app, started after the pool."""

    label = "kombu-delay mover"
    # After the pool, so its first children are forked before the thread opens sockets. A child
    # forked later (recycled, autoscaled, replacing one killed) inherits them, as it inherits
    # the consumer's: it never uses them, nor does the mover thread, which is not forked.
    requires = ("celery.worker.components:Pool",)

    def create(self, worker: Any) -> EmbeddedMover:
        return EmbeddedMover(app_target(worker.app), hostname=worker.hostname)


def install(app: Any) -> None:
    """Add the embedded mover to ``app``'s workers (the same as the one-line ``steps`` add)."""
    app.steps["worker"].add(EmbeddedMoverStep)


def enabled(app: Any) -> bool:
    """True when the app's transport options (or ``KOMBU_DELAY_EMBEDDED_MOVER``) ask for an
    embedded mover, or say so in a way that is no on/off value. Only that option is read here:
    the step's start checks them all and fails the worker on a bad one, where an error raised
    here, in Celery's ``worker_init``, would only be logged at debug level, the worker left
    running without its mover."""
    option = "delay_embedded_mover"
    options = app.conf.broker_transport_options or {}
    variable = "KOMBU_DELAY_EMBEDDED_MOVER"
    try:
        asked = {option: options[option]} if option in options else {}
        return Settings.from_options(asked, {variable: os.environ.get(variable, "")}).embedded_mover
    except ConfigError:
        return True


@signals.worker_shutting_down.connect(dispatch_uid="kombu_delay.poller")  # type: ignore[misc,untyped-decorator,unused-ignore]
def _worker_stopping(**kwargs: Any) -> None:
    # Celery sends it from its TERM, QUIT or INT handler: a worker's record of a message it took,
    # not made yet for Redis not answering (kombu_delay.poller), is given up at once rather than
    # hold the shutdown a minute (and a supervisor's kill then would lose it unsaid).
    poller.WORKER_STOPPING.set()


@signals.worker_init.connect(dispatch_uid="kombu_delay.poller.started")  # type: ignore[misc,untyped-decorator,unused-ignore]
def _worker_started(**kwargs: Any) -> None:
    # A worker started in a failover waits for Redis to take its queues' bindings
    # (kombu_delay.poller); a publisher is told at once, as kombu tells it. Told to stop during
    # that wait, it stops as Celery stops (Celery's own "Unrecoverable error" read as a crash).
    from celery.worker import state

    global _worker_pid, _worker_thread
    _worker_pid, _worker_thread = os.getpid(), threading.get_ident()
    poller.consuming = consuming
    poller.stop_worker = state.maybe_shutdown


#: The process that started the worker (0: none here), and its thread that did (the consumer's).
_worker_pid = 0
_worker_thread = 0


def consuming() -> bool:
    """Whether the caller is the worker's consumer: its own process (not a prefork child) and
    thread (not a threads pool's, nor a green pool's green thread), outside a task (the solo
    pool runs tasks in that thread). (Under eventlet's monkey-patching, the main thread's
    ``current_thread()`` is not ``main_thread()``: its id is what is compared.)"""
    from celery import current_task

    return os.getpid() == _worker_pid and threading.get_ident() == _worker_thread and not current_task


@signals.worker_init.connect(dispatch_uid="kombu_delay.mover.embedded")  # type: ignore[misc,untyped-decorator,unused-ignore]
def _install_when_enabled(sender: Any = None, **kwargs: Any) -> None:
    # worker_init fires in every WorkController just before its blueprint reads
    # app.steps['worker'], so adding the step here is early enough.
    if sender is not None and enabled(sender.app):
        install(sender.app)
