"""A mover's wake-ups: the pub/sub subscription on which a publish announces a message due
sooner than what the movers wait for (``wake_if_first`` in ``_put.lua``)."""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from kombu_delay.errors import AUTH_ERRORS, RedisUnavailable, translated_errors
from kombu_delay.store import Store, keys

logger = logging.getLogger(__name__)


class OwnConnection:
    """What a wake-up subscription draws its connection from: the store's pool, except that
    the connection is a new one, never one the pool keeps, and is closed, not handed back,
    when the subscription ends.

    From the pool itself, a new subscription would take the idle connection of the mover's
    calls, which then need another. At Redis's ``maxclients`` that one is refused, and no
    round could move anything, for the sake of a subscription that only saves polling."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        # What the pool's own make_connection builds, without counting it among the pool's,
        # connected as the pool connects one: a Sentinel-managed connection finds its master
        # only in its own connect(), which a pub/sub's first command would not call.
        connection = self._pool.connection_class(**self._pool.connection_kwargs)
        try:
            connection.connect()
        except BaseException:
            connection.disconnect()
            raise
        return connection

    def release(self, connection: Any) -> None:
        connection.disconnect()


def subscribe(store: Store) -> redis.client.PubSub:
    """A pub/sub connection of its own, subscribed to ``store``'s wake channel."""
    with translated_errors():
        pubsub: redis.client.PubSub = store.client.pubsub(  # type: ignore[no-untyped-call]
            ignore_subscribe_messages=True
        )
        pubsub.connection_pool = OwnConnection(pubsub.connection_pool)
        try:
            pubsub.subscribe(keys.wake_channel(store.prefix))
        except BaseException:
            pubsub.close()
            raise
    return pubsub


class WakeUps:
    """The wake channel of one mover's store, subscribed on first use and again after an error.

    Waking is an optimisation: where the ACL refuses the subscription (no ``+subscribe``, or
    not the channel), the mover goes on polling, says so once, and looks for the channel again
    only when it starts anew. Where Redis takes no connection for it (at its ``maxclients``),
    or drops it, the mover polls meanwhile and subscribes again at its next round."""

    def __init__(self, store: Store, name: str) -> None:
        self.store = store
        self.name = name
        self.refused = False
        self._pubsub: redis.client.PubSub | None = None
        #: Why the last subscription failed or was lost, as told; None while subscribed.
        self._lost: str | None = None

    def open(self) -> None:
        """Subscribe, unless subscribed already or refused. A subscription Redis cannot take now
        leaves the mover polling; what waiting cannot end (a password refused) is raised."""
        if self._pubsub is not None or self.refused:
            return
        try:
            self._pubsub = subscribe(self.store)
        except RedisUnavailable as exc:  # (a refused password is a RedisAuthError: raised)
            self._lose(exc)
            return
        if self._lost is not None:
            logger.info("mover %s: subscribed to wake-ups again", self.name)
            self._lost = None

    def _lose(self, exc: BaseException) -> None:
        """Poll without a subscription until the next :meth:`open`; tell the first of a run of
        failures."""
        self.close()
        cause = str(exc).removeprefix("Redis is unavailable: ")  # (translated_errors' words)
        if self._lost is None:
            logger.warning(
                "mover %s: no wake-up subscription (%s): it polls meanwhile, so a message published "
                "due sooner than what it waits for is moved up to delay_max_sleep late, and "
                "subscribes again at its next round",
                self.name,
                cause,
            )
        self._lost = cause

    def wait(self, seconds: float) -> bool:
        """Wait at most ``seconds`` for a wake-up for this mover's database; true when one came
        (several that came together are one). Without a subscription, false at once: the
        caller sleeps. A wake-up for another database of the server (the channel is theirs
        too) is let be: it would cost Redis a move call that finds nothing."""
        if self._pubsub is None:
            return False
        deadline = time.monotonic() + seconds
        try:
            woken = False
            while not woken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # None also for a subscription's confirmation, read as it comes: wait on.
                message = self._pubsub.get_message(timeout=left)
                woken = message is not None and keys.wakes(message["data"], self.store.db)
            while self._pubsub.get_message(timeout=0) is not None:
                pass
            return True
        except AUTH_ERRORS:  # a password refused on the subscription's reconnect: fatal
            raise
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # The subscription's connection alone failed or was refused again (the mover's next
            # calls tell an outage): poll until the next round subscribes anew.
            self._lose(exc)
            return False
        except redis.exceptions.NoPermissionError as exc:
            # Redis answers a refused SUBSCRIBE only once the mover reads from it: here.
            self.close()
            self.refused = True
            logger.warning(
                "mover %s: Redis's ACL refuses it the wake-up channel %s (%s): it polls instead, "
                "so a message published due sooner than what it waits for is moved up to "
                "delay_max_sleep late; grant it: `ACL SETUSER <user> +subscribe &%skombu_delay:*`",
                self.name,
                keys.wake_channel(self.store.prefix),
                exc,
                self.store.prefix,
            )
            return False

    @property
    def subscribed(self) -> bool:
        return self._pubsub is not None

    def close(self) -> None:
        """Drop the subscription (after an error, or at the end); the next :meth:`open` makes
        another."""
        if self._pubsub is None:
            return
        try:
            self._pubsub.close()
        except Exception:
            logger.debug("closing the wake subscription failed", exc_info=True)
        self._pubsub = None
