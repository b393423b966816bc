"""A cold member whose score is no due time the scripts accept (infinite, below 0, or past
``keys.MAX_DUE_MS``: written by hand) is dead-lettered, counted and logged as a member that
does not decompress is, and every other message is thawed and moved on time."""

from __future__ import annotations

import logging

import pytest

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import Store, cold, keys
from tests.support.faults import consistency
from tests.support.stored import FakeClock, kombu_payload, tags_in

#: A message due 2.1 s ahead is stored compressed, and is due soon after its thaw horizon.
JUST_COLD = Settings(compress_after_ms=2050, thaw_ahead_ms=2000)
GOOD = ["good-1", "good-2", "good-3"]


def _stored(r, prefix: str, odd: str = "bad") -> tuple[FakeClock, Store, str]:
    """A store on a fake clock holding GOOD and ``odd`` compressed, due 2.1 s ahead, for ``q``."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    q = f"{prefix}q"
    for tag in [*GOOD, odd]:
        store.schedule(Due(clock() + 2100, task_id=tag), q, kombu_payload(tag), JUST_COLD)
    return clock, store, q


def _rescored(r, prefix: str, tag: str, score: float) -> bytes:
    """Set by hand the score of the cold member of ``tag`` (in the first cold bucket); return it."""
    start = int(r.zrange(keys.cold_index(prefix), 0, 0)[0])
    key = keys.queue_set(prefix, start, f"{prefix}q", keys.COLD)
    member = next(m for m in r.zrange(key, 0, -1) if cold.unpack(m)[0] == tag)
    r.zadd(key, {member: score}, xx=True)
    return member


@pytest.mark.parametrize(
    "score",
    [float("-inf"), -1e300, -1.0],
    ids=["minus-infinity", "far-below-zero", "below-zero"],
)
def test_a_cold_member_whose_score_is_no_due_time_goes_to_the_dead_letters(r, prefix, score, caplog):
    """The member "bad" (stored as any other, then its score set by hand) is listed by every
    thaw step; it is dead-lettered as it is stored, counted as dead and expired, and logged,
    and the messages beside it reach their list once each."""
    clock, store, q = _stored(r, prefix)
    bad = _rescored(r, prefix, "bad", score)
    clock.advance(150)  # within the thaw horizon
    with caplog.at_level(logging.ERROR, logger="kombu_delay.store.move"):
        result = store.thaw(2000, 10)
    assert (result.thawed, result.dead) == (len(GOOD), 1)
    assert "is no due time" in caplog.text
    assert r.lrange(keys.dead(prefix), 0, -1) == [bad]  # kept as it was stored
    clock.advance(2000)
    assert store.move_due(10).moved == len(GOOD)
    assert sorted(tags_in(r, q)) == GOOD
    totals = store.totals()
    assert totals["dead"] == 1 and store.counts() == {}
    # Lost to delivery, so counted as expired too: the totals add up to what is stored (0).
    assert consistency(r, prefix)["stored"] == 0
    assert not r.exists(keys.cold_index(prefix))


@pytest.mark.parametrize("score", ["inf", "past-end", "past-ceiling"])
def test_a_cold_member_scored_past_its_bucket_is_listed_not_left_for_ever(r, prefix, score, caplog):
    """A member scored past its bucket's end (by hand) is never within the thaw horizon while
    its bucket is: it is listed all the same, and thawed by its due time where it has one (then
    moved when due) or dead-lettered where it has none, so its bucket does not stay held."""
    clock, store, q = _stored(r, prefix, "odd")
    now = clock()
    later = {"inf": float("inf"), "past-end": now + 3_600_000, "past-ceiling": keys.MAX_DUE_MS + 10}[score]
    _rescored(r, prefix, "odd", later)
    clock.advance(150)
    with caplog.at_level(logging.ERROR, logger="kombu_delay.store.move"):
        results = [store.thaw(2000, 10) for _ in range(3)]
    has_due = score == "past-end"
    assert sum(t.thawed for t in results) == len(GOOD) + has_due
    assert sum(t.dead for t in results) == (0 if has_due else 1)
    assert not r.exists(keys.cold_index(prefix))  # nothing left held in the cold space
    clock.advance(2000)
    assert store.move_due(10).moved == len(GOOD)
    if has_due:
        clock.ms = later
        assert store.move_due(10).moved == 1
    assert sorted(tags_in(r, q)) == sorted(GOOD + (["odd"] if has_due else []))


def test_a_cold_index_member_that_is_no_start_does_not_fail_a_thaw(r, prefix):
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    store.schedule(Due(clock() + 2100, task_id="good"), f"{prefix}q", kombu_payload("good"), JUST_COLD)
    r.zadd(keys.cold_index(prefix), {"junk": clock() + 3_600_000})
    clock.advance(150)
    assert store.thaw(2000, 10).thawed == 1
