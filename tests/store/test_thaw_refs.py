"""The id index through a thaw of many compressed messages under one task id: each call
rewrites the id's refs once, and they stay exact, one per message, where a bucket's seq
counter wraps round at one millisecond and refs repeat.

Time is driven through a fake clock (see ``FakeClock``).
"""

from __future__ import annotations

from collections import Counter

import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import Store, keys
from tests.support.stored import FakeClock, kombu_payload

COLD = Settings(compress_after_ms=3000, thaw_ahead_ms=2000)
#: Past the 2,048 seq values of one millisecond: some refs repeat.
N = 2_100


def _refs(r: redis.Redis, task_id: str) -> Counter[str]:
    return Counter((r.hget(keys.ids(""), task_id) or b"").decode().split())


def _ordinary_refs(r: redis.Redis, start: int, dest: str) -> Counter[str]:
    """The refs of the messages in the ordinary set, as put writes them."""
    scores = [score for _, score in r.zrange(keys.queue_set("", start, dest), 0, -1, withscores=True)]
    return Counter(f"{start}:{int(s) - start}:{round((s - int(s)) * 2048)}" for s in scores)


def test_a_thaw_of_many_messages_under_one_task_id_keeps_one_ref_per_message(r) -> None:
    clock = FakeClock(r)
    store = Store(r, clock=clock)
    due = (clock() // 60_000 + 2) * 60_000 + 30_000
    start = keys.bucket_start(due, COLD.bucket_width_ms)
    items = [(Due(due, task_id="same"), "q", kombu_payload(f"m{i}")) for i in range(N)]
    items.append((Due(due, task_id="other"), "q", kombu_payload("other")))
    store.schedule_many(items, COLD)
    refs = _refs(r, "same")
    assert sum(refs.values()) == N and all(ref.startswith("c") for ref in refs)
    assert max(refs.values()) == 2  # (seq wrapped round: 52 refs twice)
    clock.ms = due - 1000
    calls = 0
    # 99 a call: a call ends between two messages of one ref (at one score, side by side).
    while (result := store.thaw(COLD.thaw_ahead_ms, 99)).thawed or result.more:
        calls += 1
        refs = _refs(r, "same")
        moved = _ordinary_refs(r, start, "q")
        cold = Counter({ref: n for ref, n in refs.items() if ref.startswith("c")})
        assert refs - cold == moved - _refs(r, "other")  # every thawed message's ref, once
        assert sum(refs.values()) == N  # and each still cold message's
    assert calls >= N // 99
    assert _refs(r, "same") == _ordinary_refs(r, start, "q") - _refs(r, "other")
    assert sum(_refs(r, "other").values()) == 1
