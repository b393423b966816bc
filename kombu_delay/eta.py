"""When a kombu message is due: ETA parsing and the one datetime-to-ms helper.

Time is integer epoch milliseconds (UTC) everywhere in kombu-delay.

Accepted, in this order:

1. Celery protocol 2: the ``eta`` header, ISO-8601. With an offset it is
   taken as written; without one it is UTC, as the Celery worker reads it.
2. Celery protocol 1: ``eta`` inside a JSON body (``application/json``).
3. Plain kombu: an ``x-delay`` header in milliseconds from now, judged by the
   Redis clock (the RabbitMQ delayed-message convention).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .errors import BadETA, DelayTooLong
from .keys import MAX_DUE_MS


@dataclass(frozen=True)
class Due:
    """A message's due time: absolute epoch ms, or a delay from Redis's now."""

    #: Epoch ms (``relative`` false) or milliseconds from now (``relative`` true).
    ms: int
    relative: bool = False
    #: The task id (Celery), message id, or delivery tag: the key of the id index.
    task_id: str = ""


def to_ms(when: datetime) -> int:
    """Return ``when`` as epoch milliseconds. Naive datetimes are rejected."""
    if when.tzinfo is None or when.tzinfo.utcoffset(when) is None:
        raise BadETA(f"naive datetime {when.isoformat()!r}: give a timezone (UTC is usual)")
    return int(when.timestamp() * 1000)


def parse_iso_ms(text: str) -> int:
    """Parse an ISO-8601 ETA to epoch ms; a missing offset means UTC (Celery's rule)."""
    try:
        when = datetime.fromisoformat(text)
    except (TypeError, ValueError) as exc:
        raise BadETA(f"ETA {text!r} is not ISO-8601") from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return to_ms(when)


def _body_json(message: dict[str, Any]) -> dict[str, Any] | None:
    if message.get("content-type") != "application/json":
        return None
    body = message.get("body")
    props = message.get("properties") or {}
    if props.get("body_encoding") == "base64" and isinstance(body, str):
        body = base64.b64decode(body)
    if not isinstance(body, str | bytes):
        return None
    try:
        decoded = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to be a Celery body
        return None
    return decoded if isinstance(decoded, dict) else None


def message_id(message: dict[str, Any], body: dict[str, Any] | None = None) -> str:
    """Return the id a message is indexed under: task id, message id or delivery tag."""
    headers = message.get("headers") or {}
    props = message.get("properties") or {}
    for candidate in (headers.get("id"), (body or {}).get("id"), props.get("message_id")):
        if isinstance(candidate, str) and candidate:
            return candidate
    return str(props.get("delivery_tag", ""))


def message_due(message: dict[str, Any]) -> Due | None:
    """Return when ``message`` is due, or ``None`` when it carries no delay.

    Raises :class:`BadETA` for a delay that is present but unusable; the
    transport then delivers the message at once, as plain kombu would.
    """
    headers = message.get("headers") or {}
    if "task" in headers:  # Celery protocol 2
        eta = headers.get("eta")
        if eta is None or eta == "":  # the worker, too, reads an empty ETA as none
            return None
        return Due(parse_iso_ms(eta), task_id=message_id(message))
    if "x-delay" in headers:
        raw = headers["x-delay"]
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise BadETA(f"x-delay {raw!r} is not a number of milliseconds")
        try:
            delay = int(float(raw))
        except (TypeError, ValueError, OverflowError) as exc:
            raise BadETA(f"x-delay {raw!r} is not a number of milliseconds") from exc
        if delay <= 0:
            return None
        if delay >= MAX_DUE_MS:
            raise DelayTooLong(f"x-delay {raw!r} ms is past the year-2109 ceiling of a due time")
        return Due(delay, relative=True, task_id=message_id(message))
    body = _body_json(message)
    if body is not None and "task" in body and body.get("eta"):  # Celery protocol 1
        eta = body["eta"]
        if not isinstance(eta, str):
            raise BadETA(f"ETA {eta!r} is not ISO-8601")
        return Due(parse_iso_ms(eta), task_id=message_id(message, body))
    return None
