"""Compressed ("cold") storage of messages due far ahead.

A Celery message is about 1 KB of JSON that differs from the next one in little
more than its ids and ETA, so a message due further ahead than
``delay_compress_after`` is stored deflated against a preset dictionary of what
Celery messages share: about a fifth of its size. It is kept apart from the
messages movers push (see :mod:`kombu_delay.store.keys`), and a mover restores
("thaws") it to the exact original string, into the ordinary space, some time
before it is due (``delay_thaw_ahead``). Lua in Redis has no zlib, so the
restoring is done by the mover in Python; a move never decodes anything.

The member format: one version byte, the length of the task id (one byte), the
task id, then raw deflate data made with :data:`DICTIONARY` followed by the task
id, then (version 2) the CRC-32 of the task id and the message, 4 bytes, big-endian:
deflate has no check of its own, and a byte changed in Redis could inflate to another
message. Publishers still write version 1 (see :data:`WRITTEN`). A dictionary, once
released, never changes (a test pins its digest): a new one needs a new version byte, and
the old one stays readable, as version 1, without the CRC, does.
"""

from __future__ import annotations

import base64
import zlib

from kombu_delay.errors import CorruptMember
from kombu_delay.message import as_read

#: First byte of a cold member made with :data:`DICTIONARY`, followed by its CRC-32.
VERSION = 2
#: The version before :data:`VERSION`: the same, without the CRC-32; still read.
UNCHECKED_VERSION = 1
#: The version :func:`pack` writes. Still version 1: a mover of 1.0.0 dead-letters a version 2
#: member (an unknown version byte), and publishers are upgraded before movers. Version 2 is
#: read from this release on, and written once no older mover can be running.
WRITTEN = UNCHECKED_VERSION
#: Longest message a cold member may hold once restored, bytes (Redis's string limit).
MAX_MESSAGE_BYTES = 512 * 2**20


def _dictionary() -> bytes:
    """What Celery protocol 2 messages on Redis share, as kombu serialises them: the field
    names and constant values, and the base64 of the tail of the body every task sends (in
    each of its three alignments). deflate finds matches in the last 32 KB and codes the
    nearer ones shorter, so the most common text comes last."""
    tail = b', {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'
    bodies = b"".join(base64.b64encode(b"x" * pad + tail)[4:] for pad in (0, 1, 2))
    skeleton = (
        b'{"body": "W1tdLCB7fSwgeyJjYWxsYmFja3MiOiBudWxsLCAiZXJyYmFja3MiOiBudWxsLCAiY2hhaW4iOiBudWxsLCAi'
        b'Y2hvcmQiOiBudWxsfV0=", "content-encoding": "utf-8", "content-type": "application/json", '
        b'"headers": {"lang": "py", "task": "tasks.", "id": "", "shadow": null, "eta": "'
        b'T00:00:00.000000+00:00", "expires": null, "group": null, "group_index": null, '
        b'"retries": 0, "timelimit": [null, null], "root_id": "", "parent_id": null, '
        b'"argsrepr": "()", "kwargsrepr": "{}", "origin": "gen@", "ignore_result": false, '
        b'"replaced_task_nesting": 0, "stamped_headers": null, "stamps": {}}, "properties": '
        b'{"correlation_id": "", "reply_to": "", "delivery_mode": 2, "delivery_info": '
        b'{"exchange": "", "routing_key": "celery"}, "priority": 0, "body_encoding": "base64", '
        b'"delivery_tag": ""}}'
    )
    return bodies + skeleton


#: The preset dictionary of version 1 (see :func:`_dictionary`).
DICTIONARY = _dictionary()


#: Longest task id a cold member carries, bytes (its length is one byte).
MAX_TASK_ID_BYTES = 255

#: Largest message a publisher compresses, bytes: a larger one is stored as it is (the ordinary
#: space). Compressing is the publisher's work, inside ``apply_async``: a 50 MB message took
#: seconds more to publish than plain kombu's, to save a part of one message's memory, where
#: the cold space exists for the many small ones a large backlog holds.
MAX_PACKED_BYTES = 2**20


def pack(message: str | bytes, task_id: str, version: int = WRITTEN) -> bytes | None:
    """Return the cold member of ``message`` (the JSON string plain kombu would push) under
    ``task_id`` (its id-index key), in format ``version``, or ``None`` when the id is too long
    to carry.

    The member starts with the task id in the clear, so Lua can name the id-index entry of a
    member it removes without decoding it; the id then joins the dictionary, so the copies
    of it inside the message cost almost nothing.
    """
    tid = as_read(task_id).encode("utf-8", "surrogatepass")  # as message.id_arg sends it
    if len(tid) > MAX_TASK_ID_BYTES:
        return None
    raw = message.encode("utf-8") if isinstance(message, str) else message
    # Level 1: a publish pays for it, and higher levels shrink a Celery message by only 5 %.
    deflate = zlib.compressobj(1, zlib.DEFLATED, -15, 8, zlib.Z_DEFAULT_STRATEGY, DICTIONARY + tid)
    check = zlib.crc32(raw, zlib.crc32(tid)).to_bytes(4, "big") if version == VERSION else b""
    return bytes([version, len(tid)]) + tid + deflate.compress(raw) + deflate.flush() + check


def task_id_of(member: bytes) -> str | None:
    """The task id a cold member carries in the clear, read without restoring it; ``None``
    where there is none to read (an unknown version byte, or cut short)."""
    if len(member) < 2 or member[0] not in (VERSION, UNCHECKED_VERSION) or len(member) < 2 + member[1]:
        return None
    try:
        return member[2 : 2 + member[1]].decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None


def unpack(member: bytes) -> tuple[str, bytes]:
    """Return ``(task_id, message)`` of a cold member, the message byte for byte as it was
    published.

    Raises :class:`CorruptMember` for anything :func:`pack` did not make (an unknown version
    byte, truncated or altered data): the caller keeps such a member, it never guesses.
    """
    checked = bool(member) and member[0] == VERSION
    if len(member) < 2 or not (checked or member[0] == UNCHECKED_VERSION):
        version = member[0] if member else None
        raise CorruptMember(f"not a kombu-delay cold member (version byte {version!r})")
    end = 2 + member[1]
    tid = member[2:end]
    data, check = (member[end:-4], member[-4:]) if checked else (member[end:], b"")
    inflate = zlib.decompressobj(-15, DICTIONARY + tid)
    try:
        task_id = tid.decode("utf-8", "surrogatepass")
        message = inflate.decompress(data, MAX_MESSAGE_BYTES)
    except (zlib.error, UnicodeDecodeError) as exc:
        raise CorruptMember(f"cold member does not inflate: {exc}") from exc
    if len(tid) != member[1] or not inflate.eof or inflate.unused_data or inflate.unconsumed_tail:
        raise CorruptMember("cold member is truncated, or has data past its end")
    if checked and zlib.crc32(message, zlib.crc32(tid)).to_bytes(4, "big") != check:
        raise CorruptMember("cold member fails its CRC-32: changed since it was stored")
    return task_id, message
