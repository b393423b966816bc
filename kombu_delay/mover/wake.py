"""A mover's wake-ups: the pub/sub subscription on which a publish announces a message due
sooner than what the movers wait for (``wake_if_first`` in ``_put.lua``)."""

from __future__ import annotations

import logging
import time

import redis

from kombu_delay.store import Store, keys

logger = logging.getLogger(__name__)


class WakeUps:
    """The wake channel of one mover's store, subscribed on first use and again after an error.

    Waking is an optimisation: where the ACL refuses the subscription (no ``+subscribe``, or
    not the channel), the mover goes on polling, says so once, and looks for the channel again
    only when it starts anew."""

    def __init__(self, store: Store, name: str) -> None:
        self.store = store
        self.name = name
        self.refused = False
        self._pubsub: redis.client.PubSub | None = None

    def open(self) -> None:
        """Subscribe, unless subscribed already or refused."""
        if self._pubsub is None and not self.refused:
            self._pubsub = self.store.wake_subscription()

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
