"""The bench's counting of arrivals (no Redis: counts and samples given)."""

from __future__ import annotations

import math
from collections import Counter

from kombu_delay.tooling.bench.arrivals import early_seen, ids_of, move_span, tally
from kombu_delay.tooling.bench.report import evaluate


def test_a_duplicate_standing_in_for_a_lost_message_is_both_lost_and_doubled() -> None:
    # As many deliveries as messages: a count by number would read as all delivered once.
    counted = tally(Counter({"a": 2, "b": 1}), ["a", "b", "c"])
    assert counted == {"delivered": 3, "distinct": 2, "lost": 1, "doubled": 1, "stray": 0}
    assert tally(Counter({"a": 1, "x": 1}), ["a"])["stray"] == 1


def test_ids_are_read_from_the_headers_of_celery_messages() -> None:
    raws = [
        b'{"body": "e30=", "headers": {"root_id": "r", "id": "t-1"}}',
        '{"headers": {"id": "t-2"}}',
        b"{}",
    ]
    assert ids_of(raws) == ["t-1", "t-2"]


def test_backpressure_misses_its_target_on_a_duplicate_or_a_delivery_too_many() -> None:
    ramp = {"lost": 0, "doubled": 1, "delivered_minus_messages": 1, "peak_per_s": 10}
    rows = {row["metric"]: row["met"] for row in evaluate({"backpressure": {"max_rate": ramp}})}
    assert rows["max-rate: lost"] is True
    assert rows["max-rate: doubled"] is False
    assert rows["max-rate: delivered - published"] is False


def test_a_move_span_is_taken_from_the_counter_not_from_the_due_time() -> None:
    # (Redis ms, moved): the counter moves from 0 to 300 between 1010 and 1040.
    samples = [(1000.0, 0), (1010.0, 0), (1020.0, 100), (1030.0, 200), (1040.0, 300), (1050.0, 300)]
    span = move_span(samples, 1, 300)
    assert span["move_span_ms"] == 30.0  # from the last sample before the first move
    assert span["moved_per_s"] == 10_000.0
    assert span["move_sample_gap_ms"] == 10.0 and span["move_resolved"]
    # All at once between two samples (a RENAME): a lower bound, said to be one.
    whole = move_span([(1000.0, 0), (1005.0, 0), (1012.0, 300)], 1, 300)
    assert whole["move_span_ms"] == 7.0 and not whole["move_resolved"]
    # Never all moved: no rate.
    assert math.isnan(move_span(samples, 1, 301)["moved_per_s"])


def test_early_is_judged_against_each_messages_own_due_time_and_the_blind_gap_told() -> None:
    # A burst judged early only against its first due time missed one due 19 ms on, pushed at
    # +1 ms; and a push in the last gap before the due time went unseen, unsaid.
    dues = [1000, 1000, 1019]
    on_time = [(990.0, 0), (1000.5, 2), (1019.2, 3)]
    assert early_seen(on_time, dues, 1) == {"early": 0, "early_blind_ms": 18.5}  # 1019 after 1000.5
    pushed_ahead = [(990.0, 0), (1001.0, 3), (1019.2, 3)]  # the third, due at 1019, on at 1001
    assert early_seen(pushed_ahead, dues, 1)["early"] == 1
    assert early_seen([(1001.0, 3)], dues, 1)["early_blind_ms"] == math.inf  # none before the first


def test_backpressure_misses_its_target_when_a_cap_is_passed() -> None:
    # No row judged either cap: a mover moving 1,000,000/s under a 10,000/s cap read "yes".
    ramp = {"lost": 0, "doubled": 0, "delivered_minus_messages": 0}
    results = {
        "backpressure": {
            "max_rate": {**ramp, "rate_over_cap": 100.0},
            "max_queue_length": {**ramp, "longest_over_cap": 1.0},
        }
    }
    met = {row["metric"]: row["met"] for row in evaluate(results) if row["scenario"] == "backpressure"}
    assert met["max-rate: moved/s after the first second / cap"] is False
    assert met["max-queue-length: longest list / cap"] is True
