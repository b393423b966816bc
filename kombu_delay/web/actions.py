"""The dashboard's actions: cancel, reschedule and remove a dead letter, each a POST that
exists only with ``allow_actions``, passes the CSRF check of :mod:`kombu_delay.web.guard`, is
confirmed on a page of its own first where it destroys, and is written to the audit log."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from flask import Flask, Response, abort, g, redirect, render_template, request, url_for
from werkzeug.wrappers import Response as Redirect

from kombu_delay.control import DelayControl
from kombu_delay.errors import EditConflict, KombuDelayError, RedisUnavailable
from kombu_delay.web import guard

#: Why a dead-letter offset or position is refused (HTTP 400).
BAD_POSITION = "the offset or position is past any list"
#: Why an offset or position that is no whole number is refused (HTTP 400).
BAD_NUMBER = "an offset or position that is not a whole number of 0 or more"
READ_ONLY = "This dashboard is read-only: start it with --allow-actions to cancel, reschedule or remove."


def add_actions(app: Flask, control: DelayControl, allow_actions: bool) -> None:
    """Cancel, reschedule and remove a dead letter: POSTs, off unless ``allow_actions``."""
    who = guard.requester
    refusals: guard.Refusals = app.extensions["kombu_delay.refusals"]

    def acting(action: str, target: str) -> None:
        """Refuse a state-changing request that is off or fails the CSRF check (logged)."""
        if not allow_actions:
            refusals.post(f"{action} {guard.printable(target)}", who(), "actions are off")
            abort(403, READ_ONLY)
        problem = guard.csrf_problem(request)
        if problem is not None:
            refusals.post(f"{action} {guard.printable(target)}", who(), problem)
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
            found = control.find(task_id, unreadable=True)  # a damaged one is cancelled too
            return render_template("confirm.html", action="cancel", task_id=task_id, found=found)
        with _logged_if_failed("cancel", task_id):
            n = control.cancel(task_id)
        guard.audit.warning("cancel %s by %s: %d message(s) cancelled", guard.printable(task_id), who(), n)
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
                eta = _time_of(eta_text)
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
            guard.audit.warning(
                "reschedule %s by %s failed: %s", guard.printable(task_id), who(), guard.printable(str(exc))
            )
            return render_template("error.html", title="Not rescheduled", message=str(exc)), 400
        new = eta.isoformat() if eta is not None else f"countdown {countdown:g} s"
        guard.audit.warning(
            "reschedule %s to %s by %s: %d message(s) rescheduled", guard.printable(task_id), new, who(), n
        )
        return redirect(url_for("task", id=task_id, done=n), 303)

    @app.post("/dead/remove")
    def dead_remove() -> str | Response:
        digest = request.form.get("digest", "")
        acting("remove dead letter", digest)  # its checks (and their audit) before any other refusal
        near = _audited_position(request.form.get("near"), digest)
        if request.form.get("confirm") != "yes":
            return render_template("confirm.html", action="remove", digest=digest, near=near)
        try:
            with _logged_if_failed("remove dead letter", digest):
                n = control.remove_dead_letter(digest, near)
        except ValueError:
            guard.audit.warning(
                "remove dead letter %s by %s failed: %s", guard.printable(digest), who(), BAD_POSITION
            )
            abort(400, BAD_POSITION)
        guard.audit.warning("remove dead letter %s by %s: %d removed", guard.printable(digest), who(), n)
        return render_template("done.html", title="Removed", task_id=digest, count=n, action="remove")


@contextmanager
def _logged_if_failed(action: str, target: str) -> Iterator[None]:
    """Write the audit line of an action Redis failed (answered by the Redis error page, 503)
    or another edit kept from being done (409); a bad request (a ``ValueError``) is the caller's
    to tell and log. Where Redis went away the action may have been done all the same (its
    reply lost): said so, not "failed" (also where it could not be reached: an action of several
    calls may have made some before)."""
    g.acted = True  # (the error page says an action Redis did not answer may have been done)
    try:
        yield
    except KombuDelayError as exc:
        if not isinstance(exc, ValueError):
            how = "failed"
            if isinstance(exc, RedisUnavailable):
                how = "may or may not have been done"
            elif isinstance(exc, EditConflict):
                how = "refused, another edit first"
            guard.audit.warning(
                "%s %s by %s %s: %r", action, guard.printable(target), guard.requester(), how, str(exc)
            )
        raise


def _time_of(text: str) -> datetime:
    """The new time a reschedule's form gives (ISO-8601, a space for the ``T`` too); a
    ``ValueError`` that quotes it as typed."""
    try:
        return datetime.fromisoformat(text.replace(" ", "T"))
    except ValueError:
        raise ValueError(f"{text!r} is not a time: give one as 2030-01-01 09:00, or with an offset") from None


def _audited_position(text: str | None, digest: str) -> int:
    """A dead letter's removal's position (:func:`int_arg`), its refusal audited as any is."""
    try:
        return int_arg(text, 0, refuse=False)
    except ValueError:
        guard.audit.warning(
            "remove dead letter %s by %s failed: %s", guard.printable(digest), guard.requester(), BAD_NUMBER
        )
        abort(400, BAD_NUMBER)


def int_arg(text: str | None, default: int, refuse: bool = True) -> int:
    """A whole number of 0 or more a request gives, in ASCII digits, or ``default`` where it gives
    none; anything else (``abc``, ``1e3``, ``-5``, ``+3``, ``1_0``, 5,000 digits) is a bad
    request, 400, as a bad ``limit`` is: not taken for 0 (``refuse`` false: a ``ValueError``,
    for the caller to tell)."""
    if not text:
        return default
    if text.isascii() and text.isdigit() and len(text) <= 4000:
        return int(text)
    if refuse:
        abort(400, BAD_NUMBER)
    raise ValueError(BAD_NUMBER)
