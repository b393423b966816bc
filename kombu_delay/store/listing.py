"""Listing what is scheduled in due order, across both spaces, a bounded page at a time.

Part of the store layer (it reads Redis for :meth:`Store.page`). Messages live in one sorted set
per bucket, destination and space, so due order across them is a merge: a bucket is opened (its
sets read from the cursor on) only once nothing earlier is left unlisted, since a bucket holds
nothing due before its start. Publishers of different bucket widths may leave a wide bucket that
starts before a narrow one and ends after it: the merge handles that, and the cursor keeps the
start of the earliest bucket still open (``lo``), so the next page opens it again.

Order: due millisecond, then the cold space before the ordinary one, then score, bucket start,
destination and member. A mover thawing a message moves it from the cold space to the ordinary
one at the same due millisecond, that is, later in this order: a message thawed while a listing
pages may be listed twice. The bucket starts ahead are read a batch at a time, so a bucket made
after that read (a thaw's or a publish's) is not seen by that page, nor by a later one when it
starts before the earliest bucket still open: its messages are left out of that pass.

A page's work is bounded: each member read and each bucket opened (a read of its meta hash, for
a bucket that may hold nothing for the destinations asked for) counts against one budget. A
page cut by it while nothing is left open goes on, on the next page, from the next bucket not
opened yet; so a listing of a rare queue among many buckets of others pages its way through them.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from kombu_delay.store import keys, spaces
from kombu_delay.store.replies import Stored
from kombu_delay.store.spaces import Space

if TYPE_CHECKING:
    from kombu_delay.store.inspection import Inspecting as Store

#: Members read from one sorted set per call.
CHUNK = 64
#: Bucket starts read from an index per call.
STARTS = 64
#: What a cursor's destination keeps as it is; every other character percent-encoded.
CURSOR_SAFE = ":._-~@+,=/"
_ENCODED = re.compile(rf"(?:[A-Za-z0-9{re.escape(CURSOR_SAFE)}]|%[0-9A-Fa-f]{{2}})*")
#: The digest of a cursor that names no message: one before the next bucket to open.
NO_MEMBER = "0" * 16


@dataclass(frozen=True, order=True)
class Position:
    """Where a message stands in the listing order."""

    due_ms: int
    #: 0 for the cold space, 1 for the ordinary one.
    rank: int
    score: float
    start_ms: int
    dest: str
    #: Digest of the member (:func:`digest`), for members that share everything else.
    last: str = field(default="", compare=False)


@dataclass(frozen=True)
class Cursor:
    """A listing position: the last message listed, and ``lo``, the start of the earliest bucket
    that may still hold messages after it. Printed as
    ``<lo>:<due>:<rank>:<score>:<start>:<digest>:<dest>``, the destination percent-encoded but
    for letters, digits and ``:._-~@+,=/`` (kombu names a priority step's list with control
    characters, which a terminal drops, and a name may hold a shell's), so the printed cursor
    is text a terminal shows and a shell passes on whole."""

    lo: int
    at: Position

    def __str__(self) -> str:
        at = self.at
        return (
            f"{self.lo}:{at.due_ms}:{at.rank}:{keys.score_text(at.score)}:{at.start_ms}:{at.last}:"
            + quote(at.dest, safe=CURSOR_SAFE, errors="surrogatepass")
        )

    @classmethod
    def parse(cls, text: str) -> Cursor:
        """Parse :meth:`__str__` output; raise ``ValueError`` for anything else, such as a
        score that is NaN or a due time its score does not stand for (:func:`keys.due_of`: a
        score written by hand, ``±inf`` even, stands for the nearest end of the span)."""
        lo, due, rank, score, start, last, dest = text.split(":", 6)
        if not _ENCODED.fullmatch(dest):  # (a name as an earlier release printed it, raw or escaped)
            raise ValueError(text)
        dest = unquote(dest, errors="surrogatepass")
        numbers = (lo, due, start)
        if not all(n.isdigit() for n in numbers) or rank not in ("0", "1") or len(last) != 16:
            raise ValueError(text)
        int(last, 16)
        at = Position(int(due), int(rank), float(score), int(start), dest, last)
        if math.isnan(at.score) or keys.due_of(at.score) != at.due_ms or int(lo) > at.start_ms:
            raise ValueError(text)
        return cls(int(lo), at)


def digest(member: bytes) -> str:
    """The short digest of a member that a cursor keeps."""
    return hashlib.blake2b(member, digest_size=8).hexdigest()


class _Source:
    """The members of one sorted set from the cursor on, read a chunk at a time."""

    def __init__(self, store: Store, space: Space, start: int, dest: str, after: Position | None) -> None:
        self.store, self.space, self.start, self.dest = store, space, start, dest
        self.key = space.queue_set(store.prefix, start, dest)
        self.rank = space.rank
        #: True once the set has nothing more to read.
        self.done = False
        #: Members read so far (the page's budget).
        self.read = 0
        self._buffer: list[tuple[Position, bytes]] = []
        self._after = after
        self._lower = "-inf" if after is None else self._first_score(after)

    def _first_score(self, after: Position) -> str:
        """The lowest score that may hold members not listed yet: the cursor's own score in its
        space, its whole millisecond in the ordinary space when it is in the cold one (which
        comes first), and the next millisecond in the cold space when it is in the ordinary one.
        So at most one run of members sharing a score is read and skipped, however many pages."""
        if self.rank == after.rank:
            return keys.score_text(after.score)
        return str(after.due_ms if self.rank > after.rank else after.due_ms + 1)

    @property
    def open(self) -> bool:
        """True while it may still hold members not listed."""
        return bool(self._buffer) or not self.done

    def peek(self) -> Position | None:
        while not self._buffer and not self.done:
            self._fill()
        return self._buffer[0][0] if self._buffer else None

    def pop(self) -> tuple[Position, bytes]:
        return self._buffer.pop(0)

    @property
    def in_hand(self) -> bool:
        """True when taking the next member reads nothing more: the one after it is read
        already, or none is left."""
        return len(self._buffer) >= 2 or self.done

    def _fill(self) -> None:
        client = self.store.client
        with self.store.types_named({self.key: "zset"}):
            raw: list[Any] = client.zrangebyscore(self.key, self._lower, "+inf", 0, CHUNK, withscores=True)
            self.done = len(raw) < CHUNK
            if not self.done:  # the run of the last score is read whole: no run is split between reads
                tail = raw[-1][1]
                raw = [pair for pair in raw if pair[1] != tail]
                raw += client.zrangebyscore(self.key, tail, tail, withscores=True)
        if raw:
            self._lower = f"({keys.score_text(float(raw[-1][1]))}"
        self.read += len(raw)
        items = [
            (Position(keys.due_of(s), self.rank, float(s), self.start, self.dest, digest(bytes(m))), bytes(m))
            for m, s in raw
        ]
        if self._after is not None:
            items = self._unlisted(items, self._after)
        self._buffer += items

    def _unlisted(self, items: list[tuple[Position, bytes]], after: Position) -> list[tuple[Position, bytes]]:
        """Drop what the cursor listed already. In the cursor's own set, members sharing its
        score come in byte order: go on after the one it names or, when that one left meanwhile
        (moved, cancelled), from the first of them (a repeat, never a skip)."""
        kept = [item for item in items if not item[0] < after]
        names = [at.last for at, _ in kept if at == after]
        if after.last in names:
            kept = kept[names.index(after.last) + 1 :]
        if self.done or any(after < at for at, _ in kept):
            self._after = None  # past the cursor for good
        return kept


class _Buckets:
    """Bucket starts of both spaces from ``lo`` on, merged in start order."""

    def __init__(self, store: Store, lo: int) -> None:
        self._streams = [self._starts(store, space, lo) for space in spaces.ALL]
        self._heads: list[tuple[int, int, Space]] = []
        for i, stream in enumerate(self._streams):
            self._advance(i, stream)

    @staticmethod
    def _starts(store: Store, space: Space, lo: int) -> Iterator[tuple[int, Space]]:
        lower, tail = str(lo), set[bytes]()  # tail: the members read at the last score read
        while True:
            raw: list[Any] = store.client.zrangebyscore(
                space.index(store.prefix), lower, "+inf", 0, STARTS + len(tail), withscores=True
            )
            for member, _ in raw:
                start = keys.start_of(member)
                if start is not None and member not in tail:  # (one by hand names no bucket)
                    yield start, space
            if len(raw) < STARTS + len(tail):
                return
            # Read on from that score, inclusive: a member written by hand may share a start's
            # score, and the start must not be passed over with it. (The members at that score
            # come first, in byte order: those read before are all read again.)
            last = raw[-1][1]
            tail = {member for member, score in raw if score == last}
            lower = keys.score_text(last)

    def _advance(self, i: int, stream: Iterator[tuple[int, Space]]) -> None:
        nxt = next(stream, None)
        if nxt is not None:
            heapq.heappush(self._heads, (nxt[0], i, nxt[1]))

    def peek(self) -> int | None:
        return self._heads[0][0] if self._heads else None

    def pop(self) -> tuple[int, Space]:
        start, i, space = heapq.heappop(self._heads)
        self._advance(i, self._streams[i])
        return start, space


class _Merge:
    """One page: the members of the open sorted sets, merged in listing order."""

    def __init__(self, store: Store, after: Cursor | None, dests: set[str] | None) -> None:
        self.store, self.dests = store, dests
        self.buckets = _Buckets(store, after.lo if after else 0)
        self.at = after.at if after else None
        #: The open sets by their next member.
        self.heap: list[tuple[Position, int, _Source]] = []
        self.opened: list[_Source] = []
        #: The last member taken (the cursor's position before any).
        self.last = self.at
        #: Buckets opened, the start of the last one, and members taken, so far.
        self.visited = 0
        self.opened_to = -1
        self.taken = 0

    @property
    def spent(self) -> int:
        """The page's work so far: members read and buckets opened."""
        return self.visited + sum(s.read for s in self.opened)

    @property
    def may_stop(self) -> bool:
        """True when a cursor can go on from here, past what this page did: it took a member,
        or nothing it opened is left and the next bucket starts after the cursor's message (the
        next page starts at that bucket). Else (a wide bucket still open, say) the page goes on."""
        if self.taken:
            return True
        return not self.heap and self._untouched(self.buckets.peek())

    def _untouched(self, start: int | None) -> bool:
        """True when no bucket starting at ``start`` was opened (one of the other space may
        share its start), and none can hold the last member taken or one before it; or when
        no bucket is left."""
        if start is None:
            return True
        return start > self.opened_to and (self.last is None or self.last.due_ms < start)

    def step(self) -> Stored | bool | None:
        """Open the next bucket when it may hold the next member (``True``), else take the next
        member; ``None`` when nothing is left."""
        nxt = self.buckets.peek()
        # A bucket holds nothing due before its start: open it once nothing earlier is left.
        if nxt is not None and (not self.heap or nxt <= self.heap[0][0].due_ms):
            self._open(*self.buckets.pop())
            return True
        return self._take() if self.heap else None

    def _open(self, start: int, space: Space) -> None:
        # Only a bucket past the cursor's message counts: one that starts before it is opened
        # again (a wide bucket still open kept the cursor's start back), not explored, and
        # counted, it would cut every page after its first message.
        if self.at is None or start > self.at.due_ms:
            self.visited += 1
        self.opened_to = start
        for dest in self.store.dests(start, space, among=self.dests):
            self.opened.append(source := _Source(self.store, space, start, dest, self.at))
            self._push(source)

    def _push(self, source: _Source) -> None:
        head = source.peek()
        if head is not None:
            heapq.heappush(self.heap, (head, id(source), source))

    def take_in_hand(self) -> Stored | None:
        """Take the next member when that reads nothing: no bucket is to be opened before it,
        and its set holds the member after it in hand (or none); else ``None``."""
        if not self.heap:
            return None
        head, _, source = self.heap[0]
        nxt = self.buckets.peek()
        if (nxt is not None and nxt <= head.due_ms) or not source.in_hand:
            return None
        return self._take()

    def _take(self) -> Stored:
        self.last, _, source = heapq.heappop(self.heap)
        self.taken += 1
        _, member = source.pop()
        self._push(source)
        return Stored(source.start, self.last.score, source.dest, member, source.space.compressed)

    def cursor(self) -> Cursor | None:
        """Where the next page starts: after the last member taken, from the earliest bucket
        still open (or the last member's own)."""
        last = self.last
        if last is None:
            return None
        still = [
            s.start
            for s in self.opened
            if s.open or (s.start, s.dest, s.rank) == (last.start_ms, last.dest, last.rank)
        ]
        return Cursor(min([last.start_ms, *still]), last)

    def resume(self) -> Cursor | None:
        """The cursor of a page the budget cut: with nothing left open, one just before the next
        bucket to open (every message before it is listed, and none of its is due before its
        start), so the next page does not open again what this one did; ``None`` when no
        bucket is left."""
        nxt = self.buckets.peek()
        if self.heap or not self._untouched(nxt):
            return self.cursor()
        if nxt is None:
            return None
        return Cursor(nxt, Position(nxt - 1, spaces.ORDINARY.rank, float(nxt - 1), nxt, "", NO_MEMBER))


def page(
    store: Store, after: Cursor | None, limit: int, dests: set[str] | None, examine: int
) -> tuple[list[Stored], Cursor | None]:
    """Return up to ``limit`` messages after ``after`` in due order, and the next cursor
    (``None`` at the end). At most about ``examine`` members are read and buckets opened per
    call (a wide bucket still open, with no member taken, can hold the page longer)."""
    merge = _Merge(store, after, dests)
    out: list[Stored] = []
    while len(out) < limit:
        if merge.spent >= examine and merge.may_stop:
            # What was read is listed: opening a bucket reads ahead in each of its sets, and a
            # page that stopped at its first member then, with many sets in one bucket, listed
            # one message a page and read that bucket again for each.
            while len(out) < limit and (in_hand := merge.take_in_hand()) is not None:
                out.append(in_hand)
            return out, merge.resume()
        got = merge.step()
        if got is None:
            return out, None
        if isinstance(got, Stored):
            out.append(got)
    if not merge.heap and merge.buckets.peek() is None:  # the last page, exactly full: no next one
        return out, None
    return out, merge.cursor()
