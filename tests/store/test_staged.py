"""A herd staged ahead (stage.lua) and handed over whole when due (move.lua, _handover.lua).

Each test checks what a consumer would see against what the batches deliver for the same
messages: the same payloads, in the same order, each once, none early, and the store's
counts and keys as a batch move leaves them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import redis

from kombu_delay.errors import RedisRefused
from kombu_delay.message import Due
from kombu_delay.store import Store, keys
from kombu_delay.store.replies import Staged
from tests.support.procs import wait_until
from tests.support.stored import ORDINARY, FakeClock, kombu_payload, schedule_herd, tags_in

RUN = 3000  #: the herd of most tests
MIN_RUN = 1000  #: what these tests pass as the smallest run worth staging


def stage_all(store: Store, start: int, dest: str, batch: int = 700) -> Staged:
    """Stage calls until the run is staged or refused; the outcome of the last."""
    while (result := store.stage(start, dest, batch, MIN_RUN)).outcome is Staged.MORE:
        pass
    return result.outcome


def stage_herd(store: Store, dest: str, due: int) -> int:
    """Stage the run due at ``due`` whole; return its bucket's start."""
    start = due - due % ORDINARY.bucket_width_ms
    assert stage_all(store, start, dest) is Staged.DONE
    return start


def drain(store: Store) -> int:
    moved = 0
    while (result := store.move_due(500)).moved:
        moved += result.moved
    return moved


def staged_keys(r: redis.Redis, prefix: str) -> list[bytes]:
    return sorted(r.scan_iter(match=keys.ns(prefix) + "h:*", count=1000))


@pytest.fixture
def herd(r: redis.Redis, prefix: str) -> tuple[FakeClock, Store, str, int]:
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    width = ORDINARY.bucket_width_ms
    due = (clock() // width + 1) * width + width // 2  # mid-bucket: room before and after
    schedule_herd(store, f"{prefix}q", due, [f"h{i}" for i in range(RUN)])
    return clock, store, f"{prefix}q", due


def batches_of(
    r: redis.Redis, prefix: str, build: list[tuple[int, list[str]]], waiting: list[str]
) -> list[bytes]:
    """The list the batches leave for the same messages (under a prefix of its own)."""
    clock = FakeClock(r)
    # Stored at the test's own time: by Redis's, now, the first may be due already (a slow
    # machine), and a message due is pushed at once, in publish order, not in its batch's.
    clock.ms = min(due for due, _ in build) - 1000
    store = Store(r, f"{prefix}ctl:", clock=clock)
    dest = f"{prefix}ctl:q"
    for due, ids in build:
        schedule_herd(store, dest, due, ids)
    if waiting:
        r.lpush(dest, *waiting)
    clock.ms = max(due for due, _ in build) + 10
    drain(store)
    return r.lrange(dest, 0, -1)  # type: ignore[return-value]


def test_a_staged_herd_reaches_its_list_whole_in_one_call_as_the_batches_would_leave_it(
    r: redis.Redis, prefix: str, herd: tuple[FakeClock, Store, str, int]
) -> None:
    clock, store, dest, due = herd
    r.lpush(dest, "waiting-1", "waiting-2")  # a consumer has not taken these yet
    start = due - due % ORDINARY.bucket_width_ms
    assert stage_all(store, start, dest) is Staged.DONE
    assert stage_all(store, start, dest) is Staged.DONE  # a second mover: nothing copied twice
    assert staged_keys(r, prefix) == [keys.staged(store.prefix, start, dest).encode()]
    assert r.llen(staged_keys(r, prefix)[0]) == RUN
    assert r.llen(dest) == 2  # nothing delivered before due

    clock.ms = due - 1
    assert store.move_due(500).moved == 0
    clock.ms = due + 40
    result = store.move_due(500)

    assert (result.moved, result.more) == (RUN, True)
    assert result.lateness_ms == [40] * RUN
    expected = batches_of(r, prefix, [(due, [f"h{i}" for i in range(RUN)])], ["waiting-1", "waiting-2"])
    assert r.lrange(dest, 0, -1) == expected
    assert r.ttl(dest) == -1  # the copy's expiry did not come with it
    assert store.move_due(500).moved == 0
    assert store.counts() == {}
    assert store.totals()["moved"] == RUN
    assert store.find("h7") == []
    assert staged_keys(r, prefix) == []
    assert not r.exists(keys.queue_set(store.prefix, start, dest))


def test_what_the_set_holds_after_the_run_stays_scheduled_with_its_expiry(
    r: redis.Redis, prefix: str, herd: tuple[FakeClock, Store, str, int]
) -> None:
    clock, store, dest, due = herd
    schedule_herd(store, dest, due + 20_000, ["later-0", "later-1"])
    start = due - due % ORDINARY.bucket_width_ms
    zset = keys.queue_set(store.prefix, start, dest)
    ttl = r.pttl(zset)
    assert stage_all(store, start, dest) is Staged.DONE

    clock.ms = due
    assert store.move_due(500).moved == RUN
    assert r.zrange(zset, 0, -1) == [kombu_payload("later-0").encode(), kombu_payload("later-1").encode()]
    assert ttl - 60_000 < r.pttl(zset) <= ttl  # its own expiry (Redis's clock ran meanwhile)
    assert store.counts() == {dest: 2}
    assert [m.payload for m in store.find("later-1")] == [kombu_payload("later-1").encode()]
    clock.ms = due + 20_000
    assert store.move_due(500).moved == 2
    assert r.llen(dest) == RUN + 2


def test_a_publish_at_the_herds_millisecond_drops_its_copy_and_others_go_before_or_after_it(
    r: redis.Redis, prefix: str, herd: tuple[FakeClock, Store, str, int]
) -> None:
    clock, store, dest, due = herd
    start = stage_herd(store, dest, due)
    schedule_herd(store, dest, due, ["joined"])  # it would be missing from the copy
    assert staged_keys(r, prefix) == []
    assert stage_all(store, start, dest) is Staged.DONE  # staged again, with it
    schedule_herd(store, dest, due - 3, ["earlier"])  # before the herd, and after it: the copy
    schedule_herd(store, dest, due + 3, ["later"])  # still holds exactly the herd
    assert len(staged_keys(r, prefix)) == 1

    clock.ms = due + 5
    assert [store.move_due(500).moved for _ in range(4)] == [1, RUN + 1, 1, 0]
    listed = r.lrange(dest, 0, -1)
    assert len(listed) == len(set(listed)) == RUN + 3
    assert listed[-1] == kombu_payload("earlier").encode()  # consumers take it first
    assert listed[0] == kombu_payload("later").encode()
    assert staged_keys(r, prefix) == []


@pytest.mark.parametrize("end", [0, -1], ids=["first", "last"])
def test_a_herd_whose_set_was_edited_by_hand_after_its_copy_moves_what_the_set_holds(
    r: redis.Redis, prefix: str, herd: tuple[FakeClock, Store, str, int], end: int
) -> None:
    # A member of the run replaced by hand (no publish, no cancel: nothing drops the copy), its
    # count unchanged: the handover must see that the copy no longer matches the set, and move
    # what the set holds, not the copy's stale member. No test edited a set so.
    clock, store, dest, due = herd
    start = stage_herd(store, dest, due)
    zset = keys.queue_set(store.prefix, start, dest)
    [(old, score)] = r.zrange(zset, end, end, withscores=True)
    replacement = kombu_payload("by-hand")
    r.zrem(zset, old)
    r.zadd(zset, {replacement: score})
    clock.ms = due
    assert drain(store) == RUN
    delivered = r.lrange(dest, 0, -1)
    assert replacement.encode() in delivered and old not in delivered and len(set(delivered)) == RUN
    assert staged_keys(r, prefix) == []


@pytest.mark.parametrize("when", ["while staging", "once staged"])
def test_a_message_cancelled_after_its_herd_was_copied_is_not_delivered(
    r: redis.Redis, prefix: str, herd: tuple[FakeClock, Store, str, int], when: str
) -> None:
    clock, store, dest, due = herd
    start = due - due % ORDINARY.bucket_width_ms
    if when == "while staging":
        assert store.stage(start, dest, 1000, MIN_RUN).outcome is Staged.MORE
        assert store.cancel("h5") == 1  # already in the copy, which goes with it
        assert staged_keys(r, prefix) == []
        assert stage_all(store, start, dest) is Staged.DONE  # made again, without it
    else:
        assert stage_all(store, start, dest) is Staged.DONE
        assert store.cancel("h2999") == 1
        assert staged_keys(r, prefix) == []
    clock.ms = due
    assert drain(store) == RUN - 1
    listed = r.lrange(dest, 0, -1)
    assert len(set(listed)) == RUN - 1
    assert kombu_payload("h5" if when == "while staging" else "h2999").encode() not in listed
    assert staged_keys(r, prefix) == []


@pytest.mark.parametrize(("limit", "first_call"), [(10, RUN), (5, 5)])
def test_a_copy_left_unfinished_at_the_due_time_is_completed_or_dropped(
    r: redis.Redis, prefix: str, herd: tuple[FakeClock, Store, str, int], limit: int, first_call: int
) -> None:
    clock, store, dest, due = herd
    start = due - due % ORDINARY.bucket_width_ms
    assert store.stage(start, dest, 2800, MIN_RUN).outcome is Staged.MORE
    clock.ms = due
    # 200 are missing from the copy: within 20 x 10 the call copies them and hands the herd
    # over; past 20 x 5 it drops the copy and moves a batch.
    assert store.move_due(limit).moved == first_call
    assert staged_keys(r, prefix) == []
    assert drain(store) == RUN - first_call
    assert len(set(r.lrange(dest, 0, -1))) == RUN
    assert r.lrange(dest, 0, -1) == batches_of(r, prefix, [(due, [f"h{i}" for i in range(RUN)])], [])


def test_small_runs_are_not_staged_and_a_herd_behind_them_is_found(r: redis.Redis, prefix: str) -> None:
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    dest = f"{prefix}q"
    width = ORDINARY.bucket_width_ms
    # Mid-bucket: due + 10 in the same bucket (clock() + 5000 put it in the next one whenever
    # the clock read less than 10 ms before a bucket's end).
    due = (clock() // width + 1) * width + width // 2
    for k in range(5):  # 5 x 500 messages: 2,500 in the set, no run of 1,000
        schedule_herd(store, dest, due + k, [f"s{k}-{i}" for i in range(500)])
    start = due - due % width
    result = store.stage(start, dest, 1000, MIN_RUN)
    assert (result.outcome, result.run, result.due_ms) == (Staged.NO_RUN, 500, due)
    assert staged_keys(r, prefix) == []

    # A herd behind them is found, and only looking at it writes nothing.
    schedule_herd(store, dest, due + 10, [f"h{i}" for i in range(1500)])
    looked = store.stage(start, dest, 0, MIN_RUN)
    assert (looked.outcome, looked.staged, looked.run, looked.due_ms) == (Staged.MORE, 0, 1500, due + 10)
    assert staged_keys(r, prefix) == [] and not r.hexists(keys.meta(store.prefix, start), f"h:{dest}")
    assert stage_all(store, start, dest) is Staged.DONE
    clock.ms = due + 10
    moved = [store.move_due(5000).moved for _ in range(3)]
    assert moved == [2500, 1500, 0]  # the spread ones in a batch, then the herd whole
    assert r.lrange(dest, 0, -1) == batches_of(
        r,
        prefix,
        [(due + k, [f"s{k}-{i}" for i in range(500)]) for k in range(5)]
        + [(due + 10, [f"h{i}" for i in range(1500)])],
        [],
    )


@contextlib.contextmanager
def store_of_user(r: redis.Redis, prefix: str, clock: FakeClock, *rules: str) -> Iterator[Store]:
    """A Store whose client is an ACL user with ``rules`` (after all channels and commands)."""
    r.execute_command("ACL", "SETUSER", "limited", "on", ">pw", "&*", "+@all", *rules)
    client = redis.Redis(port=r.connection_pool.connection_kwargs["port"], username="limited", password="pw")
    try:
        yield Store(client, prefix, clock=clock)
    finally:
        client.close()
        r.execute_command("ACL", "DELUSER", "limited")


@pytest.mark.parametrize("rule", ["-rename", "-lpush"])
def test_an_acl_without_the_handover_commands_stages_nothing(
    r: redis.Redis, prefix: str, herd: tuple[FakeClock, Store, str, int], rule: str
) -> None:
    """Without RENAME the herd moves in batches; without LPUSH (which Redis 6 cannot be asked
    about: staging wrote the herd's marks, then its push failed, and every later move tried
    the handover and stopped the mover) it waits, refused, as every move of it does."""
    clock, _, dest, due = herd
    with store_of_user(r, prefix, clock, "~*", rule) as limited:
        start = due - due % ORDINARY.bucket_width_ms
        assert limited.stage(start, dest, 1000, MIN_RUN).outcome is Staged.REFUSED
        assert staged_keys(r, prefix) == [] and not r.exists(f"{keys.ns(prefix)}h-probe")
        clock.ms = due
        if rule == "-rename":
            assert drain(limited) == RUN
        else:
            assert limited.move_due(1000).refused == RUN and r.llen(dest) == 0


def test_a_queue_outside_the_acl_gets_no_copy_and_the_others_herds_still_do(
    r: redis.Redis, prefix: str, herd: tuple[FakeClock, Store, str, int]
) -> None:
    # A refused queue's herd answered "the ACL refuses the handover's commands", and the mover
    # then staged no herd of any queue for the rest of its life.
    clock, store, dest, due = herd
    other = f"{prefix}other"
    schedule_herd(store, other, due, [f"o{i}" for i in range(RUN)])
    with store_of_user(r, prefix, clock, "resetkeys", f"~{prefix}kombu_delay:*", f"~{other}") as limited:
        start = due - due % ORDINARY.bucket_width_ms
        assert limited.stage(start, dest, 1000, MIN_RUN).outcome is Staged.NO_RUN
        assert stage_all(limited, start, other) is Staged.DONE
        clock.ms = due
        moved = limited.move_due(1000)
        assert moved.moved == RUN and moved.refused == RUN and moved.refused_dests == [dest]
        assert r.llen(other) == RUN and r.llen(dest) == 0


def test_a_queue_stopped_short_of_its_due_run_moves_none_of_its_later_buckets_first(
    r: redis.Redis, prefix: str
) -> None:
    # A move stopped short of a staged run due now (to hand it over whole next call), then moved
    # the same queue's messages of a later bucket: a consumer got them before the run's.
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    width, dest = ORDINARY.bucket_width_ms, f"{prefix}q"
    a = (clock() // width + 2) * width
    for due, ids in (
        (a + 10, ["a0"]),
        (a + 20, ["a1"]),
        (a + 30, [f"A{i}" for i in range(5)]),
        (a + width + 5, ["B0"]),
    ):
        schedule_herd(store, dest, due, ids)
    assert store.stage(a, dest, 1000, 5).outcome is Staged.DONE
    clock.ms = a + width + 100
    while store.move_due(1000).moved:
        pass
    assert tags_in(r, dest) == ["a0", "a1", "A0", "A1", "A2", "A3", "A4", "B0"]


def test_a_queue_with_an_expiry_keeps_it_and_a_purge_drops_the_copy(
    r: redis.Redis, prefix: str, herd: tuple[FakeClock, Store, str, int]
) -> None:
    clock, store, dest, due = herd
    start = stage_herd(store, dest, due)
    r.lpush(dest, "waiting")
    r.pexpire(dest, 600_000)  # as kombu sets a queue's x-expires
    clock.ms = due
    assert store.move_due(500).moved == RUN
    assert 590_000 < r.pttl(dest) <= 600_000

    schedule_herd(store, dest, due + 9000, [f"p{i}" for i in range(RUN)])
    stage_all(store, start, dest)
    assert len(staged_keys(r, prefix)) == 1
    assert store.purge([dest]) == RUN
    assert staged_keys(r, prefix) == []


def test_a_consumer_blocked_on_the_empty_queue_gets_the_herd(
    r: redis.Redis, prefix: str, herd: tuple[FakeClock, Store, str, int]
) -> None:
    clock, store, dest, due = herd
    stage_all(store, due - due % ORDINARY.bucket_width_ms, dest)
    consumer = redis.Redis(port=r.connection_pool.connection_kwargs["port"])
    got: list[object] = []
    waiting = threading.Thread(target=lambda: got.append(consumer.brpop([dest], timeout=60)))
    waiting.start()
    wait_until(lambda: any(c.get("cmd") == "brpop" for c in r.client_list()), timeout=30)
    clock.ms = due
    assert store.move_due(500).moved == RUN
    waiting.join(60)
    assert got == [(dest.encode(), kombu_payload("h0").encode())]  # the herd's first, as batches give it
    consumer.close()


def test_under_maxmemory_a_copy_is_refused_before_anything_is_written(
    r: redis.Redis, prefix: str, herd: tuple[FakeClock, Store, str, int]
) -> None:
    clock, store, dest, due = herd
    start = due - due % ORDINARY.bucket_width_ms
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", "1")
    try:
        with pytest.raises(RedisRefused):
            store.stage(start, dest, 1000, MIN_RUN)
    finally:
        r.config_set("maxmemory", "0")
    assert staged_keys(r, prefix) == []
    assert not r.hexists(keys.meta(store.prefix, start), f"h:{dest}")

    # A copy made before, short of its last 200: under maxmemory the handover still completes
    # it and runs (it frees memory).
    assert store.stage(start, dest, 2800, MIN_RUN).outcome is Staged.MORE
    r.config_set("maxmemory", "1")
    try:
        clock.ms = due
        assert store.move_due(500).moved == RUN
    finally:
        r.config_set("maxmemory", "0")
    assert r.llen(dest) == RUN and staged_keys(r, prefix) == []


def test_a_rate_capped_move_takes_a_staged_herd_in_batches(
    r: redis.Redis, prefix: str, herd: tuple[FakeClock, Store, str, int]
) -> None:
    clock, store, dest, due = herd
    stage_herd(store, dest, due)
    clock.ms = due
    assert store.move_due(500, whole=False).moved == 500
    assert staged_keys(r, prefix) == []
    moved = 500
    while step := store.move_due(500, whole=False).moved:
        moved += step
    assert moved == RUN and len(set(r.lrange(dest, 0, -1))) == RUN


def big_herd(r: redis.Redis, prefix: str, n: int) -> tuple[FakeClock, Store, str, int, int]:
    """``n`` messages of 2 MB due at one millisecond: (clock, store, dest, due, start)."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    width = ORDINARY.bucket_width_ms
    due = (clock() // width + 1) * width + width // 2
    dest = f"{prefix}q"
    store.schedule_many(
        [(Due(due, task_id=f"b{i}"), dest, f"{i:02d}" + "x" * 2_000_000) for i in range(n)], ORDINARY
    )
    return clock, store, dest, due, due - due % width


def test_a_stage_call_copies_about_16_mb_however_large_the_herd(r: redis.Redis, prefix: str) -> None:
    # 2,000 members a call whatever their size: 10,000 messages of 100 KB gave 2 s a call.
    _, store, dest, _, start = big_herd(r, prefix, 20)
    copied = []
    while (result := store.stage(start, dest, 2000, 5)).outcome is Staged.MORE:
        copied.append(result.staged)
    copied.append(result.staged)
    # 16 MiB a call, in chunks of 1, 1, 2 and 4 members, then one more that goes past it.
    assert result.outcome is Staged.DONE and copied == [9, 18, 20], copied


def test_a_copy_whose_missing_part_is_over_16_mb_is_dropped_for_batches(r: redis.Redis, prefix: str) -> None:
    # The hand-over copied the rest of an unfinished copy one by one, however large: 10,000
    # messages of 100 KB held Redis for 5.2 s in one hand-over.
    clock, store, dest, due, start = big_herd(r, prefix, 20)
    assert store.stage(start, dest, 2000, 5).staged == 9  # 11 of 2 MB still missing at the due time
    clock.ms = due
    assert store.move_due(5).moved == 5  # a batch, not the herd whole
    assert staged_keys(r, prefix) == []
    assert drain(store) == 15
    assert [item[:2] for item in reversed(r.lrange(dest, 0, -1))] == [f"{i:02d}".encode() for i in range(20)]


@pytest.mark.parametrize(("waiting_size", "first_call"), [(100, RUN), (2_000_000, 500)])
def test_a_hand_over_behind_more_than_16_mb_on_its_list_moves_in_batches(
    r: redis.Redis, prefix: str, herd: tuple[FakeClock, Store, str, int], waiting_size: int, first_call: int
) -> None:
    # What waits on the list goes to the right of the herd, copied one by one: 10 items of 2 MB
    # are more than a call carries, and the herd then moves in batches.
    clock, store, dest, due = herd
    stage_herd(store, dest, due)
    r.lpush(dest, *[f"w{i}".encode() + b"x" * waiting_size for i in range(10)])
    waiting = r.lrange(dest, 0, -1)
    clock.ms = due
    assert store.move_due(500).moved == first_call
    assert drain(store) == RUN - first_call
    listed = r.lrange(dest, 0, -1)
    assert listed[-10:] == waiting and len(set(listed[:-10])) == RUN  # what waited is taken first


@pytest.mark.parametrize("junk", ["1e400", "inf", "99999999999999999999999", "abc", "-5", "2.5"])
def test_a_mark_written_by_hand_as_no_time_holds_back_no_move(r: redis.Redis, prefix: str, junk: str) -> None:
    # 'inf' or 1e400, read as a time, held the queue's moves in its bucket for good, silently.
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    width, dest = ORDINARY.bucket_width_ms, f"{prefix}q"
    start = (clock() // width + 1) * width
    due = start + width // 2
    for i in range(5):
        store.schedule(Due(due, task_id=f"t{i}"), dest, kombu_payload(f"t{i}"), ORDINARY)
    r.hset(keys.meta(prefix, start), mapping={"h:" + dest: junk, "hn:" + dest: "5"})
    clock.ms = due
    assert store.move_due(100).moved == 5
    assert sorted(tags_in(r, dest)) == [f"t{i}" for i in range(5)]
