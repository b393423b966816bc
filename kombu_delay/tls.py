"""What a TLS connection's options may get wrong, told as what it is rather than as a Redis
that cannot be reached: a file they name that cannot be read, or that OpenSSL cannot use (a
configuration error, which trying again cannot mend), and a server certificate refused (which
the server may yet renew)."""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from typing import Any

from kombu_delay.errors import ConfigError

#: The options of redis-py's TLS connections that name a file (or, the last, a directory).
FILE_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")


def check_files(options: Any) -> None:
    """Raise :class:`ConfigError` naming each file of the TLS ``options`` (kombu's ``ssl``:
    Celery's ``broker_use_ssl``, or the URL's query) that this process cannot read. redis-py
    told a missing CA file as "Error 2 connecting to host:port. No such file or directory.", a
    Redis that cannot be reached, and a mover tried again for ever."""
    if not isinstance(options, Mapping):
        return
    unread = []
    for name in FILE_OPTIONS:
        path = options.get(name)
        if not isinstance(path, str | bytes | os.PathLike) or not os.fspath(path):
            continue
        want_dir = name == "ssl_ca_path"
        found = os.path.isdir(path) if want_dir else os.path.isfile(path)
        if not (found and os.access(path, os.R_OK)):
            what = "no readable directory" if want_dir else "no readable file"
            unread.append(f"{name} {os.fsdecode(path)!r} ({what})")
    if unread:
        raise ConfigError(f"bad TLS option: {'; '.join(unread)}")
    _check_loads(options)


def _check_loads(options: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` where the files are there but OpenSSL cannot use them, as
    redis-py will load them: a CA file with no certificate in it, a key that is not the
    certificate's (told as a Redis that cannot be reached, and tried again for ever)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca_certs, ca_path = options.get("ssl_ca_certs"), options.get("ssl_ca_path")
    certfile, keyfile = options.get("ssl_certfile"), options.get("ssl_keyfile")
    try:
        if ca_certs or ca_path:
            context.load_verify_locations(cafile=ca_certs or None, capath=ca_path or None)
        if certfile:
            # (A key that needs a password and has none is refused here, not asked for.)
            password = options.get("ssl_password") or (lambda: b"")
            context.load_cert_chain(certfile, keyfile or None, password=password)
    except (ssl.SSLError, OSError, TypeError, ValueError) as exc:
        files = ", ".join(
            f"{name} {os.fsdecode(options[name])!r}" for name in FILE_OPTIONS if options.get(name)
        )
        raise ConfigError(f"bad TLS option: OpenSSL cannot use {files}: {exc}") from exc


#: What a connection closed in its TLS handshake reads as (a client certificate asked for, and
#: none given, or one the server does not trust: TLS 1.3 tells it, or the server just closes).
CLOSED_HANDSHAKE = (
    "certificate required",
    "ALERT_UNKNOWN_CA",
    "ALERT_BAD_CERTIFICATE",
    "EOF occurred in violation of protocol",
    "Connection reset by peer",
)

#: What a connection without TLS to a port that speaks it reads as: Redis closes it.
PLAIN_CLOSED = ("Connection reset by peer", "Connection closed by server")


def hint(conn: Any, exc: BaseException) -> str:
    """What the failure ``exc`` of the kombu connection ``conn`` may mean over TLS: a timeout, a
    port without TLS (which leaves the handshake unanswered); a certificate refused, options to
    check (tried again all the same: the server may renew it)."""
    if certificate_refused(exc):
        return " (the server's TLS certificate was refused: check ssl_ca_certs, and its name and dates)"
    over_tls = conn.ssl or str(conn.transport_cls).endswith("rediss")
    if over_tls and "Timeout connecting" in str(exc):
        return " (over TLS: a port that does not speak TLS leaves the handshake unanswered)"
    if over_tls and any(word in str(exc) for word in CLOSED_HANDSHAKE):
        return (
            " (over TLS: a server that asks for client certificates, tls-auth-clients, closes the "
            "connection of a client that gives none or one it does not trust: check ssl_certfile "
            "and ssl_keyfile)"
        )
    if not over_tls and any(word in str(exc) for word in PLAIN_CLOSED):
        return " (a port that speaks TLS closes a connection that does not: if it does, use delayrediss://)"
    return ""


def certificate_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (kombu's or redis-py's connection error) comes of the server's certificate
    refused: an unknown CA, a wrong name, an expired certificate."""
    seen: BaseException | None = exc
    for _ in range(8):  # (a chain of causes is short; one made into a loop must not hang)
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
