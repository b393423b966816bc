"""The census: how many messages are scheduled, overdue and due when, counted from each
bucket's counts without reading a message (``census.lua``, ``overdue.lua``); what ``stats``,
``health`` and the dashboard's overview show."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kombu_delay.errors import translated_errors
from kombu_delay.store import spaces
from kombu_delay.store.base import StoreBase, as_text
from kombu_delay.store.replies import Census

#: Most destinations a census reads by name (``HMGET``): with more, an ``HGETALL`` of a bucket's
#: meta hash (it holds only the destinations it has messages for) costs less.
CENSUS_DESTS_MAX = 16
#: Most sorted sets (a bucket's, one per destination) one census call counts: about 40 ms of
#: Redis's time. With thousands of queues a bucket counts thousands, and one call for the
#: window held Redis for seconds (every other client answered BUSY past 5 s); so did one of
#: 16 destinations over 10,000 buckets.
CENSUS_SETS_PER_CALL = 10_000
#: Most census calls per space: past them the census is cut short (``truncated``); where the
#: destinations are named, as many more as ``max_buckets`` of their buckets take.
CENSUS_CALLS = 10


def _few_dests(dests: Iterable[str] | None) -> list[str]:
    """The destinations a census reads by name, or none (read every one a meta hash counts):
    none for too many, or for one not valid UTF-8 as Redis sent it (its text names no key)."""
    if dests is None:
        return []
    named = list(dests)
    if len(named) > CENSUS_DESTS_MAX or any("\ufffd" in dest for dest in named):
        return []
    return named


class Counting(StoreBase):
    """The census and the overdue count of one store."""

    def census(
        self,
        now_ms: int,
        slot_ms: int,
        slots: int,
        max_buckets: int = 10_000,
        dests: Iterable[str] | None = None,
    ) -> Census:
        """Return the overdue count and a due-time histogram from ``now_ms`` on (``census.lua``).

        Reads each bucket's counts (an ``HGETALL`` of its meta hash), whether its sorted sets
        exist (one ``EXISTS`` per 1,000 of them) and, for a bucket that has started, one
        ``ZCOUNT`` per destination, unless its noted earliest due time is ahead; never a
        member. At most ``max_buckets`` buckets are
        examined (by the calls together, where ``dests`` are named), past which it is cut
        short; a call stops after about :data:`CENSUS_SETS_PER_CALL` sorted sets and the next
        goes on, :data:`CENSUS_CALLS` calls a space at most (where ``dests`` are named, as many as
        ``max_buckets`` of their buckets take). Compressed
        messages (the cold space) are counted too, in calls of their own.

        ``dests``: the destinations to count, where they are at most :data:`CENSUS_DESTS_MAX`
        (``stats`` passes those :meth:`counts` returns); a destination left out is not
        counted. Only their fields are read: on Redis 7, every bucket's in one ``SORT_RO`` of
        the index, for a user who may read every key; else with one ``HMGET`` per bucket.
        Either is about half the Redis work of the ``HGETALL``. With more destinations, or
        none, every destination a meta hash counts is.
        """
        self._check_format_once()
        few = _few_dests(dests)
        totals, truncated = [0] * (2 + int(slots)), False

        def add(counts: list[Any]) -> None:
            for i, value in enumerate(counts):
                totals[i] += int(value)

        window = [int(now_ms), int(slot_ms), int(slots), max_buckets]
        # Named, the calls together examine max_buckets at most: as many calls as that takes.
        calls = max(CENSUS_CALLS, -(-max_buckets * len(few) // CENSUS_SETS_PER_CALL) + 1)
        with translated_errors():
            for space in spaces.ALL:
                truncated = self._paged("census", space, [*window, space.tag], few, add, calls) or truncated
        return Census(truncated=truncated, overdue=totals[0], vanished=totals[1], slots=totals[2:])

    def _paged(
        self,
        name: str,
        space: spaces.Space,
        head: list[Any],
        tail: list[Any],
        add: Callable[[list[Any]], None],
        calls: int | None = None,
    ) -> bool:
        """Call script ``name`` (``census.lua``, ``overdue.lua``) on ``space``'s index with the
        arguments ``head``, then at most :data:`CENSUS_SETS_PER_CALL` sets or reads and the cursor
        of the call before, then ``tail``, until a reply has no cursor, ``calls`` calls at most
        (:data:`CENSUS_CALLS` by default); ``add`` takes each reply's counts (what follows its
        truncated flag and cursor). Return whether it was cut short."""
        after = ""
        for _ in range(CENSUS_CALLS if calls is None else calls):
            args = [self.ns, *head, CENSUS_SETS_PER_CALL, after, *tail]
            reply = self._scripts[name](keys=[space.index(self.prefix)], args=args)
            add(reply[2:])
            after = as_text(reply[1])
            if not after:
                return bool(int(reply[0]))
        return True

    def overdue(
        self, now_ms: int, max_buckets: int = 1000, among: tuple[spaces.Space, ...] = spaces.ALL
    ) -> tuple[dict[str, tuple[int, int]], bool]:
        """Return, per destination, (messages due by ``now_ms`` but not moved, due time of the
        oldest), and whether ``max_buckets`` cut the count short (``overdue.lua``, in the spaces
        ``among``). Reads only buckets that started by ``now_ms``; never a member. As the census,
        in calls of at most :data:`CENSUS_SETS_PER_CALL` reads of a sorted set (``ZCOUNT``),
        :data:`CENSUS_CALLS` a space at most, past which it is cut short too: with many queues
        and a mover outage, the buckets started hold many sets."""
        self._check_format_once()
        found: dict[str, tuple[int, int]] = {}
        truncated = False

        def add(triples: list[Any]) -> None:
            for i in range(0, len(triples), 3):
                dest, n, oldest = as_text(triples[i]), int(triples[i + 1]), int(triples[i + 2])
                had, first = found.get(dest, (0, oldest))
                found[dest] = (had + n, min(first, oldest))

        with translated_errors():
            for space in among:
                truncated = (
                    self._paged("overdue", space, [int(now_ms), max_buckets, space.tag], [], add) or truncated
                )
        return found, truncated
