"""Where a message waits, and what can happen to it.

A scheduled message waits in one of two **spaces**, each a set of time buckets with its own index
(:mod:`kombu_delay.store.keys` names their keys; ``lua/_spaces.lua`` is the same idea in Lua):

- :data:`ORDINARY`: the message exactly as plain kombu would push it. Movers push it onto its list
  once due (``move.lua``); nothing else ever leaves this space except by an edit or an expiry.
- :data:`COLD`: the message compressed (:mod:`kombu_delay.store.cold`), for one due further ahead
  than ``delay_compress_after``. Movers never push from here: they **thaw** each message into the
  ordinary space ``delay_thaw_ahead`` before it is due, at the same due millisecond (``thaw.lua``),
  or move a member that cannot be restored to the dead-letter list.

In either space a message may be cancelled, rescheduled or purged (each claimed by ``ZREM`` of
the exact member, so never both that and delivered), and it expires only when no mover swept its
bucket for a whole grace (``sweep.lua``). Every operation that looks at "what is scheduled" (find,
cancel, reschedule, purge, listing, counts, census, the earliest due time, the stranded-prefix
check) walks :data:`ALL`, so neither space can be left out.

The races between the spaces all come from a thaw, which moves a message from the cold space into
the ordinary one while others look, and they are handled here, once:

- a walk over both spaces takes the cold one first (:data:`ALL`): a message thawed meanwhile moves
  into the part still to come, so it is counted or listed twice at worst, never missed;
- a cancel that found a message and then could not claim it looks again (edit.py), and a
  reschedule that found a cold one picks out its ordinary copy (:func:`thawed_copy`);
- a publisher whose clock runs behind Redis's may ask for the cold space too late: the script
  refuses (``TOO_SOON_FOR_COLD``) and the message goes to the ordinary space (:func:`placed`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import cold, keys

if TYPE_CHECKING:
    from kombu_delay.store.replies import Stored

R = TypeVar("R")


@dataclass(frozen=True)
class Space:
    """One space: how its keys are named and how its members are coded."""

    name: str
    #: What its keys, bucket names and id-index refs start with (``""`` or ``c``).
    tag: str
    #: True when its members are compressed (:mod:`kombu_delay.store.cold`).
    compressed: bool
    #: Its place in a walk over both spaces, and in the listing order (0 first).
    rank: int

    def index(self, prefix: str) -> str:
        """ZSET of this space's bucket starts."""
        return keys.index(prefix, self.tag)

    def large(self, prefix: str) -> str:
        """ZSET of this space's buckets holding a large set (see :func:`keys.large`)."""
        return keys.large(prefix, self.tag)

    def meta(self, prefix: str, start_ms: int) -> str:
        """HASH of one bucket (see :func:`keys.meta`)."""
        return keys.meta(prefix, start_ms, self.tag)

    def queue_set(self, prefix: str, start_ms: int, dest: str) -> str:
        """ZSET of one bucket's messages for one destination (see :func:`keys.queue_set`)."""
        return keys.queue_set(prefix, start_ms, dest, self.tag)

    def bucket(self, start_ms: int) -> str:
        """A bucket as the scripts name it: its start, after the tag."""
        return f"{self.tag}{start_ms}"

    def member(self, payload: str, task_id: str) -> str | bytes:
        """What is stored for ``payload`` in this space (:func:`for_due` chose it)."""
        if not self.compressed:
            return payload
        member = cold.pack(payload, task_id)
        if member is None:
            raise ValueError(f"task id {task_id!r} is too long for the cold space")
        return member

    def message(self, member: bytes) -> bytes:
        """The message plain kombu would push, from a member of this space; raises
        :class:`~kombu_delay.errors.CorruptMember` for a compressed one that cannot be restored."""
        return cold.unpack(member)[1] if self.compressed else member


ORDINARY = Space("ordinary", "", compressed=False, rank=1)
COLD = Space("cold", keys.COLD, compressed=True, rank=0)
#: Both spaces, in the order every walk over them takes: the cold one first (see above).
ALL = (COLD, ORDINARY)


def of_tag(tag: str) -> Space:
    """The space whose tag is ``tag``; raise ``ValueError`` for anything else."""
    for space in ALL:
        if space.tag == tag:
            return space
    raise ValueError(tag)


def of_bucket(text: str) -> tuple[Space, int]:
    """Split a bucket as the scripts name it into its space and start; raise ``ValueError`` for
    anything else."""
    tag, start = keys.split_bucket(text)
    return of_tag(tag), start


def prefix_of_index(key: str) -> str | None:
    """The ``global_keyprefix`` of the index key of either space, else ``None``."""
    for space in ALL:
        suffix = space.index("")
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return None


def for_due(due: Due, settings: Settings, now_ms: float | None, size: int) -> Space:
    """The space a message due at ``due`` goes to: the cold one when due further ahead than
    ``compress_after_ms`` and than the thaw horizon (the script refuses a cold member within it),
    whose task id a cold member can carry, and whose ``size`` (bytes, or characters: the JSON
    of a message is almost all ASCII) is at most :data:`cold.MAX_PACKED_BYTES`.

    ``now_ms``: the publisher's estimate of Redis's clock (``None``: this machine's wall clock,
    where there is no estimate). It is good enough here: the script checks against Redis's
    clock, and :func:`placed` handles a refusal.
    """
    carried = due.task_id.encode("utf-8", "surrogatepass")  # as cold.pack carries it
    if (
        not settings.compress_after_ms
        or len(carried) > cold.MAX_TASK_ID_BYTES
        or size > cold.MAX_PACKED_BYTES
    ):
        return ORDINARY
    now = time.time() * 1000 if now_ms is None else now_ms
    ahead = due.ms if due.relative else due.ms - now
    if ahead <= max(settings.compress_after_ms, settings.thaw_ahead_ms):
        return ORDINARY
    return COLD


def placed(space: Space, reply: R, resend: Callable[[Space], R], too_soon: Callable[[R], bool]) -> R:
    """The reply of storing a message: ``reply``, what storing it in ``space`` answered, unless the
    cold space refused it as due too soon by Redis's clock (the publisher's runs behind); then
    ``resend(ORDINARY)``'s."""
    if space.compressed and too_soon(reply):
        return resend(ORDINARY)
    return reply


def thawed_copy(stored: Stored, found: Iterable[Stored]) -> Stored | None:
    """The ordinary copy, among ``found``, of the cold message ``stored`` (same destination, due
    time and message), else ``None``."""
    if not stored.space.compressed:
        return None
    wanted = (stored.dest, stored.due_ms, stored.message)
    copies = (s for s in found if not s.space.compressed and (s.dest, s.due_ms, s.payload) == wanted)
    return next(copies, None)
