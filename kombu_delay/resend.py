"""A delayed publish whose reply was lost, and kombu's retry of it: stored once.

A delayed publish is one script call. When its reply is lost (Redis closed the connection
while the call was under way, or answered later than the client's ``socket_timeout``), the
script may have run all the same. kombu's retry then sends the same message again, on a new
channel and under a new delivery tag, and without a check it would be stored twice.

So an attempt that failed so is remembered here, in the process (kombu's retry opens a new
channel), by thread (kombu retries in the thread that published: two threads publishing the
same message are two publishes) and by the publish call: kombu's retry of one
``Producer.publish`` prepares the message again around the same properties dict, and a new
call makes a new one (an app that caught the error and publishes the same message again later
means a second message, as plain kombu stores one). Before a retry of a message that differs
from a remembered one by its delivery tag alone, the namespace is searched for the remembered
attempt, by its id and a digest of its exact bytes: found, the publish stores nothing more
(logged at WARNING, counted in ``totals.resent``), and a retry that finds the message due by
now pushes nothing either (a mover moves the stored one). Nor does one whose attempt an edit
took since it was sent (a cancel, a reschedule: noted for a while, see ``keys.taken``): stored
again, a cancelled task would run, a rescheduled one run twice. A message that came due and
was moved between the two attempts is no longer found, and is pushed again, as plain kombu
would push it again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from kombu.utils.json import dumps

from kombu_delay.errors import KombuDelayError, RedisUnavailable
from kombu_delay.store import Store, keys

logger = logging.getLogger(__name__)

#: How long an attempt is remembered, seconds: kombu's retries come within seconds, or once
#: Redis is back after an outage that a retry policy waits out.
KEPT_S = 3600.0
#: The most messages whose attempts are remembered (each by digests: a few hundred bytes,
#: whatever the message's size); the oldest is forgotten first.
MAX_KEPT = 1000
#: The most attempts of one message remembered, the latest: each costs its retry a search.
MAX_ATTEMPTS = 10
#: Seconds before an attempt was sent that an edit's note of taking it may be dated, by this
#: machine's reading of Redis's clock (a note older than that is of another, earlier message
#: with the same bytes).
TAKEN_SLACK_S = 1.0

#: Where a message goes: (broker, key prefix, its list key).
Where = tuple[str, str, str]


@dataclass(frozen=True)
class Attempt:
    """A publish whose reply was lost: what it sent."""

    #: The id it was indexed by (its task id; a message without one, its delivery tag).
    task_id: str
    #: The digest (:func:`_digest`) of the message as it was sent.
    sent: bytes
    #: When it failed, ``time.monotonic()``.
    at: float
    #: When it was sent, ``time.monotonic()``.
    sent_at: float
    #: The message's properties dict, whose ``id()`` names the publish call in the key: held
    #: while the attempt is, so that no other dict can take its id meanwhile.
    call: object = None


#: A message's attempts are kept under where it goes, the thread, its fingerprint and the
#: ``id()`` of its properties dict (the publish call's: see the module's docstring).
Key = tuple[Where, int, bytes, int]

_lock = threading.Lock()
_attempts: OrderedDict[Key, list[Attempt]] = OrderedDict()


def _fingerprint(message: dict[str, Any]) -> bytes:
    """A digest of ``message`` without its delivery tag, which kombu draws anew for each attempt."""
    properties = message.get("properties")
    if isinstance(properties, dict):
        message = {**message, "properties": {k: v for k, v in properties.items() if k != "delivery_tag"}}
    return keys.digest(str(dumps(message)))


def _key(where: Where, message: dict[str, Any]) -> Key:
    return (where, threading.get_ident(), _fingerprint(message), id(message.get("properties")))


def _remembered(key: Key) -> list[Attempt]:
    with _lock:
        horizon = time.monotonic() - KEPT_S
        while _attempts and next(iter(_attempts.values()))[-1].at < horizon:
            _attempts.popitem(last=False)
        return list(_attempts.get(key, ()))


@contextmanager
def once(store: Store, where: Where, message: dict[str, Any], task_id: str, payload: str) -> Iterator[bool]:
    """Publish ``message`` (sent as ``payload``, indexed by ``task_id``) at most once.

    Yields False where an earlier attempt of it, whose reply was lost, is stored already:
    the caller then stores nothing. Otherwise yields True, and remembers the caller's attempt
    where it fails with :class:`RedisUnavailable` (the error goes on to kombu, which retries).
    A search that fails raises, and the attempts are kept for the next retry."""
    key = _key(where, message) if _attempts else None
    if key and stored_before(store, where, key):
        yield False
        return
    sent_at = time.monotonic()
    properties = message.get("properties")
    try:
        yield True
    except (RedisUnavailable, redis.ResponseError) as exc:
        # kombu's retry sends the message to every queue of its route again, those this call
        # stored it in too: they are remembered, and their retries find them. So is this one
        # where its reply was lost; one Redis refused stored nothing, and its retry stores it.
        failed_at = time.monotonic()
        for other, other_id, sent, at in _stored_by_call(properties):
            _remember(_key(other, message), Attempt(other_id, keys.digest(sent), failed_at, at, properties))
        if isinstance(exc, RedisUnavailable):
            _remember(
                key or _key(where, message),
                Attempt(task_id, keys.digest(payload), failed_at, sent_at, properties),
            )
        raise
    _note_stored(properties, (where, task_id, payload, sent_at))
    if key is not None:
        with _lock:
            _attempts.pop(key, None)


def _remember(key: Key, attempt: Attempt) -> None:
    with _lock:
        kept = _attempts.setdefault(key, [])
        kept.append(attempt)
        del kept[:-MAX_ATTEMPTS]
        _attempts.move_to_end(key)
        while len(_attempts) > MAX_KEPT:
            _attempts.popitem(last=False)


#: Per thread, the publish call in hand (its properties dict, held: no other takes its ``id()``)
#: and the stores of it that succeeded: (where, task id, what was sent, when). The next call
#: replaces them. What was sent is digested only where a later store of the call fails: the
#: publish of every delayed message passes here.
_calls = threading.local()


#: A store of a call: where, the task id, what was sent, when it was sent.
Made = tuple[Where, str, str, float]


def _note_stored(properties: object, stored: Made) -> None:
    held: tuple[object, list[Made]] | None = getattr(_calls, "held", None)
    if held is None or held[0] is not properties:
        held = (properties, [])
        _calls.held = held
    held[1].append(stored)


def _stored_by_call(properties: object) -> list[Made]:
    held = getattr(_calls, "held", None)
    return list(held[1]) if held is not None and held[0] is properties else []


def waiting() -> bool:
    """Whether any attempt is remembered (a retry of its message may come)."""
    return bool(_attempts)


def stored_before(store: Store, where: Where, key: Key | dict[str, Any]) -> bool:
    """Whether an earlier attempt of a message (its ``key``, or the message), whose reply was
    lost, is stored already (then forgotten). Also asked of a retry that finds its message due
    by now, pushed at once but for this: the attempt stored it while it was not due yet."""
    if not _attempts:
        return False
    key = _key(where, key) if isinstance(key, dict) else key
    earlier = _remembered(key)
    if earlier and _stored(store, where[2], earlier):
        with _lock:
            _attempts.pop(key, None)
        return True
    return False


def _stored(store: Store, dest: str, earlier: list[Attempt]) -> bool:
    """Whether one of the ``earlier`` attempts is stored for ``dest``, or was and an edit took
    it since (then forgotten)."""
    for attempt in earlier:
        if any(
            found.dest == dest and keys.digest(found.message) == attempt.sent
            for found in store.find(attempt.task_id)
        ):
            since = ""
        elif store.taken_lately(
            keys.taken_mark(dest, attempt.sent), time.monotonic() - attempt.sent_at + TAKEN_SLACK_S
        ):
            since = ", and cancelled or rescheduled since"
        else:
            continue
        logger.warning(
            "kombu-delay: message %r was stored by an earlier attempt whose reply was lost%s; "
            "the retry of it stores nothing more",
            attempt.task_id,
            since,
        )
        try:
            store.count("resent")
        except KombuDelayError:  # a counter must not fail the publish it counts
            logger.debug("kombu-delay: could not count a retried publish", exc_info=True)
        return True
    return False
