"""The one layer that talks to Redis: kombu-delay's keys, scripts and replies.

Everything above it (transport, mover, inspection, CLI) calls :class:`Store` and never builds a
Redis command. :class:`Store` is one facade over the store's jobs, one module each:

- :mod:`~kombu_delay.store.publish`: schedule a message (or push it now);
- :mod:`~kombu_delay.store.move`: move due messages, thaw cold ones, sweep, heartbeats;
- :mod:`~kombu_delay.store.inspection`: find, list (:mod:`~kombu_delay.store.listing`),
  counts, health facts, and the census (:mod:`~kombu_delay.store.census`);
- :mod:`~kombu_delay.store.edit`: cancel, reschedule, purge;
- :mod:`~kombu_delay.store.server`: the server's eviction policy, run id, persistence and
  free memory.

Script replies become the values of :mod:`~kombu_delay.store.replies`, and redis-py's failures
the errors of :mod:`kombu_delay.errors` (:func:`~kombu_delay.errors.translated_errors`).
"""

from __future__ import annotations

from kombu_delay.store.base import MAX_PAYLOAD_BYTES
from kombu_delay.store.edit import Editing
from kombu_delay.store.move import Moving
from kombu_delay.store.server import ServerFacts

__all__ = ["MAX_PAYLOAD_BYTES", "Store"]


class Store(Editing, Moving, ServerFacts):
    """kombu-delay's data in one Redis database, under one ``global_keyprefix``."""
