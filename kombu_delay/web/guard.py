"""What keeps the dashboard safe to expose: the Host allow-list, basic auth, CSRF tokens, and the
audit log of actions. The Host allow-list and CSRF stop web pages, not other clients: beyond a
loopback address, basic auth (or a proxy in front that asks for it) is what keeps others out,
and ``web`` refuses actions there without it (:func:`loopback_only`).

* Host allow-list: every request, static files included, must name in its ``Host`` header a
  host the dashboard answers to (see :func:`allowed_hosts_of`); others are refused with 400. A
  page of another site that rebinds its own name to the dashboard's address (DNS rebinding)
  sends its own name, so it can neither read the pages nor pass the ``Origin`` check below.
* Basic auth (optional): every request, static files included, needs the one user and password;
  a wrong one is told on the audit log (:class:`Refusals`).
* Other pages: a request another origin's page makes (an image, a fetch, a frame, a form), as
  the browser says in its ``Sec-Fetch-*`` headers, and a prefetch, are refused with 403 before
  they cost Redis anything (:func:`from_another_page`); a link followed from another site is
  served.
* CSRF: a random token in a ``SameSite=Lax``, ``HttpOnly`` cookie, which every POST must also
  carry as the form field ``csrf`` (a page of another site can make the browser send the cookie,
  but cannot read it to fill in the field); a POST whose ``Origin`` names another host, or is
  ``null``, is refused as well.
* Audit: every state-changing request is logged on ``kombu_delay.web.audit`` at WARNING, with
  who (the basic-auth user, else ``-``), from where, what, and the outcome; what the request
  chose is escaped (``%r``), so no value can start a line of its own. Refusals are paced, each
  reason apart (:class:`Refusals`).
"""

from __future__ import annotations

import base64
import hmac
import ipaddress
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import flask
from flask import Request, Response

from kombu_delay.message import shown

#: How often, at most, refusals of one kind are told, seconds (see :class:`Refusals`).
TOLD_EVERY_S = 10.0
#: Kinds of refusal paced apart (logins, and refused POSTs by reason); past these many, the
#: others share one pace.
MAX_REASONS = 32
#: Name of the cookie that carries the CSRF token.
CSRF_COOKIE = "kombu_delay_csrf"
#: Name of the form field every POST must carry the token in.
CSRF_FIELD = "csrf"
#: Environment variable read for ``--auth`` when the flag is not given.
AUTH_ENV = "KOMBU_DELAY_WEB_AUTH"
#: The names a dashboard bound to a loopback address (or to every address) answers to.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
#: ``--allowed-host`` value that lets any ``Host`` through (unsafe without basic auth).
ANY_HOST = "*"
#: A host name or IPv4 address, as a ``Host`` header or ``--allowed-host`` gives it.
_NAME = re.compile(r"[a-z0-9_.-]+", re.ASCII)
#: The ``Host`` header: a name or a bracketed IPv6 address, then maybe a port.
_HOST = re.compile(r"([a-z0-9_.-]+|\[[0-9a-f:.]+\])(?::[0-9]{1,5})?", re.ASCII)

audit = logging.getLogger("kombu_delay.web.audit")


@dataclass(frozen=True)
class Credentials:
    """The one user and password of HTTP basic auth."""

    user: str
    password: str

    @classmethod
    def parse(cls, text: str) -> Credentials:
        """Read ``user:password`` (the password may hold colons); raise ``ValueError`` otherwise."""
        user, sep, password = text.partition(":")
        if not sep or not user or not password:
            raise ValueError("expected USER:PASSWORD, both non-empty")
        return cls(user, password)

    def check(self, header: str | None) -> bool:
        """True when an ``Authorization`` header carries these credentials (constant-time)."""
        if not header or not header.lower().startswith("basic "):
            return False
        try:
            raw = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8")
        except ValueError:  # binascii.Error, UnicodeDecodeError, and a header that is not ASCII
            return False
        user, _, password = raw.partition(":")
        same_user = hmac.compare_digest(user.encode(), self.user.encode())
        same_password = hmac.compare_digest(password.encode(), self.password.encode())
        return same_user and same_password


def host_name(text: str) -> str:
    """One ``--allowed-host`` value (or a ``--host`` address) as the allow-list holds it: lower case,
    an IPv6 address in brackets; :data:`ANY_HOST` as it is. ``ValueError`` for anything else, a
    port too (any port is allowed: the name is what a rebinding page cannot choose)."""
    name = text.strip().lower()
    if name == ANY_HOST:
        return name
    try:
        address = ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
    except ValueError:
        address = None
    if address is not None:
        return f"[{address.compressed}]" if address.version == 6 else address.compressed
    if _NAME.fullmatch(name) and not name.startswith(".") and ".." not in name:
        return name
    raise ValueError(f"{text!r} is not a host name or address (give it without scheme, port or path)")


def allowed_hosts_of(bound: str, given: Iterable[str] = ()) -> frozenset[str]:
    """The names a dashboard listening on ``bound`` (``--host``) answers to: those ``given``
    (``--allowed-host``, read by :func:`host_name`), ``bound`` itself unless it is every
    address (``0.0.0.0``, ``::``), and the loopback names when it is a loopback address or
    every address."""
    names = {host_name(name) for name in given}
    try:
        own = host_name(bound or "0.0.0.0")
    except ValueError:  # no address anyone can listen on: serving fails before any request
        return frozenset(names)
    address = _address_of(own)
    # Every address (0.0.0.0, ::) includes loopback; no browser asks for it by that address, so
    # the names it is reached by otherwise are those given.
    loopback_or_any = address is not None and (address.is_loopback or address.is_unspecified)
    if own in ("localhost", ANY_HOST) or loopback_or_any:
        names.update(LOOPBACK_HOSTS)
    if own != ANY_HOST and not (address is not None and address.is_unspecified):
        names.add(own)  # (127.0.0.2, say: the address the URL it prints names)
    return frozenset(names)


def loopback_only(bound: str) -> bool:
    """Whether a dashboard listening on ``bound`` (``--host``) can be reached from this machine
    only: a loopback address, or ``localhost``. Any other name is taken for one others reach."""
    try:
        own = host_name(bound or "0.0.0.0")
    except ValueError:
        return False
    if own.rstrip(".") == "localhost":
        return True
    address = _address_of(own)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address is not None and (address.is_loopback or bool(mapped and mapped.is_loopback))


def _address_of(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host name (as :func:`host_name` gives it) is, or ``None`` for a name."""
    try:
        return ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None


def url_host(bound: str) -> str:
    """The host a URL for a dashboard listening on ``bound`` (``--host``) names: one it answers
    to (see :func:`allowed_hosts_of`), a loopback address in place of every address."""
    address = _address_of(bound)
    if address is not None and address.is_unspecified:
        return "[::1]" if address.version == 6 else "127.0.0.1"
    return "[" + bound + "]" if ":" in bound else bound


def from_another_page(request: Request) -> bool:
    """Whether the browser says another origin's page made this request, other than to open
    the dashboard in a window or tab of its own: its ``Sec-Fetch-Site`` is ``cross-site`` or
    ``same-site`` (another port of the same host is that), and it is no GET of a top-level
    document (an image, a script, a fetch, a frame, a form's POST). Such a request cannot
    read the reply, but each made Redis work: three images or frames on any page of the web
    made the browser of whoever opened it run a listing of every bucket, and read a hundred
    megabytes of dead letters. A prefetch or prerender (``Sec-Purpose``) is refused too,
    wherever it comes from: no one asked to see that page yet. A browser that sends no such
    header (an old one, or any over plain HTTP to a name other than loopback), and a client
    that is no browser, are let through: the Host allow-list and basic auth still apply."""
    if "prefetch" in request.headers.get("Sec-Purpose", ""):
        return True
    opening = (
        request.method == "GET"
        and request.headers.get("Sec-Fetch-Mode") == "navigate"
        and request.headers.get("Sec-Fetch-Dest") == "document"
    )
    return request.headers.get("Sec-Fetch-Site") in ("cross-site", "same-site") and not opening


def host_allowed(host: str, allowed: frozenset[str]) -> bool:
    """Whether a request's ``Host`` (``name``, ``name:port``, ``[v6]:port``; any port) names a
    host in ``allowed`` (:func:`allowed_hosts_of`)."""
    if ANY_HOST in allowed:
        return True
    found = _HOST.fullmatch(host.strip().lower())
    try:
        return found is not None and host_name(found.group(1)) in allowed
    except ValueError:
        return False


def printable(text: str) -> str:
    """``text`` quoted and escaped as ``%r`` writes it: a newline or any other control character
    in it cannot start a line of the log of its own; and cut as :func:`shown` cuts it (a header
    of any length, sent with no password, makes no longer line)."""
    return shown(text)


def header_text(value: str) -> str:
    """A header's text as its client sent it: WSGI reads a header's bytes as Latin-1, so UTF-8
    ones (a name, a right-to-left mark) came out garbled; they are read as UTF-8 where they are."""
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


def new_token() -> str:
    """A fresh CSRF token."""
    return secrets.token_urlsafe(32)


def csrf_problem(request: Request) -> str | None:
    """Why a state-changing request fails the CSRF check, or ``None`` when it passes."""
    cookie = request.cookies.get(CSRF_COOKIE, "")
    sent = request.form.get(CSRF_FIELD, "")
    if not cookie or not sent:
        return "the form carries no CSRF token (reload the page and try again)"
    # (Read as the form's other fields are, a token may hold a lone surrogate: no token does.)
    if not hmac.compare_digest(cookie.encode(errors="surrogatepass"), sent.encode(errors="surrogatepass")):
        return "the form's CSRF token does not match this browser's (reload the page and try again)"
    # A browser sends Origin with every POST; a client without one (curl, a script) is no page
    # of another site, and still needs the token from the cookie, so it may go on. "null" is
    # what a browser sends from a sandboxed frame, a data: URL or a file: page: any site can
    # make one, so it is refused.
    origin = request.headers.get("Origin")
    if origin is not None and (origin == "null" or urlsplit(origin).netloc != request.host):
        return f"the request comes from another origin ({origin!r})"
    return None


def who(request: Request, user: str | None) -> str:
    """``user@address`` of a request, for the audit log. ``user``: the basic-auth user once its
    password was checked, else ``None`` (written ``-``); a name in an ``Authorization`` header
    of a dashboard without auth is no one's. The user and ``X-Forwarded-For`` (which any client
    may send) are escaped with :func:`printable`."""
    forwarded = request.headers.get("X-Forwarded-For")
    where = request.remote_addr or "?"
    if forwarded is not None:
        where += f" (forwarded for {printable(header_text(forwarded))})"
    return f"{printable(user) if user is not None else '-'}@{where}"


def requester() -> str:
    """:func:`who` made the request in hand, the user only where basic auth checked it."""
    return who(flask.request, flask.g.get("user"))


class Refusals:
    """Refusals told on a dashboard's audit log, each kind paced apart: the first at once, then
    at most one line each :data:`TOLD_EVERY_S` with how many came meanwhile, so a client that
    guesses passwords or loops refused POSTs (some thousand a second over one connection) is
    seen, and floods no log. The kinds: a wrong basic-auth user or password (not none, as a
    browser's first request sends), and a refused POST, by its reason (what a reason quotes,
    an origin, left out; past :data:`MAX_REASONS` kinds, the others share one pace)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._paces: dict[str, tuple[float, int]] = {}  # kind -> (told at, refused since)

    def _count(self, kind: str) -> int:
        """Count a refusal of ``kind``; return how many to tell now (this one included), or 0."""
        with self._lock:
            if kind not in self._paces and len(self._paces) >= MAX_REASONS:
                kind = "others"
            told_at, untold = self._paces.get(kind, (float("-inf"), 0))
            now = self._clock()
            if now - told_at < TOLD_EVERY_S:
                self._paces[kind] = (told_at, untold + 1)
                return 0
            self._paces[kind] = (now, 0)
            return untold + 1

    def login(self, request: Request) -> None:
        """Tell a request whose basic-auth user or password was wrong."""
        count = self._count("login")
        if count:
            audit.warning(
                "refused login by %s: wrong user or password; %d refused, from any address, since the "
                "last such line (this one included)",
                who(request, None),
                count,
            )

    def post(self, what: str, by: str, problem: str) -> None:
        """Tell a refused POST: ``what`` it asked for (escaped), ``by`` whom, and why."""
        count = self._count("post: " + problem.split(" (", 1)[0])
        if count:
            more = f"; {count} refused for this reason since the last such line (this one included)"
            audit.warning("refused %s by %s: %s%s", what, by, problem, more if count > 1 else "")


def refusal(
    request: Request, hosts: frozenset[str], credentials: Credentials | None, refusals: Refusals
) -> Response | None:
    """The answer to a request refused before any page, else ``None``. First the Host
    allow-list: a page that rebound its own name to this address gets nothing, not even the
    basic-auth prompt (for its own origin, in the browser of someone who may fill it in). Then
    a request of another origin's page, or a prefetch (:func:`from_another_page`), then basic
    auth."""
    if not host_allowed(request.host, hosts):
        text = (
            f"this dashboard does not answer to the host {request.host!r}: if that is its name "
            "(behind a reverse proxy, say), start it with --allowed-host NAME\n"
        )
        return refused_early(request, 400, text, "host not allowed", refusals)
    if from_another_page(request):
        text = "this dashboard answers no request of another site's page, nor a prefetch\n"
        return refused_early(request, 403, text, "made by another site's page, or a prefetch", refusals)
    if credentials is not None and not credentials.check(request.headers.get("Authorization")):
        if "Authorization" in request.headers and request.method != "POST":  # (a POST: told below)
            refusals.login(request)
        challenge = {"WWW-Authenticate": 'Basic realm="kombu-delay", charset="UTF-8"'}
        text = "authentication required\n"
        return refused_early(request, 401, text, "authentication failed", refusals, challenge)
    return None


def refused_early(
    request: Request,
    status: int,
    text: str,
    problem: str,
    refusals: Refusals,
    headers: dict[str, str] | None = None,
) -> Response:
    """The plain-text refusal of a request refused before any page (by the Host allow-list or
    basic auth); a state-changing one is written to the audit log, its path and query naming
    the action and its target."""
    if request.method == "POST":
        refused_post(request, who(request, None), problem, refusals)
    return Response(text, status, headers, mimetype="text/plain")


def refused_post(request: Request, by: str, problem: str, refusals: Refusals) -> None:
    """Write a refused POST to the audit log (paced: :class:`Refusals`), its path and query
    naming the action and its target (an action refused before its own code reads them: by the
    checks above, or as too large to read)."""
    query = request.query_string.decode(errors="backslashreplace")  # (any bytes a client sent)
    path = request.script_root + request.path  # (under --url-prefix, the path a browser asked for)
    target = f"{path}?{query}" if query else path
    refusals.post(f"POST {target[:300]!r}", by, problem)
