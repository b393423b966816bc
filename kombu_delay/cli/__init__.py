"""The ``kombu-delay`` command line: a thin noun-verb layer over the mover and the store.

One module per command family: :mod:`~kombu_delay.cli.mover`, :mod:`~kombu_delay.cli.health`,
:mod:`~kombu_delay.cli.inspect` (stats, ls, reschedule, purge) and
:mod:`~kombu_delay.cli.lookup` (find, cancel, dead), plus the tooling
(bench, demo), imported only when its command runs. Subcommands find their broker through
:class:`~kombu_delay.connect.Target`, stored as the click context object, so the same commands
serve ``kombu-delay ...`` and ``celery -A proj delay ...`` (:mod:`~kombu_delay.cli.celery_cmd`).
"""

from __future__ import annotations

import click

from kombu_delay import __version__
from kombu_delay.cli.common import RedactingGroup, global_options, setup_logging
from kombu_delay.cli.health import health
from kombu_delay.cli.inspect import COMMANDS as INSPECT_COMMANDS
from kombu_delay.cli.lookup import COMMANDS as LOOKUP_COMMANDS
from kombu_delay.cli.mover import mover

__all__ = ["main"]

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
@click.version_option(__version__, "--version", prog_name="kombu-delay", message="%(prog)s %(version)s")
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


for _command in (mover, health, *INSPECT_COMMANDS, *LOOKUP_COMMANDS):
    main.add_command(_command)
