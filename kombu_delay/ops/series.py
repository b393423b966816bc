"""Which queues get a ``kombu_delay_scheduled_messages`` series of their own: a bounded number,
however many queues come and go."""

from __future__ import annotations

#: Most queues with a ``kombu_delay_scheduled_messages`` series of their own.
MAX_QUEUE_SERIES = 200
#: How long a queue that emptied keeps reading 0 before its series is dropped, seconds.
ZERO_KEEP_S = 300.0
#: The ``queue`` label of what the queues past :data:`MAX_QUEUE_SERIES` hold.
OTHER_QUEUES = "(other)"


class QueueSeries:
    """Which queues get a series of their own, and what each reads: bounded however many
    queues come and go (the top :data:`MAX_QUEUE_SERIES` by count, the rest under
    :data:`OTHER_QUEUES`; emptied ones read 0 for :data:`ZERO_KEEP_S`)."""

    def __init__(self, limit: int = MAX_QUEUE_SERIES, zero_keep_s: float = ZERO_KEEP_S) -> None:
        self.limit = limit
        self.zero_keep_s = zero_keep_s
        #: Queue -> when it last held something (monotonic), for the queues shown.
        self._shown: dict[str, float] = {}
        self._other = False

    def labels(self) -> list[str]:
        """The labels of the series shown now."""
        return [*self._shown, *([OTHER_QUEUES] if self._other else [])]

    def values(self, per_queue: dict[str, int], now: float) -> tuple[dict[str, int], list[str]]:
        """Return the series to set (label -> value) and the labels to drop."""
        # A queue named as the overflow's label is counted under it: a series of its own would
        # be overwritten by the overflow's, and its messages lost from the sum.
        named_other = max(per_queue.get(OTHER_QUEUES, 0), 0)
        busy = sorted(
            (q for q, n in per_queue.items() if n > 0 and q != OTHER_QUEUES), key=lambda q: (-per_queue[q], q)
        )
        top, rest = busy[: self.limit], busy[self.limit :]
        out = {q: per_queue[q] for q in top}
        for queue in top:
            self._shown[queue] = now
        room = self.limit - len(top)
        for queue, seen in sorted(self._shown.items(), key=lambda item: -item[1]):
            if queue not in out and room > 0 and now - seen < self.zero_keep_s:
                out[queue] = 0  # emptied a moment ago: reads 0 rather than vanishing
                room -= 1
        dropped = [q for q in self._shown if q not in out]
        for queue in dropped:
            del self._shown[queue]
        other = named_other + sum(per_queue[q] for q in rest)
        self._other = self._other or bool(rest) or named_other > 0
        if self._other:  # only once some queue went past the limit: one series, kept from then on
            out[OTHER_QUEUES] = other
        return out, dropped
