"""``celery -A proj delay ...``: the kombu-delay commands, configured from the Celery app.

Celery imports this module (a ``celery.commands`` entry point) at the start of
every ``celery`` command, which also registers the ``delay*`` URL schemes, so
``celery worker``, ``call``, ``purge`` and ``inspect`` accept them with no
import in user code.
"""

from __future__ import annotations

from typing import Any

import click

from kombu_delay.cli import EXTRAS
from kombu_delay.cli.common import (
    LOG_FILTER,
    LOG_LEVELS,
    RedactingGroup,
    global_options,
    setup_logging,
    target,
)
from kombu_delay.cli.health import health
from kombu_delay.cli.inspect import COMMANDS as INSPECT_COMMANDS
from kombu_delay.cli.lookup import COMMANDS as LOOKUP_COMMANDS
from kombu_delay.cli.mover import run_tuned, tuning_options
from kombu_delay.connect import PLAIN_SCHEMES, app_target, check_url
from kombu_delay.errors import KombuDelayError
from kombu_delay.mover import embedded as _embedded  # noqa: F401  (connects the delay_embedded_mover hook)
from kombu_delay.redact import Redactor, mask_url
from kombu_delay.transport import register

register()


def app_broker_warning(url: str) -> str | None:
    """What to tell the user about an app broker URL that is plain Redis, else ``None``."""
    schemes = {one.partition("://")[0].lower() for one in url.split(";")}
    if not schemes & PLAIN_SCHEMES:
        return None
    return (
        f"kombu-delay: the Celery app's broker URL {mask_url(url)} is plain Redis: its publishers "
        "send ETA and countdown tasks straight to the workers, which hold them in memory. Only "
        "messages published through delayredis:// (delayrediss://, delaysentinel://) wait in Redis; "
        "set broker_url to that scheme (and import kombu_delay where the app publishes)."
    )


@click.group(name="delay", cls=RedactingGroup, lazy=EXTRAS)
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
    setup_logging(log_level)
    app: Any = ctx.obj.app
    try:
        tgt = app_target(app)
    except KombuDelayError as exc:
        raise click.UsageError(str(exc)) from exc
    LOG_FILTER.redactor = Redactor.for_url(tgt.url, tgt.transport_options)
    try:
        check_url(tgt.url)
    except KombuDelayError as exc:  # its text starts "broker URL <masked>: ..."
        raise click.UsageError(f"the Celery app's {exc}") from exc
    ctx.obj = tgt
    warning = app_broker_warning(tgt.url)
    if warning:
        click.echo(warning, err=True)


@global_options
@delay.command()
@tuning_options
@click.pass_context
def mover(ctx: click.Context, /, **flags: Any) -> None:
    """Move due messages onto their queues, with the app's broker URL and options.

    \b
    Examples:
      celery -A proj delay mover
      celery -A proj delay mover --metrics-port 9808
      celery -A proj delay mover --max-rate 5000
    """
    run_tuned(target(ctx), **flags)


# What --broker falls back to here (cli.common.BrokerOption): the app's, not the environment.
delay.broker_fallback = "else the Celery app's broker_write_url or broker_url"  # type: ignore[attr-defined]

for _command in (health, *INSPECT_COMMANDS, *LOOKUP_COMMANDS):
    delay.add_command(_command)
