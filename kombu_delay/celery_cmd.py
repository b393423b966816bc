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
from .connect import Target
from .transport import register

register()


@click.group(name="delay")
@click.pass_context
def delay(ctx: click.Context) -> None:
    """kombu-delay: the mover and inspection, with the app's broker settings.

    \b
    Examples:
      celery -A proj delay mover
      celery -A proj delay stats
    """
    app: Any = ctx.obj.app
    conf = app.conf
    ctx.obj = Target(str(conf.broker_url), dict(conf.broker_transport_options or {}))


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
