"""Turn stored kombu messages and stats into what the dashboard shows: previews, details, chart bars.

Pure functions, no Redis and no web framework. What they return is plain text; the templates
escape all of it. Arguments are shown as Celery's ``argsrepr``/``kwargsrepr`` headers when the
message has them (an app that hides a secret argument sets them), and decoded from the body only
when it has not.
"""

from __future__ import annotations

import ast
import base64
import json
import pprint
from dataclasses import dataclass
from typing import Any

from kombu_delay.control import Slot
from kombu_delay.message import load_stored, protocol1_body

#: Longest args/kwargs preview in a listing row, characters.
PREVIEW_CHARS = 120
#: Longest text shown for one message part on the detail page, characters.
DETAIL_CHARS = 20_000


@dataclass(frozen=True)
class Shown:
    """One message as the dashboard shows it."""

    #: Celery's args and kwargs (``argsrepr`` and ``kwargsrepr`` when present), pretty-printed.
    args: str
    kwargs: str
    #: The message's headers and properties, as stored, as indented JSON.
    headers: str
    properties: str
    #: The body when it is not a Celery task's (a plain kombu message), else ``""``.
    body: str
    #: Where args and kwargs came from: ``"argsrepr"``, ``"body"`` or ``""`` (not a Celery task).
    source: str


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ending in an ellipsis when cut."""
    return text if len(text) <= limit else text[: max(0, limit - 1)] + "\u2026"


def _raw_body(envelope: dict[str, Any]) -> bytes | None:
    body = envelope.get("body")
    props = envelope.get("properties") or {}
    if not isinstance(body, str):
        return None
    if props.get("body_encoding") == "base64":
        try:
            return base64.b64decode(body, validate=True)
        except ValueError:
            return None
    return body.encode("utf-8", "replace")


def _pretty_repr(text: str) -> str:
    """A Python repr (Celery's argsrepr) laid out over lines when it parses as a literal."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        return text
    return pprint.pformat(value, width=80, sort_dicts=False)


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=repr)


def arguments(envelope: dict[str, Any]) -> tuple[str, str, str]:
    """(args, kwargs, source) of a decoded kombu envelope; empty texts when it is no Celery task."""
    headers = envelope.get("headers") or {}
    if "task" in headers:
        if isinstance(headers.get("argsrepr"), str) or isinstance(headers.get("kwargsrepr"), str):
            return (
                _pretty_repr(str(headers.get("argsrepr") or "()")),
                _pretty_repr(str(headers.get("kwargsrepr") or "{}")),
                "argsrepr",
            )
        raw = _raw_body(envelope)
        try:
            decoded = json.loads(raw) if raw is not None else None
        except ValueError:
            decoded = None
        if isinstance(decoded, list) and len(decoded) >= 2:
            return _json(decoded[0]), _json(decoded[1]), "body"
        return "", "", ""
    body = protocol1_body(envelope)
    if body is not None:
        return _json(body.get("args")), _json(body.get("kwargs")), "body"
    return "", "", ""


def show(message: bytes) -> Shown:
    """What the task page shows of a stored message (each part clipped to ``DETAIL_CHARS``)."""
    envelope = load_stored(message)
    if envelope is None:
        text = message.decode("utf-8", "replace")
        return Shown("", "", "", "", clip(text, DETAIL_CHARS), "")
    args, kwargs, source = arguments(envelope)
    body = ""
    if not source:
        raw = _raw_body(envelope)
        body = raw.decode("utf-8", "replace") if raw is not None else _json(envelope.get("body"))
    return Shown(
        args=clip(args, DETAIL_CHARS),
        kwargs=clip(kwargs, DETAIL_CHARS),
        headers=clip(_json(envelope.get("headers") or {}), DETAIL_CHARS),
        properties=clip(_json(envelope.get("properties") or {}), DETAIL_CHARS),
        body=clip(body, DETAIL_CHARS),
        source=source,
    )


def preview(message: bytes) -> str:
    """A one-line args/kwargs preview for a listing row (``PREVIEW_CHARS`` at most)."""
    envelope = load_stored(message)
    if envelope is None:
        return ""
    args, kwargs, source = arguments(envelope)
    if not source:
        return ""
    flat = f"{' '.join(args.split())}  {' '.join(kwargs.split())}"
    return clip(flat, PREVIEW_CHARS)


def dead_preview(member: bytes, limit: int = 400) -> str:
    """A dead letter's bytes as text: printable ASCII as is, anything else as ``\\xNN``."""
    text = "".join(chr(b) if 32 <= b < 127 else f"\\x{b:02x}" for b in member[:limit])
    return text + ("\u2026" if len(member) > limit else "")


@dataclass(frozen=True)
class Bar:
    """One bar of the due-time chart, in the chart's own units (SVG user space)."""

    x: float
    y: float
    width: float
    height: float
    count: int
    start_ms: int
    end_ms: int


#: Size of the chart's drawing area (SVG viewBox).
CHART_W, CHART_H = 1200.0, 160.0


def bars(slots: list[Slot]) -> list[Bar]:
    """The chart's bars for the histogram's slots, scaled to the tallest (linear)."""
    if not slots:
        return []
    peak = max(s.count for s in slots) or 1
    width = CHART_W / len(slots)
    found = []
    for i, slot in enumerate(slots):
        height = 0.0 if not slot.count else max(1.0, CHART_H * slot.count / peak)
        found.append(
            Bar(
                x=round(i * width, 2),
                y=round(CHART_H - height, 2),
                width=round(max(0.5, width * 0.85), 2),
                height=round(height, 2),
                count=slot.count,
                start_ms=slot.start_ms,
                end_ms=slot.end_ms,
            )
        )
    return found
