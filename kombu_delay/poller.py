"""The consuming side of the ``delay*`` transports: kombu's poller, with no message held
unrecorded while a worker has no credit.

kombu sends a ``BRPOP`` while a channel may take a message, and leaves its reply unread once
the channel may not (its prefetch is used up). The reply holds a message Redis has already
popped from its list, which nothing else then holds: a worker killed before it reads it
(``SIGKILL``, the OOM killer, a lost node) loses it, with ``acks_late`` too. Celery raises a
channel's credit for each message that carries an ETA and lowers it once the ETA has come, so a
worker that takes due messages one at a time, as a mover delivers them, often has a ``BRPOP``
out and no credit: a review lost one task in three of four rounds of six.

Here a reply is read as soon as it comes: the message is delivered, and kombu records it in its
unacked hash at once, from which it is restored if the worker dies (after the visibility
timeout), as every other prefetched message is. The worker then holds one message past its
prefetch limit, as it holds a prefetched one.

That record is a command of its own, after the ``BRPOP``: where Redis goes away between the
two (a restart, a failover), kombu drops the message, which no list holds any more (one task
lost in each of three Redis restarts under a worker taking due messages). Here the record is
tried again while Redis does not answer, for :data:`RECORD_RETRY_S`; once it is written, the
message is delivered, and restored from there if the worker dies, as any other. Its
acknowledgement, which takes the record away, is tried again the same way: one lost to a
restart left the record, and the task, run already, ran again after the visibility timeout.
Only Redis not answering is tried again, and not once the worker is told to stop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from kombu.transport import redis as kombu_redis

from kombu_delay.errors import unavailable_text
from kombu_delay.message import message_id, shown

logger = logging.getLogger(__name__)

#: How long a worker tries to record a message it has taken, or to acknowledge one, while Redis
#: does not answer, s (a restart's time, with room): given up, a message taken is lost, and one
#: acknowledged runs again after the visibility timeout, as kombu would have them at once.
RECORD_RETRY_S = 60.0
#: Set once Celery tells this process's worker to stop (by kombu_delay.mover.embedded, which
#: Celery loads at start through the ``delay`` command; importing kombu_delay loads no Celery).
WORKER_STOPPING = threading.Event()


class DeliveringPoller(kombu_redis.MultiChannelPoller):  # type: ignore[misc]
    """kombu's poller, reading each ``BRPOP`` reply when it arrives, credit or not."""

    def _pause_brpop(self, channel: Any, fileno: int) -> None:
        """Never pause: :meth:`on_readable` reads the reply (kombu pauses it, unread)."""

    def on_readable(self, fileno: int) -> Any:
        owner = self._fd_to_chan.get(fileno)
        if owner is not None and owner[1] == "BRPOP" and owner[0]._in_poll:
            return owner[0].handlers["BRPOP"]()  # a BRPOP sent, and its reply here: deliver it
        return super().on_readable(fileno)


class RecordingQoS(kombu_redis.QoS):  # type: ignore[misc]
    """kombu's acknowledgement emulation, whose record of a message taken (the unacked hash,
    from which it is restored) and whose acknowledgement, which takes the record away, are tried
    again while Redis does not answer."""

    def append(self, message: Any, delivery_tag: Any) -> None:
        _tried_again(lambda: super(RecordingQoS, self).append(message, delivery_tag), message, _RECORD)

    def ack(self, delivery_tag: Any) -> None:
        message = self._delivered.get(delivery_tag)
        _tried_again(lambda: super(RecordingQoS, self).ack(delivery_tag), message, _ACK)


#: What :func:`_tried_again` tells of a record and of an acknowledgement: while it tries, and
#: when it gives up (with the cause, and why it gave up).
_RECORD = (
    "kombu-delay: message %s, taken from its list, is not recorded as taken yet (%s); "
    "trying again for up to %g s",
    "kombu-delay: message %s, taken from its list, could not be recorded as taken (%s; %s): it is lost",
)
_ACK = (
    "kombu-delay: message %s is not acknowledged yet (%s); trying again for up to %g s",
    "kombu-delay: message %s could not be acknowledged (%s; %s): kombu restores it after the visibility "
    "timeout, and it is delivered again",
)


def _tried_again(call: Callable[[], None], message: Any, told: tuple[str, str]) -> None:
    """``call()``, tried again while Redis does not answer, for :data:`RECORD_RETRY_S` at most
    and until the worker is told to stop; ``message``: what it records or acknowledges."""
    deadline, pause = time.monotonic() + RECORD_RETRY_S, 0.1
    while True:
        try:
            call()
            return
        except (redis.ConnectionError, redis.TimeoutError) as exc:  # only Redis not answering
            taken = shown(message_id(message._raw)) if message is not None else "(unknown)"
            why = unavailable_text(exc)
            stopping = WORKER_STOPPING.is_set()
            if stopping or time.monotonic() + pause > deadline:
                after = "the worker is stopping" if stopping else f"tried for {RECORD_RETRY_S:g} s"
                logger.error(told[1], taken, why, after)
                raise
            if pause == 0.1:
                logger.warning(told[0], taken, why, RECORD_RETRY_S)
            _nap(pause)
            pause = min(pause * 2, 2.0)


def _nap(seconds: float) -> None:
    """Sleep ``seconds``, or less once the worker is told to stop (looked at every 0.1 s: a wait
    on the event would take its lock, which the signal handler that sets it takes too)."""
    end = time.monotonic() + seconds
    while not WORKER_STOPPING.is_set() and time.monotonic() < end:
        time.sleep(min(0.1, max(0.0, end - time.monotonic())))


class RecordingChannelMixin:
    """A Redis channel whose record of each message taken is :class:`RecordingQoS`'s."""

    QoS = RecordingQoS


class DeliveringTransportMixin:
    """A Redis transport whose channels share a :class:`DeliveringPoller`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cycle = DeliveringPoller()
