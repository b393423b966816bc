"""The stored member format, read on the Python side (the Lua scripts write it).

An envelope is ``<len(id)>:<len(dest)>:<id><dest><payload>``, lengths in
bytes. ``payload`` is the exact JSON string plain kombu would ``LPUSH`` onto
``dest``; it is never decoded by Lua, only copied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import CorruptMember

_HEADER = re.compile(rb"^(\d{1,9}):(\d{1,9}):")


@dataclass(frozen=True)
class Envelope:
    """One scheduled message as stored in a bucket."""

    task_id: str
    dest: str
    payload: bytes

    def encode(self) -> bytes:
        """Return the member bytes (the same layout ``schedule.lua`` builds)."""
        tid = self.task_id.encode()
        dest = self.dest.encode()
        return b"%d:%d:%s%s%s" % (len(tid), len(dest), tid, dest, self.payload)


def decode(member: bytes) -> Envelope:
    """Parse member bytes; raise :class:`CorruptMember` if they are not an envelope."""
    match = _HEADER.match(member)
    if not match:
        raise CorruptMember(f"no envelope header in {member[:40]!r}")
    id_len, dest_len = int(match[1]), int(match[2])
    start = match.end()
    body = start + id_len + dest_len
    if dest_len == 0 or len(member) <= body:
        raise CorruptMember(f"envelope lengths do not fit in {member[:40]!r}")
    try:
        task_id = member[start : start + id_len].decode()
        dest = member[start + id_len : body].decode()
    except UnicodeDecodeError as exc:
        raise CorruptMember(f"envelope header is not UTF-8: {member[:40]!r}") from exc
    return Envelope(task_id, dest, member[body:])
