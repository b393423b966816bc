"""The sweep (sweep.lua, run by every mover): nothing a running mover holds expires, however long
it is held, and messages found gone (expired, evicted, deleted) are settled and counted, not
left counted as scheduled.

Time is driven through a fake clock (see ``FakeClock``): hours pass in a step.
"""

from __future__ import annotations

import logging
import threading

import redis

from kombu_delay import DelayControl
from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.mover.loop import Mover
from kombu_delay.store import Store, keys
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.faults import consistency
from tests.support.procs import wait_until
from tests.support.stored import FakeClock, expires_at, kombu_payload, sweep_all, tags_in

HOUR = 3_600_000
#: The shortest grace accepted, and messages stored uncompressed.
SHORT = Settings(compress_after_ms=0, grace_ms=HOUR)
#: Stored compressed (the cold space) when due more than a second ahead.
COLD = Settings(compress_after_ms=1000, thaw_ahead_ms=1000, grace_ms=HOUR)


def message_keys(client: redis.Redis, prefix: str) -> list[str]:
    """Every key of the namespace that holds messages or what finds them (sets, metas, task-id
    lists, the indexes and the shared hashes)."""
    found = [k.decode() for k in client.scan_iter(match=keys.ns(prefix) + "*", count=1000)]
    return sorted(k for k in found if not k.endswith(("totals", "movers", "alerts")))


def test_held_messages_keep_their_grace_for_as_long_as_a_mover_holds_them(r, prefix):
    """A full list (delay_max_queue_length) holds an ordinary message, and a compressed one is
    never thawed (as under a refused thaw): a day passes, in steps of 20 minutes, with a mover
    moving and sweeping; every key still has its whole grace left at each step, and the held
    message is delivered once the list has room."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    q = f"{prefix}q"
    r.rpush(q, "filler")
    store.schedule(Due(clock() + 1000, task_id="held"), q, kombu_payload("held"), SHORT)
    store.schedule(Due(clock() + 5000, task_id="frozen"), f"{prefix}c", kombu_payload("frozen"), COLD)
    assert r.zcard(keys.cold_index(prefix)) == 1 and r.zcard(keys.index(prefix)) == 1
    for _ in range(72):
        clock.advance(20 * 60_000)
        result = store.move_due(100, max_queue_length=1)
        assert (result.moved, result.held) == (0, 1)
        renewed, lost, _ = sweep_all(store)
        assert lost == 0 and renewed >= 2
        for key in message_keys(r, prefix):
            at = expires_at(r, key)
            assert at is not None and at >= clock() + HOUR - 5, (key, at, clock())
    assert len(store.find("frozen")) == 1 and len(store.find("held")) == 1
    r.delete(q)
    assert store.move_due(100, max_queue_length=1).moved == 1
    assert tags_in(r, q) == ["held"]


def test_a_running_mover_sweeps_at_its_start_and_pushes_the_expiry_out(r):
    """A mover (its loop in a thread) whose clock is two hours past a held bucket's end gives
    that bucket its grace again in its first sweep, at start."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    r.rpush("q", "filler")
    store.schedule(Due(clock() + 1000, task_id="held"), "q", kombu_payload("held"), SHORT)
    start = keys.bucket_start(clock() + 1000, SHORT.bucket_width_ms)
    was = expires_at(r, keys.queue_set("", start, "q"))
    clock.advance(2 * HOUR)
    mover = Mover(store, Settings(max_queue_length=1), watch=False)
    runner = threading.Thread(target=mover.run, daemon=True)
    runner.start()
    try:
        wait_until(lambda: mover.stats.renewed >= 1, timeout=60)
    finally:
        mover.stop()
        runner.join(30)
    now_at = expires_at(r, keys.queue_set("", start, "q"))
    assert was is not None and now_at is not None
    assert was < clock() and now_at >= clock() + HOUR - 5


def test_messages_found_gone_are_settled_counted_and_no_longer_scheduled(r, prefix, redis_server):
    """Sorted sets of future buckets vanish (as an eviction would take them): ``stats`` stops
    counting them at once, a sweep settles them as expired, and the totals add up."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    base = clock()
    base -= base % 60_000  # a bucket's start: base + i, i < 5, share a bucket
    items = [
        (
            Due(base + (10 + 10 * b) * 60_000 + i, task_id=f"m{b}-{i}"),
            f"{prefix}{d}",
            kombu_payload(f"m{b}-{i}"),
        )
        for b in range(4)
        for i in range(5)
        for d in ("a", "b")
        if d == "a" or i < 2
    ]
    store.schedule_many(items, SHORT)
    starts = [int(s) for s in r.zrange(keys.index(prefix), 0, -1)]
    assert len(starts) == 4
    r.delete(keys.queue_set(prefix, starts[1], f"{prefix}a"), keys.queue_set(prefix, starts[3], f"{prefix}b"))
    gone = 5 + 2
    with DelayControl(redis_server.delay_url, {"global_keyprefix": prefix}) as ctl:
        stats = ctl.stats()
        assert (stats.scheduled, stats.vanished) == (len(items) - gone, gone)
        assert sweep_all(store) == (0, gone, 0)
        stats = ctl.stats()
        assert (stats.scheduled, stats.vanished) == (len(items) - gone, 0)
        assert stats.by_queue == {"a": 15, "b": 6}
        assert stats.totals["expired"] == gone
    rest = consistency(r, prefix)
    assert rest["stored"] == len(items) - gone and rest["expired"] == gone


def test_a_bucket_whose_meta_hash_vanished_is_rebuilt_and_delivered(r, prefix):
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = clock() + 30 * 60_000
    store.schedule_many(
        [
            (Due(due + i, task_id=f"t{i}"), f"{prefix}{q}", kombu_payload(f"t{i}"))
            for i in range(6)
            for q in "xy"
        ],
        SHORT,
    )
    start = keys.bucket_start(due, SHORT.bucket_width_ms)
    r.delete(keys.meta(prefix, start))
    assert sweep_all(store) == (0, 0, 1)
    clock.advance(31 * 60_000)
    assert store.move_due(100).moved == 12
    assert sorted(tags_in(r, f"{prefix}x")) == sorted(f"t{i}" for i in range(6))
    assert store.counts() == {}


def test_a_bucket_deleted_whole_is_told_and_counted_when_the_move_lets_it_go(r, prefix, caplog):
    """Its meta hash and its sorted sets deleted by hand (or evicted): nothing is left to say
    what it held. The mover let it go in silence; now it says so, as an ERROR, and counts it."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = clock() + 30 * 60_000
    due -= due % 60_000  # a bucket's start: due + i, i < 3, share it
    items = [
        (Due(due + i, task_id=f"t{i}"), f"{prefix}{q}", kombu_payload(f"t{i}"))
        for i in range(3)
        for q in "xy"
    ]
    store.schedule_many(items, SHORT)
    later = [(Due(due + 3 * 60_000, task_id="kept"), f"{prefix}x", kombu_payload("kept"))]
    store.schedule_many(later, SHORT)
    start = keys.bucket_start(due, SHORT.bucket_width_ms)
    r.delete(keys.meta(prefix, start), *(keys.queue_set(prefix, start, f"{prefix}{q}") for q in "xy"))
    clock.advance(31 * 60_000)
    with caplog.at_level(logging.ERROR, logger="kombu_delay.mover.loop"):
        result = Mover(store, SHORT, name="m", watch=False).drain()
    assert (result.moved, result.vanished, result.expired) == (0, 1, 0)
    assert "mover m: 1 buckets vanished whole" in caplog.text
    assert store.totals().get("vanished_buckets") == 1
    clock.advance(3 * 60_000)
    result = store.move_due(100)
    assert (result.moved, result.vanished) == (1, 0)  # the next bucket moves, and none vanished
    assert r.llen(f"{prefix}x") == 1


def test_a_bucket_deleted_whole_before_it_is_due_is_told_and_counted_by_the_sweep(r, prefix, caplog):
    """The sweep reaches a bucket due later before any move does, and let it go in silence: its
    messages vanished without a word, though the move tells the same loss (above)."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = clock() + 30 * 60_000
    due -= due % 60_000
    items = [
        (Due(due + i, task_id=f"t{i}"), f"{prefix}{q}", kombu_payload(f"t{i}"))
        for i in range(3)
        for q in "xy"
    ]
    store.schedule_many(items, SHORT)
    start = keys.bucket_start(due, SHORT.bucket_width_ms)
    r.delete(keys.meta(prefix, start), *(keys.queue_set(prefix, start, f"{prefix}{q}") for q in "xy"))
    mover = Mover(store, SHORT, name="m", watch=False)
    with caplog.at_level(logging.ERROR, logger="kombu_delay.mover.loop"):
        mover.sweep()
    assert "mover m: 1 buckets vanished whole" in caplog.text
    assert store.totals().get("vanished_buckets") == 1
    assert r.zscore(keys.index(prefix), str(start)) is None  # let go
    caplog.clear()
    clock.advance(31 * 60_000)
    with caplog.at_level(logging.ERROR, logger="kombu_delay.mover.loop"):
        assert mover.drain().vanished == 0  # told once, not again
        assert sweep_all(store) == (0, 0, 0)
    assert "vanished" not in caplog.text and store.totals().get("vanished_buckets") == 1


def test_a_sweep_under_maxmemory_still_pushes_the_expiry_out(tmp_path):
    """Over maxmemory (noeviction), a held message keeps its grace: the renewal's first writes
    cannot grow memory, so Redis lets the sweep run."""
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as server:
        client = server.client()
        clock = FakeClock(client)
        store = Store(client, clock=clock)
        client.rpush("q", "filler")
        store.schedule(Due(clock() + 1000, task_id="held"), "q", kombu_payload("held"), SHORT)
        client.config_set("maxmemory", client.info("memory")["used_memory"] // 2)
        clock.advance(3 * HOUR)
        assert sweep_all(store)[0] == 1
        start = keys.bucket_start(clock() - 3 * HOUR + 1000, SHORT.bucket_width_ms)
        at = expires_at(client, keys.queue_set("", start, "q"))
        assert at is not None and at >= clock() + HOUR - 5


def test_the_sweep_keeps_the_hash_of_a_held_x_expires_queues_other_lists(r, prefix):
    """The hash that names an x-expires queue's other lists (renewed with its list when a
    message is pushed) is kept a day past its buckets, as the shared hashes are: a message held
    longer than that (a full list) outlived it, and its push renewed its own list only."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    q = f"{prefix}q"
    others = [f"{q}{keys.KOMBU_PRIORITY_SEP}3"]
    store.schedule(
        Due(clock() + 1000, task_id="held"), q, kombu_payload("held"), SHORT, 600_000, siblings=others
    )
    clock.advance(30 * 60_000)  # half its grace gone: the sweep renews it
    r.pexpire(keys.lists(prefix), 1000)  # as a day on from its bucket's grace, held all along
    renewed, _, _ = sweep_all(store)
    assert renewed == 1
    assert r.pttl(keys.lists(prefix)) > 86_400_000
