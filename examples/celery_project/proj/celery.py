"""The Celery app. The only kombu-delay-specific line is the import below."""

from celery import Celery

# Registers the delayredis:// scheme in this process. The `celery` command does this
# by itself (kombu-delay ships a `celery.commands` entry point), but a web process
# that only publishes tasks needs the import.
import kombu_delay  # noqa: F401

app = Celery("proj")
app.config_from_object("proj.celeryconfig")
