"""``python -m kombu_delay`` is the ``kombu-delay`` command."""

from kombu_delay.cli import main

main(prog_name="kombu-delay")
