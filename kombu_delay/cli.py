"""The ``kombu-delay`` command line: a thin noun-verb layer over the mover and the store.

Subcommands find their broker through :class:`~kombu_delay.connect.Target`, stored
as the click context object, so the same commands serve ``kombu-delay ...`` and
``celery -A proj delay ...``.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import threading
from typing import Any

import click

from .connect import Target
from .demo import demo
from .errors import KombuDelayError
from .health import health
from .mover import Mover, mover_id, open_when_reachable

BROKER_ENV = "KOMBU_DELAY_BROKER"


#: ``-o`` words that stand for Python constants (any case), as in Celery's and kombu's config.
OPTION_WORDS: dict[str, Any] = {"true": True, "false": False, "none": None}

#: kombu and redis-py options whose values are names, kept as typed: ``-o
#: global_keyprefix=0123`` is the prefix ``0123``, not the number 123.
STRING_OPTIONS = frozenset(
    {"global_keyprefix", "master_name", "sep", "client_name", "username", "password", "queue_order_strategy"}
)


def option_value(text: str) -> Any:
    """Type one ``-o`` value: ``true``/``false``/``none`` (any case), an integer or a finite
    decimal number become that Python value; anything else stays a string.

    redis-py and kombu want ``socket_timeout=5`` as a number and ``max_connections=20`` as
    an int, as they would get them from ``broker_transport_options``.
    """
    if text.lower() in OPTION_WORDS:
        return OPTION_WORDS[text.lower()]
    for kind in (int, float):
        try:
            number = kind(text)
        except ValueError:
            continue
        if math.isfinite(number):
            return number
    return text


def parse_option(values: tuple[str, ...]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--transport-option")
        key = key.strip()
        options[key] = value if key in STRING_OPTIONS else option_value(value)
    return options


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--broker",
    "-b",
    envvar=[BROKER_ENV, "CELERY_BROKER_URL"],
    default="delayredis://localhost:6379/0",
    show_default=True,
    help=f"Broker URL (env {BROKER_ENV} or CELERY_BROKER_URL). "
    "redis://, rediss://, sentinel:// and redis+socket:// are accepted too.",
)
@click.option("--prefix", default=None, help="kombu's global_keyprefix, as the publisher sets it.")
@click.option(
    "--transport-option",
    "-o",
    "transport_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="A broker_transport_options entry (repeatable), e.g. -o master_name=mymaster "
    "-o socket_timeout=5. Integers and decimals become numbers, true/false/none (any case) "
    "become True/False/None; any other VALUE is a string.",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
)
@click.pass_context
def main(
    ctx: click.Context, broker: str, prefix: str | None, transport_options: tuple[str, ...], log_level: str
) -> None:
    """kombu-delay: delayed delivery for Celery on Redis.

    \b
    Examples:
      kombu-delay --broker delayredis://localhost:6379/0 mover
      kombu-delay -b redis://cache:6379/1 --prefix myapp: stats
    """
    setup_logging(log_level)
    options = parse_option(transport_options)
    if prefix is not None:
        options["global_keyprefix"] = prefix
    if ctx.obj is None:
        ctx.obj = Target(broker, options)


def target(ctx: click.Context) -> Target:
    found = ctx.find_object(Target)
    if found is None:  # pragma: no cover - both entry points set it
        raise click.UsageError("no broker given")
    return found


@main.command()
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


def run_mover(tgt: Target, metrics_port: int | None = None, metrics_addr: str = "127.0.0.1") -> None:
    """Run a mover in the foreground with signal handling; shared by both CLIs."""
    try:
        settings = tgt.settings()
    except KombuDelayError as exc:
        raise click.UsageError(str(exc)) from exc
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
                from .metrics import serve_metrics

                try:
                    hooks = serve_metrics(store, metrics_port, metrics_addr)
                except OSError as exc:  # the port is taken, say
                    where = f"{metrics_addr}:{metrics_port}"
                    raise click.ClickException(f"cannot serve metrics on {where}: {exc}") from exc
            running.append(Mover(store, settings, name=name, **hooks))
            if not stopping.is_set():
                running[0].run()
    except KombuDelayError as exc:  # a bad URL or option, credentials or ACL: waiting cannot fix it
        raise click.ClickException(str(exc)) from exc


main.add_command(health)

main.add_command(demo)

# Inspection and control: stats, ls, cancel, reschedule, purge.
from .cmd_inspect import COMMANDS as _INSPECT  # noqa: E402  (kept next to its registration)

for _command in _INSPECT:
    main.add_command(_command)

from .bench import bench as _bench  # noqa: E402  (kept next to its registration)

main.add_command(_bench)

if __name__ == "__main__":  # pragma: no cover
    main()
