"""Celery protocol 1: a task message whose ETA is in its body, not in a header.

Read (:func:`protocol1_body`) and, with a new ETA, written back (:func:`rewrite_body`) in the
form it was sent in: JSON or msgpack, compressed or not, base64 or not. Pickle and YAML bodies
are never read (either may run code as it loads): such a task is no protocol 1 task here.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import kombu.compression
import kombu.serialization
import kombu.utils.json


def part(message: dict[str, Any], name: str) -> dict[str, Any]:
    """``message[name]`` when it is an object, else ``{}`` (absent, damaged in Redis, or
    published so: kombu sends what it is given)."""
    value = message.get(name)
    return value if isinstance(value, dict) else {}


#: The serializers of a Celery protocol 1 body that are read, by content type: those that
#: decode to data only (never pickle or YAML, which may run code as they load; msgpack where it
#: is installed, as it is for its publisher), with the keys every such body has, as they appear
#: in its bytes: a cheap test, so that a plain kombu body is decoded only when it could be a
#: Celery task at all.
_PROTOCOL1_BODIES = {
    "application/json": ("json", (b'"task"', b'"id"', b'"args"', b'"kwargs"', b'"eta"')),
    "application/x-msgpack": ("msgpack", (b"\xa4task", b"\xa2id", b"\xa4args", b"\xa6kwargs", b"\xa3eta")),
}


def protocol1_body(message: dict[str, Any]) -> dict[str, Any] | None:
    """Return the decoded body of a Celery protocol 1 task message, else ``None``.

    Recognised by its full shape, as Celery's ``as_task_v1`` builds it and its worker reads it:
    no ``task`` header, and a JSON or msgpack object body (compressed, where Celery's
    ``task_compression`` had kombu compress it) with ``task`` and ``id`` strings, an ``args``
    list, a ``kwargs`` mapping and an ``eta`` key. Application data that merely has ``task`` and
    ``eta`` keys is not a Celery task, and plain kombu delivers it as it is.
    """
    headers = part(message, "headers")
    content_type = message.get("content-type")
    if "task" in headers or not isinstance(content_type, str) or content_type not in _PROTOCOL1_BODIES:
        return None
    serializer, marks = _PROTOCOL1_BODIES[content_type]
    raw = _body_bytes(message)
    compression = headers.get("compression")
    if raw is not None and compression:  # Celery's task_compression: kombu compressed the body
        try:
            raw = kombu.compression.decompress(raw, compression)
        except Exception:  # an unknown or damaged compression: not a task this can read
            return None
    if raw is None or not all(key in raw for key in marks):
        return None
    decoded = _decoded(raw, serializer, content_type)
    if (
        isinstance(decoded, dict)
        and isinstance(decoded.get("task"), str)
        and isinstance(decoded.get("id"), str)
        and isinstance(decoded.get("args"), list)
        and isinstance(decoded.get("kwargs"), dict)
        and "eta" in decoded
    ):
        return decoded
    return None


def _decoded(raw: bytes, serializer: str, content_type: str) -> Any:
    """A protocol 1 body decoded, or ``None`` where it cannot be: JSON by :mod:`json`, msgpack
    by kombu's own decoder, as the worker decodes it (not installed: not read)."""
    try:
        if serializer == "json":
            return json.loads(raw)
        return kombu.serialization.loads(raw, content_type, "binary", accept={content_type})
    except Exception:  # not JSON or msgpack (its own errors: ExtraData...), nested too deep to be a
        return None  # Celery body, or no msgpack installed


def _body_bytes(message: dict[str, Any]) -> bytes | None:
    """The body of ``message`` as bytes (base64 ``body_encoding`` undone), or ``None``."""
    body = message.get("body")
    if isinstance(body, bytes):
        return body
    if _kombu_bytes(body):  # a body_encoding of None: bytes, as kombu's JSON wrote them
        try:
            return kombu.utils.json.object_hook(body)  # type: ignore[no-any-return]
        except ValueError:  # not base64 after all, or a lone surrogate
            return None
    if not isinstance(body, str):
        return None
    props = part(message, "properties")
    try:
        return base64.b64decode(body) if props.get("body_encoding") == "base64" else body.encode()
    except ValueError:  # not base64 after all (binascii.Error), or a lone surrogate
        return None


def _kombu_bytes(body: Any) -> bool:
    """Whether ``body`` is bytes as kombu's JSON writes them: ``{"__type__": "bytes"}`` (UTF-8)
    or ``"base64"``, with the text as ``__value__``."""
    return (
        isinstance(body, dict)
        and body.keys() == {"__type__", "__value__"}
        and body["__type__"] in ("bytes", "base64")
        and isinstance(body["__value__"], str)
    )


def rewrite_body(message: dict[str, Any], body: dict[str, Any], eta: str) -> None:
    """Write ``body`` (:func:`protocol1_body` of ``message``), with ``eta``, back into
    ``message``, encoded as it was."""
    headers = part(message, "headers")
    body["eta"] = eta
    if message.get("content-type") == "application/json":
        encoded = json.dumps(body).encode("utf-8")
    else:  # msgpack (protocol1_body read it): as its publisher's kombu encoded it
        encoded = kombu.serialization.dumps(body, serializer=_PROTOCOL1_BODIES[message["content-type"]][0])[2]
    if headers.get("compression"):  # compressed as it was (protocol1_body read it decompressed)
        encoded = kombu.compression.compress(encoded, headers["compression"])[0]
    props = part(message, "properties")
    if _kombu_bytes(message.get("body")):  # as it was: bytes, which kombu's JSON writes so
        message["body"] = kombu.utils.json.JSONEncoder().default(encoded)
    elif props.get("body_encoding") == "base64":
        message["body"] = base64.b64encode(encoded).decode("ascii")
    else:
        message["body"] = encoded.decode("utf-8")
