"""Pure functions, table-driven: ETA parsing, key names, scores and the envelope layout."""

from __future__ import annotations

import base64
import json
import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from kombu.transport.redis import Channel as KombuChannel

from kombu_delay import keys
from kombu_delay.envelope import Envelope, decode
from kombu_delay.errors import BadETA, CorruptMember
from kombu_delay.eta import Due, message_due, parse_iso_ms, to_ms

T = datetime(2030, 5, 6, 7, 8, 9, 123_456, tzinfo=UTC)
T_MS = 1_904_281_689_123


def p2(eta: Any, **headers: Any) -> dict[str, Any]:
    return {"headers": {"task": "t", "id": "abc", "eta": eta, **headers}, "properties": {}}


def p1(body: dict[str, Any], encode: bool = True) -> dict[str, Any]:
    raw = json.dumps(body)
    return {
        "content-type": "application/json",
        "headers": {},
        "body": base64.b64encode(raw.encode()).decode() if encode else raw,
        "properties": {"body_encoding": "base64"} if encode else {},
    }


def xd(value: Any) -> dict[str, Any]:
    return {"headers": {"x-delay": value}, "properties": {"delivery_tag": "tag-1"}}


DUE_CASES: dict[str, tuple[dict[str, Any], Due | None]] = {
    "p2-utc-offset": (p2(T.isoformat()), Due(T_MS, task_id="abc")),
    "p2-z-suffix": (p2("2030-05-06T07:08:09.123456Z"), Due(T_MS, task_id="abc")),
    "p2-plus-0200": (p2(T.astimezone(timezone(timedelta(hours=2))).isoformat()), Due(T_MS, task_id="abc")),
    "p2-naive-is-utc": (p2("2030-05-06T07:08:09.123456"), Due(T_MS, task_id="abc")),
    "p2-no-eta": (p2(None), None),
    "p2-wins-over-x-delay": (p2(T.isoformat(), **{"x-delay": 5}), Due(T_MS, task_id="abc")),
    "p1-body-base64": (p1({"task": "t", "id": "b1", "eta": T.isoformat()}), Due(T_MS, task_id="b1")),
    "p1-body-plain": (p1({"task": "t", "id": "b1", "eta": T.isoformat()}, False), Due(T_MS, task_id="b1")),
    "p1-no-eta": (p1({"task": "t", "id": "b1", "eta": None}), None),
    "not-celery-body": (p1({"eta": T.isoformat()}), None),
    "x-delay-int": (xd(1500), Due(1500, relative=True, task_id="tag-1")),
    "x-delay-str": (xd("1500"), Due(1500, relative=True, task_id="tag-1")),
    "x-delay-float": (xd(1500.9), Due(1500, relative=True, task_id="tag-1")),
    "x-delay-zero": (xd(0), None),
    "x-delay-negative": (xd(-3), None),
    "plain-message": ({"headers": {}, "properties": {}}, None),
    "no-headers": ({"properties": {}}, None),
}


@pytest.mark.parametrize("name", list(DUE_CASES))
def test_message_due(name):
    message, expected = DUE_CASES[name]
    assert message_due(message) == expected


BAD_CASES = {
    "p2-garbage": p2("next tuesday"),
    "p2-month-13": p2("2030-13-01T00:00:00"),
    "p2-number": p2(12345),
    "p1-number-eta": p1({"task": "t", "id": "b", "eta": 12}),
    "x-delay-word": xd("soon"),
    "x-delay-bool": xd(True),
    "x-delay-list": xd([1]),
    "x-delay-inf": xd(float("inf")),
}


@pytest.mark.parametrize("name", list(BAD_CASES))
def test_unusable_delays_raise_bad_eta(name):
    with pytest.raises(BadETA):
        message_due(BAD_CASES[name])


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("1970-01-01T00:00:00+00:00", 0),
        ("1970-01-01T00:00:00.000999+00:00", 0),  # floor to the ms: never later than the ETA
        ("1970-01-01T00:00:00.001+00:00", 1),
        ("1970-01-01T01:00:00+01:00", 0),
        ("2030-05-06T07:08:09.123456", T_MS),
    ],
)
def test_parse_iso_ms(text, ms):
    assert parse_iso_ms(text) == ms


def test_to_ms_rejects_naive_datetimes():
    with pytest.raises(BadETA, match="naive"):
        to_ms(datetime(2030, 1, 1))
    assert to_ms(T) == T_MS


@pytest.mark.parametrize("priority", range(10))
@pytest.mark.parametrize("prefix", ["", "app1:"])
@pytest.mark.parametrize("queue", ["celery", "a.b", "q\x06\x16x"])
def test_destination_matches_kombu_q_for_pri(priority, prefix, queue):
    channel = object.__new__(KombuChannel)  # only _q_for_pri and priority are used
    stepped = channel.priority(priority)
    expected = prefix + channel._q_for_pri(queue, priority)
    assert keys.destination(prefix, queue, stepped, channel.sep) == expected
    if "\x06\x16" not in queue:
        assert keys.queue_of(expected, prefix, channel.sep) == queue


@pytest.mark.parametrize("due", [0, 1, 1_796_040_000_123, 2**41 - 1])
@pytest.mark.parametrize("seq", [0, 1, 1023, 2047])
def test_score_floor_is_the_due_ms_and_survives_redis_text(due, seq):
    score = keys.score(due, seq)
    assert math.floor(score) == due
    assert (score - due) * keys.SEQ_SLOTS == seq  # the seq is recoverable (the id index ref)
    assert float(keys.score_text(score)) == score


def test_score_floor_is_the_due_ms_up_to_the_year_2109_ceiling():
    due = keys.MAX_DUE_MS - 1
    assert all(math.floor(keys.score(due, seq)) == due for seq in range(keys.SEQ_SLOTS))


@pytest.mark.parametrize(
    ("due", "width", "start"),
    [
        (0, 60_000, 0),
        (59_999, 60_000, 0),
        (60_000, 60_000, 60_000),
        (1_796_040_001_234, 1000, 1_796_040_001_000),
    ],
)
def test_bucket_start(due, width, start):
    assert keys.bucket_start(due, width) == start


ENVELOPES = [
    Envelope("abc", "celery", b'{"body": "x"}'),
    Envelope("", "q", b"{}"),
    Envelope("tâche-é", "app1:celery\x06\x169", '{"é": "ü"}'.encode()),
    Envelope("id:with:colons", "12:34:", b"5:6:payload"),
]


@pytest.mark.parametrize("env", ENVELOPES, ids=range(len(ENVELOPES)))
def test_envelope_round_trip(env):
    assert decode(env.encode()) == env


@pytest.mark.parametrize(
    "member",
    [b"", b"garbage", b"3:6:ab", b"0:0:x", b"2:99:ab", b"\x00not", b"1:1:a\xff{}", b"9999999999:1:x"],
)
def test_corrupt_members_raise(member):
    with pytest.raises(CorruptMember):
        decode(member)
