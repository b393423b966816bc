"""``mover``: run a mover in the foreground until SIGTERM, SIGINT or SIGHUP.

:func:`run_mover` and its flags (:func:`tuning_options`) are shared by ``kombu-delay mover``
and ``celery -A proj delay mover``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click
from kombu.transport import redis as kombu_redis

from kombu_delay.cli.common import global_options, target
from kombu_delay.connect import Target
from kombu_delay.errors import KombuDelayError, needs_extra
from kombu_delay.mover import check_pool, mover_id, open_when_reachable
from kombu_delay.mover.loop import Mover

if TYPE_CHECKING:
    from kombu_delay.ops.metrics import MoverMetrics

logger = logging.getLogger(__name__)


def tuning_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The mover's flags for its ``delay_*`` settings, shared by ``kombu-delay mover`` and
    ``celery -A proj delay mover``; each overrides its option and ``KOMBU_DELAY_*``.

    A count is taken as text and read as its variable and its option are (``--max-rate 1e3``
    is 1000 there too; click's integer refused it), and refused with their words."""
    count: dict[str, Any] = {"type": str, "metavar": "INTEGER", "default": None}
    flags = [
        click.option("--batch-size", **count, help="Messages per move call (default 500)."),
        click.option(
            "--max-sleep", type=float, default=None, help="Longest sleep without looking, s (default 1)."
        ),
        click.option("--max-rate", **count, help="Moves per second cap, 0 = none (default)."),
        click.option(
            "--max-queue-length",
            **count,
            help="Hold messages while their list is this long, 0 = never (default).",
        ),
        click.option(
            "--thaw-ahead",
            type=float,
            default=None,
            help="Restore compressed messages this long before they are due, s (default 30).",
        ),
        click.option(
            "--look-ahead",
            type=float,
            default=None,
            help="Hand messages to their lists this long before due, ETA unchanged, s (default 0 = off).",
        ),
        click.option(
            "--metrics-port",
            type=click.IntRange(1, 65535),
            default=None,
            help="Serve Prometheus metrics on this port.",
        ),
        click.option(
            "--metrics-addr", default="127.0.0.1", show_default=True, help="Address for --metrics-port."
        ),
    ]
    for flag in reversed(flags):
        command = flag(command)
    return command


def run_tuned(tgt: Target, metrics_port: int | None, metrics_addr: str, **tuning: float | None) -> None:
    """:func:`run_mover` with the flags of :func:`tuning_options` applied to ``tgt``."""
    tgt.overrides.update(tuning)
    run_mover(tgt, metrics_port=metrics_port, metrics_addr=metrics_addr)


@global_options
@click.command()
@tuning_options
@click.pass_context
def mover(ctx: click.Context, /, **flags: Any) -> None:
    """Move due messages onto their queues until SIGTERM, SIGINT or SIGHUP.

    Reads the same options as the publisher: from flags, from KOMBU_DELAY_*
    variables, or from -o delay_*=VALUE transport options. Run two or more for
    availability: they need no leader, and one message is moved by one of them
    only (a Redis failover can deliver one twice: see Guarantees in the docs).

    \b
    Examples:
      kombu-delay -b delayredis://localhost:6379/0 mover
      kombu-delay -b delayredis://redis:6379/0 --prefix myapp: mover --metrics-port 9808
      KOMBU_DELAY_MAX_RATE=5000 kombu-delay mover --max-queue-length 10000
      kombu-delay mover -b delayredis://redis:6379/0 --log-level debug
    """
    run_tuned(target(ctx), **flags)


def look_ahead_unchecked(tgt: Target, look_ahead_ms: int) -> str | None:
    """What to tell of a look-ahead checked against kombu's default ``visibility_timeout`` (an
    hour) for want of the workers' own: a mover given a broker URL, not a Celery app's settings,
    may not share them (a mover with a look-ahead of 30 s, its workers' timeout 10 s: every
    task moved ahead ran three times, unsaid)."""
    if not look_ahead_ms or "visibility_timeout" in tgt.transport_options or "Celery app" in tgt.source:
        return None
    return (
        f"a look-ahead of {look_ahead_ms / 1000:g} s is checked against kombu's default "
        f"visibility_timeout ({kombu_redis.Channel.visibility_timeout:g} s), as none is given here: a worker "
        "whose visibility_timeout is not far longer runs each message moved ahead again before it is "
        "due; give the workers' (-o visibility_timeout=N) to have it checked"
    )


def run_mover(tgt: Target, metrics_port: int | None = None, metrics_addr: str = "127.0.0.1") -> None:
    """Run a mover in the foreground with signal handling; shared by both CLIs."""
    logger.info("kombu-delay: %s", tgt.describe())
    try:
        settings = tgt.settings()
        check_pool(tgt)
    except KombuDelayError as exc:
        raise click.UsageError(tgt.redact(str(exc))) from exc
    if unchecked := look_ahead_unchecked(tgt, settings.look_ahead_ms):
        logger.warning("kombu-delay: %s", unchecked)
    name = mover_id()
    stopping = threading.Event()
    running: list[Mover] = []
    handle_stop_signals(name, stopping, running)
    # Served before Redis answers: a scrape then shows the mover up, counting its failed tries.
    metrics = serve_metrics_on(metrics_port, metrics_addr)
    try:
        with open_when_reachable(tgt, stopping, name, None if metrics is None else metrics.on_error) as store:
            if store is None:
                return
            hooks: dict[str, Any] = {}
            if metrics is not None:
                metrics.attach(store, settings.max_sleep_ms / 1000)
                hooks = metrics.hooks()
            running.append(Mover(store, settings, name=name, **hooks))
            if not stopping.is_set():
                running[0].run()
    except KombuDelayError as exc:  # a bad URL or option, credentials or ACL: waiting cannot fix it
        raise click.ClickException(tgt.redact(str(exc))) from exc


def handle_stop_signals(name: str, stopping: threading.Event, running: list[Mover]) -> None:
    """On the first SIGTERM, SIGINT or SIGHUP (a closed terminal, unless under nohup; a mover
    has no settings to read again), ask the movers in ``running`` to stop after their move; on
    a second, leave at once."""

    asked: list[int] = []

    def stop_all(signum: int) -> None:
        logger.info(
            "mover %s: stopping on %s (a second signal stops it at once)", name, signal.Signals(signum).name
        )
        stopping.set()
        for worker in running:
            worker.stop()

    def on_signal(signum: int, frame: object) -> None:
        if asked:
            # Asked twice: leave now, without the clean-up a SystemExit would run (a Redis that
            # does not answer would hold it for a socket timeout); a move in flight is one
            # atomic script, and the heartbeat ages out.
            sys.stderr.write(f"mover {name}: stopped by a second {signal.Signals(signum).name}\n")
            sys.stderr.flush()
            os._exit(1)
        asked.append(signum)
        # Not here: Event.set takes the lock of its Event, which the main thread, interrupted
        # by this handler inside that Event's wait, may hold: the mover hung for good, deaf to
        # every later signal. A thread sets them once this handler has returned.
        threading.Thread(target=stop_all, args=(signum,), name="kombu-delay-stop", daemon=True).start()

    # SIGINT even where it was ignored when the mover started (a shell script's background
    # job, a supervisor's or a test runner's): a stop asked with it is a stop.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Not where it is ignored already: a mover started under nohup keeps running when its
    # terminal closes.
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, on_signal)


def serve_metrics_on(port: int | None, addr: str) -> MoverMetrics | None:
    """Serve Prometheus metrics on ``addr:port`` and return their series, for a mover's store
    and hooks; ``None`` without a port (``prometheus_client`` is then never imported)."""
    if port is None:
        return None
    if importlib.util.find_spec("prometheus_client") is None:  # a flag this install cannot serve
        raise click.UsageError(needs_extra("--metrics-port", "metrics"))
    from kombu_delay.ops.metrics import serve_metrics

    try:
        return serve_metrics(None, port, addr)
    except OSError as exc:  # the port is taken, say
        raise click.ClickException(f"cannot serve metrics on {addr}:{port}: {exc}") from exc
