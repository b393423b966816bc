"""``celery -A proj delay ...``: the kombu-delay commands, configured from the Celery app.

Celery imports this module (a ``celery.commands`` entry point) at the start of
every ``celery`` command, which also registers the ``delay*`` URL schemes, so
``celery worker``, ``call``, ``purge`` and ``inspect`` accept them with no
import in user code.
"""

from __future__ import annotations

from typing import Any

import click

from . import cli
from . import embedded as _embedded  # noqa: F401  (connects the delay_embedded_mover hook)
from .cli_common import LOG_FILTER, LOG_LEVELS, RedactingGroup, global_options
from .connect import app_target
from .errors import KombuDelayError
from .health import health
from .redact import Redactor
from .transport import register

register()


@click.group(name="delay", cls=RedactingGroup)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
)
@click.pass_context
def delay(ctx: click.Context, log_level: str) -> None:
    """kombu-delay: the mover and inspection, with the app's broker settings.

    The broker is the app's broker_write_url or broker_url, and every option
    (global_keyprefix, master_name, delay_*) comes from broker_transport_options,
    so the mover always agrees with the app's publishers.

    \b
    Examples:
      celery -A proj delay mover
      celery -A proj delay health --max-overdue 60
      celery -A proj delay --log-level debug mover --metrics-port 9808
    """
    cli.setup_logging(log_level)
    app: Any = ctx.obj.app
    try:
        tgt = app_target(app)
    except KombuDelayError as exc:
        raise click.UsageError(str(exc)) from exc
    LOG_FILTER.redactor = Redactor.for_url(tgt.url, tgt.transport_options)
    ctx.obj = tgt


@global_options
@delay.command()
@click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics on this port.")
@click.option("--metrics-addr", default="127.0.0.1", show_default=True, help="Address for --metrics-port.")
@click.pass_context
def mover(ctx: click.Context, metrics_port: int | None, metrics_addr: str) -> None:
    """Move due messages onto their queues, with the app's broker URL and options.

    \b
    Examples:
      celery -A proj delay mover
      celery -A proj delay mover --metrics-port 9808
    """
    cli.run_mover(cli.target(ctx), metrics_port=metrics_port, metrics_addr=metrics_addr)


delay.add_command(health)


# Inspection and control: stats, ls, cancel, reschedule, purge.
from .cmd_inspect import COMMANDS as _INSPECT  # noqa: E402  (kept next to its registration)

for _command in _INSPECT:
    delay.add_command(_command)
