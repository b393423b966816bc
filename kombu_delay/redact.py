"""Keep passwords out of everything kombu-delay prints: find them in broker URLs, mask URLs, scrub text.

The functions are pure and lenient: they read URLs that kombu cannot parse (a password with
an unescaped ``/``, ``#`` or ``?``), because those are the URLs whose error messages quote a
part of the password. The CLI scrubs what it prints and logs with a :class:`Redactor`; the
library scrubs the exceptions it raises while connecting.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, unquote_plus

#: What stands in for a secret.
MASK = "****"
#: Pieces of a secret shorter than this are left alone: masking every "pa" would garble text
#: and tell nothing about the password's length or content. A whole secret that short (a
#: password "x", "0") is masked only where a URL holds a password: masked wherever it stands,
#: it garbled every line ("127.****.****.1", "without **** trace") and so told the secret.
MIN_FRAGMENT = 3
#: Where a URL holds a password: its user-info part (``scheme://[user:]secret@``), or a
#: ``password=`` in its query.
_IN_URL = r"(?:(?<=:)|(?<=//)){0}(?=@)|(?<=password=){0}(?=[&\s'\"]|$)"
#: Where URL parsers (and people) cut a password into pieces.
_DELIMITERS = re.compile(r"[/#?@:;&=%+\s]+")
#: A ``;`` that begins the next URL of a failover list (a scheme follows it). Any other ``;``
#: is inside a URL: in a password, unescaped (kombu cuts the URL there, and refuses it), it
#: is masked with the rest of the password.
_NEXT_URL = re.compile(r";(?=\s*[A-Za-z][A-Za-z0-9+.\-]*://)")
#: A host, an optional port and database, then a query: an ``@`` after this is inside the
#: query (say ``?ssl_ca_certs=/etc/x@y.pem``), not the end of a user-info part.
_QUERY_FIRST = re.compile(r"[^@/?#:]*(?::\d*)?(?:/\d*)?\?")


@dataclass(frozen=True)
class UrlParts:
    """One broker URL cut leniently: ``head`` + ``userinfo`` + ``@`` + ``rest``."""

    #: ``scheme://`` (empty when the text has no ``://``).
    head: str
    #: Everything between ``://`` and the last ``@``; ``None`` when there is no ``@``.
    userinfo: str | None
    #: Host, port, database and query.
    rest: str

    @property
    def user(self) -> str:
        """The user name (empty when the user-info part has no ``:``: all of it is secret)."""
        if self.userinfo is None or ":" not in self.userinfo:
            return ""
        return self.userinfo.partition(":")[0]

    @property
    def password(self) -> str:
        """What follows the first ``:`` of the user-info part, or all of it without one."""
        if self.userinfo is None:
            return ""
        user, colon, password = self.userinfo.partition(":")
        return password if colon else user


def split_url(one: str) -> UrlParts:
    """Cut one URL (no ``;``) into head, user-info and rest, whatever kombu would make of it."""
    scheme, sep, after = one.partition("://")
    head, body = (scheme + sep, after) if sep else ("", one)
    at = body.rfind("@")
    found = _QUERY_FIRST.match(body)
    if at < 0 or (found is not None and found.end() <= at and "=" in body[found.end() : at]):
        return UrlParts(head, None, body)
    return UrlParts(head, body[:at], body[at + 1 :])


def split_urls(url: str) -> list[str]:
    """The URLs of a failover list (``url1;url2``), each whole: a ``;`` not followed by a scheme
    stays in its URL."""
    return _NEXT_URL.split(url)


def query_passwords(rest: str) -> list[str]:
    """The values of ``password=`` in the query of a URL's ``rest`` (:class:`UrlParts`)."""
    _, mark, query = rest.partition("?")
    if not mark:
        return []
    found = []
    for pair in query.split("&"):
        key, equals, value = pair.partition("=")
        if equals and unquote_plus(key).strip().lower() == "password" and value:
            found.append(value)
    return found


def url_secrets(url: str, transport_options: Mapping[str, Any] | None = None) -> list[str]:
    """Return every password in ``url`` (each ``;``-separated URL: user-info and ``password=``
    in the query) and in ``transport_options`` (``password``, ``sentinel_kwargs.password``)."""
    found: list[str] = []
    for one in split_urls(url):
        parts = split_url(one)
        found.append(parts.password)
        found.extend(query_passwords(parts.rest))
    options = transport_options or {}
    sentinel = options.get("sentinel_kwargs")
    for value in (
        options.get("password"),
        sentinel.get("password") if isinstance(sentinel, Mapping) else None,
    ):
        if isinstance(value, str | bytes):
            found.append(value.decode(errors="replace") if isinstance(value, bytes) else value)
    return [secret for secret in found if secret]


def masked_uri(conn: Any) -> str:
    """kombu Connection ``conn``'s URL, every password masked (kombu's own ``as_uri()`` shows
    ``:**@`` even where there is none). kombu's fails on a ``virtual_host`` given as a number,
    which the connection itself takes: the URL is then made of its parts."""
    try:
        uri = conn.as_uri(include_password=True)
    except TypeError:
        uri = f"{conn.transport_cls}://{conn.hostname}:{conn.port}/{conn.virtual_host}"
    return mask_url(uri)


def mask_url(url: str) -> str:
    """Return ``url`` with every password shown as ``****``: ``scheme://user:****@host:port/db``,
    also for a URL that kombu cannot parse."""
    masked = []
    for one in split_urls(url):
        parts = split_url(one)
        rest = re.sub(r"(?i)((?:^|[?&])password=)[^&]*", rf"\g<1>{MASK}", parts.rest)
        if parts.userinfo is None:
            masked.append(parts.head + rest)
        else:
            user = f"{parts.user}:" if ":" in parts.userinfo else ""
            masked.append(f"{parts.head}{user}{MASK}@{rest}")
    return ";".join(masked)


def _pieces(secret: str) -> set[str]:
    """The secret as it may be printed (raw, percent-decoded or -encoded, repr'd), and the
    pieces of each form that URL parsers cut at delimiters."""
    forms = {secret, unquote(secret), unquote_plus(secret), quote(secret, safe=""), repr(secret)[1:-1]}
    forms.add(quote(unquote(secret), safe=""))
    pieces = {form for form in forms if form}
    for form in forms:
        pieces.update(piece for piece in _DELIMITERS.split(form) if len(piece) >= MIN_FRAGMENT)
    return pieces


class Redactor:
    """Replace secrets, their encoded forms and their fragments of 3 or more characters with
    ``****`` in any text (a secret shorter than that, only where a URL holds a password).
    Calling it on text is cheap; build one per set of secrets."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        pieces: set[str] = set()
        for secret in secrets:
            if secret:
                pieces.update(_pieces(secret))
        # Longest first, so that a whole password goes before its pieces do.
        ordered = sorted(pieces, key=lambda piece: (-len(piece), piece))
        parts = [
            re.escape(piece) if len(piece) >= MIN_FRAGMENT else _IN_URL.format(re.escape(piece))
            for piece in ordered
        ]
        self._pattern = re.compile("|".join(parts)) if parts else None

    @classmethod
    def for_url(cls, url: str, transport_options: Mapping[str, Any] | None = None) -> Redactor:
        """A redactor of the passwords of ``url`` and ``transport_options``."""
        return cls(url_secrets(url, transport_options))

    def __bool__(self) -> bool:
        return self._pattern is not None

    def __call__(self, text: str) -> str:
        return text if self._pattern is None else self._pattern.sub(MASK, text)

    @contextmanager
    def scrubbing(self) -> Iterator[None]:
        """Scrub the text arguments of any exception raised in the block, and of its causes,
        keeping types and chain, so that whoever prints it (or its traceback) prints no secret."""
        try:
            yield
        except Exception as exc:
            if self._pattern is not None:
                seen: set[int] = set()
                link: BaseException | None = exc
                while link is not None and id(link) not in seen:  # a chain can loop
                    seen.add(id(link))
                    link.args = tuple(self(arg) if isinstance(arg, str) else arg for arg in link.args)
                    link = link.__cause__ or link.__context__
            raise


class RedactingFilter(logging.Filter):
    """A logging filter that scrubs messages and tracebacks with its :attr:`redactor`. The CLI
    installs it on its log handlers; the library never configures logging."""

    def __init__(self) -> None:
        super().__init__()
        #: Replaced by the CLI once it knows the broker URL and options.
        self.redactor = Redactor()

    def filter(self, record: logging.LogRecord) -> bool:
        redact = self.redactor
        if not redact:
            return True
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True
