"""kombu-delay: delayed delivery for Celery and kombu on Redis.

Importing this package registers the ``delayredis://``, ``delayrediss://`` and
``delaysentinel://`` broker URL schemes with kombu.
"""

from __future__ import annotations

from kombu_delay.config import Settings
from kombu_delay.control import DelayControl, Page, ScheduledMessage, Slot, Stats
from kombu_delay.errors import (
    BadETA,
    ConfigError,
    DelayTooLong,
    KombuDelayError,
    PayloadTooLarge,
    RedisAuthError,
    RedisPermissionError,
    RedisRefused,
    RedisUnavailable,
    StorageFormatError,
)
from kombu_delay.transport import register

__version__ = "0.3.0"

register()

__all__ = [
    "BadETA",
    "ConfigError",
    "DelayControl",
    "DelayTooLong",
    "KombuDelayError",
    "Page",
    "PayloadTooLarge",
    "RedisAuthError",
    "RedisPermissionError",
    "RedisRefused",
    "RedisUnavailable",
    "ScheduledMessage",
    "Settings",
    "Slot",
    "Stats",
    "StorageFormatError",
    "__version__",
    "register",
]
