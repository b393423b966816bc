"""The census (census.lua) behind ``stats``: the same counts whether it reads each bucket's counts
by name (the destinations ``stats`` passes: on Redis 7, all buckets in one SORT_RO, else one
HMGET per bucket) or whole, including sets that are gone and buckets that have started. Time
is set per call, never waited for."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.control import DelayControl
from kombu_delay.message import Due
from kombu_delay.store import Store, keys
from kombu_delay.store.census import CENSUS_DESTS_MAX
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.servers import binary_from
from tests.support.stored import kombu_payload, redis_ms

MINUTE = 60_000
ORDINARY = Settings(compress_after_ms=0)
#: Compressed beyond 30 minutes: the later part of the window is held in the cold space.
MIXED = Settings(compress_after_ms=30 * MINUTE, thaw_ahead_ms=5_000)


def _store(r: redis.Redis, prefix: str, messages: list[tuple[int, str]], settings: Settings) -> Store:
    store = Store(r, prefix)
    items = [
        (Due(due, task_id=f"t{i}"), f"{prefix}{queue}", kombu_payload(f"t{i}", queue))
        for i, (due, queue) in enumerate(messages)
    ]
    store.schedule_many(items, settings)
    return store


def _with_a_lost_set(r: redis.Redis, prefix: str) -> tuple[Store, int, int]:
    """Over the next three hours in both spaces, three queues, several messages to a bucket; one
    set gone (deleted by hand: an eviction looks the same). Returns the store, a time past the
    first buckets' starts (their due members count as overdue) and the lost set's size."""
    now = redis_ms(r)
    queues = ["a", "b", "c"]
    messages = [(now + 2 * MINUTE + i * 85_000, queues[i % 3]) for i in range(120)]
    store = _store(r, prefix, messages, MIXED)
    assert r.zcard(keys.cold_index(prefix)) > 0 and r.zcard(keys.index(prefix)) > 0
    lost = keys.queue_set(prefix, keys.bucket_start(messages[40][0], 60_000), f"{prefix}b", "c")
    lost_size = r.zcard(lost)
    assert lost_size > 0 and r.delete(lost) == 1
    return store, now + 7 * MINUTE + 30_000, lost_size


def test_a_census_by_name_counts_what_a_whole_read_counts(r: redis.Redis, prefix: str) -> None:
    store, later, lost_size = _with_a_lost_set(r, prefix)
    dests = store.counts()

    whole = store.census(later, 30 * MINUTE, 6)
    named = store.census(later, 30 * MINUTE, 6, dests=dests)
    assert named == whole
    assert whole.vanished == lost_size
    # Four messages (at +2 min and then every 85 s) are due by +7.5 min, and all lie
    # within the window (+170.6 min at most).
    assert whole.overdue == 4
    assert whole.overdue + sum(whole.slots) + whole.vanished == 120
    assert whole.truncated is False

    # A destination left out is not counted; more than CENSUS_DESTS_MAX are read whole.
    only_a = store.census(later, 30 * MINUTE, 6, dests=[f"{prefix}a"])
    assert only_a.overdue + sum(only_a.slots) == 40
    many = [f"{prefix}a"] + [f"{prefix}none{i}" for i in range(CENSUS_DESTS_MAX)]
    assert store.census(later, 30 * MINUTE, 6, dests=many) == whole
    # Cut short at two buckets (of each space), it says so.
    cut = store.census(later, 30 * MINUTE, 6, max_buckets=2, dests=dests)
    assert cut.truncated is True and cut == store.census(later, 30 * MINUTE, 6, max_buckets=2)
    assert 0 < cut.overdue + sum(cut.slots) < whole.overdue + sum(whole.slots)


@pytest.fixture(scope="module")
def server7() -> Iterator[RedisServer]:
    with RedisServer(binary=binary_from(7)) as server:
        yield server


def _calls(r: redis.Redis, command: str) -> int:
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_on_redis_7_a_census_by_name_reads_all_buckets_in_one_sort_or_bucket_by_bucket_where_refused(
    server7: RedisServer, prefix: str
) -> None:
    r = server7.client()
    r.flushall()
    store, later, _ = _with_a_lost_set(r, prefix)
    dests = store.counts()
    whole = store.census(later, 30 * MINUTE, 6)
    for index in (keys.index(prefix), keys.cold_index(prefix)):  # by hand: it names no bucket
        r.zadd(index, {"junk": later + MINUTE})

    started = sum(
        1
        for index in (keys.index(prefix), keys.cold_index(prefix))
        for member, start in r.zrange(index, 0, -1, withscores=True)
        if member != b"junk" and start <= later
    )
    r.config_resetstat()
    assert store.census(later, 30 * MINUTE, 6, dests=dests) == whole
    # One per space, and an HMGET of each started bucket's noted earliest due time, not of its
    # counts.
    assert (_calls(r, "sort_ro"), _calls(r, "hmget")) == (2, started)

    # So does a user who may read every key without the allkeys flag ("%R~*", writing only its
    # namespace's keys), as Redis lets it GET by pattern.
    ns = keys.ns(prefix)
    r.acl_setuser("reader", enabled=True, passwords=["+pw"], categories=["+@all"], keys=["%R~*", f"{ns}*"])
    client = server7.client(username="reader", password="pw")
    r.config_resetstat()
    assert Store(client, prefix).census(later, 30 * MINUTE, 6, dests=dests) == whole
    assert (_calls(r, "sort_ro"), _calls(r, "hmget")) == (2, started)
    client.close()

    # A user who may read only the namespace's keys (SORT_RO's GET is refused to it), and one
    # whose ACL refuses SORT_RO: bucket by bucket, with nothing in the ACL log or in the failed
    # calls INFO counts on every census (it is not tried).
    r.acl_log_reset()
    for name, commands in (("scoped", []), ("nosort", ["-sort_ro"])):
        r.acl_setuser(
            name, enabled=True, passwords=["+pw"], categories=["+@all"], commands=commands, keys=[f"{ns}*"]
        )
        client = server7.client(username=name, password="pw")
        r.config_resetstat()
        assert Store(client, prefix).census(later, 30 * MINUTE, 6, dests=dests) == whole
        assert (_calls(r, "sort_ro"), _calls(r, "hmget") > 0) == (0, True)
        client.close()
    assert r.acl_log() == []

    # A meta key of another type, written by hand, counts nothing either way.
    start = next(int(m) for m in r.zrange(keys.cold_index(prefix), 0, -1) if m.isdigit())
    meta = keys.meta(prefix, start, keys.COLD)
    r.delete(meta)
    r.set(meta, "by hand")
    assert store.census(later, 30 * MINUTE, 6, dests=dests) == store.census(later, 30 * MINUTE, 6)
    r.close()


def test_on_redis_7_a_key_prefix_with_a_nul_byte_is_counted_bucket_by_bucket(server7: RedisServer) -> None:
    r = server7.client()
    r.flushall()
    store, later, _ = _with_a_lost_set(r, "a\x00b:")
    r.config_resetstat()
    assert store.census(later, 30 * MINUTE, 6, dests=store.counts()) == store.census(later, 30 * MINUTE, 6)
    assert _calls(r, "sort_ro") == 0
    r.close()


def test_a_census_counts_nothing_for_an_index_member_that_names_no_bucket(
    r: redis.Redis, prefix: str
) -> None:
    store, later, _ = _with_a_lost_set(r, prefix)
    dests = store.counts()
    before = store.census(later, 30 * MINUTE, 6, dests=dests)
    # Written by hand, in the window of each space: no start, so no bucket.
    for index in (keys.index(prefix), keys.cold_index(prefix)):
        r.zadd(index, {"junk": later + MINUTE})
    assert store.census(later, 30 * MINUTE, 6, dests=dests) == before
    assert store.census(later, 30 * MINUTE, 6) == store.census(later, 30 * MINUTE, 6, dests=dests)


def test_a_key_prefix_with_a_star_is_counted_bucket_by_bucket(r: redis.Redis) -> None:
    store, later, _ = _with_a_lost_set(r, "a*b:")
    assert store.census(later, 30 * MINUTE, 6, dests=store.counts()) == store.census(later, 30 * MINUTE, 6)


def test_a_census_of_many_queues_is_counted_in_bounded_calls_that_add_up(
    r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With thousands of queues each bucket counts thousands of sets, and one call counted all
    # of the window's: seconds of Redis's time, every other client answered BUSY past 5 s. A
    # call now stops after the bucket that reaches its budget of sets, and the next goes on.
    store, later, lost_size = _with_a_lost_set(r, prefix)
    whole = store.census(later, 30 * MINUTE, 6)

    def script_calls() -> int:
        return _calls(r, "evalsha") + _calls(r, "fcall")

    before = script_calls()
    monkeypatch.setattr("kombu_delay.store.census.CENSUS_SETS_PER_CALL", 3)
    monkeypatch.setattr("kombu_delay.store.census.CENSUS_CALLS", 1000)
    paged = store.census(later, 30 * MINUTE, 6)
    assert paged == whole and whole.vanished == lost_size and not paged.truncated
    # 120 messages of three queues, one to four a bucket: 3 sets and a bucket a call.
    assert script_calls() - before > 20
    # Past the most calls, the census says it was cut short, and counts no more than it read.
    monkeypatch.setattr("kombu_delay.store.census.CENSUS_CALLS", 2)
    cut = store.census(later, 30 * MINUTE, 6)
    assert cut.truncated and 0 < cut.overdue + sum(cut.slots) < whole.overdue + sum(whole.slots)


def _census_by_name_in_bounded_calls(r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store, later, _ = _with_a_lost_set(r, prefix)
    dests = store.counts()
    whole = store.census(later, 30 * MINUTE, 6, dests=dests)
    first = store.census(later, 30 * MINUTE, 6, max_buckets=40, dests=dests)  # cut by the buckets
    assert first.truncated and not whole.truncated
    before = _calls(r, "evalsha") + _calls(r, "fcall")
    monkeypatch.setattr("kombu_delay.store.census.CENSUS_SETS_PER_CALL", len(dests) * 2)
    monkeypatch.setattr("kombu_delay.store.census.CENSUS_CALLS", 1000)
    assert store.census(later, 30 * MINUTE, 6, dests=dests) == whole
    assert _calls(r, "evalsha") + _calls(r, "fcall") - before > 20  # two buckets a call
    # The calls together examine max_buckets at most, as one call did, and as many calls as
    # max_buckets takes are made (a cap of calls cut a census of a larger max_buckets short).
    assert store.census(later, 30 * MINUTE, 6, max_buckets=40, dests=dests) == first
    monkeypatch.setattr("kombu_delay.store.census.CENSUS_CALLS", 2)
    assert store.census(later, 30 * MINUTE, 6, dests=dests) == whole


def test_a_census_by_name_is_counted_in_bounded_calls_that_add_up(
    r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With 16 destinations (4 queues of kombu's 4 priority steps) or fewer, a census read them
    # by name in one call over up to 10,000 buckets: 160,000 sets, a call that held Redis for
    # seconds at each `stats --hours 336` and each refresh of the dashboard's days.
    _census_by_name_in_bounded_calls(r, prefix, monkeypatch)


def test_on_redis_7_a_census_by_sort_is_counted_in_bounded_calls_that_add_up(
    server7: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = server7.client()
    r.flushall()
    _census_by_name_in_bounded_calls(r, prefix, monkeypatch)
    assert _calls(r, "sort_ro") > 20
    r.close()


@pytest.mark.parametrize("space", ["ordinary", "cold"])
def test_the_overdue_count_of_many_queues_is_made_in_bounded_calls_that_add_up(
    r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch, space: str
) -> None:
    # With thousands of queues and buckets started during a mover outage, one call looked at
    # every set of them: a review's 210,000 overdue over 10,000 queues held Redis for 6 to 22 s.
    now = redis_ms(r)
    settings = Settings(compress_after_ms=60_000 if space == "cold" else 0, bucket_width_ms=1000)
    store = Store(r, prefix)
    # 12 one-second buckets, each with a message for each of 40 queues.
    messages = [(now + 120_000 + 1000 * (i % 12) + i % 7, f"q{i // 12}") for i in range(480)]
    _store(r, prefix, messages, settings)
    later = now + 120_000 + 12_000
    whole, cut = store.overdue(later)
    assert not cut and sum(n for n, _ in whole.values()) == 480 and len(whole) == 40
    assert {q: oldest for q, (_, oldest) in whole.items()} == {
        f"{prefix}q{k}": min(due for due, q in messages if q == f"q{k}") for k in range(40)
    }

    def script_calls() -> int:
        return _calls(r, "evalsha") + _calls(r, "fcall")

    before = script_calls()
    monkeypatch.setattr("kombu_delay.store.census.CENSUS_SETS_PER_CALL", 25)
    monkeypatch.setattr("kombu_delay.store.census.CENSUS_CALLS", 1000)
    assert store.overdue(later) == (whole, False)
    assert script_calls() - before >= 12  # 40 sets a bucket: one bucket a call
    monkeypatch.setattr("kombu_delay.store.census.CENSUS_CALLS", 3)
    found, cut = store.overdue(later)
    assert cut and 0 < sum(n for n, _ in found.values()) < 480


def test_a_census_checks_its_sets_in_slices_and_finds_one_gone_in_any(r: redis.Redis, prefix: str) -> None:
    now = redis_ms(r)
    # 2,500 one-second buckets, one set each: three slices of the sets' EXISTS.
    messages = [(now + MINUTE + i * 1000, "a") for i in range(2500)]
    store = _store(r, prefix, messages, Settings(compress_after_ms=0, bucket_width_ms=1000))
    assert r.zcard(keys.index(prefix)) == 2500
    gone = [messages[i][0] for i in (0, 1500, 2499)]
    for due in gone:
        assert r.delete(keys.queue_set(prefix, keys.bucket_start(due, 1000), f"{prefix}a")) == 1
    for dests in (None, store.counts()):
        census = store.census(now, 10 * MINUTE, 6, dests=dests)
        assert census.vanished == 3
        assert sum(census.slots) == 2497 and census.overdue == 0


def test_stats_reads_buckets_by_name_and_still_counts_every_message(r, redis_server, prefix) -> None:
    now = redis_ms(r)
    # Every 3 minutes from +5 min: 19 in the first hour, 11 after it.
    messages = [(now + 5 * MINUTE + i * 3 * MINUTE, ("a", "b")[i % 2]) for i in range(30)]
    _store(r, prefix, messages, ORDINARY)
    with DelayControl(redis_server.url, {"global_keyprefix": prefix}) as ctl:
        stats = ctl.stats(hours=1, slot_minutes=10)
    assert stats.scheduled == 30 and stats.by_queue == {"a": 15, "b": 15}
    assert sum(s.count for s in stats.histogram) == 19 and stats.later == 11
