"""move.lua's reply: the counts and the scan position, then the lateness, run-length coded in Lua, one value
per moved message in Python."""

from __future__ import annotations

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import Store, keys
from kombu_delay.store.replies import MoveResult, Scheduled, _runs
from tests.support.stored import FakeClock

#: How far ahead of Redis's clock the messages are due: the store's clock is moved to their
#: due times, but a mover that judges by Redis's (another test's, left running) takes none.
AHEAD_MS = 3_600_000
#: Stored as they are, however far ahead (compressed, they would be thawed before they move).
ORDINARY = Settings(compress_after_ms=0)


def test_runs_expand_in_order() -> None:
    assert _runs([]) == []
    assert _runs([3, 0, 5]) == [3, 0, 5]
    assert _runs([-3, 7]) == [7, 7, 7]
    assert _runs([b"1", b"-2", b"4", b"0"]) == [1, 4, 4, 0]


def test_reply_has_the_scan_position_and_the_refusals_before_the_lateness() -> None:
    head = [b"3", b"-1", b"1000", b"250", b"2", b"1", b"0", b"1"]
    result = MoveResult.from_reply([*head, b"-1", b"0", b"0", b"0", [], [], [], b"-2", b"5", b"9"])
    assert result == MoveResult(3, None, 1000, 250, 2, 1, 0, True, [5, 5, 9])
    plain = MoveResult.from_reply(
        [*head, 60_000, 4, 2, 1, [b"celery"], [b"blocked"], [b"m:1", b"aside:1", b"z", b""], 7]
    )
    assert plain.scan_after == 60_000 and plain.recounted == 4 and plain.lateness_ms == [7]
    assert plain.vanished == 1 and plain.damaged == [("m:1", "aside:1"), ("z", "")]
    assert (plain.refused, plain.refused_dests, plain.wrongtype_dests) == (2, ["celery"], ["blocked"])


def test_lateness_has_one_value_per_moved_message(r: redis.Redis, prefix: str) -> None:
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    now = clock() + AHEAD_MS
    # 30 messages share one due time, 5 more each have their own: runs and singles.
    dues = [now + 300] * 30 + [now + 301 + i for i in range(5)]
    items = [(Due(due, task_id=f"t{i}"), f"{prefix}q", f"payload-{i}") for i, due in enumerate(dues)]
    assert {x.outcome for x in store.schedule_many(items, ORDINARY)} == {Scheduled.STORED}
    clock.ms = max(dues) + 5
    result = store.move_due(1000)
    assert result.moved == 35
    assert len(result.lateness_ms) == 35
    late_at = result.now_ms
    assert result.lateness_ms == [late_at - due for due in dues]
    assert r.llen(f"{prefix}q") == 35


def test_lateness_follows_the_move_order_destination_by_destination(r: redis.Redis, prefix: str) -> None:
    """In one bucket, each destination's messages move together, in due order; the
    lateness list follows that order (which destination goes first is not specified)."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    width = 60_000
    now = clock() + AHEAD_MS
    start = keys.bucket_start(now + 300, width)
    if start + width - (now + 300) < 1000:  # keep every due time in one bucket
        start += width
    base = max(start, now + 300)
    dues = {"a": [base + 2 * i for i in range(10)], "b": [base + 2 * i + 1 for i in range(10)]}
    items = [
        (Due(due, task_id=f"{dest}{i}"), f"{prefix}{dest}", f"payload-{dest}{i}")
        for dest, times in dues.items()
        for i, due in enumerate(times)
    ]
    assert {
        x.outcome for x in store.schedule_many(items, Settings(bucket_width_ms=width, compress_after_ms=0))
    } == {Scheduled.STORED}
    assert r.zcard(keys.index(prefix)) == 1
    clock.ms = base + 26
    result = store.move_due(1000)
    assert result.moved == 20
    late = {dest: [result.now_ms - due for due in times] for dest, times in dues.items()}
    assert result.lateness_ms in (late["a"] + late["b"], late["b"] + late["a"])


def test_a_score_written_by_hand_as_minus_infinity_is_moved_with_a_finite_lateness(r, prefix) -> None:
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = clock() + AHEAD_MS
    store.schedule(Due(due, task_id="t"), f"{prefix}q", "payload", Settings(compress_after_ms=0))
    start = int(r.zrange(keys.index(prefix), 0, 0)[0])
    r.zadd(keys.queue_set(prefix, start, f"{prefix}q"), {"by hand": float("-inf")})
    clock.ms = due + 5
    result = store.move_due(100)
    assert result.moved == 2 and sorted(result.lateness_ms) == [5, 2**53]


def large_and_small(prefix: str, due: int, shape: str) -> list[tuple[Due, str, str]]:
    """Messages in due order (then publish order): seven of 4 MB then fifty small ones; one
    small one then twelve of 3 MB; or 129 small ones then 128 of 512 KB."""
    q = f"{prefix}q"
    if shape == "large first":
        big = [(Due(due + i, task_id=f"big{i}"), q, f"{i:02d}" + "x" * 4_000_000) for i in range(7)]
        return big + [(Due(due + 10, task_id=f"s{i}"), q, f"small-{i}") for i in range(50)]
    if shape == "small first":
        big = [(Due(due + 1 + i, task_id=f"b{i}"), q, f"{i:02d}" + "x" * 3_000_000) for i in range(12)]
        return [(Due(due, task_id="s"), q, "small"), *big]
    small = [(Due(due, task_id=f"s{i}"), q, f"small-{i}") for i in range(129)]
    return small + [(Due(due, task_id=f"b{i}"), q, f"{i:02d}" + "x" * 2**19) for i in range(128)]


@pytest.mark.parametrize(
    ("shape", "calls"),
    [
        # Four of 4 MB, then four again (the second batch's head is big too: it takes a small
        # one with it), then the rest.
        ("large first", [4, 4, 49, 0]),
        # A batch was sized by its head alone: one small message ahead of 3 MB ones let a call
        # carry 305 MB. The small one and six of 3 MB (chunks of 1, 1, 2, 2 and 1: the last
        # goes past 16 MiB), then five (as many as fit at the head's size), then the last.
        ("small first", [7, 5, 1, 0]),
        # 129 small ones, then 128 of 512 KB, all due at one millisecond: chunks of 1 to 16
        # members, none kept past 16 MiB: the small ones and 32 large ones (the last goes
        # past), then 31 a call. Chunks of up to 128 members took all 257 (64 MiB) in one.
        ("many small first", [161, 31, 31, 31, 3, 0]),
    ],
)
def test_a_call_moves_about_16_mb_however_large_its_messages(
    r: redis.Redis, prefix: str, shape: str, calls: list[int]
) -> None:
    # A batch of 500 messages of 10 MB held Redis for 8 s in one call, its memory peaking at 4
    # times the data; the mover's socket timed out on it, and said Redis was away. A batch is
    # read in chunks that stop once 16 MiB are read.
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = clock() + AHEAD_MS
    if due % 60_000 > 59_000:  # due .. due + 12 in one bucket (a minute's)
        due += 1_000
    messages = large_and_small(prefix, due, shape)
    assert {x.outcome for x in store.schedule_many(messages, ORDINARY)} == {Scheduled.STORED}
    clock.ms = due + 100
    made = []
    while True:
        result = store.move_due(500)
        made.append(result.moved)
        if not result.more and result.moved == 0:
            break
    assert made == calls
    pushed = [item[:2] for item in reversed(r.lrange(f"{prefix}q", 0, -1))]
    assert pushed == [payload[:2].encode() for _, _, payload in messages]  # in due order, each once
    assert store.counts() == {}
