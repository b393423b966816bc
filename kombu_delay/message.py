"""What a kombu message says: when it is due, its id, its task name (a protocol-1 body: protocol1.py).

Time is integer epoch milliseconds (UTC) everywhere in kombu-delay; :func:`to_ms` is the
one datetime-to-ms helper. A message's due time is read, in this order, from:

1. Celery protocol 2: the ``eta`` header, ISO-8601. With an offset it is
   taken as written; without one it is UTC, as the Celery worker reads it.
2. Celery protocol 1: ``eta`` inside a JSON or msgpack body, for a message of protocol 1's
   full shape only (:func:`protocol1_body`); other such bodies are app data.
3. Plain kombu: an ``x-delay`` header in milliseconds from now, judged by the
   Redis clock (the RabbitMQ delayed-message convention), on any message that is no
   Celery protocol 2 task with an ETA: an ``eta`` header counts only beside a ``task``
   header (with none, it is app data, and the ``x-delay`` holds the message).

A stored payload (the JSON string plain kombu would push) is read and its ETA rewritten
here too, in Python: Lua never decodes a payload (a Lua decode and re-encode corrupts JSON).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from dateutil.parser import isoparse

from kombu_delay.errors import BadETA, DelayTooLong
from kombu_delay.protocol1 import part, protocol1_body, rewrite_body
from kombu_delay.store.keys import MAX_DUE_MS, MAX_DUE_TEXT


@dataclass(frozen=True)
class Due:
    """A message's due time: absolute epoch ms, or a delay from Redis's now."""

    #: Epoch ms (``relative`` false) or milliseconds from now (``relative`` true).
    ms: int
    relative: bool = False
    #: The task id (Celery), message id, or delivery tag: the key of the id index.
    task_id: str = ""


# -- time -------------------------------------------------------------------------------------


#: The epoch, for :func:`to_ms`.
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


def to_ms(when: datetime) -> int:
    """Return ``when`` as epoch milliseconds, rounded down to the millisecond, exactly (in
    floating point, ``timestamp() * 1000`` puts many a whole millisecond of the years before
    the 2109 ceiling one millisecond early). Naive datetimes are rejected, and what is no
    datetime (nor behaves as one) is a ``TypeError``."""
    try:
        if when.tzinfo is None or when.tzinfo.utcoffset(when) is None:
            raise BadETA(f"naive datetime {when.isoformat()!r}: give a timezone (UTC is usual)")
        return (when - _EPOCH) // _MS
    except (AttributeError, TypeError) as exc:  # a str (it failed on an attribute), say
        raise TypeError(
            f"an ETA given to kombu-delay is an aware datetime, not {type(when).__name__}"
        ) from exc


#: ``datetime.isoformat()``'s form, which Celery writes an ETA in (and its millisecond form):
#: ``fromisoformat`` and ``isoparse`` read it alike.
_CELERY_FORM = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{3}|\.[0-9]{6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?"
)


def _read_iso(text: str) -> datetime:
    if _CELERY_FORM.fullmatch(text):
        with contextlib.suppress(ValueError):  # 24:00, which isoparse reads
            return datetime.fromisoformat(text)
    when: datetime = isoparse(text)
    return when


def parse_iso_ms(text: object) -> int:
    """Parse an ISO-8601 ETA to epoch ms; a missing offset means UTC (Celery's rule).

    Exactly what a Celery worker reads as a time (``dateutil``'s ``isoparse``: ordinal dates,
    ``24:00``) is one here: a text the worker refuses (a space before the offset, an offset
    with seconds) is a :class:`BadETA`, delivered at once for the worker to report, not held
    until a time it will refuse then. The form Celery writes (:data:`_CELERY_FORM`) is read
    by ``datetime.fromisoformat``, which gives the same time faster."""
    if not isinstance(text, str):  # a header holds what a publisher put there
        raise BadETA(f"ETA {shown(text)} is not ISO-8601")
    try:
        when = _read_iso(text)
    except (ValueError, OverflowError) as exc:
        raise BadETA(f"ETA {shown(text)} is not ISO-8601") from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return to_ms(when)


def iso_utc(ms: int) -> str:
    """Return epoch ``ms`` as ISO-8601 in UTC with an explicit offset (Celery's ``eta`` form)."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


# -- a decoded kombu message (a dict) -----------------------------------------------------------

#: The parts of a kombu message that are JSON objects when present.
_OBJECT_PARTS = ("headers", "properties")


def _parts_are_objects(message: dict[str, Any]) -> bool:
    """Whether the headers and properties of ``message`` are objects (or absent, or empty)."""
    return all(isinstance(message.get(part) or {}, dict) for part in _OBJECT_PARTS)


def message_id(message: dict[str, Any], body: dict[str, Any] | None = None) -> str:
    """Return the id a message is indexed under: task id, message id or delivery tag (``""``
    when it has none; headers or properties that are not objects hold none)."""
    headers, props = part(message, "headers"), part(message, "properties")
    for candidate in (headers.get("id"), (body or {}).get("id"), props.get("message_id")):
        if isinstance(candidate, str) and candidate:
            return candidate
    return str(props.get("delivery_tag", ""))


def is_text(value: str) -> bool:
    """Whether ``value`` encodes as UTF-8, as Redis is sent text: not where it holds a lone
    surrogate (``os.fsdecode`` of bytes that are not UTF-8, a JSON ``\\udcff`` escape)."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def as_read(task_id: str) -> str:
    """``task_id`` as a worker reads it from the message: JSON joins two surrogates that make a
    pair (``"\\ud83d\\ude00"``) into the one character they encode; a lone one stays."""
    if is_text(task_id):
        return task_id
    return task_id.encode("utf-16", "surrogatepass").decode("utf-16", "surrogatepass")


def id_arg(task_id: str) -> str | bytes:
    """``task_id`` as Redis is sent it (the id index's key): the text itself (:func:`as_read`),
    or, where it holds lone surrogates (``os.fsdecode`` of bytes that are not UTF-8, or a JSON
    ``\\udcff`` escape), which Redis cannot be sent as text, its UTF-8 bytes with those
    surrogates encoded as they are ("surrogatepass"). No text encodes to such bytes, so no two
    ids share a key. Anything but a str is a ``TypeError`` (``None`` or bytes failed deep in the
    store, on an attribute)."""
    if not isinstance(task_id, str):
        raise TypeError(f"a task id is a str, not {type(task_id).__name__}")
    task_id = as_read(task_id)
    return task_id if is_text(task_id) else task_id.encode("utf-8", "surrogatepass")


def message_due(message: dict[str, Any]) -> Due | None:
    """Return when ``message`` is due, or ``None`` when it carries no delay.

    Raises :class:`BadETA` for a delay that is present but unusable; the
    transport then delivers the message at once, as plain kombu would. A message whose
    headers or properties are not objects (kombu sends what it is given) carries none: it could
    not be read back once stored (:func:`load_stored`).
    """
    if not _parts_are_objects(message):
        return None
    headers = part(message, "headers")
    if "task" in headers:  # Celery protocol 2
        eta = headers.get("eta")
        if isinstance(eta, datetime):  # a raw kombu publish: kombu's JSON carries it, and the
            eta = eta.isoformat()  # worker reads it back, as a time
        # An empty ETA is none here (an x-delay may still delay the message); another false one
        # (0, an empty list) is a bad one. (A Celery 5.7 worker fails on either, as on redis://.)
        if eta is not None and eta != "":
            return Due(parse_iso_ms(eta), task_id=message_id(message))
    # A protocol-1 task's ETA, in its body, before an x-delay beside it: the worker waits for
    # that ETA whenever the message arrives (held by the x-delay, it held it in memory).
    body = protocol1_body(message)
    if body is not None and body["eta"]:
        eta = body["eta"]
        if not isinstance(eta, str):
            raise BadETA(f"ETA {shown(eta)} is not ISO-8601")
        return Due(parse_iso_ms(eta), task_id=message_id(message, body))
    if "x-delay" in headers:
        delay = _x_delay_ms(headers["x-delay"])
        return Due(delay, relative=True, task_id=message_id(message, body)) if delay > 0 else None
    return None


#: The longest part of a header's value that an error or log line shows, characters.
SHOWN_CHARS = 200


def shown(value: Any) -> str:
    """``repr(value)``, cut to about :data:`SHOWN_CHARS` characters for an error or a log
    line: a header holds whatever a publisher put there, a megabyte of it too."""
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python shows (sys.get_int_max_str_digits)
        return f"<{type(value).__name__} too long to show>"
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(text):,} characters)"


# The text of a number of milliseconds: ASCII digits, a sign, a point and an exponent, or an
# infinity (refused as too long, or no delay). Python's float() reads more ("1_000", digits of
# other scripts), which no other reader of the header takes for a number.
# Each text is read one way only: ``\d+\.?\d*`` split a run of digits between its two parts
# in every way before it refused one followed by a letter, a time that grew with the square of
# its length (16,000 digits: 7.5 s).
_MS_TEXT = re.compile(
    r"\s*[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?\s*|\s*[+-]?inf(?:inity)?\s*", re.ASCII | re.IGNORECASE
)


def _x_delay_ms(raw: Any) -> int:
    """An ``x-delay`` header as whole milliseconds (0 or less: no delay)."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise BadETA(f"x-delay {shown(raw)} is not a number of milliseconds")
    if isinstance(raw, str) and not _MS_TEXT.fullmatch(raw):
        raise BadETA(f"x-delay {shown(raw)} is not a number of milliseconds")
    try:
        delay = float(raw)
    except OverflowError:  # an int past a float's range: as far as infinity, or as short
        delay = math.inf if int(raw) > 0 else -math.inf
    except (TypeError, ValueError) as exc:
        raise BadETA(f"x-delay {shown(raw)} is not a number of milliseconds") from exc
    if math.isnan(delay):
        raise BadETA(f"x-delay {shown(raw)} is not a number of milliseconds")
    if delay >= MAX_DUE_MS:  # infinity too: never "at once"
        raise DelayTooLong(f"x-delay {shown(raw)} ms is past the latest supported due time, {MAX_DUE_TEXT}")
    return 0 if delay <= 0 else int(delay)


# -- a stored payload (the JSON string plain kombu would push) ------------------------------------


def load_stored(payload: bytes | str) -> dict[str, Any] | None:
    """A stored payload as a kombu message, or ``None`` for a member that is not one (damaged):
    not a JSON object, or one whose ``headers`` or ``properties`` is not an object."""
    try:
        message = json.loads(payload)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to be a kombu message
        return None
    if not isinstance(message, dict):
        return None
    return message if _parts_are_objects(message) else None


def index_id(payload: bytes | str) -> str:
    """Return the id-index key of a stored payload, as the transport chose it at publish
    (task id, message id or delivery tag); ``""`` for a payload that is not a kombu message."""
    message = load_stored(payload)
    if message is None:
        return ""
    return message_id(message, protocol1_body(message))


def task_name(payload: bytes | str) -> str | None:
    """Return the Celery task name of a payload (protocol 2 or 1), or ``None``."""
    message = load_stored(payload)
    if message is None:
        return None
    headers = message.get("headers") or {}
    name = headers.get("task")
    if name is None:
        body = protocol1_body(message)
        name = body["task"] if body is not None else None
    return name if isinstance(name, str) else None


def carries_eta(payload: bytes | str) -> bool:
    """True when the stored message ``payload`` carries an ETA of its own, which a worker
    waits for whenever the message arrives; false for one held by its ``x-delay`` alone (or
    that holds no delay), which a worker runs on arrival."""
    message = load_stored(payload)
    try:
        due = message_due(message) if message is not None else None
    except (BadETA, DelayTooLong):
        return False
    return due is not None and not due.relative


def with_eta(payload: bytes | str, due_ms: int) -> str:
    """Return ``payload`` with its Celery ETA set to ``due_ms``.

    A worker holds a message in memory until the ETA it carries, whatever time it
    was delivered, so a message rescheduled earlier must carry its new ETA too.
    Protocol 2: the ``eta`` header; protocol 1: ``eta`` in the body, encoded as it was
    (JSON or msgpack, compressed or not, base64 ``body_encoding`` kept). Other messages
    (``x-delay``) are returned unchanged: their delivery time is the stored score alone.
    """
    text = payload.decode("utf-8") if isinstance(payload, bytes) else payload
    message = load_stored(text)
    if message is None:
        return text
    eta = iso_utc(due_ms)
    headers = message.get("headers") or {}
    if "task" in headers:
        if headers.get("eta") is None or headers["eta"] == "":  # held by its x-delay
            return text
        headers["eta"] = eta
        return json.dumps(message)
    body = protocol1_body(message)
    if body is None:
        return text
    rewrite_body(message, body, eta)
    return json.dumps(message)


def spent_delay_removed(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` as its due time is judged: without its ``x-delay`` when kombu puts it back
    (``redelivered``: a requeue, or an unacked message restored, where ack emulation is off).
    That delay, from its publish, is spent, as RabbitMQ's delayed exchange applies one only on
    publish; an absolute ETA still counts."""
    headers = message.get("headers")
    if not message.get("redelivered") or not isinstance(headers, dict) or "x-delay" not in headers:
        return message
    return {**message, "headers": {k: v for k, v in headers.items() if k != "x-delay"}}
