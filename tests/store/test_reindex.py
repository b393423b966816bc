"""A bucket index evicted or deleted strands every bucket it named: reindex (reindex.lua, run by
a mover's background checks) puts back each bucket whose meta hash counts messages, and
nothing else. Time is set per call, never waited for."""

from __future__ import annotations

import logging

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.mover.watch import Watch
from kombu_delay.store import Store, keys
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.procs import wait_until
from tests.support.stored import kombu_payload, redis_ms

WIDTH = 60_000
ORDINARY = Settings(compress_after_ms=0)
COLD = Settings(compress_after_ms=60_000, thaw_ahead_ms=30_000)


def _schedule(store: Store, tag: str, due: int, settings: Settings, now: int) -> None:
    store.schedule(Due(due, task_id=tag), f"{store.prefix}celery", kombu_payload(tag), settings, now_ms=now)


@pytest.mark.parametrize("prefix", ["", "app*[1]:"], ids=["noprefix", "globprefix"])
def test_buckets_left_out_of_a_lost_index_are_put_back_and_moved(r: redis.Redis, prefix: str) -> None:
    now = redis_ms(r)
    start = (now // WIDTH + 10) * WIDTH
    store = Store(r, prefix)
    # Another namespace whose name the glob prefix would match unescaped: left alone.
    other = Store(r, "app1:")
    _schedule(other, "x", start + 1_000, ORDINARY, now)
    other_index = r.zrange(keys.index("app1:"), 0, -1)
    r.delete(keys.index("app1:"))

    _schedule(store, "o1", start + 1_000, ORDINARY, now)
    _schedule(store, "o2", start + WIDTH + 1_000, ORDINARY, now)
    for i in range(3):
        _schedule(store, f"c{i}", start + 2 * WIDTH + i, COLD, now)
    drained = start - 5 * WIDTH
    _schedule(store, "gone", drained + 1_000, ORDINARY, now)
    assert store.move_due(10, now_ms=drained + 2_000).moved == 1  # drained: its bucket left the index
    r.delete(keys.index(prefix), keys.cold_index(prefix))
    # A publish into a bucket that exists already does not index it again.
    _schedule(store, "o3", start + 2_000, ORDINARY, now)
    assert store.move_due(10, now_ms=start + 3 * WIDTH).moved == 0

    assert store.reindex(page=2) == (3, 6)
    assert sorted(r.zrange(keys.index(prefix), 0, -1)) == sorted(
        [str(start).encode(), str(start + WIDTH).encode()]
    )
    assert r.zrange(keys.cold_index(prefix), 0, -1) == [str(start + 2 * WIDTH).encode()]
    assert r.pttl(keys.index(prefix)) > 0 and r.pttl(keys.cold_index(prefix)) > 0
    assert store.reindex() == (0, 0)  # nothing twice
    assert r.exists(keys.index("app1:")) == 0 and other_index  # the other namespace untouched
    assert store.totals()["reindexed"] == 3

    assert sum(store.thaw(40_000, 100, now_ms=start + 2 * WIDTH - 30_000).thawed for _ in range(2)) == 3
    assert store.move_due(100, now_ms=start + 3 * WIDTH).moved == 6
    assert r.llen(f"{prefix}celery") == 7 and store.counts() == {}


def test_a_mover_puts_back_a_lost_index_and_says_so(r: redis.Redis, prefix: str, caplog) -> None:
    now = redis_ms(r)
    store = Store(r, prefix)
    _schedule(store, "o1", (now // WIDTH + 3) * WIDTH, ORDINARY, now)
    r.delete(keys.index(prefix))
    watch = Watch(store, "m1")
    with caplog.at_level(logging.ERROR, logger="kombu_delay.mover.watch"):
        watch.check_prefixes()
    assert r.zcard(keys.index(prefix)) == 1
    assert "1 buckets holding 1 messages had left the bucket index" in caplog.text


@pytest.mark.parametrize("cold", [False, True], ids=["ordinary", "cold"])
def test_a_bucket_whose_score_in_its_index_was_changed_is_put_right(
    r: redis.Redis, prefix: str, cold: bool
) -> None:
    """A bucket at another score in its index (ZADD by hand, its member right) was reached by
    nothing until the clock read that score: messages due in 5 s waited for 2100, with no word
    from the mover, and reindex, which looked only for buckets missing from the index, passed
    it over."""
    now = redis_ms(r)
    start = (now // WIDTH + 10) * WIDTH
    store = Store(r, prefix)
    for i in range(3):
        _schedule(store, f"m{i}", start + 1_000 + i, COLD if cold else ORDINARY, now)
    index = keys.cold_index(prefix) if cold else keys.index(prefix)
    [member] = r.zrange(index, 0, -1)
    r.zadd(index, {member: 4102444800000})
    assert store.reindex() == (1, 3)
    assert r.zscore(index, member) == start
    assert store.reindex() == (0, 0)
    if cold:
        assert store.thaw(40_000, 100, now_ms=start - 30_000).thawed == 3
    assert store.move_due(100, now_ms=start + WIDTH).moved == 3
    assert r.llen(f"{prefix}celery") == 3


def test_a_bucket_scheduled_into_after_it_drained_is_not_cleaned_up_when_the_index_is_lost(r, prefix):
    """A bucket that drained (into <ns>gc) and was scheduled into again is in the index and in
    gc. With the index lost, the gc clean-up once its end passed took it for a drained one and
    deleted its meta hash, so reindex could not find it: it now puts it back into the index."""
    now = redis_ms(r)
    start = (now // WIDTH + 2) * WIDTH
    store = Store(r, prefix)
    _schedule(store, "m1", start + 1_000, ORDINARY, now)
    assert store.move_due(10, now_ms=start + 2_000).moved == 1
    _schedule(store, "m2", start + 30_000, ORDINARY, start + 2_500)
    r.delete(keys.index(prefix))
    store.move_due(10, now_ms=start + WIDTH + 1_000)  # the gc clean-up of the ended bucket
    assert r.zscore(keys.index(prefix), str(start)) is not None
    assert store.move_due(10, now_ms=start + 2 * WIDTH).moved == 1
    assert r.llen(f"{prefix}celery") == 2 and store.counts() == {}
    assert store.totals()["reindexed"] == 1


def test_the_background_walks_end_at_a_stop_between_their_scan_calls(r: redis.Redis) -> None:
    # A mover's stop waited for the whole SCAN of a big database (10 s for 8 million keys),
    # then closed the connection under the walk still running.
    r.mset({f"filler:{i}": 1 for i in range(1000)})
    store = Store(r)
    asked: list[int] = []

    def stopping() -> bool:
        asked.append(1)
        return True

    assert store.stranded(60_000, page=10, stopping=stopping) == {}
    assert store.reindex(page=10, stopping=stopping) == (0, 0)
    assert asked == [1, 1]  # one SCAN call each, then the stop was seen
    asked.clear()
    assert store.reindex(page=10, stopping=lambda: bool(asked.append(1))) == (0, 0)
    assert len(asked) > 50  # not asked to stop: the whole keyspace, page by page


def test_a_lost_index_is_put_back_over_maxmemory_and_a_failed_check_is_a_warning(caplog) -> None:
    # Refused over maxmemory, the reindex left the buckets stranded, and the watch said so only
    # at debug level: their messages, which would free memory, never moved.
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as server:
        r = server.client()
        now = redis_ms(r)
        store = Store(r)
        _schedule(store, "o1", (now // WIDTH + 10) * WIDTH + 1_000, ORDINARY, now)
        r.delete(keys.index(""))
        r.rpush("filler", "x" * 10_000)
        r.config_set("maxmemory", r.info("memory")["used_memory"] // 2)
        try:
            assert store.reindex() == (1, 1)
        finally:
            r.config_set("maxmemory", 0)
        r.delete(keys.ids(""))
        r.set(keys.ids(""), "written by hand")  # the walk of the id index fails on it
        watch = Watch(store, "test")
        with caplog.at_level(logging.WARNING, logger="kombu_delay"):
            watch.start()
            try:
                wait_until(lambda: "the walk of the id index failed" in caplog.text, timeout=60)
            finally:
                watch.stop()


def test_a_drained_bucket_is_not_put_back(r: redis.Redis, prefix: str) -> None:
    # Its meta hash stays a while (for the clean-up of its task-id list) and counts nothing:
    # put back, it showed as reindexed in the totals and the log, and movers visited it again.
    store = Store(r, prefix)
    now = redis_ms(r)
    due = now + 1_500
    _schedule(store, "t", due, ORDINARY, now)
    assert store.move_due(10, now_ms=due + 1).moved == 1
    assert r.exists(keys.ns(prefix) + f"m:{due - due % WIDTH}") == 1  # the drained bucket's meta hash
    assert store.reindex(now_ms=due + 2) == (0, 0)
    assert r.zcard(keys.index(prefix)) == 0 and "reindexed" not in store.totals()
