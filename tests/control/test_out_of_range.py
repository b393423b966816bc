"""Due times and histogram spans out of any datetime's range, on a real Redis: a reschedule past
the year-2109 ceiling is refused as too far (nothing changes), one absurdly far in the past is
delivered now with a formattable ETA, and ``stats`` refuses a histogram it cannot draw; none of
them ends in an ``OverflowError`` or a ``ValueError`` from datetime."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from fractions import Fraction

import pytest

from kombu_delay import DelayControl, DelayTooLong
from kombu_delay.control.results import HOUR_MS, histogram_slots
from kombu_delay.store import keys
from tests.support.cli import kd, options
from tests.support.cli import publish as publish_tasks

#: The latest aware datetime there is, 23:59 behind UTC: in UTC it is in the year 10000.
LATEST = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone(-timedelta(hours=23, minutes=59)))
#: The earliest, an hour ahead of UTC: in UTC it is in the year 0.
EARLIEST = datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1)))
#: How a reschedule past the ceiling is refused.
PAST_CEILING = "after 2109-05-15 07:35:11.103 UTC: past the latest supported ETA; it stays as it was"


def publish(redis_server, prefix: str) -> str:
    """One task, 600 s out."""
    [task_id] = publish_tasks(redis_server, prefix, n=1)
    return str(task_id)


@pytest.mark.parametrize(
    "when",
    [
        {"countdown": 1e12},
        {"countdown": 1e300},
        {"countdown": 1.7e308},
        {"countdown": 10**400},  # past any float: an OverflowError escaped
        {"countdown": Fraction(10**400, 3)},
        {"countdown": Decimal("1e400")},  # finite, though past any float: was "not finite"
        {"eta": LATEST},
    ],
    ids=[
        "countdown-1e12",
        "countdown-1e300",
        "countdown-max-float",
        "countdown-10e400",
        "countdown-fraction",
        "countdown-decimal",
        "eta-year-10000-utc",
    ],
)
def test_reschedule_past_the_ceiling_is_too_far_and_changes_nothing(r, redis_server, prefix, when):
    task_id = publish(redis_server, prefix)
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        before = ctl.store.find(task_id)
        assert len(before) == 1
        with pytest.raises(DelayTooLong, match=PAST_CEILING):
            ctl.reschedule(task_id, **when)
        assert ctl.store.find(task_id) == before  # same payload, same due time
        assert ctl.stats().totals.get("rescheduled", 0) == 0
    assert r.llen(f"{prefix}celery") == 0


def test_reschedule_past_max_delay_names_the_option(r, redis_server, prefix):
    # The refusal quoted a due time in ms, clamped on its way, and a "delay limit" that no
    # option had set.
    task_id = publish(redis_server, prefix)
    with DelayControl(redis_server.url, {**options(prefix), "delay_max_delay": 3600}) as ctl:
        with pytest.raises(
            DelayTooLong,
            match=r"to 2\d{3}-\d\d-\d\dT[\d:.]+\+00:00: past delay_max_delay \(3,600 s from now\)",
        ):
            ctl.reschedule(task_id, countdown=7200)
        assert ctl.reschedule(task_id, countdown=1800) == 1


def test_reschedule_just_past_the_ceiling_is_refused_like_just_below_it_is_taken(r, redis_server, prefix):
    task_id = publish(redis_server, prefix)
    ceiling = datetime.fromtimestamp(keys.MAX_DUE_MS / 1000, UTC)
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        with pytest.raises(DelayTooLong, match=PAST_CEILING):
            ctl.reschedule(task_id, eta=ceiling + timedelta(milliseconds=1))
        assert ctl.reschedule(task_id, eta=ceiling) == 1
        assert ctl.find(task_id)[0].due_ms == keys.MAX_DUE_MS


@pytest.mark.parametrize(
    "when",
    [{"countdown": -1e12}, {"countdown": -1e300}, {"countdown": -1.7e308}, {"eta": EARLIEST}],
    ids=["countdown-minus-1e12", "countdown-minus-1e300", "countdown-min-float", "eta-year-0-utc"],
)
def test_reschedule_far_into_the_past_delivers_it_once_now(r, redis_server, prefix, when):
    task_id = publish(redis_server, prefix)
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        assert ctl.reschedule(task_id, **when) == 1
        (raw,) = r.lrange(f"{prefix}celery", 0, -1)
        headers = json.loads(raw)["headers"]
        assert headers["id"] == task_id
        # Before the epoch is as past as the epoch; the ETA a worker reads stays a real time.
        assert datetime.fromisoformat(headers["eta"]) == datetime(1970, 1, 1, tzinfo=UTC)
        assert ctl.find(task_id) == []
        stats = ctl.stats()
        assert stats.scheduled == 0 and stats.totals["rescheduled"] == 1


def test_a_non_finite_countdown_is_a_value_error_and_changes_nothing(r, redis_server):
    task_id = publish(redis_server, "")
    with DelayControl(redis_server.url) as ctl:
        before = ctl.store.find(task_id)
        assert ctl.reschedule(task_id, countdown=-(10**400)) == 1  # before the epoch: now
        assert r.llen("celery") == 1
    task_id = publish(redis_server, "")
    with DelayControl(redis_server.url) as ctl:
        before = ctl.store.find(task_id)
        for countdown in (
            math.inf,
            -math.inf,
            math.nan,
            Decimal("Infinity"),
            Decimal("NaN"),
            Decimal("sNaN"),
        ):
            with pytest.raises(ValueError, match="not a finite number"):
                ctl.reschedule(task_id, countdown=countdown)
        assert ctl.store.find(task_id) == before


BAD_SPANS = [
    (math.inf, 60),
    (math.nan, 60),
    (-math.inf, 60),
    (12, math.inf),
    (12, math.nan),
    (1e308, 60),
    (-1e308, 60),
    (1e300, 1e300),
    (12, 1e300),
    (12, -1e300),
    (2e6, 1e6),  # 228 years in 120 slots: past the ceiling
]


@pytest.mark.parametrize(("hours", "slot"), BAD_SPANS)
def test_histogram_slots_refuses_what_it_cannot_draw(hours, slot):
    with pytest.raises(ValueError, match="histogram of"):
        histogram_slots(hours, slot)


def test_histogram_slots_still_takes_spans_up_to_the_ceiling():
    assert histogram_slots(12, 60) == (HOUR_MS, 12)
    ceiling = keys.MAX_DUE_MS
    assert histogram_slots(ceiling / HOUR_MS, ceiling / 60_000) == (ceiling, 1)


def test_a_histogram_slot_is_no_wider_than_its_window():
    # --hours 0.001 --slot 60 drew one 60-minute row for a window of 3.6 s.
    assert histogram_slots(0.001, 60) == (3_600, 1)
    assert histogram_slots(1, 120) == (HOUR_MS, 1)


@pytest.mark.parametrize(("hours", "slot"), [(1e308, 60), (1e300, 1e300), (math.nan, 60)])
def test_stats_refuses_what_it_cannot_draw(r, redis_server, hours, slot):
    publish(redis_server, "")
    with DelayControl(redis_server.url) as ctl, pytest.raises(ValueError, match="histogram of"):
        ctl.stats(hours=hours, slot_minutes=slot)


def test_cli_reschedule_out_of_range_exits_cleanly(r, redis_server, prefix):
    task_id = publish(redis_server, prefix)
    for args in (["--countdown", "1e12"], ["--eta", LATEST.isoformat()]):
        code, out = kd(redis_server, prefix, "reschedule", task_id, *args)
        assert code == 3, out
        assert "past the latest supported ETA" in out and "Traceback" not in out
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        assert len(ctl.find(task_id)) == 1
    code, out = kd(redis_server, prefix, "reschedule", task_id, "--countdown", "-1e300")
    assert code == 0, out
    assert "sent to its queue now" in out
    assert r.llen(f"{prefix}celery") == 1
    task_id = publish(redis_server, prefix)
    code, out = kd(redis_server, prefix, "reschedule", task_id, "--eta", EARLIEST.isoformat())
    assert code == 0, out
    assert r.llen(f"{prefix}celery") == 2


@pytest.mark.parametrize(("hours", "slot"), [("1e308", "60"), ("1e300", "1e300"), ("12", "1e300")])
def test_cli_stats_out_of_range_is_a_usage_error(r, redis_server, hours, slot):
    code, out = kd(redis_server, "", "stats", "--hours", hours, "--slot", slot)
    assert code == 2, out
    assert "--hours/--slot" in out and "histogram of" in out
