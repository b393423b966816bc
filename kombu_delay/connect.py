"""Open kombu-delay's store for a broker URL, through kombu itself.

Going through a kombu channel means URL parsing, TLS, ACL credentials and
Sentinel discovery work exactly as they do for the publisher.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import unquote

import redis
from kombu.connection import Connection
from kombu.exceptions import OperationalError
from kombu.transport import redis as kombu_redis

from kombu_delay import tls
from kombu_delay.config import Settings
from kombu_delay.errors import (
    AUTH_ERRORS,
    ConfigError,
    RedisAuthError,
    RedisPermissionError,
    RedisRefused,
    RedisUnavailable,
    coded_text,
    translated_errors,
    unavailable_text,
)
from kombu_delay.redact import (
    Redactor,
    mask_url,
    masked_uri,
    query_passwords,
    split_url,
    split_urls,
    url_secrets,
)
from kombu_delay.store import Store
from kombu_delay.transport import register

logger = logging.getLogger(__name__)

#: Plain kombu schemes and the kombu-delay scheme that serves the same server.
DELAY_SCHEMES = {
    "redis": "delayredis",
    "rediss": "delayrediss",
    "sentinel": "delaysentinel",
    "redis+socket": "delayredis+socket",
}
#: Schemes that name a Redis server but publish without kombu-delay.
PLAIN_SCHEMES = frozenset(DELAY_SCHEMES)
#: Every scheme kombu-delay can work with (any case, as kombu reads them): the store is in Redis.
REDIS_SCHEMES = PLAIN_SCHEMES | frozenset(DELAY_SCHEMES.values())
#: What a refusal of another transport's URL suggests instead.
_NEEDS_REDIS = (
    "kombu-delay keeps its messages in Redis and needs a delayredis://, delayrediss://, "
    "delaysentinel:// or delayredis+socket:// URL (or redis://, rediss://, sentinel://, "
    "redis+socket:// of the same server)"
)


#: kombu reads ``+`` in a scheme as "transport + inner URL": ``redis+delay://host`` is plain
#: Redis on localhost:6379, its host ignored. These are the only ``+`` schemes that mean what
#: they say.
_PLUS_SCHEMES = frozenset({"redis+socket", "delayredis+socket"})
#: What cuts a user-info part short for kombu's URL parser (urllib's): the rest of the
#: password is read as the host, path, query or fragment.
_USERINFO_BREAKERS = "/#?"


def check_url(url: str) -> None:
    """Refuse a broker URL that kombu would silently or noisily misread, or that names another
    transport than Redis, with one line that names the problem and shows the URL with its
    password masked (:class:`ConfigError`)."""
    for one in split_urls(url):  # a ';' in a password: kombu would take it for the next URL's start
        parts = split_url(one)
        if any(";" in secret for secret in (parts.userinfo or "", *query_passwords(parts.rest))):
            raise ConfigError(
                f"broker URL {mask_url(one)}: the user name or password holds an unescaped ';', which kombu "
                'reads as the start of another URL; percent-encode it: urllib.parse.quote(password, safe="")'
            )
    for one in url.split(";"):
        scheme = one.partition("://")[0] if "://" in one else ""
        if "+" in scheme and scheme.lower() not in _PLUS_SCHEMES:
            raise ConfigError(
                f"broker URL {mask_url(one)}: kombu reads the '+' in {scheme!r} as transport "
                f"{scheme.split('+')[0]!r} plus an inner URL, so the host is not used as written "
                "(redis+delay://host is plain Redis on localhost:6379, with no delayed delivery); "
                "use delayredis:// (delayrediss://, delaysentinel://)"
            )
        _check_redis_scheme(one, scheme)
        userinfo = split_url(one).userinfo or ""
        found = [char for char in _USERINFO_BREAKERS if char in userinfo]
        if found:
            chars = " ".join(repr(char) for char in found)
            raise ConfigError(
                f"broker URL {mask_url(one)}: the user name or password holds an unescaped {chars}, which "
                'ends it early for kombu; percent-encode it: urllib.parse.quote(password, safe="")'
            )


def _check_redis_scheme(one: str, scheme: str) -> None:
    """Refuse one URL of a broker URL whose scheme is not Redis's: kombu would open its own
    transport (``memory://``, ``filesystem://``; with no scheme at all, AMQP), where
    kombu-delay has no store."""
    if scheme.lower() in REDIS_SCHEMES:
        return
    if not one.strip():
        raise ConfigError(f"the broker URL is empty: {_NEEDS_REDIS}")
    if not scheme:
        raise ConfigError(
            f"broker URL {mask_url(one)!r} has no scheme (kombu would read it as amqp://): {_NEEDS_REDIS}"
        )
    raise ConfigError(f"broker URL {mask_url(one)}: {scheme!r} is not a Redis scheme; {_NEEDS_REDIS}")


def delay_url(url: str) -> str:
    """Return ``url`` with a plain Redis scheme replaced by its kombu-delay scheme."""
    parts = []
    for one in url.split(";"):
        scheme, sep, rest = one.partition("://")
        parts.append(f"{DELAY_SCHEMES.get(scheme, scheme)}{sep}{rest}")
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
    #: Where ``url`` came from, as the commands say it (``--broker``, ``KOMBU_DELAY_BROKER``, ...).
    source: str = ""

    def describe(self) -> str:
        """``broker <URL, password masked> (<source>), key prefix '<prefix>'``."""
        where = f" ({self.source})" if self.source else ""
        prefix = self.transport_options.get("global_keyprefix") or ""
        return f"broker {mask_url(self.url)}{where}, key prefix {prefix!r}"

    def redact(self, text: str) -> str:
        """``text`` with this target's passwords (URL and options) masked."""
        return Redactor.for_url(self.url, self.transport_options)(text)

    def settings(self) -> Settings:
        settings = Settings.from_options(self.transport_options).with_values(**self.overrides)
        _check_look_ahead(settings, self.transport_options)
        return settings

    @contextmanager
    def open(self) -> Iterator[Store]:
        """Yield a :class:`Store` for this target, closing the connection afterwards."""
        with open_store(self.url, self.transport_options, ssl=self.ssl) as store:
            yield store


def _check_look_ahead(settings: Settings, options: Mapping[str, Any]) -> None:
    """Refuse a look-ahead not shorter than the ``visibility_timeout`` these options give
    (kombu's default where they give none): a worker that fetched a message that far ahead has
    it restored from its unacked set, and run again, before it is due."""
    timeout = options.get("visibility_timeout")
    timeout_s = kombu_redis.Channel.visibility_timeout if timeout is None else timeout
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not settings.look_ahead_ms:
        return  # (a timeout that is no number is refused where the connection is made)
    if settings.look_ahead_ms >= timeout_s * 1000:
        raise ConfigError(
            f"delay_look_ahead ({settings.look_ahead_ms / 1000:g} s) must be shorter than "
            f"visibility_timeout ({timeout_s:g} s), and far shorter than the workers': a worker holds "
            "a message moved ahead until it is due, and kombu restores it after visibility_timeout, "
            "so it runs again"
        )


#: The ``socket_timeout`` and ``socket_connect_timeout`` of a mover's and the CLI's connections
#: when the transport options set none (redis-py waits forever), seconds: every command they
#: send is bounded to tens of milliseconds of Redis's time, so a silent server is given up
#: on, reconnected to, and a stop is heard.
SOCKET_TIMEOUT_S = 10.0


def with_socket_timeouts(tgt: Target) -> Target:
    """``tgt`` with :data:`SOCKET_TIMEOUT_S` socket timeouts unless its transport options set
    their own: a Redis that accepts connections but never answers (stopped, or behind a
    black-holed network) fails a command instead of hanging it."""
    defaults = {"socket_timeout": SOCKET_TIMEOUT_S, "socket_connect_timeout": SOCKET_TIMEOUT_S}
    return replace(tgt, transport_options={**defaults, **tgt.transport_options})


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
    # Celery's environment variables win over the app's own settings: the source says which.
    if os.environ.get("CELERY_BROKER_WRITE_URL"):
        source = "CELERY_BROKER_WRITE_URL, the Celery app's broker_write_url"
    elif conf.get("broker_write_url"):
        source = "the Celery app's broker_write_url"
    elif os.environ.get("CELERY_BROKER_URL"):
        source = "CELERY_BROKER_URL (which celery -b sets), the Celery app's broker_url"
    else:
        source = "the Celery app's broker_url"
    return Target(str(url), dict(conf.broker_transport_options or {}), ssl=conf.broker_use_ssl, source=source)


#: Where kombu's refusal of a keyword comes from: the URL's query, which it takes as its own arguments.
_QUERY_HINT = " (a URL's query takes kombu's connection arguments only: give options with -o NAME=VALUE)"


def connection(url: str, transport_options: Mapping[str, Any] | None = None, ssl: Any = None) -> Connection:
    """Return a kombu :class:`~kombu.Connection` to the kombu-delay transport of ``url``
    (not yet connected); a URL kombu cannot read, or would misread, raises :class:`ConfigError`.
    No exception raised here quotes a password."""
    register()
    check_url(url)
    check_options(transport_options or {})
    with Redactor.for_url(url, transport_options).scrubbing():
        try:
            options = dict(transport_options or {})
            return Connection(delay_url(url), transport_options=options, ssl=False if ssl is None else ssl)
        except (KeyError, ValueError, TypeError) as exc:  # an unknown scheme, a bad port or database
            hint = _QUERY_HINT if "keyword argument" in str(exc) else ""
            if isinstance(exc, KeyError) and f"ssl_cert_reqs={exc.args[0]}" in unquote(url):  # (kombu's)
                hint = ": ssl_cert_reqs takes required, optional or none (or CERT_REQUIRED, ...)"
            raise ConfigError(f"bad broker URL {mask_url(url)}: {exc}{hint}") from exc


def _redactor(conn: Connection) -> Redactor:
    """The passwords a kombu connection knows: its own, its alternates' and its options'."""
    found = [str(conn.password)] if isinstance(conn.password, str) else []
    urls = [one for one in conn.alt or [] if isinstance(one, str)]
    return Redactor(found + url_secrets(";".join(urls), conn.transport_options))


def default_channel(conn: Connection, at_once: bool = False) -> Any:
    """Return ``conn.default_channel``, with every failure as a kombu-delay error:
    refused credentials :class:`RedisAuthError`, an ACL refusal :class:`RedisPermissionError`,
    another refusal (a database number the server lacks) :class:`RedisRefused`, a transport
    option redis-py cannot use :class:`ConfigError`, and anything else :class:`RedisUnavailable`.
    A connection of another transport than Redis (a kombu :class:`~kombu.Connection` to
    ``memory://`` handed to :class:`~kombu_delay.DelayControl`) raises :class:`ConfigError`.
    No exception raised here quotes a password.

    ``at_once``: try each of the broker's URLs once, without kombu's own retries, which spend
    about 6 s (its ``connect_timeout``) on a closed port or a wrong password before they
    tell; for connections of kombu-delay's own, whose callers retry (a mover, with its
    back-off) or report (the CLI)."""
    with _redactor(conn).scrubbing(), translated_errors():
        try:
            if not issubclass(conn.transport.Channel, kombu_redis.Channel):
                raise ConfigError(f"a kombu connection of transport {conn.transport_cls!r}: {_NEEDS_REDIS}")
            if at_once:  # kombu moves on to the next URL after each failure, with no pause
                conn.ensure_connection(max_retries=max(len(conn.alt or ()), 1) - 1)
            return conn.default_channel
        except OperationalError as exc:  # kombu re-raises redis-py's connection errors as its own
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, AUTH_ERRORS):  # before ConnectionError, of which it is one
                raise RedisAuthError(f"Redis authentication failed: {exc}") from exc
            if isinstance(cause, redis.exceptions.NoPermissionError):
                raise RedisPermissionError(f"Redis's ACL refused this user: {exc}") from exc
            if isinstance(cause, redis.ResponseError):
                raise RedisRefused(f"Redis refused the connection: {coded_text(cause)}") from exc
            raise RedisUnavailable(
                f"Redis is unavailable: {unavailable_text(exc)}{tls.hint(conn, exc)}"
            ) from exc
        except ConfigError:
            raise
        except (ValueError, TypeError, ImportError) as exc:  # redis-py setting up a socket, say
            # ``socket_timeout=abc``; kombu importing a ``queue_order_strategy`` by its name
            raise ConfigError(f"bad broker URL or option: {_not_numbers(conn)}{exc}") from exc


#: kombu's and redis-py's transport options that take a number (or none).
NUMBER_OPTIONS = (
    "socket_timeout",
    "socket_connect_timeout",
    "max_connections",
    "health_check_interval",
    "visibility_timeout",
    "polling_interval",
)


#: The longest ``socket_timeout`` or ``socket_connect_timeout`` accepted, seconds.
MAX_SOCKET_TIMEOUT_S = 365 * 86_400


def check_options(options: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` for a transport option that redis-py or kombu would take and
    then fail on, far from where it was given: a key prefix that is not text (a traceback at
    the first key), a socket timeout of zero or less (a non-blocking socket: every command
    fails as "unavailable"), a pool size that is not a whole number."""
    prefix = options.get("global_keyprefix")
    if prefix is not None and not isinstance(prefix, str):
        raise ConfigError(f"global_keyprefix must be text, got {prefix!r}")
    for name in ("socket_timeout", "socket_connect_timeout"):
        value = options.get(name)
        # (False is 0; past a year, Python's sockets overflow their clock, at 1e10 s)
        if isinstance(value, bool) or (
            isinstance(value, int | float) and not 0 < value <= MAX_SOCKET_TIMEOUT_S
        ):
            raise ConfigError(
                f"{name} must be a number of seconds above 0 and at most {MAX_SOCKET_TIMEOUT_S} (a year; "
                f"or unset: no limit), got {value!r}"
            )
    pool = options.get("max_connections")
    if isinstance(pool, float):
        raise ConfigError(f"max_connections must be a whole number, got {pool!r}")
    ignored = [name for name in ("username", "password") if options.get(name) is not None]
    if ignored:  # (kombu reads them from the URL only; the connection then fails "NOAUTH")
        logger.warning(
            "kombu-delay: kombu's Redis transport does not read the transport option %s: give it in "
            "the broker URL (delayredis://user:password@host:port/db)",
            " or ".join(repr(name) for name in ignored),
        )


def _not_numbers(conn: Connection) -> str:
    """The options of ``conn`` that take a number and were given another value, named for an
    error that redis-py gives without a name ("'str' object cannot be interpreted as an
    integer"), or ``""``."""
    options = conn.transport_options or {}
    named = [
        f"{key}={options[key]!r}"
        for key in NUMBER_OPTIONS
        if isinstance(options.get(key), bool | str | bytes | list | dict)
    ]
    return f"{', '.join(named)} ({'takes' if len(named) == 1 else 'take'} a number): " if named else ""


#: A Redis Cluster hash tag: the text between the first ``{`` and the next ``}``, not empty.
HASH_TAG = re.compile(r"^[^{]*\{[^}]+\}")


def store_of(channel: Any) -> Store:
    """The :class:`Store` of a kombu Redis channel: a kombu-delay channel's own, or for a
    plain ``redis://`` one, a store on its pool (same server, same keys)."""
    found: Store | None = getattr(channel, "delay_store", None)
    if found is None:
        client = redis.Redis(connection_pool=channel.pool)
        found = Store(client, channel.global_keyprefix, str(channel.sep), steps=channel.priority_steps)
    _refuse_cluster(found, masked_uri(channel.connection.client))
    return found


@contextmanager
def open_store(
    url: str, transport_options: Mapping[str, Any] | None = None, ssl: Any = None
) -> Iterator[Store]:
    """Yield the :class:`Store` of the kombu-delay data behind ``url``."""
    conn = connection(url, transport_options, ssl)
    try:
        channel = default_channel(conn, at_once=True)
        # kombu checked the server on a connection of the pool it publishes and consumes from,
        # which a store never uses: it held one of Redis's maxclients places, idle, for the
        # life of each mover.
        channel.async_pool.disconnect(inuse_connections=False)
        yield store_of(channel)
    finally:
        conn.release()


def _refuse_cluster(store: Store, where: str) -> None:
    """Refuse a node of a Redis Cluster, with one line: a script reads and writes many keys,
    which a cluster allows only in one hash slot, and every command of the others would be
    answered with a redirect. A key prefix with a hash tag (``{app1}:``) puts every key in one
    slot: that works while this node holds it, unsupported, told in a WARNING."""
    if not store.in_cluster():
        return
    if HASH_TAG.search(store.prefix):
        logger.warning(
            "kombu-delay: %s is a node of a Redis Cluster, which kombu-delay does not support; the "
            "key prefix %r puts every key in one hash slot, which works only while this node holds it",
            where,
            store.prefix,
        )
        return
    raise ConfigError(
        f"{where} is a node of a Redis Cluster, which kombu-delay does not support (nor does "
        "kombu's Redis transport): use a standalone Redis, or Sentinel (delaysentinel://)"
    )
