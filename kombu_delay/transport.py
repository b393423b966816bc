"""kombu-delay transport: kombu's Redis transport, with future-ETA messages held in Redis.

Capabilities
============
* Selected by URL: ``delayredis://[user:pass@]host[:port][/db]``, ``delayrediss://`` (TLS)
  and ``delaysentinel://host:port;delaysentinel://host2:port`` (option ``master_name``).
  Everything else (consuming, acks, visibility timeout, restores) is kombu's, but for kombu_delay.poller.
* A message whose ETA is in the future is stored in a time-bucketed sorted set, score =
  due time in epoch ms, until a mover (``kombu-delay mover``) pushes it onto the very
  list key plain kombu would have used. Workers never see it before it is due.
* A message with no ETA, an ETA already past, or one that cannot be parsed goes onto the
  list exactly as plain kombu sends it. An unparsable ETA is logged at WARNING and counted.
* Fanout stays immediate: pub/sub has no list to hold a message for. One that asked for a
  delay is logged (once per exchange) and counted.
* Purging a queue (``celery purge``, ``Queue.purge()``) also removes its delayed messages,
  and counts them in the number purged.
* Options (``broker_transport_options``): kombu's Redis options (``global_keyprefix`` names
  every key kombu-delay creates too), and the ``delay_*`` options of the Configuration page.
* Where a message's ETA is read from, in which order: :mod:`kombu_delay.message`.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Mapping
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps

from kombu_delay import resend, tls
from kombu_delay.config import Settings
from kombu_delay.errors import BadETA, DelayTooLong, KombuDelayError, RedisPermissionError, WrongTypeKey
from kombu_delay.message import message_due, message_id, shown, spent_delay_removed
from kombu_delay.ops.checks import FRESH_HEARTBEAT_MS, MoverAsks, glob_escaped, ways_to_start
from kombu_delay.poller import DeliveringTransportMixin, RecordingChannelMixin
from kombu_delay.redact import masked_uri
from kombu_delay.store import Store, keys
from kombu_delay.store.replies import Scheduled

logger = logging.getLogger(__name__)

#: Whether a delayed publish asks if a mover serves its namespace, in its own script call.
_asks = MoverAsks()
#: Set once a queue size could not read the delayed counts, and once a deleted queue's delayed
#: messages could not be deleted with it, each said so (once per process).
_size_refusal_told, _delete_refusal_told = threading.Event(), threading.Event()
#: The fanout exchanges told of (FANOUT_TOLD): at most 1,000, then begun afresh (told again).
_fanouts_told: set[str] = set()
FANOUT_TOLD = (
    "kombu-delay: fanout exchange %r delivers at once: pub/sub holds no message, so kombu-delay cannot "
    "hold it (a worker holds a task with an ETA in memory until then, as on redis://; an x-delay is "
    "not kept); publish to a direct or topic exchange to delay it"
)
NO_MOVER_TOLD = (
    "kombu-delay: no mover serves key prefix %r on %s (none has a heartbeat in the last %d s): delayed "
    "messages are stored but not delivered until one runs; start one with %s (the same database number too)"
)
PURGE_REFUSED_TOLD = (
    "kombu-delay: queue %s: the messages on its lists were purged (%s), but none of its delayed messages, "
    "which will still run: %s"
)

SCHEMES = {
    "delayredis": "kombu_delay.transport:Transport",
    "delayrediss": "kombu_delay.transport:TLSTransport",
    "delaysentinel": "kombu_delay.transport:SentinelTransport",
}


class DelayChannelMixin(RecordingChannelMixin):
    """What changes in kombu's channel: ``_put`` of a message due in the future, and the
    queue operations that must see the messages held for a queue (size, purge, delete)."""

    _delay_store: Store | None = None
    _delay_settings: Settings | None = None
    _delay_broker: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        tls.check_files(args[0].client.ssl)  # a TLS file it cannot use, told as one, not retried for ever
        super().__init__(*args, **kwargs)
        # A bad delay_* option fails the publisher as its channel opens, not at its first delayed message.
        _ = self.delay_settings

    @property
    def delay_settings(self) -> Settings:
        if self._delay_settings is None:
            options = self.connection.client.transport_options  # type: ignore[attr-defined]
            self._delay_settings = Settings.from_options(options)
        return self._delay_settings

    @property
    def delay_store(self) -> Store:
        """A :class:`Store` on this channel's pool, with a plain client: kombu-delay
        applies ``global_keyprefix`` itself (kombu's client would prefix ``KEYS[1]`` only)."""
        if self._delay_store is None:
            client = redis.Redis(connection_pool=self.pool)  # type: ignore[attr-defined]
            prefix, sep = self.global_keyprefix, str(self.sep)  # type: ignore[attr-defined]
            self._delay_store = Store(client, prefix, sep, steps=self.priority_steps)  # type: ignore[attr-defined]
        return self._delay_store

    @property
    def delay_broker(self) -> str:
        """This channel's broker URL, a password masked; worked out once, not on every publish."""
        if self._delay_broker is None:
            self._delay_broker = masked_uri(self.connection.client)  # type: ignore[attr-defined]
        return self._delay_broker

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str, **kwargs: Any) -> None:
        """kombu's fanout (Redis pub/sub: no list to hold a message for), at once; a message
        that asked for a delay is logged, once per exchange and process, and counted
        (``totals.fanout_at_once``), one whose delay cannot be read as ``_put`` tells it: once
        sent (in a publish batch, which may yet be discarded, not counted)."""
        bad = None
        try:
            asked = message_due(message) is not None
        except BadETA as exc:  # delivered at once either way, and no delay was readable
            asked, bad = False, exc
        except DelayTooLong:  # no delay is kept here, so none is too long: at once, as kombu's
            asked = True
        batched = kwargs.get("_publish_batch") is not None
        super()._put_fanout(exchange, message, routing_key, **kwargs)  # type: ignore[misc]
        if bad is not None:
            self._tell_bad_eta(bad, message, batched)
        if asked:
            if exchange not in _fanouts_told:
                if len(_fanouts_told) >= 1000:
                    _fanouts_told.clear()
                _fanouts_told.add(exchange)
                logger.warning(FANOUT_TOLD, exchange)
            if not batched:
                self._count("fanout_at_once")

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        if self.connection is None:  # type: ignore[attr-defined]
            # (kombu's own _put fails with an AttributeError, not retried; a connection error is)
            raise redis.ConnectionError(
                "kombu-delay: the producer's channel was closed, as kombu closes it when its retry gives up "
                "on a Redis it could not reach; nothing was sent"
            )
        try:
            due, bad = message_due(spent_delay_removed(message)), None
        except BadETA as exc:
            due, bad = None, exc
        # Due already, by Redis's clock as estimated here (never this machine's wall clock):
        # pushed as plain kombu pushes it, unless a retry finds it stored by an attempt whose
        # reply was lost. A due time near the estimate goes through the script, which judges it
        # by Redis's clock and pushes a due message itself.
        if due is None or self.delay_store.surely_due(due):
            to = due is not None and resend.waiting() and self._where(queue, message)[1]
            if not to or not resend.stored_before(self.delay_store, to, message):
                super()._put(queue, message, **kwargs)  # type: ignore[misc]
            if bad is not None:  # told once it is on its way: a refused push raised instead
                self._tell_bad_eta(bad, message, batched=kwargs.get("_publish_batch") is not None)
            return
        # A held message is not part of a publish batch: it is written now, in one
        # atomic script call, and only a mover ever delivers it. One the script finds due is
        # left to the batch, which pushes it in its order or, aborted, not at all.
        batch = kwargs.pop("_publish_batch", None)
        where, to = self._where(queue, message)
        dest, ask = to[2], _asks.due(where)
        expires = getattr(self, "_expires", {}).get(queue, 0)  # x-expires: kombu 5.7+
        payload = dumps(message)
        with resend.once(self.delay_store, to, message, due.task_id, payload) as first:
            if not first:  # stored by an attempt whose reply was lost
                return
            result = self.delay_store.schedule(
                due,
                dest,
                payload,
                self.delay_settings,
                expires,
                FRESH_HEARTBEAT_MS if ask else 0,
                push_due=batch is None,
                siblings=[key for key in self._delay_dests(queue) if key != dest] if expires else (),
            )
        if result.outcome is Scheduled.DUE_NOW:
            super()._put(queue, message, _publish_batch=batch, **kwargs)  # type: ignore[misc]
            return
        if ask and result.outcome is not Scheduled.PUSHED_NOW:  # pushed: no mover needed
            self._tell_if_no_mover(where, result.movers)
        if result.wake_refused:
            self._tell_wake_refused()
        if expires:
            # x-expires: renew the queue's lists, as kombu's publish does (and the mover's push). The
            # message is written: a failure must not reach kombu, whose retry would send it twice.
            try:
                self.delay_store.renew_expiry(self._delay_dests(queue), expires)
            except redis.RedisError as exc:
                logger.warning("kombu-delay: could not renew the expiry of queue %s: %s", queue, exc)

    def _where(self, queue: str, message: dict[str, Any]) -> tuple[tuple[int, str, str], resend.Where]:
        """(process, broker, key prefix: a mover is asked for once each), (broker, prefix, list key)."""
        priority = self._get_message_priority(message, reverse=False)  # type: ignore[attr-defined]
        dest = self.global_keyprefix + self._q_for_pri(queue, priority)  # type: ignore[attr-defined]
        broker, prefix = self.delay_broker, self.global_keyprefix  # type: ignore[attr-defined]
        return (os.getpid(), broker, prefix), (broker, prefix, dest)

    def _tell_bad_eta(self, bad: BadETA, message: dict[str, Any], batched: bool) -> None:
        """Log and count a message whose ETA or x-delay could not be read, sent at once (in a
        publish batch, which may yet be discarded or fail, logged so and not counted)."""
        sent = "goes at once, with its publish batch" if batched else "delivered now"
        logger.warning("kombu-delay: %s; message %s %s", bad, shown(message_id(message)), sent)
        if not batched:
            self._count("bad_eta")

    def _count(self, counter: str) -> None:
        """Count one in ``totals``, never failing the publish it counts (a user of kombu's keys only)."""
        try:
            self.delay_store.count(counter)
        except KombuDelayError:
            logger.debug("kombu-delay: could not count %s", counter, exc_info=True)

    @staticmethod
    def _tell_if_no_mover(where: tuple[int, str, str], movers: int | None) -> None:
        """Warn once per process and namespace when a delayed message was stored and no mover
        has a fresh heartbeat there: without one, the message is never delivered; and where
        one does later (:class:`~kombu_delay.ops.checks.MoverAsks`), tell that."""
        told, (_, broker, prefix) = _asks.answered(where, movers), where
        if told == "none":
            logger.warning(NO_MOVER_TOLD, prefix, broker, FRESH_HEARTBEAT_MS // 1000, ways_to_start(prefix))
        elif told == "now":
            logger.info("kombu-delay: a mover serves key prefix %r on %s now", prefix, broker)

    def _tell_wake_refused(self) -> None:
        """Warn once per connection that Redis's ACL refuses this user the channel that wakes
        movers. The message is stored (counted as ``wake_refused``): a publish that made its
        writes must not fail for an optimisation, or kombu's retry would store it twice."""
        transport = self.connection  # type: ignore[attr-defined]
        if getattr(transport, "_delay_wake_refused_told", False):
            return
        transport._delay_wake_refused_told = True
        prefix = self.global_keyprefix  # type: ignore[attr-defined]
        logger.warning(
            "kombu-delay: Redis's ACL refuses this user PUBLISH on %s, the channel that wakes "
            "movers: delayed messages are stored and delivered, but movers learn of one due "
            "sooner than what they wait for only when they next poll (up to delay_max_sleep "
            "late); grant the channel to this user: `ACL SETUSER <user> &%skombu_delay:*` "
            "(see the security docs)",
            keys.wake_channel(prefix),
            glob_escaped(prefix),
        )

    def _purge(self, queue: str) -> int:
        # ``celery purge`` and ``Queue.purge()`` mean "these tasks must not run", so the
        # queue's delayed messages go too, counted: first, so that one a mover moves meanwhile
        # is on the list when the list is purged (the other way round, it escaped both).
        try:
            delayed = self.delay_store.purge(self._delay_dests(queue))
        except (RedisPermissionError, WrongTypeKey) as exc:
            listed = super()._purge(queue)  # type: ignore[misc]  # what this user may purge, as on redis://
            # Told: `celery purge` takes the error for a queue that is not there ("No messages purged").
            logger.warning(PURGE_REFUSED_TOLD, queue, listed, exc)
            raise
        return int(super()._purge(queue)) + delayed  # type: ignore[misc]

    def _size(self, queue: str) -> int:
        # On redis:// a message with an ETA sits on the queue's list, and counts in its size
        # (``queue_declare``'s message count, ``SimpleQueue.qsize()``, ``if_empty``): here
        # its delayed messages count too, as ``_purge`` counts them. They are read first: one
        # a mover moves meanwhile is then on the list when the list is read, counted twice at
        # worst, never missed (a queue of one message read as empty).
        delayed = self._delayed_count(queue)
        return int(super()._size(queue)) + delayed  # type: ignore[misc]

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        # A queue holding only delayed messages exists, as its list does on redis://. The lists
        # are read after the counts (a message moved in between is on one), by their full
        # names: kombu's own look leaves out the global_keyprefix.
        if self._delayed_count(queue) > 0:
            return True
        return bool(self.delay_store.client.exists(*self._delay_dests(queue)))

    def _delayed_count(self, queue: str) -> int:
        """How many delayed messages ``queue`` holds; 0 where this user may not read the
        counts (a worker's ACL user that has only kombu's keys) or they were written by hand:
        a size must never fail a worker's queue declaration, as it never did on redis://."""
        try:
            return self.delay_store.pending(self._delay_dests(queue))
        except (RedisPermissionError, WrongTypeKey) as exc:
            advice = (
                "%skombu_delay:counts is no hash, written by hand? rename it out of the way, and "
                "kombu-delay makes it anew"
                if isinstance(exc, WrongTypeKey)
                else "grant this user read access to %skombu_delay:counts to count them"
            )
            told = f"queue sizes leave delayed messages out: %s ({advice})"
            self._refused_once(_size_refusal_told, told, exc)
            return 0

    def _refused_once(
        self, told: threading.Event, message: str, exc: Exception, pattern: bool = False
    ) -> None:
        """Log ``message`` (with ``exc`` and the key prefix, as a glob's literal part with
        ``pattern``) at WARNING, once a process per ``told``."""
        if not told.is_set():
            told.set()
            prefix = self.global_keyprefix  # type: ignore[attr-defined]
            logger.warning("kombu-delay: " + message, exc, glob_escaped(prefix) if pattern else prefix)

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any
    ) -> None:
        # A deleted queue's delayed messages go with it (left behind, they would recreate its list
        # when due), first (one a mover moves meanwhile is then on the list kombu deletes), and only
        # where kombu deletes the queue: it deletes nothing for a queue this channel holds no binding
        # of. ``if_empty`` counts the delayed messages too (``_size``; ``exchange_delete`` uses it).
        dests = self._delay_dests(queue)
        if if_empty and self._size(queue):
            return
        if any(True for _ in self.state.queue_bindings(queue)):  # type: ignore[attr-defined]
            self._purge_deleted(dests)
        # Judged once, above: kombu's second look could keep a queue its delayed messages left.
        super().queue_delete(queue, if_unused=if_unused, if_empty=False, **kwargs)  # type: ignore[misc]

    def _purge_deleted(self, dests: list[str]) -> None:
        """Delete a deleted queue's delayed messages. A user that may not (a worker's ACL user
        with only kombu's keys, which deletes its mingle reply queue at start-up, and its
        auto-delete queues on close) still deletes the queue, as on redis://, with one WARNING
        a process: a delayed message of that queue, if any, would recreate its list when due."""
        try:
            self.delay_store.purge(dests)
        except (RedisPermissionError, WrongTypeKey) as exc:
            self._refused_once(
                _delete_refusal_told,
                "a deleted queue's delayed messages, if any, were left: %s (grant this user "
                "the keys %skombu_delay:* to delete them with it)",
                exc,
                pattern=True,
            )

    def _delay_dests(self, queue: str) -> list[str]:
        """The list keys of ``queue``, one per priority step, as the store names them."""
        return [
            self.global_keyprefix + self._q_for_pri(queue, pri)  # type: ignore[attr-defined]
            for pri in self.priority_steps  # type: ignore[attr-defined]
        ]


class Channel(DelayChannelMixin, kombu_redis.Channel):  # type: ignore[misc]
    """kombu's Redis channel with delayed delivery."""


class Transport(DeliveringTransportMixin, kombu_redis.Transport):  # type: ignore[misc]
    """``delayredis://``: kombu's Redis transport with delayed delivery."""

    Channel = Channel


class TLSTransport(Transport):
    """``delayrediss://``: always TLS. Without ``broker_use_ssl`` options (none, ``True`` or
    ``{}``) the server certificate is verified against the system CAs (kombu's ``rediss://``
    would not verify without options, and with ``True`` would not even use TLS)."""

    def __init__(self, client: Any, *args: Any, **kwargs: Any) -> None:
        # kombu's Redis channel uses TLS only for a non-empty mapping of redis-py SSL
        # options: anything else (``True``, ``{}``) would connect in plaintext.
        if not client.ssl or not isinstance(client.ssl, Mapping):
            client.ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
        super().__init__(client, *args, **kwargs)


class SentinelChannel(DelayChannelMixin, kombu_redis.SentinelChannel):  # type: ignore[misc]
    """kombu's Sentinel channel with delayed delivery, reading ``delaysentinel://`` URLs."""

    def _sentinel_managed_pool(self, asynchronous: bool = False) -> Any:
        # kombu only collects alternates whose scheme is literally "sentinel"; show it
        # our URLs under that name for the duration of the call.
        client = self.connection.client
        saved = client.alt
        client.alt = [
            "sentinel://" + url[len("delaysentinel://") :] if url.startswith("delaysentinel://") else url
            for url in saved
        ]
        try:
            return super()._sentinel_managed_pool(asynchronous)
        finally:
            client.alt = saved


class SentinelTransport(DeliveringTransportMixin, kombu_redis.SentinelTransport):  # type: ignore[misc]
    """``delaysentinel://``: kombu's Sentinel transport with delayed delivery."""

    Channel = SentinelChannel


def register() -> None:
    """Make the ``delay*`` URL schemes known to kombu (idempotent)."""
    from kombu.transport import TRANSPORT_ALIASES

    TRANSPORT_ALIASES.update(SCHEMES)
