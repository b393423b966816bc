"""Read and rewrite a stored kombu message (the JSON string plain kombu would push), in Python.

Lua never decodes a payload (a Lua decode and re-encode corrupts JSON); the
few fields inspection needs are read, and the ETA rewritten, here.
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

from kombu_delay.eta import message_id, protocol1_body


def iso_utc(ms: int) -> str:
    """Return epoch ``ms`` as ISO-8601 in UTC with an explicit offset (Celery's ``eta`` form)."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def _load(payload: bytes | str) -> dict[str, Any] | None:
    try:
        message = json.loads(payload)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def index_id(payload: bytes | str) -> str:
    """Return the id-index key of a stored payload, as the transport chose it at publish
    (task id, message id or delivery tag); ``""`` for a payload that is not a kombu message."""
    message = _load(payload)
    if message is None:
        return ""
    headers = message.get("headers") or {}
    body = None if "x-delay" in headers else protocol1_body(message)
    return message_id(message, body)


def task_name(payload: bytes | str) -> str | None:
    """Return the Celery task name of a payload (protocol 2 or 1), or ``None``."""
    message = _load(payload)
    if message is None:
        return None
    headers = message.get("headers") or {}
    name = headers.get("task")
    if name is None:
        body = protocol1_body(message)
        name = body["task"] if body is not None else None
    return name if isinstance(name, str) else None


def with_eta(payload: bytes | str, due_ms: int) -> str:
    """Return ``payload`` with its Celery ETA set to ``due_ms``.

    A worker holds a message in memory until the ETA it carries, whatever time it
    was delivered, so a message rescheduled earlier must carry its new ETA too.
    Protocol 2: the ``eta`` header; protocol 1: ``eta`` in the JSON body (base64
    ``body_encoding`` kept). Other messages (``x-delay``) are returned unchanged:
    their delivery time is the stored score alone.
    """
    text = payload.decode("utf-8") if isinstance(payload, bytes) else payload
    message = _load(text)
    if message is None:
        return text
    eta = iso_utc(due_ms)
    headers = message.get("headers") or {}
    if "task" in headers:
        headers["eta"] = eta
        return json.dumps(message)
    body = protocol1_body(message)
    if body is None:
        return text
    body["eta"] = eta
    encoded = json.dumps(body).encode("utf-8")
    props = message.get("properties") or {}
    if props.get("body_encoding") == "base64":
        message["body"] = base64.b64encode(encoded).decode("ascii")
    else:
        message["body"] = encoded.decode("utf-8")
    return json.dumps(message)
