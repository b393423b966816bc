"""Key names and bucket maths: every Redis key kombu-delay touches is named here.

All functions are pure. ``prefix`` is kombu's ``global_keyprefix``; kombu's
prefixing client rewrites only some commands (and only ``KEYS[1]`` of
``EVALSHA``), so kombu-delay applies the prefix itself and talks to Redis
through a plain client.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

# For the scripts (schedule.lua counts the movers with a fresh heartbeat, forget.lua takes over
# the walk of one without): constants of keys.py.
from kombu_delay.ops.checks import FRESH_HEARTBEAT_MS as FRESH_HEARTBEAT_MS
from kombu_delay.ops.checks import FUTURE_BEAT_MS as FUTURE_BEAT_MS

#: Namespace of every key kombu-delay creates, after ``global_keyprefix``.
NAMESPACE = "kombu_delay:"

#: Sub-millisecond tie-breakers per due millisecond. ``due_ms + seq/2048`` is an
#: exact double for every epoch millisecond below 2**42 (year 2109), the hard ETA
#: ceiling: a double has 53 bits, 42 for the millisecond and 11 for ``seq``.
SEQ_SLOTS = 2048

#: kombu's default ``sep`` transport option, between a queue name and its priority step.
KOMBU_PRIORITY_SEP = "\x06\x16"
#: kombu's default priority steps (its ``priority_steps`` transport option): a queue's lists
#: are the queue itself (step 0) and ``<queue><sep><step>`` for each other step.
KOMBU_PRIORITY_STEPS = (0, 3, 6, 9)

#: Latest due time accepted, epoch ms (in the year 2109): below 2**42, where a double still holds
#: every score ``due + seq/2048`` exactly, so each message's id-index ref can be read back
#: from its score.
MAX_DUE_MS = 2**42 - 1
#: :data:`MAX_DUE_MS` as errors and docs name it.
MAX_DUE_TEXT = "2109-05-15 07:35:11.103 UTC"

#: Bytes of messages one move, thaw scan or thaw call carries, about (at least one message):
#: large messages must not hold Redis for seconds in one call.
CALL_BYTES = 16 * 2**20

#: The storage format this version writes and reads: the layout of every key named here. A
#: change that code of this format would misread takes the next number. Publishers (with their
#: first message) and movers (with each heartbeat) write it as the field :data:`FORMAT_FIELD` of
#: :func:`totals`; movers (heartbeat.lua) and inspection check it and refuse any other.
FORMAT = 1
FORMAT_FIELD = "format"


def ns(prefix: str) -> str:
    """Return the prefix shared by all kombu-delay keys of one app."""
    return f"{prefix}{NAMESPACE}"


def bucket_start(due_ms: int, width_ms: int) -> int:
    """Return the start (epoch ms) of the bucket that holds ``due_ms``."""
    return due_ms - due_ms % width_ms


def index(prefix: str, space: str = "") -> str:
    """ZSET of bucket starts holding scheduled messages (of one space): member and score =
    bucket start."""
    return f"{ns(prefix)}{space}index"


def large(prefix: str, space: str = "") -> str:
    """ZSET of the buckets (of one space) whose set for a destination has reached 1,000
    messages, for the movers' plans: member and score = bucket start. A hint: the publish
    that reaches the size writes it, the bucket's clean-up takes it out (``lua/_put.lua``)."""
    return f"{ns(prefix)}{space}large"


def lists(prefix: str) -> str:
    """HASH of the queues declared with x-expires: a destination list key -> the JSON array of
    its queue's other list keys (its other priority steps), whose expiry a push renews with
    its own, as kombu's publish renews every list of the queue (``lua/_put.lua``)."""
    return f"{ns(prefix)}lists"


#: Key-name prefix of the cold space: messages stored compressed (see :mod:`kombu_delay.store.spaces`).
#: A cold bucket has the keys of a bucket with this in front (``cm:<start>``,
#: ``cz:<start>:<dest>``), its own index (``cindex``) and no task-id list; its id-index refs
#: read ``c<start>:<offset>:<seq>``. Movers never push from it: they thaw its messages into
#: the ordinary buckets first.
COLD = "c"


def meta(prefix: str, start_ms: int, space: str = "") -> str:
    """HASH of one bucket: ``q:<dest>`` counts, the ``seq`` counter and its ``end`` (epoch ms)."""
    return f"{ns(prefix)}{space}m:{start_ms}"


def is_meta(key: str) -> bool:
    """Whether ``key`` is named as a bucket's meta hash (:func:`meta`, either space), under any
    key prefix."""
    return _META.search(key) is not None


def is_cold_meta(key: str) -> bool:
    """Whether ``key`` is named as a compressed bucket's meta hash."""
    found = _META.search(key)
    return found is not None and found.group(1) == COLD


_META = re.compile(rf"{re.escape(NAMESPACE)}({COLD}?)m:\d+\Z")


def queue_set(prefix: str, start_ms: int, dest: str, space: str = "") -> str:
    """ZSET of one bucket's messages for one destination list: member = the payload itself
    (compressed in the cold space), score ``due_ms + seq/2048``."""
    return f"{ns(prefix)}{space}z:{start_ms}:{dest}"


def staged(prefix: str, start_ms: int, dest: str) -> str:
    """LIST: a herd of one bucket's set for ``dest`` (a run of members due at one millisecond)
    copied ahead of its due time, in the order a move pushes it, for the move to hand over
    whole (``RENAME`` onto ``dest``). Its bucket's meta hash marks it (fields ``h:<dest>``,
    the run's due time, and ``hn:<dest>``, its size); see ``lua/_staged.lua``."""
    return f"{ns(prefix)}h:{start_ms}:{dest}"


def split_bucket(text: str) -> tuple[str, int]:
    """Split a bucket as the scripts name it (``<start>``, or ``c<start>`` in the cold space)
    into its space (``""`` or :data:`COLD`) and start; raise ``ValueError`` for anything else."""
    space = COLD if text.startswith(COLD) else ""
    start = start_of(text[len(space) :])
    if start is None:
        raise ValueError(text)
    return space, start


def start_of(member: bytes | str) -> int | None:
    """The bucket start an index member names (``"<start>"``, written as the scripts write a
    number: no leading zero), or ``None`` for a member no publish writes (written by hand,
    ``0<start>`` too, which the scripts read as another bucket): readers pass it over, and the
    scripts retire it."""
    text = member.decode("ascii", "replace") if isinstance(member, bytes) else member
    if not (text.isascii() and text.isdigit()) or (text[0] == "0" and text != "0"):
        return None
    return int(text)


def due_of(score: float) -> int:
    """The due time (epoch ms) a member's score stands for, kept within ``0 .. MAX_DUE_MS``:
    a score no publish writes (below 0, past the span, ``±inf``, by hand) is shown at the
    nearest end, in the order of the scores, and not raised on."""
    return int(min(max(score, 0.0), float(MAX_DUE_MS)))


def cold_index(prefix: str) -> str:
    """ZSET of the cold buckets' starts, as :func:`index` for the ordinary ones."""
    return index(prefix, COLD)


def task_ids(prefix: str, start_ms: int) -> str:
    """LIST of the task ids scheduled into one bucket, for the id-index clean-up once it drains."""
    return f"{ns(prefix)}t:{start_ms}"


def drained(prefix: str) -> str:
    """ZSET of drained buckets waiting for their id-index clean-up: member = start, score = end."""
    return f"{ns(prefix)}gc"


def purging(prefix: str) -> str:
    """HASH destination list key -> purges of it under way (``purging.lua``)."""
    return f"{ns(prefix)}purging"


def ids(prefix: str) -> str:
    """HASH task id -> space-separated refs ``start:offset:seq`` of its stored messages."""
    return f"{ns(prefix)}ids"


def counts(prefix: str) -> str:
    """HASH destination list key -> number of scheduled messages."""
    return f"{ns(prefix)}counts"


def totals(prefix: str) -> str:
    """HASH of lifetime counters (scheduled, moved, dead, expired, cancelled, ...) and the
    storage format (:data:`FORMAT_FIELD`), kept for as long as the namespace is used."""
    return f"{ns(prefix)}totals"


def dead(prefix: str) -> str:
    """LIST of dead letters: compressed members that could not be restored, kept as stored."""
    return f"{ns(prefix)}dead"


def movers(prefix: str) -> str:
    """ZSET mover id -> last heartbeat (epoch ms, Redis clock)."""
    return f"{ns(prefix)}movers"


def alerts(prefix: str) -> str:
    """HASH of what movers found wrong that no single call shows (another key prefix's
    stranded messages): name -> ``<epoch ms checked> <text>``. Movers rewrite it on each check."""
    return f"{ns(prefix)}alerts"


#: The field of :func:`alerts` that tells of stranded prefixes.
STRANDED_ALERT = "stranded"


def stranded(prefix: str) -> str:
    """HASH of the other key prefixes whose messages no mover serves, as this namespace's movers
    last found them: prefix -> messages. A mover's check looks again at what is recorded and
    at what it found, and writes what is stranded still, the record watched from its read to
    its write: no mover's check writes over another's finding."""
    return f"{ns(prefix)}stranded"


#: How long :func:`taken` notes a message an edit took, ms: kombu retries a publish within
#: seconds (Celery's default policy: within a second).
TAKEN_KEEP_MS = 300_000


def taken(prefix: str) -> str:
    """ZSET of the messages edits (cancel, reschedule) took lately: member :func:`taken_mark`,
    score when (epoch ms, Redis clock), each kept :data:`TAKEN_KEEP_MS`. kombu's retry of a
    publish whose reply was lost, made after an edit took what the first attempt stored, finds
    it here and stores nothing more (:mod:`kombu_delay.resend`)."""
    return f"{ns(prefix)}taken"


def digest(message: str | bytes) -> bytes:
    """What a message is known by, where its bytes would be too many to keep: 16 bytes."""
    return hashlib.blake2b(message.encode() if isinstance(message, str) else message, digest_size=16).digest()


def taken_mark(dest: str, message_digest: bytes) -> bytes:
    """The member of :func:`taken` for a message (its :func:`digest`) for list key ``dest``."""
    return hashlib.blake2b(dest.encode() + b"\0" + message_digest, digest_size=16).digest()


def walk(prefix: str) -> str:
    """HASH of the walk of the id index in hand (``at``, ``by``, ``done``): it expires when the
    next walk is due, so that one mover walks in that time, however many run."""
    return f"{ns(prefix)}walk"


def wake_channel(prefix: str) -> str:
    """Pub/sub channel a publish uses to wake movers for an earlier due time. Pub/sub ignores
    the database: a wake-up's text, ``<due ms>@<db>``, names its database (see
    :func:`wakes`)."""
    return f"{ns(prefix)}wake"


def wakes(text: bytes | str, db: int) -> bool:
    """Whether a wake-up whose text is ``text`` is one for database ``db``'s movers: it names
    that database, or none (a 1.0.0 publisher's, which wakes every mover)."""
    if isinstance(text, str):
        text = text.encode()
    _, at, named = text.rpartition(b"@")
    return not at or named == str(db).encode()


def destination(prefix: str, queue: str, priority: int, sep: str) -> str:
    """Return kombu's list key for ``queue`` at an already-stepped priority.

    Mirrors ``kombu.transport.redis.Channel._q_for_pri`` plus the global key
    prefix that kombu's client would add to ``LPUSH``.
    """
    if priority:
        return f"{prefix}{queue}{sep}{priority}"
    return f"{prefix}{queue}"


def queue_of(dest: str, prefix: str, sep: str, steps: Iterable[int] = KOMBU_PRIORITY_STEPS) -> str:
    """Return the queue name of a destination key (inverse of :func:`destination`): a name
    that ends in ``sep`` and one of the priority ``steps`` is that queue's priority list, as
    kombu names them; so is one that ends in kombu's own separator and any step (no queue
    name holds that separator: a tool not told an app's ``priority_steps`` still finds its
    lists); any other (``tenant:7`` under ``sep=':'``, where 7 is no step) is a queue of its own."""
    name = dest[len(prefix) :] if prefix and dest.startswith(prefix) else dest
    if not sep:  # kombu names them <queue><step> then: a name that ends in a step is one
        for step in sorted({str(step) for step in steps if step}, key=len, reverse=True):
            if len(name) > len(step) and name.endswith(step):
                return name[: -len(step)]
        return name
    base, found, pri = name.rpartition(sep)
    if not found:
        return name
    if pri in {str(step) for step in steps if step}:
        return base
    any_step = sep == KOMBU_PRIORITY_SEP and pri.isascii() and pri.isdigit() and pri == str(int(pri))
    return base if any_step and int(pri) else name


def score(due_ms: int, seq: int) -> float:
    """Return the bucket score of a stored message; ``floor(score) == due_ms``."""
    return due_ms + seq / SEQ_SLOTS


def score_text(value: float) -> str:
    """Format a score so Redis parses it back to the identical double."""
    return repr(float(value))
