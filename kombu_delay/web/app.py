"""The dashboard's Flask app: overview, scheduled listing, task detail, dead letters, and the
actions of :mod:`kombu_delay.web.actions`.

Every read goes through :class:`~kombu_delay.control.DelayControl`. Every request must name an
allowed host in its ``Host`` header (:mod:`kombu_delay.web.guard`). A task id or a name that holds
lone surrogates is shown escaped and carried in URLs exactly (:mod:`kombu_delay.web.surrogates`).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable
from typing import Any

from flask import Flask, Response, abort, g, jsonify, redirect, render_template, request, url_for
from werkzeug.exceptions import HTTPException, MethodNotAllowed, RequestEntityTooLarge
from werkzeug.wrappers import Response as Redirect

from kombu_delay.cli.common import shown
from kombu_delay.cli.inspect import clipped, span, when
from kombu_delay.control import DeadLetter, DelayControl, Page
from kombu_delay.errors import EditConflict, KombuDelayError, RedisUnavailable
from kombu_delay.store.listing import Cursor
from kombu_delay.web import guard, present, surrogates
from kombu_delay.web.actions import BAD_POSITION, add_actions, int_arg
from kombu_delay.web.overview import DEFAULT_RANGE, MAX_REFRESH_S, RANGES, SHARED_FOR_S, Shared

#: Rows per page of the scheduled listing and of the dead letters, and the messages a task page shows.
PAGE_ROWS = 50
#: Most rows one listing page may ask for.
MAX_ROWS = 500
#: How far either side of where a page showed a dead letter its own page looks for it.
DEAD_REACH = 10_000
#: The largest request body read, bytes: the waitress server of ``web`` refuses a longer one
#: before it reads it, so it is not in the audit log (waitress's own default is 1 GiB, written
#: to a file before the app sees the request). ``web`` gives waitress one byte more: waitress
#: refuses a body of exactly its limit, the app only one over its own.
MAX_BODY = 64 * 1024
#: The routes that answer JSON, errors included.
JSON_ENDPOINTS = frozenset({"overview_json"})
#: The ``done`` of a task page: a count of messages rescheduled, as the reschedule action
#: redirects with it (any other value is not shown: the link could say anything).
DONE_COUNT = re.compile(r"[0-9]{1,18}")


class Dashboard(Flask):
    """Flask, with lone surrogates shown escaped and read from URLs exactly (:mod:`.surrogates`)."""

    request_class = surrogates.DashboardRequest
    jinja_options = {**Flask.jinja_options, "finalize": surrogates.visible}


def create_app(
    control: DelayControl,
    *,
    allow_actions: bool = False,
    credentials: guard.Credentials | None = None,
    allowed_hosts: Iterable[str] | None = None,
    refresh_s: float = 5.0,
    where: str = "",
    max_buckets: int = 10_000,
    share_s: float = SHARED_FOR_S,
) -> Flask:
    """Build the dashboard for ``control``. ``where``: the broker and prefix, passwords masked,
    shown in the page header. Mount it under a path prefix with the WSGI ``SCRIPT_NAME``
    (``kombu-delay web --url-prefix``). ``share_s``: how long one overview serves every browser.
    ``refresh_s``: the overview's refresh, from 0 (off) to :data:`MAX_REFRESH_S`, else
    ``ValueError``. ``allowed_hosts``: the hosts the ``Host`` header may name, as
    :func:`~kombu_delay.web.guard.allowed_hosts_of` makes them (``kombu-delay web --host`` and
    ``--allowed-host``); by default the loopback names."""
    if not (math.isfinite(refresh_s) and 0 <= refresh_s <= MAX_REFRESH_S):
        raise ValueError(f"refresh_s {refresh_s} is not a number of seconds from 0 to {MAX_REFRESH_S}")
    app = Dashboard(__name__)
    app.config.update(MAX_CONTENT_LENGTH=MAX_BODY)
    app.url_defaults(surrogates.encode_query)
    shared = Shared(control, max_buckets, share_s)
    hosts = frozenset(
        guard.host_name(name) for name in (guard.LOOPBACK_HOSTS if allowed_hosts is None else allowed_hosts)
    )

    # Names and ids as text, every character that is not printable escaped (an RTL override
    # or a NUL must not make one id look like another): whole (``shown``), or cut as ``ls``
    # cuts them in a listing's rows (``name``: one name of a megabyte made every row that long),
    # or as the task page cuts each part of a message (``detail``).
    app.jinja_env.filters.update(shown=shown, name=lambda text: clipped(shown(text)), detail=present.part)
    _install_guards(app, credentials, hosts, allow_actions, where, refresh_s)
    _add_pages(app, control, shared)
    _add_detail_pages(app, control)
    add_actions(app, control, allow_actions)
    return app


def _install_guards(
    app: Flask,
    credentials: guard.Credentials | None,
    hosts: frozenset[str],
    allow_actions: bool,
    where: str,
    refresh_s: float,
) -> None:
    """The Host allow-list, basic auth, the CSRF cookie, security headers, server timing and error
    pages."""

    @app.context_processor
    def helpers() -> dict[str, Any]:
        return {
            "allow_actions": allow_actions,
            "where": where,
            "refresh_ms": round(refresh_s * 1000),
            "csrf_token": g.get("csrf", ""),
            "span": span,
            "when": when,
            "ranges": RANGES,
        }

    refusals = app.extensions["kombu_delay.refusals"] = guard.Refusals()

    @app.before_request
    def before() -> Response | None:
        g.started = time.perf_counter()
        refused = guard.refusal(request, hosts, credentials, refusals)
        if refused is not None:
            return refused
        outside = request.environ.get(OUTSIDE_PREFIX)
        if outside is not None:  # (told after the checks: only to whom they let in)
            return Response(f"not found: the dashboard is under {outside}/\n", 404, mimetype="text/plain")
        if credentials is not None:
            g.user = credentials.user  # checked: the audit log may name it
        g.csrf = request.cookies.get(guard.CSRF_COOKIE) or guard.new_token()
        return None

    @app.after_request
    def after(response: Response) -> Response:
        if "started" in g:
            elapsed = (time.perf_counter() - g.started) * 1000
            response.headers["Server-Timing"] = f"app;dur={elapsed:.1f}"
        if "csrf" in g and request.cookies.get(guard.CSRF_COOKIE) != g.csrf:
            response.set_cookie(
                guard.CSRF_COOKIE,
                g.csrf,
                httponly=True,
                # Lax, not Strict: a link from another site to the dashboard sent no cookie, so
                # it was given a new token, and the forms of the tabs already open were refused.
                # A POST from another site still sends none (and needs the token besides).
                samesite="Lax",
                secure=request.is_secure,
                path=request.script_root or "/",
            )
        for name, value in SECURITY_HEADERS:
            response.headers.setdefault(name, value)
        return response

    @app.errorhandler(KombuDelayError)
    def redis_error(exc: KombuDelayError) -> tuple[str | Response, int]:
        told = str(exc)
        if g.get("acted") and isinstance(exc, RedisUnavailable):  # (its reply lost, perhaps)
            told += "; the action may or may not have been done: look again once Redis answers"
        return _error("Redis error", told), 503

    @app.errorhandler(EditConflict)  # Redis is well: another edit came first (a purge, say)
    def edit_conflict(exc: EditConflict) -> tuple[str | Response, int]:
        return _error("Not done: try again", str(exc)), 409

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> tuple[str | Response, int] | Response:
        if isinstance(exc, MethodNotAllowed):  # refused before any page: plain text, as 400 and 401
            allow = {"Allow": ", ".join(exc.valid_methods or ())}
            return Response(f"{exc.code} {exc.name}\n", exc.code, allow, mimetype="text/plain")
        if isinstance(exc, RequestEntityTooLarge) and request.method == "POST":
            guard.refused_post(request, guard.requester(), "request too large", refusals)
        return _error(exc.name, exc.description or ""), exc.code or 500


def _error(title: str, message: str) -> str | Response:
    """An error's body: ``{"error": message}`` on a JSON route, else the error page."""
    if request.endpoint in JSON_ENDPOINTS:
        return jsonify(error=message)
    return render_template("error.html", title=title, message=message)


def _add_pages(app: Flask, control: DelayControl, shared: Shared) -> None:
    """The read-only pages of many things: the overview and the scheduled listing."""

    def range_arg() -> str:
        chosen = request.args.get("range", DEFAULT_RANGE)
        return chosen if chosen in RANGES else DEFAULT_RANGE

    @app.get("/")
    def index() -> str:
        return render_template("overview.html", view=shared.get(range_arg()))

    @app.get("/overview/part")
    def overview_part() -> str:
        return render_template("_overview.html", view=shared.get(range_arg()))

    @app.get("/overview.json")
    def overview_json() -> dict[str, Any]:
        view = shared.get(range_arg())
        return {
            **view.stats.to_dict(),
            "queues": [vars(q) for q in view.queues],
            "warnings": view.warnings,
            "truncated": view.truncated,
        }

    @app.get("/scheduled")
    def scheduled() -> str | Redirect:
        # Each value as given: a queue, an id or a task name may start or end with a space.
        task_id = request.args.get("id", "")
        if task_id:
            return redirect(url_for("task", id=task_id))
        queue = request.args.get("queue") or None
        name = request.args.get("task", "")
        cursor = request.args.get("cursor") or None
        try:
            limit = min(MAX_ROWS, max(1, int(request.args.get("limit", PAGE_ROWS))))
            if cursor:
                Cursor.parse(cursor)
        except ValueError:
            abort(400, "the cursor or limit is not one this page made")
        # A queue that is not UTF-8 text (a lone surrogate): none is named so (the control refuses it).
        no_queue = queue is not None and surrogates.has_surrogates(queue)
        page = Page([], None) if no_queue else control.scheduled(queue=queue, limit=limit, cursor=cursor)
        now = control.time_ms()
        # The task-name filter (a part of the name) applies to the page read: a filtered page may
        # come back short, never longer to read.
        items = [m for m in page.items if name in (m.task or "")]
        rows = [(m, present.preview(m.message)) for m in items]
        return render_template(
            "scheduled.html",
            rows=rows,
            now=now,
            queue=queue or "",
            name=name,
            limit=limit,
            cursor=cursor,
            next_cursor=page.cursor,
            read=len(page.items),
        )


def _add_detail_pages(app: Flask, control: DelayControl) -> None:
    """The read-only pages of one thing: a task's messages, the dead letters."""

    @app.get("/task")
    def task() -> tuple[str, int]:
        task_id = request.args.get("id", "")
        found = control.find(task_id, unreadable=True) if task_id else []  # damaged ones too
        shown = [(m, present.show(m.message)) for m in found[:PAGE_ROWS]]  # (20,000 made 72 MB)
        done, now, more = request.args.get("done", ""), control.time_ms(), len(found) - len(shown)
        rescheduled = int(done) if DONE_COUNT.fullmatch(done) else None
        return render_template(
            "task.html", task_id=task_id, shown=shown, now=now, rescheduled=rescheduled, more=more
        ), (200 if found else 404)

    @app.get("/dead")
    def dead() -> str:
        offset = int_arg(request.args.get("offset"), 0)
        total, letters = _dead_letters(control, offset, PAGE_ROWS)
        rows = [(letter, letter.preview(160)) for letter in letters]
        return render_template("dead.html", total=total, rows=rows, offset=offset, page_rows=PAGE_ROWS)

    @app.get("/dead/letter")
    def dead_letter() -> tuple[str, int]:
        digest, near = request.args.get("digest", ""), int_arg(request.args.get("near"), 0)
        try:  # around where a page showed it, then further (bounded: a GET reads no list whole)
            letter = control.dead_letter(digest, near, reach=DEAD_REACH)
        except ValueError:
            abort(400, BAD_POSITION)
        text = letter.preview(20_000) if letter else ""
        return render_template("dead_letter.html", letter=letter, text=text, near=near), (
            200 if letter else 404
        )


def _dead_letters(control: DelayControl, offset: int, limit: int) -> tuple[int, list[DeadLetter]]:
    """:meth:`DelayControl.dead_letters`, a position past any list being a bad request."""
    try:
        return control.dead_letters(offset, limit)
    except ValueError:
        abort(400, BAD_POSITION)


#: Headers every answer carries, the app's pages and :class:`PathPrefix`'s 404 alike.
SECURITY_HEADERS = (
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "same-origin"),
    (
        "Content-Security-Policy",
        "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    ),
    ("Cache-Control", "no-store"),
)


#: The WSGI environ key :class:`PathPrefix` marks a request outside its prefix with.
OUTSIDE_PREFIX = "kombu_delay.outside_prefix"


class PathPrefix:
    """WSGI middleware that serves an app under ``prefix`` (a reverse proxy that passes the path on
    unchanged): ``/prefix/x`` is the app's ``/x``, and links it makes start with ``/prefix``."""

    def __init__(self, app: Any, prefix: str) -> None:
        self.app = app
        self.prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if self.prefix and not (path == self.prefix or path.startswith(self.prefix + "/")):
            # Answered 404 by the app, once the Host check and basic auth have let it in: this
            # answered before them, naming the prefix to anyone.
            environ[OUTSIDE_PREFIX] = self.prefix
            return self.app(environ, start_response)
        environ["SCRIPT_NAME"] = environ.get("SCRIPT_NAME", "") + self.prefix
        environ["PATH_INFO"] = path[len(self.prefix) :] or "/"
        return self.app(environ, start_response)
