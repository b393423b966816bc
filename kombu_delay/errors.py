"""The exception tree of kombu-delay."""

from __future__ import annotations

import redis


class KombuDelayError(Exception):
    """Base class of every error kombu-delay raises."""


class ConfigError(KombuDelayError, ValueError):
    """An option has a bad value; the message names the option."""


class BadETA(KombuDelayError, ValueError):
    """A message's ETA or ``x-delay`` cannot be used; it is delivered at once."""


class DelayTooLong(KombuDelayError, ValueError):
    """The ETA is further out than ``max_delay`` (or the year-2109 ceiling) allows."""


class RedisUnavailable(KombuDelayError, redis.ConnectionError):
    """Redis could not be reached. Also a ``redis.ConnectionError``, so kombu's
    and Celery's connection-retry policies treat it as a connection error."""


class RedisAuthError(KombuDelayError, redis.AuthenticationError):
    """Redis refused the credentials: a wrong password or user name, a missing password, or
    a disabled user. Retrying cannot help, so the mover stops with this error. Also a
    ``redis.AuthenticationError``, so kombu and Celery treat it as they treat the same
    refusal of plain kombu's own connection."""


class RedisPermissionError(KombuDelayError, redis.exceptions.NoPermissionError):
    """Redis's ACL does not let this user run a command or touch a key that kombu-delay
    needs (``NOPERM``; the README's ACL line lists them). Retrying cannot help, so the mover
    stops with this error. Also a ``redis.exceptions.NoPermissionError``, as redis-py
    raises for the same refusal outside a script."""


class RedisRefused(KombuDelayError, redis.ResponseError):
    """Redis refused a write (``maxmemory`` reached under ``noeviction``, a read-only
    replica, a failed background save). Also a ``redis.ResponseError``, so it is one of
    kombu's ``channel_errors``, as the same refusal of plain kombu's ``LPUSH`` would be."""


class PayloadTooLarge(KombuDelayError, ValueError):
    """The message is larger than Redis accepts for one string (512 MB)."""


class CorruptMember(KombuDelayError, ValueError):
    """A stored compressed message cannot be restored (altered or truncated in Redis). The
    mover keeps it on the dead-letter list, counted, and never pushes it."""
