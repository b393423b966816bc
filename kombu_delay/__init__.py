"""kombu-delay: delayed delivery for Celery and kombu on Redis.

Importing this package registers the ``delayredis://``, ``delayrediss://`` and
``delaysentinel://`` broker URL schemes with kombu.

The public API is what ``__all__`` names: :class:`Settings`, :class:`DelayControl` and the
types its results come in, the exception tree rooted at :class:`KombuDelayError`, and
:func:`register`. Names not in ``__all__`` are internal.
"""

from __future__ import annotations

from kombu_delay.config import Settings
from kombu_delay.control import DeadLetter, DelayControl, Page, ScheduledMessage, Slot, Stats
from kombu_delay.errors import (
    BadETA,
    ConfigError,
    CorruptMember,
    DelayTooLong,
    EditConflict,
    KombuDelayError,
    OverMaxmemory,
    PayloadTooLarge,
    ReadOnlyRefused,
    RedisAuthError,
    RedisPermissionError,
    RedisRefused,
    RedisUnavailable,
    StorageFormatError,
    WrongTypeKey,
)
from kombu_delay.transport import register

#: A development version between releases (PEP 440): what runs can always be told from the
#: release before it, as an upgrade's order needs (docs/upgrading.md).
__version__ = "1.1.0.dev0"

register()

__all__ = [
    "BadETA",
    "ConfigError",
    "CorruptMember",
    "DeadLetter",
    "DelayControl",
    "DelayTooLong",
    "EditConflict",
    "KombuDelayError",
    "OverMaxmemory",
    "Page",
    "PayloadTooLarge",
    "ReadOnlyRefused",
    "RedisAuthError",
    "RedisPermissionError",
    "RedisRefused",
    "RedisUnavailable",
    "ScheduledMessage",
    "Settings",
    "Slot",
    "Stats",
    "StorageFormatError",
    "WrongTypeKey",
    "__version__",
    "register",
]
