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
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis


class DeliveringPoller(kombu_redis.MultiChannelPoller):  # type: ignore[misc]
    """kombu's poller, reading each ``BRPOP`` reply when it arrives, credit or not."""

    def _pause_brpop(self, channel: Any, fileno: int) -> None:
        """Never pause: :meth:`on_readable` reads the reply (kombu pauses it, unread)."""

    def on_readable(self, fileno: int) -> Any:
        owner = self._fd_to_chan.get(fileno)
        if owner is not None and owner[1] == "BRPOP" and owner[0]._in_poll:
            return owner[0].handlers["BRPOP"]()  # a BRPOP sent, and its reply here: deliver it
        return super().on_readable(fileno)


class DeliveringTransportMixin:
    """A Redis transport whose channels share a :class:`DeliveringPoller`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cycle = DeliveringPoller()
