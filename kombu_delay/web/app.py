"""The dashboard's Flask app: overview, scheduled listing, task detail, dead letters, and actions.

Every read goes through :class:`~kombu_delay.control.DelayControl`. Every request must name an
allowed host in its ``Host`` header (:mod:`kombu_delay.web.guard`). State-changing requests
(cancel, reschedule, remove a dead letter) exist only with ``allow_actions``; they are POSTs
that pass the CSRF check of :mod:`kombu_delay.web.guard`, destructive ones are confirmed on a
page of their own first, and each is written to the audit log. A task id or a name that holds
lone surrogates is shown escaped and carried in URLs exactly (:mod:`kombu_delay.web.surrogates`).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from flask import Flask, Response, abort, g, jsonify, redirect, render_template, request, url_for
from werkzeug.exceptions import HTTPException
from werkzeug.wrappers import Response as Redirect

from kombu_delay.cli.inspect import clipped, shown, span, when
from kombu_delay.control import DeadLetter, DelayControl, Page
from kombu_delay.errors import KombuDelayError
from kombu_delay.store.listing import Cursor
from kombu_delay.web import guard, present, surrogates
from kombu_delay.web.overview import DEFAULT_RANGE, MAX_REFRESH_S, RANGES, SHARED_FOR_S, Shared

#: Rows per page of the scheduled listing and of the dead letters, and the messages a task page shows.
PAGE_ROWS = 50
#: Most rows one listing page may ask for.
MAX_ROWS = 500
#: Why a dead-letter offset or position is refused (HTTP 400).
BAD_POSITION = "the offset or position is past any list"
READ_ONLY = "This dashboard is read-only: start it with --allow-actions to cancel, reschedule or remove."
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
    app.config.update(MAX_CONTENT_LENGTH=64 * 1024)
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
    _add_actions(app, control, allow_actions)
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

    @app.before_request
    def before() -> Response | None:
        g.started = time.perf_counter()
        # First: a page that rebound its own name to this address gets nothing, not even the
        # basic-auth prompt (for its own origin, in the browser of someone who may fill it in).
        if not guard.host_allowed(request.host, hosts):
            text = (
                f"this dashboard does not answer to the host {request.host!r}: if that is its name "
                "(behind a reverse proxy, say), start it with --allowed-host NAME\n"
            )
            return guard.refused_early(request, 400, text, "host not allowed")
        if credentials is not None:
            if not credentials.check(request.headers.get("Authorization")):
                challenge = {"WWW-Authenticate": 'Basic realm="kombu-delay", charset="UTF-8"'}
                text = "authentication required\n"
                return guard.refused_early(request, 401, text, "authentication failed", challenge)
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
                samesite="Strict",
                secure=request.is_secure,
                path=request.script_root or "/",
            )
        for name, value in SECURITY_HEADERS:
            response.headers.setdefault(name, value)
        return response

    @app.errorhandler(KombuDelayError)
    def redis_error(exc: KombuDelayError) -> tuple[str | Response, int]:
        return _error("Redis error", str(exc)), 503

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> tuple[str | Response, int]:
        return _error(exc.name, exc.description or ""), exc.code or 500


def _error(title: str, message: str) -> str | Response:
    """An error's body: ``{"error": message}`` on a JSON route, else the error page."""
    if request.endpoint in JSON_ENDPOINTS:
        return jsonify(error=message)
    return render_template("error.html", title=title, message=message)


def _who() -> str:
    """Who made this request, for the audit log: the user only when basic auth checked it."""
    return guard.who(request, g.get("user"))


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
        found = control.find(task_id) if task_id else []
        shown = [(m, present.show(m.message)) for m in found[:PAGE_ROWS]]  # (20,000 made 72 MB)
        done, now, more = request.args.get("done", ""), control.time_ms(), len(found) - len(shown)
        rescheduled = int(done) if DONE_COUNT.fullmatch(done) else None
        return render_template(
            "task.html", task_id=task_id, shown=shown, now=now, rescheduled=rescheduled, more=more
        ), (200 if found else 404)

    @app.get("/dead")
    def dead() -> str:
        offset = max(0, _int(request.args.get("offset"), 0))
        total, letters = _dead_letters(control, offset, PAGE_ROWS)
        rows = [(letter, letter.preview(160)) for letter in letters]
        return render_template("dead.html", total=total, rows=rows, offset=offset, page_rows=PAGE_ROWS)

    @app.get("/dead/letter")
    def dead_letter() -> tuple[str, int]:
        digest, near = request.args.get("digest", ""), max(0, _int(request.args.get("near"), 0))
        _, letters = _dead_letters(control, max(0, near - 50), 100)
        letter = next((d for d in letters if d.digest == digest), None)
        text = letter.preview(20_000) if letter else ""
        return render_template("dead_letter.html", letter=letter, text=text, near=near), (
            200 if letter else 404
        )


def _add_actions(app: Flask, control: DelayControl, allow_actions: bool) -> None:
    """Cancel, reschedule and remove a dead letter: POSTs, off unless ``allow_actions``."""

    def acting(action: str, target: str) -> None:
        """Refuse a state-changing request that is off or fails the CSRF check (logged)."""
        if not allow_actions:
            guard.audit.warning("refused %s %r by %s: actions are off", action, target, _who())
            abort(403, READ_ONLY)
        problem = guard.csrf_problem(request)
        if problem is not None:
            guard.audit.warning("refused %s %r by %s: %s", action, target, _who(), problem)
            abort(403, f"Refused: {problem}.")

    def action_id() -> str:
        """The task id of a cancel or reschedule: in the URL's query, where the page's forms
        carry it (a form field cannot hold a lone surrogate), else in the form (a script's)."""
        return request.args.get("id", request.form.get("id", ""))

    @app.post("/task/cancel")
    def cancel() -> str | Response:
        task_id = action_id()
        acting("cancel", task_id)
        if request.form.get("confirm") != "yes":
            found = control.find(task_id)
            return render_template("confirm.html", action="cancel", task_id=task_id, found=found)
        with _logged_if_failed("cancel", task_id):
            n = control.cancel(task_id)
        guard.audit.warning("cancel %r by %s: %d message(s) cancelled", task_id, _who(), n)
        return render_template("done.html", title="Cancelled", task_id=task_id, count=n, action="cancel")

    @app.post("/task/reschedule")
    def reschedule() -> Redirect | tuple[str, int]:
        task_id = action_id()
        acting("reschedule", task_id)
        eta_text = request.form.get("eta", "").strip()
        countdown_text = request.form.get("countdown", "").strip()
        eta, countdown = None, None
        try:
            if eta_text and not countdown_text:
                eta = datetime.fromisoformat(eta_text.replace(" ", "T"))
                if eta.tzinfo is None:  # the form says so: UTC unless an offset is given
                    eta = eta.replace(tzinfo=UTC)
            elif countdown_text and not eta_text:
                countdown = float(countdown_text)
                if not math.isfinite(countdown):
                    raise ValueError("the countdown must be a finite number of seconds")
            else:
                raise ValueError("give either a new time or a countdown")
            with _logged_if_failed("reschedule", task_id):
                n = control.reschedule(task_id, eta=eta, countdown=countdown)
        except ValueError as exc:  # a bad time, or one Redis refuses (too far, say)
            guard.audit.warning("reschedule %r by %s failed: %r", task_id, _who(), str(exc))
            return render_template("error.html", title="Not rescheduled", message=str(exc)), 400
        new = eta.isoformat() if eta is not None else f"countdown {countdown:g} s"
        guard.audit.warning("reschedule %r to %s by %s: %d message(s) rescheduled", task_id, new, _who(), n)
        return redirect(url_for("task", id=task_id, done=n), 303)

    @app.post("/dead/remove")
    def dead_remove() -> str | Response:
        digest, near = request.form.get("digest", ""), max(0, _int(request.form.get("near"), 0))
        acting("remove dead letter", digest)
        if request.form.get("confirm") != "yes":
            return render_template("confirm.html", action="remove", digest=digest, near=near)
        try:
            with _logged_if_failed("remove dead letter", digest):
                n = control.remove_dead_letter(digest, near)
        except ValueError:
            guard.audit.warning("remove dead letter %r by %s failed: %s", digest, _who(), BAD_POSITION)
            abort(400, BAD_POSITION)
        guard.audit.warning("remove dead letter %r by %s: %d removed", digest, _who(), n)
        return render_template("done.html", title="Removed", task_id=digest, count=n, action="remove")


@contextmanager
def _logged_if_failed(action: str, target: str) -> Iterator[None]:
    """Write the audit line of an action Redis failed (answered by the Redis error page, 503);
    a bad request (a ``ValueError``) is the caller's to tell and log."""
    try:
        yield
    except KombuDelayError as exc:
        if not isinstance(exc, ValueError):
            guard.audit.warning("%s %r by %s failed: %r", action, target, _who(), str(exc))
        raise


def _dead_letters(control: DelayControl, offset: int, limit: int) -> tuple[int, list[DeadLetter]]:
    """:meth:`DelayControl.dead_letters`, a position past any list being a bad request."""
    try:
        return control.dead_letters(offset, limit)
    except ValueError:
        abort(400, BAD_POSITION)


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text else default
    except ValueError:
        return default


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


class PathPrefix:
    """WSGI middleware that serves an app under ``prefix`` (a reverse proxy that passes the path on
    unchanged): ``/prefix/x`` is the app's ``/x``, and links it makes start with ``/prefix``."""

    def __init__(self, app: Any, prefix: str) -> None:
        self.app = app
        self.prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if self.prefix and not (path == self.prefix or path.startswith(self.prefix + "/")):
            headers = [("Content-Type", "text/plain; charset=utf-8"), *SECURITY_HEADERS]
            start_response("404 Not Found", headers)
            return [f"not found: the dashboard is under {self.prefix}/\n".encode()]
        environ["SCRIPT_NAME"] = environ.get("SCRIPT_NAME", "") + self.prefix
        environ["PATH_INFO"] = path[len(self.prefix) :] or "/"
        return self.app(environ, start_response)
