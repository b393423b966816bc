"""The ``kombu-delay`` command line: a thin noun-verb layer over the mover and the store.

Subcommands find their broker through :class:`~kombu_delay.connect.Target`, stored
as the click context object, so the same commands serve ``kombu-delay ...`` and
``celery -A proj delay ...``.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import click

from kombu_delay.cli.common import RedactingGroup, global_options, parse_option, setup_logging, target
from kombu_delay.connect import Target
from kombu_delay.errors import KombuDelayError
from kombu_delay.mover.loop import Mover, mover_id, open_when_reachable
from kombu_delay.ops.health import health

__all__ = ["main", "parse_option", "run_mover", "setup_logging", "target"]

logger = logging.getLogger(__name__)

#: The tooling's commands, imported only when they run.
TOOLING = {
    "bench": "kombu_delay.tooling.bench:bench",
    "demo": "kombu_delay.tooling.demo:demo",
}
#: Commands of optional extras, imported only when they run (the mover never loads them).
EXTRAS = {"web": "kombu_delay.web.cli:web"}


@global_options
@click.group(
    cls=RedactingGroup,
    lazy={**TOOLING, **EXTRAS},
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
def main() -> None:
    """kombu-delay: delayed delivery for Celery on Redis.

    The options below work after the command too (kombu-delay mover -b URL); given in both
    places, the command's value wins.

    \b
    Examples:
      kombu-delay --broker delayredis://localhost:6379/0 mover
      kombu-delay -b redis://cache:6379/1 --prefix myapp: stats
      kombu-delay stats -b redis://cache:6379/1 --prefix myapp:
    """
    if click.get_current_context().params["log_level"] is None:
        setup_logging("info")


@global_options
@click.command()
@click.option("--batch-size", type=int, default=None, help="Messages per move call (default 500).")
@click.option("--max-sleep", type=float, default=None, help="Longest sleep without looking, s (default 1).")
@click.option("--max-rate", type=int, default=None, help="Moves per second cap, 0 = none (default).")
@click.option(
    "--max-queue-length",
    type=int,
    default=None,
    help="Hold messages while their list is this long, 0 = never (default).",
)
@click.option(
    "--thaw-ahead",
    type=float,
    default=None,
    help="Restore compressed messages this long before they are due, s (default 30).",
)
@click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics on this port.")
@click.option("--metrics-addr", default="127.0.0.1", show_default=True, help="Address for --metrics-port.")
@click.pass_context
def mover(
    ctx: click.Context,
    batch_size: int | None,
    max_sleep: float | None,
    max_rate: int | None,
    max_queue_length: int | None,
    thaw_ahead: float | None,
    metrics_port: int | None,
    metrics_addr: str,
) -> None:
    """Move due messages onto their queues until SIGTERM or SIGINT.

    Reads the same options as the publisher: from flags, from KOMBU_DELAY_*
    variables, or from -o delay_*=VALUE transport options. Run two or more for
    availability; they need no leader and never deliver a message twice.

    \b
    Examples:
      kombu-delay -b delayredis://localhost:6379/0 mover
      kombu-delay -b delayredis://redis:6379/0 --prefix myapp: mover --metrics-port 9808
      KOMBU_DELAY_MAX_RATE=5000 kombu-delay mover --max-queue-length 10000
      kombu-delay mover -b delayredis://redis:6379/0 --log-level debug
    """
    tgt = target(ctx)
    tgt.overrides.update(
        batch_size=batch_size,
        max_sleep=max_sleep,
        max_rate=max_rate,
        max_queue_length=max_queue_length,
        thaw_ahead=thaw_ahead,
    )
    run_mover(tgt, metrics_port=metrics_port, metrics_addr=metrics_addr)


main.add_command(mover)


def run_mover(tgt: Target, metrics_port: int | None = None, metrics_addr: str = "127.0.0.1") -> None:
    """Run a mover in the foreground with signal handling; shared by both CLIs."""
    logger.info("kombu-delay: %s", tgt.describe())
    try:
        settings = tgt.settings()
    except KombuDelayError as exc:
        raise click.UsageError(tgt.redact(str(exc))) from exc
    name = mover_id()
    stopping = threading.Event()
    running: list[Mover] = []

    def on_signal(signum: int, frame: object) -> None:
        if stopping.is_set():  # asked twice: leave now; a move in flight is one atomic script
            raise SystemExit(f"mover {name}: stopped by a second {signal.Signals(signum).name}")
        stopping.set()
        for worker in running:
            worker.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        with open_when_reachable(tgt, stopping, name) as store:
            if store is None:
                return
            hooks: dict[str, Any] = {}
            if metrics_port is not None:
                from kombu_delay.ops.metrics import serve_metrics

                try:
                    hooks = serve_metrics(store, metrics_port, metrics_addr)
                except OSError as exc:  # the port is taken, say
                    where = f"{metrics_addr}:{metrics_port}"
                    raise click.ClickException(f"cannot serve metrics on {where}: {exc}") from exc
            running.append(Mover(store, settings, name=name, **hooks))
            if not stopping.is_set():
                running[0].run()
    except KombuDelayError as exc:  # a bad URL or option, credentials or ACL: waiting cannot fix it
        raise click.ClickException(tgt.redact(str(exc))) from exc


main.add_command(health)


# Inspection and control: stats, ls, cancel, reschedule, purge.
from kombu_delay.cli.inspect import COMMANDS as _INSPECT  # noqa: E402  (kept next to its registration)

for _command in _INSPECT:
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    main()
