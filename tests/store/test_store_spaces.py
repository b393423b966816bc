"""The two spaces (kombu_delay.store.spaces): every operation on what is scheduled covers both, the
same table of steps run once per space, with and without a key prefix. Time is set per call
(``now_ms``), never waited for."""

from __future__ import annotations

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import Store, inspection, keys, spaces
from kombu_delay.store.replies import Rescheduled, Scheduled
from tests.support.stored import kombu_payload, redis_ms

HOUR = 3_600_000
#: Settings that put a message due a minute ahead in each space.
PLACING = {
    spaces.ORDINARY: Settings(compress_after_ms=0),
    spaces.COLD: Settings(compress_after_ms=10_000, thaw_ahead_ms=5_000),
}


def test_spaces_are_defined_once() -> None:
    assert spaces.ALL == (spaces.COLD, spaces.ORDINARY)  # the cold one first: see the docstring
    assert [s.rank for s in spaces.ALL] == [0, 1]
    for space in spaces.ALL:
        assert spaces.of_tag(space.tag) is space
        assert spaces.of_bucket(space.bucket(120_000)) == (space, 120_000)
        for prefix in ("", "app1:"):
            assert spaces.prefix_of_index(space.index(prefix)) == prefix
            assert space.queue_set(prefix, 60_000, "q") == keys.queue_set(prefix, 60_000, "q", space.tag)
    assert spaces.COLD.index("p:") == keys.cold_index("p:")
    assert spaces.ORDINARY.index("p:") == keys.index("p:")
    assert spaces.prefix_of_index("p:kombu_delay:ids") is None
    with pytest.raises(ValueError):
        spaces.of_bucket("x60000")


@pytest.mark.parametrize(
    ("ahead_ms", "settings", "expected"),
    [
        (60_000, Settings(compress_after_ms=0), spaces.ORDINARY),  # compression off
        (60_000, Settings(compress_after_ms=10_000, thaw_ahead_ms=5_000), spaces.COLD),
        (10_000, Settings(compress_after_ms=10_000, thaw_ahead_ms=5_000), spaces.ORDINARY),  # not past it
        (60_000, Settings(compress_after_ms=10_000, thaw_ahead_ms=60_000), spaces.ORDINARY),  # thaw horizon
    ],
)
def test_where_a_new_message_goes(ahead_ms: int, settings: Settings, expected: spaces.Space) -> None:
    now = 1_000_000
    assert spaces.for_due(Due(now + ahead_ms, task_id="t"), settings, now, 100) is expected
    assert spaces.for_due(Due(ahead_ms, relative=True, task_id="t"), settings, None, 100) is expected
    assert spaces.for_due(Due(now + ahead_ms, task_id="x" * 300), settings, now, 100) is spaces.ORDINARY


def test_a_refusal_of_the_cold_space_falls_back_once() -> None:
    sent: list[spaces.Space] = []

    def send(space: spaces.Space) -> str:
        sent.append(space)
        return "stored"

    assert spaces.placed(spaces.COLD, "too soon", send, lambda r: r == "too soon") == "stored"
    assert sent == [spaces.ORDINARY]
    assert spaces.placed(spaces.ORDINARY, "too soon", send, lambda r: r == "too soon") == "too soon"
    assert sent == [spaces.ORDINARY]


@pytest.mark.parametrize("space", spaces.ALL, ids=lambda s: s.name)
def test_every_operation_covers_the_space(r: redis.Redis, prefix: str, space: spaces.Space) -> None:
    store = Store(r, prefix)
    settings = PLACING[space]
    now = redis_ms(r)
    due = now + 60_000
    dest = f"{prefix}q"

    def schedule(task_id: str) -> None:
        result = store.schedule(Due(due, task_id=task_id), dest, kombu_payload(task_id), settings, now_ms=now)
        assert result.outcome is Scheduled.STORED

    schedule("t1")
    [found] = store.find("t1")
    assert found.space is space and found.due_ms == due
    assert store.counts() == {dest: 1}
    assert store.earliest_due_ms() == due
    census = store.census(now, 30_000, 4)
    assert (census.overdue, sum(census.slots), census.vanished) == (0, 1, 0)  # a bucket's resolution
    listed, cursor = store.page(None, 10)
    assert [s.space for s in listed] == [space] and cursor is None
    assert Store(r, "other:").stranded(fresh_ms=60_000) == {prefix: 1}

    # The sweep renews the bucket's expiry once its grace runs short.
    swept = store.sweep("", 100, now_ms=due + settings.grace_ms - HOUR)
    assert (swept.renewed, swept.lost, swept.cursor) == (1, 0, "")

    moved = store.reschedule(found, "t1", kombu_payload("t1"), due + 1000, settings, now_ms=now)
    assert moved is Rescheduled.RESCHEDULED
    [again] = store.find("t1")
    assert again.space is space and again.due_ms == due + 1000
    assert store.cancel("t1", now_ms=now) == 1
    assert store.find("t1") == [] and store.counts() == {}

    schedule("t2")
    assert store.purge([dest], now_ms=now) == 1
    assert store.counts() == {} and store.earliest_due_ms() is None
    assert store.totals() == {"scheduled": 2, "rescheduled": 1, "cancelled": 1, "purged": 1}


def test_a_sweep_of_many_queues_is_made_in_bounded_calls(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A call visited 500 buckets whatever they held: with 10,000 queues, one EXISTS for each
    # of some 350,000 sets, 3 to 13 s of Redis. It stops after the bucket that reaches
    # SWEEP_SETS, and the next goes on from there: every bucket is renewed once all the same.
    store = Store(r, "")
    now = redis_ms(r)
    settings = Settings(compress_after_ms=0, bucket_width_ms=1000, grace_ms=2 * HOUR)
    due = [Due(now + 60_000 + 1000 * (i % 10), task_id=f"t{i}") for i in range(300)]
    store.schedule_many([(d, f"q{i // 10}", kombu_payload(f"t{i}")) for i, d in enumerate(due)], settings)
    monkeypatch.setattr("kombu_delay.store.move.SWEEP_SETS", 45)
    pages, cursor, renewed = 0, "", 0
    while True:
        page = store.sweep(cursor, 500, now_ms=now + 60_000 + HOUR)
        pages, renewed, cursor = pages + 1, renewed + page.renewed, page.cursor
        if not cursor:
            break
    assert renewed == 10 and pages == 6  # 30 sets a bucket: two buckets a call, then the end


@pytest.mark.parametrize("refilled", [False, True], ids=["drained", "drained-and-refilled"])
@pytest.mark.parametrize("space", spaces.ALL, ids=lambda s: s.name)
def test_a_bucket_drained_while_the_earliest_due_time_is_read_is_not_told_overdue(
    r: redis.Redis, prefix: str, space: spaces.Space, refilled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # health read the first bucket, then its heads: a move or thaw that drained it in between
    # left no head, and the bucket was told by its start, overdue since then (50 s of a thaw
    # at due, under maxmemory, in 5 of 72 probes). So did one a publish put back into the index
    # just after (the first bucket is the one publishers write into).
    store, now, dest = Store(r, prefix), redis_ms(r), f"{prefix}q"
    first, later = now + 60_000, now + 60_000 + 10 * PLACING[space].bucket_width_ms

    def schedule(task_id: str, due: int) -> None:
        stored = store.schedule(
            Due(due, task_id=task_id), dest, kombu_payload(task_id), PLACING[space], now_ms=now
        )
        assert stored.outcome is Scheduled.STORED

    schedule("first", first)
    schedule("later", later)
    real = store._earliest_in

    def drained_meanwhile(start: int, in_space: spaces.Space) -> int | None:
        if not store.cancel("first", now_ms=now):  # the first time only: its bucket's last message
            return real(start, in_space)
        assert r.zcard(in_space.index(prefix)) == 1  # and the bucket left its index
        found = real(start, in_space)
        if refilled:
            schedule("again", first + 1)  # into the same bucket, back in the index
        return found

    monkeypatch.setattr(store, "_earliest_in", drained_meanwhile)
    assert store.earliest_due_ms() == (first + 1 if refilled else later)


@pytest.mark.parametrize("space", spaces.ALL, ids=lambda s: s.name)
def test_a_bucket_whose_messages_vanished_is_told_by_its_start(
    r: redis.Redis, prefix: str, space: spaces.Space
) -> None:
    """Counted, with its sorted set gone (evicted, deleted by hand): overdue since its start,
    so that health says so, and not hidden as a bucket a move drained meanwhile is."""
    store, now, dest = Store(r, prefix), redis_ms(r), f"{prefix}q"
    due = now + 60_000
    stored = store.schedule(Due(due, task_id="t"), dest, kombu_payload("t"), PLACING[space], now_ms=now)
    assert stored.outcome is Scheduled.STORED
    start = due - due % PLACING[space].bucket_width_ms
    assert r.delete(space.queue_set(prefix, start, dest)) == 1
    assert store.earliest_due_ms() == start


def test_a_cold_message_is_thawed_then_moved_by_the_time_given(r: redis.Redis, prefix: str) -> None:
    store = Store(r, prefix)
    settings = PLACING[spaces.COLD]
    now = redis_ms(r)
    due = now + 60_000
    store.schedule(Due(due, task_id="t"), f"{prefix}q", kombu_payload("t"), settings, now_ms=now)
    assert store.thaw(settings.thaw_ahead_ms, 100, now_ms=due - settings.thaw_ahead_ms - 1).thawed == 0
    assert store.thaw(settings.thaw_ahead_ms, 100, now_ms=due - settings.thaw_ahead_ms).thawed == 1
    [found] = store.find("t")
    assert found.space is spaces.ORDINARY
    assert store.move_due(100, now_ms=due - 1).moved == 0  # never early
    result = store.move_due(100, now_ms=due)
    assert result.moved == 1 and result.lateness_ms == [0]
    assert r.llen(f"{prefix}q") == 1
    assert store.heartbeat("m", now_ms=due) == (due, False)


def _reads_of_members(r: redis.Redis) -> int:
    stats = r.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("zrange", "zrangebyscore"))


@pytest.mark.usefixtures("large_cold_members")
@pytest.mark.parametrize("space", spaces.ALL, ids=lambda s: s.name)
def test_the_oldest_overdue_is_found_without_reading_the_messages_into_lua(
    r: redis.Redis, prefix: str, space: spaces.Space
) -> None:
    """The dashboard and ``DelayControl.overdue`` read the first message of each queue's set
    into Lua for its score (Lua hashes every byte: 135 ms of Redis for 50 MB). Now the sets'
    ranges are read only in the indexes: as many with one destination as with seven. A
    message thawed late lies before its bucket's start, and a score written below 0 by hand
    is due at 0."""
    store = Store(r, prefix)
    now = redis_ms(r)
    # Mid-bucket (a minute's), so that first + 1 shares it; its start, end and this lie apart.
    first = (now // 60_000 + 2) * 60_000 + 30_007
    dests = [f"{prefix}q"] + [f"{prefix}q\x06{i}" for i in range(1, 7)]

    def schedule(task_id: str, due: int, dest: str, pad: int = 0) -> None:
        payload = kombu_payload(task_id).replace('"body": "', '"body": "' + "x" * pad, 1)
        result = store.schedule(Due(due, task_id=task_id), dest, payload, PLACING[space], now_ms=now)
        assert result.outcome is Scheduled.STORED

    def reads(expected: dict[str, tuple[int, int]]) -> int:
        assert store.earliest_due_ms() == min(oldest for _, oldest in expected.values())
        r.config_resetstat()
        assert store.overdue(first + 5_000) == (expected, False)
        assert store.overdue(first - 1) == ({}, False)
        return _reads_of_members(r)

    schedule("big", first, dests[0], 4 * 2**20)
    for i in range(3):
        schedule(f"same{i}", first, dests[0])  # scores first + seq/2048
    alone = reads({dests[0]: (4, first)})
    for i, dest in enumerate(dests[1:]):
        schedule(f"later{i}", first + 1 + i * 997, dest)
    expected = {dest: (1, first + 1 + i * 997) for i, dest in enumerate(dests[1:])}
    assert reads({dests[0]: (4, first), **expected}) == alone
    # Before its bucket's start (as a late thaw stores one), then below 0 (by hand).
    [zset] = [key for key in r.keys(f"{prefix}kombu_delay:*z:*") if key.endswith(dests[1].encode())]
    [(member, _)] = r.zrange(zset, 0, -1, withscores=True)
    for score, shown in ((first - 120_000, first - 120_000), (-5, 0)):
        r.zadd(zset, {member: score})
        assert store.earliest_due_ms() == shown
        assert store.overdue(first + 5_000)[0][dests[1]] == (1, shown)


def test_the_earliest_due_time_is_found_past_the_first_round_trip_of_queue_heads(
    r: redis.Redis, prefix: str
) -> None:
    # The heads of a bucket's queues are read HEADS_PER_TRIP at a time: the earliest may be
    # in any round trip.
    store = Store(r, prefix)
    now = redis_ms(r)
    start = (now // 60_000 + 5) * 60_000
    queues = inspection.HEADS_PER_TRIP + 50
    for n in range(queues):  # sorted by name, the last queue holds the earliest message
        due = start + 1_000 if n == queues - 1 else start + 2_000 + n
        store.schedule(
            Due(due, task_id=f"t{n}"),
            f"{prefix}q{n:04d}",
            kombu_payload(f"t{n}"),
            Settings(compress_after_ms=0),
        )
    assert store.earliest_due_ms() == start + 1_000
