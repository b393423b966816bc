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
from .errors import ConfigError, RedisAuthError, RedisPermissionError, RedisRefused, RedisUnavailable
from .replies import AUTH_ERRORS, translated_errors
from .store import Store
from .transport import register

#: Plain kombu schemes and the kombu-delay scheme that serves the same server.
_DELAY_SCHEMES = {
    "redis": "delayredis",
    "rediss": "delayrediss",
    "sentinel": "delaysentinel",
    "redis+socket": "delayredis+socket",
}


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
    #: kombu's ``ssl`` connection argument: Celery's ``broker_use_ssl``.
    ssl: Any = None

    def settings(self) -> Settings:
        return Settings.from_options(self.transport_options).with_values(**self.overrides)

    @contextmanager
    def open(self) -> Iterator[Store]:
        """Yield a :class:`Store` for this target, closing the connection afterwards."""
        with open_store(self.url, self.transport_options, ssl=self.ssl) as store:
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
    return Target(str(url), dict(conf.broker_transport_options or {}), ssl=conf.broker_use_ssl)


def connection(url: str, transport_options: Mapping[str, Any] | None = None, ssl: Any = None) -> Connection:
    """Return a kombu :class:`~kombu.Connection` to the kombu-delay transport of ``url``
    (not yet connected); a URL kombu cannot read raises :class:`ConfigError`."""
    register()
    try:
        return Connection(
            delay_url(url), transport_options=dict(transport_options or {}), ssl=False if ssl is None else ssl
        )
    except (KeyError, ValueError, TypeError) as exc:  # an unknown scheme, a bad port or database
        raise ConfigError(f"bad broker URL: {exc}") from exc


def default_channel(conn: Connection) -> Any:
    """Return ``conn.default_channel``, with every failure as a kombu-delay error:
    refused credentials :class:`RedisAuthError`, an ACL refusal :class:`RedisPermissionError`,
    another refusal (a database number the server lacks) :class:`RedisRefused`, a transport
    option redis-py cannot use :class:`ConfigError`, and anything else :class:`RedisUnavailable`."""
    with translated_errors():
        try:
            return conn.default_channel
        except OperationalError as exc:  # kombu re-raises redis-py's connection errors as its own
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, AUTH_ERRORS):  # before ConnectionError, of which it is one
                raise RedisAuthError(f"Redis authentication failed: {exc}") from exc
            if isinstance(cause, redis.exceptions.NoPermissionError):
                raise RedisPermissionError(f"Redis's ACL refused this user: {exc}") from exc
            if isinstance(cause, redis.ResponseError):
                raise RedisRefused(f"Redis refused the connection: {exc}") from exc
            raise RedisUnavailable(f"Redis is unavailable: {exc}") from exc
        except (ValueError, TypeError) as exc:  # redis-py setting up a socket, say ``socket_timeout=abc``
            raise ConfigError(f"bad broker URL or option: {exc}") from exc


def store_of(channel: Any) -> Store:
    """The :class:`Store` of a kombu Redis channel: a kombu-delay channel's own, or for a
    plain ``redis://`` one, a store on its pool (same server, same keys)."""
    found: Store | None = getattr(channel, "delay_store", None)
    if found is None:
        found = Store(redis.Redis(connection_pool=channel.pool), channel.global_keyprefix, str(channel.sep))
    return found


@contextmanager
def open_store(
    url: str, transport_options: Mapping[str, Any] | None = None, ssl: Any = None
) -> Iterator[Store]:
    """Yield the :class:`Store` of the kombu-delay data behind ``url``."""
    conn = connection(url, transport_options, ssl)
    try:
        yield store_of(default_channel(conn))
    finally:
        conn.release()
