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

from kombu_delay.cli.common import shown
from kombu_delay.control import Slot
from kombu_delay.message import load_stored
from kombu_delay.protocol1 import protocol1_body

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


def _pretty_repr(text: str, limit: int) -> str:
    """A Python repr (Celery's argsrepr) laid out over lines when it parses as a literal and is
    no longer than ``limit`` (parsing a megabyte of it took seconds, and a page shows
    ``DETAIL_CHARS`` of it at most); else as it is."""
    if len(text) > limit:
        return text
    try:
        return pprint.pformat(ast.literal_eval(text), width=80, sort_dicts=False)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        # (ValueError too from pformat: an int of more than 4,300 digits has no repr)
        return text


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=repr)


def arguments(envelope: dict[str, Any], laid_out: int = DETAIL_CHARS) -> tuple[str, str, str]:
    """(args, kwargs, source) of a decoded kombu envelope; empty texts when it is no Celery task.
    An ``argsrepr`` or ``kwargsrepr`` up to ``laid_out`` characters long is laid out over lines."""
    headers = envelope.get("headers") or {}
    if "task" in headers:
        if isinstance(headers.get("argsrepr"), str) or isinstance(headers.get("kwargsrepr"), str):
            return (
                _pretty_repr(str(headers.get("argsrepr") or "()"), laid_out),
                _pretty_repr(str(headers.get("kwargsrepr") or "{}"), laid_out),
                "argsrepr",
            )
        raw = _raw_body(envelope)
        try:
            decoded = json.loads(raw) if raw is not None else None
        except (ValueError, RecursionError):  # not JSON, or nested too deep for Python
            decoded = None
        if isinstance(decoded, list) and len(decoded) >= 2:
            return _json(decoded[0]), _json(decoded[1]), "body"
        return "", "", ""
    body = protocol1_body(envelope)
    if body is not None:
        return _json(body.get("args")), _json(body.get("kwargs")), "body"
    return "", "", ""


def part(text: str) -> str:
    """One part of the task page: clipped to ``DETAIL_CHARS``, every character that is not
    printable but a line's end escaped (an RTL override must not make one id pass for another)."""
    return shown(clip(text, DETAIL_CHARS), keep="\n")


def show(message: bytes) -> Shown:
    """What the task page shows of a stored message (each part as :func:`_part` makes it)."""
    envelope = load_stored(message)
    if envelope is None:
        return Shown("", "", "", "", part(message.decode("utf-8", "replace")), "")
    args, kwargs, source = arguments(envelope)
    body = ""
    if not source:
        raw = _raw_body(envelope)
        body = raw.decode("utf-8", "replace") if raw is not None else _json(envelope.get("body"))
    return Shown(
        args=part(args),
        kwargs=part(kwargs),
        headers=part(_json(envelope.get("headers") or {})),
        properties=part(_json(envelope.get("properties") or {})),
        body=part(body),
        source=source,
    )


def preview(message: bytes) -> str:
    """A one-line args/kwargs preview for a listing row (``PREVIEW_CHARS`` at most)."""
    envelope = load_stored(message)
    if envelope is None:
        return ""
    args, kwargs, source = arguments(envelope, laid_out=0)  # one line: nothing to lay out
    if not source:
        return ""
    flat = f"{' '.join(args.split())}  {' '.join(kwargs.split())}"
    return clip(shown(flat), PREVIEW_CHARS)


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
