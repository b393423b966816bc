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


@pytest.mark.parametrize(
    "score",
    [float("-inf"), -1e300, -1.0],
    ids=["minus-infinity", "far-below-zero", "below-zero"],
)
def test_a_cold_member_whose_score_is_no_due_time_goes_to_the_dead_letters(r, prefix, score, caplog):
    """The member "bad" (stored as any other, then its score set by hand) is listed by every
    thaw step; it is dead-lettered as it is stored, counted as dead and expired, and logged,
    and the messages beside it reach their list once each."""
    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    q = f"{prefix}q"
    now = clock()
    for tag in [*GOOD, "bad"]:
        store.schedule(Due(now + 2100, task_id=tag), q, kombu_payload(tag), JUST_COLD)
    start = int(r.zrange(keys.cold_index(prefix), 0, 0)[0])
    key = keys.queue_set(prefix, start, q, keys.COLD)
    bad = next(m for m in r.zrange(key, 0, -1) if cold.unpack(m)[0] == "bad")
    r.zadd(key, {bad: score}, xx=True)
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
