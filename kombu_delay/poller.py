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
tried again while Redis does not answer, or refuses writes for a while (a failover's
``NOREPLICAS``, ``READONLY`` or ``MASTERDOWN``, a failing disk's ``MISCONF``), for
:data:`RECORD_RETRY_S`; once it is written, the message is delivered, and restored from there if
the worker dies, as any other. Its acknowledgement, which takes the record away, is tried again
the same way: one lost to a restart left the record, and the task, run already, ran again
after the visibility timeout. Neither is tried again once the worker is told to stop.

kombu's writes as a worker connects wait too (a worker started or reconnecting in a failover
stopped on them): its sweep of messages unacknowledged past the visibility timeout, refused for
now, is told and left to its next run, and the worker's consumer's record of a queue's binding
is tried again every second, for :data:`RECORD_RETRY_S` (a task's, as any publisher's, is
not). A ``BRPOP`` answered ``UNBLOCKED`` (its master demoted to a replica) asks again, as one
refused does.

A record still not written then, or refused at Redis's ``maxmemory`` (``noeviction``: freed
memory, not a wait, ends that), leaves the message in this worker's memory alone: it is
delivered unrecorded, with an ERROR, rather than dropped with the worker stopped (kombu's way).
It runs; where it is given back unrun (a warm shutdown, a reject with requeue), it is pushed
back onto its list from memory, as kombu would from its record, tried again while Redis refuses
the push (at its maxmemory too: other workers taking messages free memory) for a minute, 10 s
once the worker is told to stop. It is lost, with an ERROR, if that push is still refused then,
or the worker is told to stop while its record is tried; and, unsaid, if the worker dies first.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps

from kombu_delay.errors import coded_text, over_maxmemory, refusal_text, unavailable_text, write_waits_out
from kombu_delay.message import message_id, shown

logger = logging.getLogger(__name__)

#: How long a worker tries to record a message it has taken, or to acknowledge one, while Redis
#: does not answer, s (a restart's time, with room): given up, a message taken is lost, and one
#: acknowledged runs again after the visibility timeout, as kombu would have them at once.
RECORD_RETRY_S = 60.0
#: How long a worker told to stop still tries to give back a message delivered unrecorded (its
#: only copy, in this worker's memory), s.
GIVE_BACK_STOPPING_S = 10.0
#: Set once Celery tells this process's worker to stop (by kombu_delay.mover.embedded, which
#: Celery loads at start through the ``delay`` command; importing kombu_delay loads no Celery).
WORKER_STOPPING = threading.Event()


def _publishing() -> bool:
    return False


#: Whether this call is a Celery worker's consumer's (the worker's own process and thread,
#: outside a task; set by kombu_delay.mover.embedded, as above): its write of a queue's binding
#: is waited out (RecordingChannelMixin._queue_bind), a publisher's, a task's among them,
#: refused at once, as kombu's is (a task waiting there was cut short by a warm shutdown).
consuming: Callable[[], bool] = _publishing
#: What a worker told to stop does where that wait ends for it (set by
#: kombu_delay.mover.embedded: Celery's own stop, raised as Celery raises it; none: the refusal
#: itself is raised).
stop_worker: Callable[[], None] | None = None


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
    again while Redis does not answer or refuses writes for now; and which delivers a message
    whose record cannot be written unrecorded, and gives it back from memory, as the module says."""

    #: When a sweep refused for now was last told (monotonic s): once a minute at most.
    _restore_refused_told = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The messages delivered with no record (Redis at its maxmemory), by delivery tag.
        self._unrecorded: dict[Any, Any] = {}

    def append(self, message: Any, delivery_tag: Any) -> None:
        try:
            _tried_again(lambda: super(RecordingQoS, self).append(message, delivery_tag), message, _RECORD)
        except _RETRIED as exc:
            if isinstance(exc, redis.ResponseError) and not _refused_for_now(exc):
                raise
            taken, why = shown(message_id(message._raw)), _why(exc)
            if WORKER_STOPPING.is_set():
                logger.error(_RECORD[1], taken, why, "the worker is stopping")
                raise
            logger.error(_UNRECORDED, taken, why)
            self._unrecorded[delivery_tag] = message
            super(kombu_redis.QoS, self).append(message, delivery_tag)  # kept in memory only

    def ack(self, delivery_tag: Any) -> None:
        if self._unrecorded.pop(delivery_tag, None) is not None:  # no record to take away
            super(kombu_redis.QoS, self).ack(delivery_tag)
            return
        message = self._delivered.get(delivery_tag)
        try:
            _tried_again(lambda: self._ack_recorded(delivery_tag), message, _ACK)
        except _RETRIED as exc:
            # Told (_ACK): its record stays, and it runs again after the visibility timeout. A
            # refusal raised, or anything at a warm shutdown, stopped the worker with a traceback.
            stopping = WORKER_STOPPING.is_set()
            if not (stopping or (isinstance(exc, redis.ResponseError) and _refused_for_now(exc))):
                raise
            super(kombu_redis.QoS, self).ack(delivery_tag)

    def _ack_recorded(self, delivery_tag: Any) -> None:
        try:
            super().ack(delivery_tag)
        except redis.ResponseError as exc:
            if not over_maxmemory(exc):
                raise
            # At its maxmemory Redis refuses every command of a MULTI, deletions too (kombu's
            # ack): the record is taken away one command at a time, which it allows.
            with self.channel.conn_or_acquire() as client:
                pipe = client.pipeline(transaction=False)
                pipe.zrem(self.unacked_index_key, delivery_tag).hdel(self.unacked_key, delivery_tag).execute()
            super(kombu_redis.QoS, self).ack(delivery_tag)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        # As kombu's, through this class's ack and restore.
        if not requeue:
            self.ack(delivery_tag)
            return
        self.restore_by_tag(delivery_tag, leftmost=True)
        super(kombu_redis.QoS, self).ack(delivery_tag)

    def restore_unacked(self, client: Any = None) -> None:
        # Those delivered unrecorded first, each told where it cannot be given back: kombu's loop
        # over all ends at the first recorded one whose restore Redis refuses (its record stays,
        # and it comes back after the visibility timeout), and they have no record to come back from.
        for tag in list(self._unrecorded):
            self.restore_by_tag(tag, client)
            self._delivered.pop(tag, None)  # (done: kombu's restore would look for its record)
        super().restore_unacked(client)

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        """kombu's sweep of the records past the visibility timeout, run as a worker connects and
        every so often after: one Redis refuses for now (a failover's ``NOREPLICAS`` as workers
        reconnect, ``maxmemory``) is told and left to the next sweep (kombu raised it as the
        worker connected, and the worker stopped)."""
        try:
            super().restore_visible(start, num, interval)
        except redis.ResponseError as exc:
            if not _refused_for_now(exc):
                raise
            now = time.monotonic()
            if now - RecordingQoS._restore_refused_told >= REFUSED_POP_TOLD_S:  # (kombu sweeps every 10 s)
                RecordingQoS._restore_refused_told = now
                logger.warning(
                    "kombu-delay: messages unacknowledged past the visibility timeout are not restored "
                    "now (%s); the next sweep tries again (told again in a minute while it lasts)",
                    _why(exc),
                )

    def restore_by_tag(self, tag: Any, client: Any = None, leftmost: bool = False) -> None:
        """Give a message back to its list: kombu's way, from its record; one delivered with none,
        from memory (its record is missing: kombu's way would drop it)."""
        message = self._unrecorded.get(tag)
        if message is None:
            super().restore_by_tag(tag, client, leftmost)
            return
        delivery, channel = message.delivery_info, self.channel

        def give_back() -> None:
            # As kombu's _do_restore_message, whose look-up of the bindings logs a refusal (BUSY)
            # and pushes nothing, the message then gone: here a refusal is raised, and waited out.
            payload = message._raw
            with contextlib.suppress(KeyError, TypeError):  # (kombu's marks, where the message has them)
                payload["headers"]["redelivered"] = payload["properties"]["delivery_info"]["redelivered"] = (
                    True
                )
            priority = channel._get_message_priority(payload, reverse=False)
            with channel.conn_or_acquire(client) as conn:
                pipe = conn.pipeline()
                for queue in channel._lookup(delivery["exchange"], delivery["routing_key"]):
                    (pipe.lpush if leftmost else pipe.rpush)(
                        channel._q_for_pri(queue, priority), dumps(payload)
                    )
                pipe.execute()

        # Redis at its maxmemory refuses the push too, until memory is freed (by other workers
        # taking messages): waited for, for a while at a warm shutdown as well.
        try:
            _tried_again(give_back, message, _GIVEN_BACK, _refused_for_now, stopping_s=GIVE_BACK_STOPPING_S)
        except _RETRIED as exc:  # (kombu's restore of every other message goes on)
            if isinstance(exc, redis.ResponseError) and not _refused_for_now(exc):
                raise
            logger.error(_GIVEN_BACK[1], shown(message_id(message._raw)), _why(exc))
        finally:
            self._unrecorded.pop(tag, None)


#: What :func:`_tried_again` tells of a record and of an acknowledgement: while it tries, and
#: when it gives up (with the cause, and why it gave up).
_RECORD = (
    "kombu-delay: message %s, taken from its list, is not recorded as taken yet (%s); "
    "trying again for up to %g s",
    "kombu-delay: message %s, taken from its list, could not be recorded as taken (%s; %s): it is lost",
)
_UNRECORDED = (
    "kombu-delay: message %s, taken from its list, could not be recorded as taken (%s); it is delivered "
    "unrecorded: it runs, and is lost if this worker dies before it is acknowledged or given back"
)
#: What is tried again: Redis not answering, and a write it refuses for now (:func:`write_waits_out`).
_RETRIED = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError)
_GIVEN_BACK = (
    "kombu-delay: message %s, delivered unrecorded and given back unrun, is not on its list yet (%s); "
    "trying again for up to %g s",
    "kombu-delay: message %s, delivered unrecorded and given back unrun, could not be put back onto its "
    "list (%s): it is lost",
)
_ACK = (
    "kombu-delay: message %s is not acknowledged yet (%s); trying again for up to %g s",
    "kombu-delay: message %s could not be acknowledged (%s; %s): kombu restores it after the visibility "
    "timeout, and it is delivered again",
)


def _tried_again(
    call: Callable[[], None],
    message: Any,
    told: tuple[str, str],
    waits: Callable[[redis.ResponseError], bool] = write_waits_out,
    stopping_s: float = 0.0,
) -> None:
    """``call()``, tried again while Redis does not answer or refuses the write for now
    (``waits``), for :data:`RECORD_RETRY_S` at most, and once the worker is told to stop for
    ``stopping_s`` more at most; ``message``: what it records, acknowledges or gives back. Given
    up, an acknowledgement is told (``told[1]``), a record or a giving back left to its caller."""
    deadline, pause = time.monotonic() + RECORD_RETRY_S, 0.1
    while True:
        try:
            call()
            return
        except _RETRIED as exc:
            if isinstance(exc, redis.ResponseError) and not waits(exc):
                raise
            taken = shown(message_id(message._raw)) if message is not None else "(unknown)"
            why = _why(exc)
            stopping = WORKER_STOPPING.is_set()
            if stopping:
                deadline = min(deadline, time.monotonic() + stopping_s)
                stopping_s = 0.0  # (counted from the first failure seen while stopping)
            if time.monotonic() + pause > deadline:
                if told is _ACK:
                    after = "the worker is stopping" if stopping else f"tried for {RECORD_RETRY_S:g} s"
                    logger.error(told[1], taken, why, after)
                raise
            if pause == 0.1:
                logger.warning(told[0], taken, why, RECORD_RETRY_S)
            time.sleep(pause) if stopping else _nap(pause)
            pause = min(pause * 2, 2.0)


def _refused_for_now(exc: redis.ResponseError) -> bool:
    """A write refused for now (:func:`write_waits_out`), or until memory is freed."""
    return write_waits_out(exc) or over_maxmemory(exc)


def _why(exc: BaseException) -> str:
    """``exc`` told: a refusal without the pipelined command redis-py puts before it, which shows
    the start of the message ("Command # 1 (RPUSH q {"body": ...) of pipeline caused error: ")."""
    if isinstance(exc, redis.ResponseError):
        told = refusal_text(coded_text(exc).rpartition(" of pipeline caused error: ")[2])
        return f"Redis refused the write: {told}"
    return unavailable_text(exc)


def _nap(seconds: float) -> None:
    """Sleep ``seconds``, or less once the worker is told to stop (looked at every 0.1 s: a wait
    on the event would take its lock, which the signal handler that sets it takes too)."""
    end = time.monotonic() + seconds
    while not WORKER_STOPPING.is_set() and time.monotonic() < end:
        time.sleep(min(0.1, max(0.0, end - time.monotonic())))


#: How long a channel waits before it asks again for a message that Redis refused to pop for
#: now (:func:`write_waits_out`), s; and how often it says so, at most.
REFUSED_POP_WAIT_S, REFUSED_POP_TOLD_S = 1.0, 60.0


class RecordingChannelMixin:
    """A Redis channel whose record of each message taken is :class:`RecordingQoS`'s, and whose
    ``BRPOP``, a write, waits while Redis refuses writes for now (a failover's ``NOREPLICAS``, a
    master demoted): kombu raised the refusal, and the worker stopped, where a moment later it
    could go on."""

    QoS = RecordingQoS
    _pop_refused_told = 0.0

    def _brpop_read(self, **options: Any) -> Any:
        try:
            return super()._brpop_read(**options)  # type: ignore[misc]
        except redis.ResponseError as exc:
            # UNBLOCKED: a BRPOP waiting as its master became a replica (REPLICAOF, as Sentinel
            # demotes an old master), which refuses the next one (READONLY) until it is a master again.
            if not write_waits_out(exc) and not str(exc).startswith("UNBLOCKED"):
                raise
            now = time.monotonic()
            if now - self._pop_refused_told >= REFUSED_POP_TOLD_S:
                self._pop_refused_told = now
                logger.warning(
                    "kombu-delay: Redis refuses to hand out messages for now (%s); asking again every %g s",
                    _why(exc),
                    REFUSED_POP_WAIT_S,
                )
            _nap(REFUSED_POP_WAIT_S)  # (nothing was popped: nothing is held meanwhile)
            raise kombu_redis.Empty() from exc

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        """kombu's record of a queue's binding (a ``SADD``, as a worker starts), tried again by
        a worker's consumer (:data:`consuming`) every second while Redis refuses writes for now,
        for :data:`RECORD_RETRY_S` at most: kombu raised the refusal, and a worker started in a
        failover stopped. A publisher's, a task's among them, is raised at once, as kombu's: its
        publish would be refused as well. Told to stop meanwhile, the worker stops as Celery
        stops (:data:`stop_worker`)."""
        deadline = time.monotonic() + RECORD_RETRY_S
        while True:
            try:
                super()._queue_bind(exchange, routing_key, pattern, queue)  # type: ignore[misc]
                return
            except redis.ResponseError as exc:
                if not (write_waits_out(exc) and consuming()):
                    raise
                if time.monotonic() + REFUSED_POP_WAIT_S > deadline:
                    raise
                if deadline - time.monotonic() > RECORD_RETRY_S - REFUSED_POP_WAIT_S:  # the first refusal
                    logger.warning(
                        "kombu-delay: Redis refuses for now to record the binding of queue %s (%s); "
                        "trying again every %g s for up to %g s",
                        shown(queue),
                        _why(exc),
                        REFUSED_POP_WAIT_S,
                        RECORD_RETRY_S,
                    )
                _nap(REFUSED_POP_WAIT_S)
                if WORKER_STOPPING.is_set():
                    if stop_worker is not None:  # a stop asked for, not an error
                        stop_worker()
                    raise


class DeliveringTransportMixin:
    """A Redis transport whose channels share a :class:`DeliveringPoller`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cycle = DeliveringPoller()
