"""``delay_look_ahead``: the mover moves what falls due within the window, unchanged.

The message keeps its ETA (a worker's timer starts it then; the drain benchmark's
smoke test runs real workers on it and finds no early start). Here: the boundary of the
window on a driven clock, the bytes on the list, the mover's sleep, the option's bounds,
and a mover process that reads the option.
"""

from __future__ import annotations

import threading

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.errors import ConfigError
from kombu_delay.message import Due
from kombu_delay.mover.loop import Mover
from kombu_delay.store import Store, keys
from kombu_delay.store.replies import MoveResult, Rescheduled, Scheduled
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.procs import joined, wait_until
from tests.support.stored import FakeClock, LpushMonitor, kombu_payload

WIDTH = 60_000
AHEAD = 10_000


def _herd(r: redis.Redis, prefix: str) -> tuple[Store, FakeClock, int, dict[str, int]]:
    """A herd at ``due`` and a straggler 5 ms later, in a bucket that starts after the
    window opens (so the bucket itself is not started when they move), and one message a
    bucket later. Returns (store, clock, due, payload -> due)."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    due = keys.bucket_start(clock() + 3 * WIDTH, WIDTH) + 1_000
    dues = {f"herd-{i}": due for i in range(20)}
    dues["straggler"] = due + 5
    dues["next-bucket"] = due + WIDTH
    items = [(Due(ms, task_id=name), f"{prefix}q", name) for name, ms in dues.items()]
    plain = Settings(compress_after_ms=0)  # in the ordinary space, however far ahead
    assert {x.outcome for x in store.schedule_many(items, plain)} == {Scheduled.STORED}
    return store, clock, due, dues


def _on_list(r: redis.Redis, prefix: str) -> set[str]:
    return {x.decode() for x in r.lrange(f"{prefix}q", 0, -1)}


@pytest.mark.parametrize(
    ("before_due_ms", "moved"),
    [
        (AHEAD + 1, set()),  # one ms before the window reaches the herd
        (AHEAD, {f"herd-{i}" for i in range(20)}),  # the window's edge: the herd, not the straggler
        (AHEAD - 5, {f"herd-{i}" for i in range(20)} | {"straggler"}),
    ],
)
def test_the_window_moves_what_falls_due_within_it_and_nothing_later(
    r: redis.Redis, prefix: str, before_due_ms: int, moved: set[str]
) -> None:
    store, clock, due, dues = _herd(r, prefix)
    clock.ms = due - before_due_ms
    result = store.move_due(1000, look_ahead_ms=AHEAD)
    assert result.moved == len(moved)
    assert _on_list(r, prefix) == moved  # the members as stored: ETA and all untouched
    assert result.lateness_ms == [0] * len(moved)  # moved ahead of due: never negative
    left = [name for name in dues if name not in moved]
    assert result.next_due_ms == min(dues[name] for name in left)


def test_without_a_look_ahead_nothing_moves_before_due(r: redis.Redis, prefix: str) -> None:
    store, clock, due, _ = _herd(r, prefix)
    clock.ms = due - 1
    assert store.move_due(1000).moved == 0
    assert store.move_due(1000, look_ahead_ms=0).moved == 0
    clock.ms = due
    assert store.move_due(1000).moved == 20


def test_the_mover_wakes_the_look_ahead_before_the_next_due_time(r: redis.Redis) -> None:
    settings = Settings(max_sleep_ms=60_000)
    result = MoveResult(0, 1_000_000 + 15_000, 1_000_000, 0, 0, 0, 0, False)
    store = Store(r)
    assert Mover(store, settings, watch=False)._sleep_for(result) == 15.0
    ahead = Settings(max_sleep_ms=60_000, look_ahead_ms=AHEAD)
    assert Mover(store, ahead, watch=False)._sleep_for(result) == 5.0


def test_the_option_is_seconds_off_by_default_and_bounded() -> None:
    assert Settings().look_ahead_ms == 0
    assert Settings.from_options({"delay_look_ahead": 2.5}, env={}).look_ahead_ms == 2_500
    assert Settings.from_options({}, env={"KOMBU_DELAY_LOOK_AHEAD": "60"}).look_ahead_ms == 60_000
    for bad in (-1, 60.001, "soon"):
        with pytest.raises(ConfigError, match="delay_look_ahead"):
            Settings.from_options({"delay_look_ahead": bad}, env={})
    # The mover's --look-ahead flag goes through the same check.
    assert Settings().with_values(look_ahead=5).look_ahead_ms == 5_000
    with pytest.raises(ConfigError, match="delay_look_ahead must be at most 60 s"):
        Settings().with_values(look_ahead=61)


@pytest.mark.timeout(120)
def test_a_mover_process_hands_a_message_over_the_look_ahead_before_due(
    r: redis.Redis, redis_server: RedisServer, start_mover: object
) -> None:
    """Due 40 s ahead with a 30 s window: it reaches the list long before it is due (the
    10 s to the window plus 30 s of margin for a busy machine), and not before the window
    opens (by the Redis clock of the push, which MONITOR records)."""
    store = Store(r)
    due = store.time_ms() + 40_000
    with LpushMonitor(redis_server.client(), r) as monitor:
        stored = store.schedule_many([(Due(due, task_id="t"), "q", "payload")], Settings())
        assert [x.outcome for x in stored] == [Scheduled.STORED]
        mover = start_mover("-o", "delay_look_ahead=30")  # type: ignore[operator]
        wait_until(lambda: r.llen("q") == 1, timeout=60)
        assert store.time_ms() < due
    assert r.lrange("q", 0, -1) == [b"payload"]
    [pushed_us] = monitor.first_push_us("payload")
    assert pushed_us >= (due - 30_000) * 1000  # strict: not before the window opened
    assert mover.stop() == 0


def test_a_compressed_message_is_thawed_in_time_for_the_look_ahead(r: redis.Redis) -> None:
    """A look-ahead longer than the thaw lead: the mover thaws that much earlier too, so a
    compressed message reaches its list the look-ahead before due, not the thaw lead before.
    Time is driven; the clock stands still while the test waits for the mover."""
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    publish = Settings(compress_after_ms=3_000, thaw_ahead_ms=2_000)
    due = clock() + 120_000
    stored = store.schedule_many([(Due(due, task_id="t"), "q", "payload")], publish)
    assert [x.outcome for x in stored] == [Scheduled.STORED]
    assert r.zcard(keys.cold_index("")) == 1  # compressed

    mover = Mover(store, Settings(thaw_ahead_ms=2_000, look_ahead_ms=AHEAD), watch=False)
    runner = threading.Thread(target=mover.run, daemon=True)
    runner.start()
    try:
        clock.ms = due - AHEAD - 1  # a millisecond before the window reaches it: thawed, not moved
        wait_until(lambda: mover.stats.thawed == 1, timeout=60)
        assert r.llen("q") == 0
        clock.ms = due - AHEAD  # the window's edge: moved, 10 s before due
        wait_until(lambda: r.llen("q") == 1, timeout=60)
    finally:
        mover.stop()
        joined(runner, 30)
    assert r.lrange("q", 0, -1) == [b"payload"]


@pytest.mark.parametrize("space", ["ordinary", "cold", "rescheduled"])
def test_a_message_with_no_eta_of_its_own_is_never_moved_before_its_due_time(
    r: redis.Redis, prefix: str, space: str
) -> None:
    """An x-delay message: a worker runs it on arrival, so the look-ahead leaves it (and its
    bucket) until it is due, in whichever space it waited; a message with an ETA in a later
    bucket still moves ahead."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    base = keys.bucket_start(clock() + 3 * WIDTH, WIDTH)
    due, eta_due = base + 1_000, base + WIDTH + 1_000
    cold = Settings(compress_after_ms=30_000, thaw_ahead_ms=20_000)
    plain = Settings(compress_after_ms=0)
    dest, x_delay, eta = f"{prefix}q", kombu_payload("x"), kombu_payload("eta")
    published_due = due - 5_000 if space == "rescheduled" else due
    delay = Due(published_due - clock(), relative=True, task_id="x")
    store.schedule(delay, dest, x_delay, cold if space == "cold" else plain)
    if space == "rescheduled":  # to its due time, as a message with no ETA of its own
        [stored] = store.find("x")
        assert store.reschedule(stored, "x", x_delay, due, plain, own_eta=False) is Rescheduled.RESCHEDULED
    store.schedule(Due(eta_due, task_id="eta"), dest, eta, plain)
    if space == "cold":
        clock.ms = due - 20_000
        assert store.thaw(20_000, 100).thawed == 1
    clock.ms = due - AHEAD
    result = store.move_due(1000, look_ahead_ms=AHEAD)
    assert result.moved == 0
    assert result.next_due_ms == due + AHEAD  # the mover calls again AHEAD before that: at due
    clock.ms = due - 1
    assert store.move_due(1000, look_ahead_ms=AHEAD).moved == 0
    clock.ms = due
    assert store.move_due(1000, look_ahead_ms=AHEAD).moved == 1
    clock.ms = eta_due - AHEAD
    assert store.move_due(1000, look_ahead_ms=AHEAD).moved == 1
    assert r.lrange(dest, 0, -1) == [eta.encode(), x_delay.encode()]
