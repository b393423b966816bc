"""Open kombu-delay's store for a broker URL, through kombu itself.

Going through a kombu channel means URL parsing, TLS, ACL credentials and
Sentinel discovery work exactly as they do for the publisher.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis
from kombu.connection import Connection
from kombu.exceptions import OperationalError

from .config import Settings
from .errors import ConfigError, RedisAuthError, RedisUnavailable
from .replies import AUTH_ERRORS, translated_errors
from .store import Store
from .transport import register

#: Plain kombu schemes and the kombu-delay scheme that serves the same server.
_DELAY_SCHEMES = {"redis": "delayredis", "rediss": "delayrediss", "sentinel": "delaysentinel"}


def delay_url(url: str) -> str:
    """Return ``url`` with a plain Redis scheme replaced by its kombu-delay scheme."""
    parts = []
    for one in url.split(";"):
        scheme, sep, rest = one.partition("://")
        parts.append(f"{_DELAY_SCHEMES.get(scheme, scheme)}{sep}{rest}")
    return ";".join(parts)


@dataclass
class Target:
    """Where the CLI works: a broker URL and transport options (CLI flags already merged)."""

    url: str
    transport_options: dict[str, Any] = field(default_factory=dict)
    #: ``--set`` style overrides of kombu-delay settings, user-facing units.
    overrides: dict[str, Any] = field(default_factory=dict)

    def settings(self) -> Settings:
        return Settings.from_options(self.transport_options).with_values(**self.overrides)

    @contextmanager
    def open(self) -> Iterator[Store]:
        """Yield a :class:`Store` for this target, closing the connection afterwards."""
        with open_store(self.url, self.transport_options) as store:
            yield store


def app_target(app: Any) -> Target:
    """Return the :class:`Target` of a Celery app: its broker URL and ``broker_transport_options``.

    The write URL is preferred (``broker_write_url``, else ``broker_url``, each
    honouring Celery's environment variables): the mover writes where publishers write.
    """
    conf = app.conf
    url: Any = conf.broker_write_url or conf.broker_url
    if isinstance(url, list | tuple):
        url = ";".join(str(one) for one in url)
    if not url:
        raise ConfigError("the Celery app has no broker_url")
    return Target(str(url), dict(conf.broker_transport_options or {}))


def default_channel(conn: Connection) -> Any:
    """Return ``conn.default_channel``; refused credentials raise :class:`RedisAuthError`,
    an unreachable server :class:`RedisUnavailable`, and another refusal (an ACL, say)
    kombu's own ``OperationalError``, whose message says it."""
    with translated_errors():
        try:
            return conn.default_channel
        except OperationalError as exc:  # kombu re-raises redis-py's connection errors as its own
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, AUTH_ERRORS):  # before ConnectionError, of which it is one
                raise RedisAuthError(f"Redis authentication failed: {exc}") from exc
            if isinstance(cause, redis.ConnectionError | redis.TimeoutError | OSError):
                raise RedisUnavailable(f"Redis is unavailable: {exc}") from exc
            raise


@contextmanager
def open_store(url: str, transport_options: Mapping[str, Any] | None = None) -> Iterator[Store]:
    """Yield the :class:`Store` of the kombu-delay data behind ``url``."""
    register()
    conn = Connection(delay_url(url), transport_options=dict(transport_options or {}))
    try:
        store: Store = default_channel(conn).delay_store
        yield store
    finally:
        conn.release()
