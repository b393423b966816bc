"""A minimal Celery project on kombu-delay: ``celery -A proj worker`` as usual."""

from .celery import app

__all__ = ["app"]
