"""A mover's wake-ups: the pub/sub subscription on which a publish announces a message due
sooner than what the movers wait for (``wake_if_first`` in ``_put.lua``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from kombu_delay.errors import AUTH_ERRORS, RedisUnavailable, unavailable_text
from kombu_delay.ops.checks import glob_escaped
from kombu_delay.store import Store, keys

logger = logging.getLogger(__name__)

#: After a subscription Redis refused, the mover tries again this long after, then twice as long
#: after each refusal, up to RETRY_MAX_S: at Redis's ``maxclients`` each try is a connection
#: refused (a TLS handshake, with rediss://), and every mover makes them.
RETRY_MIN_S, RETRY_MAX_S = 1.0, 60.0


class WakeUps:
    """The wake channel of one mover's store, subscribed on first use and again after an error.

    Waking is an optimisation: where the ACL refuses the subscription (no ``+subscribe``, or
    not the channel), the mover goes on polling, says so once, and looks for the channel again
    only when it starts anew. Where Redis drops it, the mover subscribes again after its next
    round's calls; where Redis refuses it a connection (at its ``maxclients``), the mover polls
    meanwhile and tries again less and less often (``RETRY_MIN_S`` to ``RETRY_MAX_S``)."""

    def __init__(self, store: Store, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.name = name
        self.refused = False
        self._pubsub: redis.client.PubSub | None = None
        self._clock = clock
        #: The cause of the refusal last told; None when none is (subscribed, or not yet refused).
        self._told: str | None = None
        self._retry_at, self._retry_s = 0.0, RETRY_MIN_S

    def open(self, quiet: bool = False) -> None:
        """Subscribe, unless subscribed already, refused by the ACL, or waiting to try again.
        What waiting cannot end (a password refused) is raised. Where Redis refuses the
        connection, say so (once for each cause) and wait before the next try; ``quiet``: before
        the first round's calls, which tell an outage themselves, try only."""
        if self._pubsub is not None or self.refused or self._clock() < self._retry_at:
            return
        try:
            self._pubsub = self.store.wake_subscription()
        except RedisUnavailable as exc:  # (a refused password is a RedisAuthError: raised)
            if not quiet:
                self._refused_now(str(exc).removeprefix("Redis is unavailable: "))
            return
        self._retry_s = RETRY_MIN_S
        if self._told is not None:
            logger.info("mover %s: subscribed to wake-ups again", self.name)
            self._told = None

    def _refused_now(self, cause: str) -> None:
        """A subscription refused after calls that succeeded: poll until the next try."""
        self._retry_at = self._clock() + self._retry_s
        if cause != self._told:
            logger.warning(
                "mover %s: no wake-up subscription (%s): it polls meanwhile, so a message published "
                "due sooner than what it waits for is moved up to delay_max_sleep late; it tries "
                "again in %.0f s, then less often, down to once a minute",
                self.name,
                cause,
                self._retry_s,
            )
            self._told = cause
        self._retry_s = min(RETRY_MAX_S, self._retry_s * 2)

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
            # The subscription's connection dropped, and could not be made again: made anew after
            # the mover's next calls, which tell an outage; told here too, for one Redis closed
            # alone (a client-output-buffer-limit for pub/sub clients, a CLIENT KILL).
            logger.info(
                "mover %s: wake-up subscription lost (%s); it subscribes again, and polls meanwhile",
                self.name,
                unavailable_text(exc),
            )
            self.close()
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
                glob_escaped(self.store.prefix),
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
