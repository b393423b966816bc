"""The ``web`` command of ``kombu-delay`` and ``celery -A proj delay``: serve the dashboard.

Loaded only when the command runs (or help lists it); Flask and waitress are imported inside
the command, so a missing ``web`` extra is one clear message, not a broken CLI.
"""

from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING

import click

from kombu_delay.cli.common import announce, target
from kombu_delay.cli.inspect import InspectError
from kombu_delay.connect import with_socket_timeouts
from kombu_delay.errors import KombuDelayError, needs_extra
from kombu_delay.web.overview import MAX_REFRESH_S

if TYPE_CHECKING:
    from flask import Flask
    from waitress.server import BaseWSGIServer, MultiSocketServer

    from kombu_delay.web.guard import Credentials

DEFAULT_PORT = 9809


def refresh_seconds(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """``--refresh``: finite, from 0 (off) to :data:`~kombu_delay.web.overview.MAX_REFRESH_S`; a usage
    error otherwise (an infinite one made every page fail)."""
    if not (math.isfinite(value) and 0 <= value <= MAX_REFRESH_S):
        raise click.BadParameter(f"{value} is not a number of seconds from 0 (off) to {MAX_REFRESH_S:,}")
    return value


def url_prefix_path(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """``--url-prefix``: the path, as "/a/b" ("" for none), of segments of the characters a URL's
    path takes as they are (ASCII letters, digits and ``-._~!$&'()*+,;=:@``; none "." or ".."),
    which every browser and proxy sends as written; a usage error otherwise. Under "../x",
    "/a?b", "/a#b", "/a%2Fb", "/ä" or "/a\\b" (a browser folds the dots away, cuts at "?" or
    "#", and sends the others encoded or changed) the dashboard answered 404 to every request."""
    segments = value.strip("/").split("/") if value.strip("/") else []
    if any(s in ("", ".", "..") or not re.fullmatch(r"[A-Za-z0-9._~!$&'()*+,;=:@-]+", s) for s in segments):
        raise click.BadParameter(
            f"{value!r}: give a path of segments of ASCII letters, digits and -._~!$&'()*+,;=:@ (none "
            "'.' or '..'), such as /ops/delay: others reach the dashboard changed, or not at all"
        )
    return "/" + "/".join(segments) if segments else ""


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True)
@click.option(
    "--allow-actions",
    is_flag=True,
    help="Allow cancel, reschedule and removing dead letters (POST, CSRF-checked, logged). "
    "Without it the dashboard is read-only.",
)
@click.option(
    "--auth",
    default=None,
    metavar="USER:PASSWORD",
    help="Require HTTP basic auth (else from env KOMBU_DELAY_WEB_AUTH; none when neither is set). "
    "An empty or malformed value, from either, is refused.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="Answer requests for this host name too (repeatable; any port): the name a reverse proxy "
    "passes on. By default only the --host address, or localhost, 127.0.0.1 and [::1] when that is "
    "a loopback address or 0.0.0.0. Other Host headers are refused (400), against DNS rebinding. "
    "'*': any host, unsafe without --auth.",
)
@click.option(
    "--url-prefix",
    default="",
    callback=url_prefix_path,
    help="Serve under this path (behind a reverse proxy that passes /PREFIX/... on unchanged).",
)
@click.option(
    "--refresh",
    type=float,
    callback=refresh_seconds,
    default=5.0,
    show_default=True,
    help=f"Overview refresh, s, at most {MAX_REFRESH_S:,}; 0: off",
)
@click.option("--threads", type=click.IntRange(1, 64), default=4, show_default=True, help="Request threads.")
@click.pass_context
def web(
    ctx: click.Context,
    host: str,
    port: int,
    allow_actions: bool,
    auth: str | None,
    allowed_hosts: tuple[str, ...],
    url_prefix: str,
    refresh: float,
    threads: int,
) -> None:
    """Serve the dashboard: overview, scheduled messages, task detail, dead letters.

    Read-only unless --allow-actions. It reads the broker and key prefix as every other
    command does. Needs the web extra (Flask and waitress).

    \b
    Examples:
      kombu-delay -b delayredis://localhost:6379/0 web
      kombu-delay web --host 0.0.0.0 --allowed-host dash.example.com --auth ops:s3cret --allow-actions
      KOMBU_DELAY_WEB_AUTH=ops:s3cret kombu-delay web --url-prefix /kd --allowed-host dash.example.com
      celery -A proj delay web --allow-actions
    """
    try:
        import waitress  # noqa: F401 - the extra's other half, told here when missing

        from kombu_delay.web.app import PathPrefix, create_app
        from kombu_delay.web.guard import ANY_HOST, url_host
    except ImportError as exc:
        raise click.ClickException(f"{needs_extra('the dashboard', 'web')} ({exc.name} is missing)") from exc
    from kombu_delay.control import DelayControl

    tgt = with_socket_timeouts(target(ctx))
    credentials, hosts, reachable = _access(host, auth, allowed_hosts, allow_actions)
    announce(ctx)
    try:
        control = DelayControl(tgt.url, tgt.transport_options, ssl=tgt.ssl)
    except KombuDelayError as exc:  # a broker URL it cannot use: one line, as the other commands say it
        raise InspectError(tgt.redact(str(exc))) from exc
    app = create_app(
        control,
        allow_actions=allow_actions,
        credentials=credentials,
        allowed_hosts=hosts,
        refresh_s=refresh,
        where=tgt.describe(),
    )
    prefix = url_prefix
    if reachable:
        click.echo(f"warning: {host} without --auth: anyone who can reach it reads the schedule", err=True)
    if ANY_HOST in hosts and credentials is None:
        click.echo(
            "warning: --allowed-host '*' without --auth: any web page can use it (DNS rebinding)", err=True
        )
    if prefix:
        app.wsgi_app = PathPrefix(app.wsgi_app, prefix)  # type: ignore[method-assign]
    mode = "actions allowed" if allow_actions else "read-only"
    try:
        server = _bound(app, host, port, threads)
        # Said once the port is bound: a port in use is told alone.
        auth_mode = "basic auth" if credentials else "no auth"
        click.echo(
            f"kombu-delay web: http://{url_host(host)}:{port}{prefix}/ ({mode}, {auth_mode})", err=True
        )
        server.run()
    finally:
        control.close()


def _bound(app: Flask, host: str, port: int, threads: int) -> BaseWSGIServer | MultiSocketServer:
    """A waitress server for ``app``, its port bound; one line of error where it cannot be."""
    import waitress

    from kombu_delay.web.app import MAX_BODY

    try:
        # clear_untrusted_proxy_headers: waitress would drop X-Forwarded-For, which the audit
        # log records (as sent, marked as such: it does not replace the peer's address).
        return waitress.create_server(
            app,
            host=host,
            port=port,
            threads=threads,
            ident="kombu-delay",
            clear_untrusted_proxy_headers=False,
            max_request_body_size=MAX_BODY + 1,  # (see MAX_BODY)
        )
    except (OSError, ValueError) as exc:  # ValueError: waitress cannot resolve --host
        raise click.ClickException(f"cannot serve on {host}:{port}: {exc}") from exc


def _access(
    host: str, auth: str | None, allowed_hosts: tuple[str, ...], allow_actions: bool
) -> tuple[Credentials | None, frozenset[str], bool]:
    """The basic-auth credentials (``--auth``, else the environment), the hosts answered to, and
    whether others can reach the dashboard with no password; a usage error for a value that is
    none, and for actions others could reach with no password."""
    from kombu_delay.web.guard import ANY_HOST, AUTH_ENV, Credentials, allowed_hosts_of, loopback_only

    # Any value given is parsed, the empty one too (an unset shell variable): it is refused,
    # never read as "no auth", and never hides the environment variable.
    source = "--auth" if auth is not None else AUTH_ENV
    auth = auth if auth is not None else os.environ.get(AUTH_ENV)
    try:
        credentials = Credentials.parse(auth) if auth is not None else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=source) from exc
    try:
        hosts = allowed_hosts_of(host, allowed_hosts)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--allowed-host") from exc
    reachable = not loopback_only(host) and credentials is None
    if ANY_HOST in hosts and credentials is None and allow_actions:
        raise click.UsageError(
            f"--allow-actions with --allowed-host '*' needs --auth (or {AUTH_ENV}): answering any "
            "host, it lets any web page a browser on this machine opens (DNS rebinding) fetch the "
            "CSRF token and cancel or reschedule tasks. Give --auth, or name the hosts"
        )
    if reachable and allow_actions:
        raise click.UsageError(
            f"--allow-actions on {host}, which others can reach, needs --auth (or {AUTH_ENV}): the "
            "Host and CSRF checks stop web pages, not other clients, so anyone who reaches the port "
            "could cancel and reschedule tasks. Give --auth, or listen on 127.0.0.1 behind a proxy "
            "that asks for a password"
        )
    return credentials, hosts, reachable
