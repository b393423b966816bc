"""Batched consume for workers on ``delayredis://`` (opt-in): the prefetch window per round trip.

kombu's Redis channel takes one message per ``BRPOP`` and records each one in its unacked
set with a pipeline of its own before handing it over. With ``delay_batched_consume`` on,
a read that got one message also takes what the consumer's prefetch window still allows
from the same list (one ``RPOP key count``, Redis 6.2+), records all of them in the unacked set with one
pipeline, and only then hands them to the consumer, in list order. Acks, rejects, restores
and the visibility timeout are kombu's, unchanged: every message is in the unacked set
before its consumer sees it, as kombu does it one at a time. A consumer without a prefetch
limit (``basic_qos`` never called, or 0) reads one message at a time, as with kombu.

What differs: a read hands over several messages (``drain_events()`` may deliver up to the
window in one call), and if the worker dies between the read and the pipeline, up to the
window is lost instead of one message (kombu's own gap between ``BRPOP`` and recording the
message in the unacked set, made wider; ``acks_late`` does not cover it either way).
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

logger = logging.getLogger(__name__)

#: The most messages one read takes, whatever the prefetch window.
MAX_BATCH = 100


class BatchedQoS(kombu_redis.QoS):  # type: ignore[misc]
    """kombu's Redis QoS, whose unacked records of one batch go out in one pipeline."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batch_pipe: Any = None

    def append(self, message: Any, delivery_tag: str) -> None:
        pipe = self._batch_pipe
        if pipe is None:
            super().append(message, delivery_tag)
            return
        delivery = message.delivery_info
        pipe.zadd(self.unacked_index_key, {delivery_tag: kombu_redis.time()})
        pipe.hset(
            self.unacked_key,
            delivery_tag,
            dumps([message._raw, delivery["exchange"], delivery["routing_key"]]),
        )
        kombu_redis.virtual.QoS.append(self, message, delivery_tag)


class BatchedConsumeMixin:
    """Channel part: the batched read, and callbacks held until the batch is recorded."""

    QoS = BatchedQoS
    _batch: list[tuple[Any, Any]] | None = None
    #: False once the server refused ``RPOP key count`` (before Redis 6.2): one at a time.
    _rpop_count = True

    def basic_consume(self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any) -> Any:
        ret = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)  # type: ignore[misc]
        channel: Any = self
        if not channel.delay_settings.batched_consume:
            return ret

        def _callback(raw_message: Any) -> Any:
            message = channel.Message(raw_message, channel=channel)
            if not no_ack:
                channel.qos.append(message, message.delivery_tag)
            if channel._batch is not None:
                channel._batch.append((callback, message))
                return None
            return callback(message)

        channel.connection._callbacks[queue] = _callback
        return ret

    def _batch_room(self) -> int:
        qos: Any = self.qos  # type: ignore[attr-defined]
        on = self.delay_settings.batched_consume  # type: ignore[attr-defined]
        if not on or not isinstance(qos, BatchedQoS) or not self._rpop_count:
            return 0
        room = qos.can_consume_max_estimate()
        # No prefetch limit (a plain kombu consumer, not a Celery worker): kombu's path, one
        # message per read, as callers of drain_events() may rely on.
        return 0 if room is None else min(int(room), MAX_BATCH)

    def _brpop_read(self, **options: Any) -> bool:
        channel: Any = self
        room = self._batch_room()
        if room <= 1:
            return bool(super()._brpop_read(**options))  # type: ignore[misc]
        client, conn = channel.client, channel.client.connection
        try:
            try:
                dest__item = client.parse_response(conn, "BRPOP", **options)
            except channel.connection_errors:
                conn.disconnect()
                raise
            if not dest__item:
                raise kombu_redis.Empty()
            raw_dest, item = dest__item
            items = [item]
            try:
                # The BRPOP connection is idle now (its reply is read, no command is sent):
                # the rest of the window comes off the same list, on the same connection. The
                # command goes out raw, so the global_keyprefix that kombu's client took off
                # the key in the reply goes back on here.
                prefix = channel.global_keyprefix
                key = prefix.encode() + raw_dest if isinstance(raw_dest, bytes) else prefix + raw_dest
                conn.send_command("RPOP", key, room - 1)
                more = client.parse_response(conn, "RPOP")
                items.extend(more or [])
            except redis.ResponseError:
                self._rpop_count = False
                logger.warning("this Redis has no RPOP with a count (6.2+); consuming one at a time")
            except channel.connection_errors:
                conn.disconnect()  # what was taken is only `item`: it is delivered below
            dest = bytes_to_str(raw_dest).rsplit(channel.sep, 1)[0]
            channel._queue_cycle.rotate(dest)
            self._deliver_batch(dest, items)
            return True
        finally:
            channel._in_poll = None
            channel._flush_brpop_reauth()

    def _deliver_batch(self, dest: str, items: list[Any]) -> None:
        """Record every message in the unacked set (one pipeline), then hand each over.

        A message that cannot be decoded is gone, as with kombu (it was taken off the list);
        the others are still recorded and handed over, and then its error is raised, as
        kombu raises it. A consumer's error is raised after the rest were handed over.
        """
        channel: Any = self
        qos: BatchedQoS = channel.qos
        held: list[tuple[Any, Any]] = []
        error: BaseException | None = None
        self._batch = held
        try:
            with channel.conn_or_acquire() as client:
                qos._batch_pipe = client.pipeline()
                try:
                    for item in items:
                        try:
                            payload = loads(bytes_to_str(item))
                        except Exception as exc:
                            error = error or exc
                            continue
                        channel.connection._deliver(payload, dest)
                    qos._batch_pipe.execute()
                finally:
                    qos._batch_pipe = None
        finally:
            self._batch = None
        for callback, message in held:
            try:
                callback(message)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
