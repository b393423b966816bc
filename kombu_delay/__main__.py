"""``python -m kombu_delay`` is the ``kombu-delay`` command."""

from .cli import main

main(prog_name="kombu-delay")
