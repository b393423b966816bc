"""What keeps the dashboard safe to expose: basic auth, CSRF tokens, and the audit log of actions.

* Basic auth (optional): every request, static files included, needs the one user and password.
* CSRF: a random token in a ``SameSite=Strict``, ``HttpOnly`` cookie, which every POST must also
  carry as the form field ``csrf`` (a page of another site can make the browser send the cookie,
  but cannot read it to fill in the field); a POST whose ``Origin`` names another host is refused
  as well.
* Audit: every state-changing request is logged on ``kombu_delay.web.audit`` at WARNING, with
  who (the basic-auth user, else ``-``), from where, what, and the outcome.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from flask import Request

#: Name of the cookie that carries the CSRF token.
CSRF_COOKIE = "kombu_delay_csrf"
#: Name of the form field every POST must carry the token in.
CSRF_FIELD = "csrf"
#: Environment variable read for ``--auth`` when the flag is not given.
AUTH_ENV = "KOMBU_DELAY_WEB_AUTH"

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
        except (binascii.Error, UnicodeDecodeError):
            return False
        user, _, password = raw.partition(":")
        same_user = hmac.compare_digest(user.encode(), self.user.encode())
        same_password = hmac.compare_digest(password.encode(), self.password.encode())
        return same_user and same_password


def new_token() -> str:
    """A fresh CSRF token."""
    return secrets.token_urlsafe(32)


def csrf_problem(request: Request) -> str | None:
    """Why a state-changing request fails the CSRF check, or ``None`` when it passes."""
    cookie = request.cookies.get(CSRF_COOKIE, "")
    sent = request.form.get(CSRF_FIELD, "")
    if not cookie or not sent:
        return "the form carries no CSRF token (reload the page and try again)"
    if not hmac.compare_digest(cookie.encode(), sent.encode()):
        return "the form's CSRF token does not match this browser's (reload the page and try again)"
    origin = request.headers.get("Origin")
    if origin and origin != "null" and urlsplit(origin).netloc != request.host:
        return f"the request comes from another origin ({origin})"
    return None


def who(request: Request) -> str:
    """``user@address`` of a request, for the audit log (``-`` when there is no basic auth)."""
    user = request.authorization.username if request.authorization else None
    forwarded = request.headers.get("X-Forwarded-For")
    where = request.remote_addr or "?"
    if forwarded:
        where += f" (forwarded for {forwarded})"
    return f"{user or '-'}@{where}"
