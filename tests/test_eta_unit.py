"""Pure functions, table-driven: ETA parsing, key names, scores, the id a stored payload is
indexed under and the listing cursor."""

from __future__ import annotations

import base64
import json
import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from celery.utils.time import maybe_iso8601
from kombu.transport.redis import Channel as KombuChannel
from kombu.utils import json as kombu_json

from kombu_delay.errors import BadETA, DelayTooLong
from kombu_delay.message import (
    Due,
    carries_eta,
    index_id,
    message_due,
    parse_iso_ms,
    task_name,
    to_ms,
    with_eta,
)
from kombu_delay.store import keys
from kombu_delay.store.listing import Cursor, Position, digest
from kombu_delay.store.replies import Stored

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


def task(**fields: Any) -> dict[str, Any]:
    """A Celery protocol 1 body, as ``as_task_v1`` builds it (the fields the worker reads)."""
    return {"task": "t", "id": "b1", "args": [], "kwargs": {}, "eta": None, **fields}


#: JSON app data sent with plain kombu (no ``task`` header): not Celery, never held.
APP_DATA = {
    "app-data-task-and-eta": {"task": "buy milk", "eta": "2099-01-01T09:00:00"},
    "app-data-past-ceiling": {"task": "buy milk", "eta": "2200-01-01T09:00:00"},
    "app-data-bad-eta": {"task": "buy milk", "eta": 12},
    "no-args": {k: v for k, v in task(eta=T.isoformat()).items() if k != "args"},
    "args-not-a-list": task(eta=T.isoformat(), args="1, 2"),
    "kwargs-not-a-dict": task(eta=T.isoformat(), kwargs=[]),
    "id-not-a-string": task(eta=T.isoformat(), id=7),
    "task-not-a-string": task(eta=T.isoformat(), task=["t"]),
    "no-eta-key": {k: v for k, v in task().items() if k != "eta"},
}


def xd(value: Any) -> dict[str, Any]:
    return {"headers": {"x-delay": value}, "properties": {"delivery_tag": "tag-1"}}


DUE_CASES: dict[str, tuple[dict[str, Any], Due | None]] = {
    "p2-utc-offset": (p2(T.isoformat()), Due(T_MS, task_id="abc")),
    "p2-z-suffix": (p2("2030-05-06T07:08:09.123456Z"), Due(T_MS, task_id="abc")),
    "p2-plus-0200": (p2(T.astimezone(timezone(timedelta(hours=2))).isoformat()), Due(T_MS, task_id="abc")),
    "p2-naive-is-utc": (p2("2030-05-06T07:08:09.123456"), Due(T_MS, task_id="abc")),
    "p2-no-eta": (p2(None), None),
    "p2-empty-eta": (p2(""), None),
    "p2-wins-over-x-delay": (p2(T.isoformat(), **{"x-delay": 5}), Due(T_MS, task_id="abc")),
    # A task header with no ETA of its own: its x-delay holds it, as any message's does.
    "p2-no-eta-x-delay": (p2(None, **{"x-delay": 1500}), Due(1500, relative=True, task_id="abc")),
    "p2-empty-eta-x-delay": (p2("", **{"x-delay": "1500"}), Due(1500, relative=True, task_id="abc")),
    "app-task-header-x-delay": (
        {"headers": {"task": "resize", "x-delay": 60_000}, "properties": {"delivery_tag": "tag-1"}},
        Due(60_000, relative=True, task_id="tag-1"),
    ),
    "p2-no-eta-x-delay-zero": (p2(None, **{"x-delay": 0}), None),
    "p1-body-base64": (p1(task(eta=T.isoformat())), Due(T_MS, task_id="b1")),
    "p1-body-plain": (p1(task(eta=T.isoformat()), False), Due(T_MS, task_id="b1")),
    "p1-no-eta": (p1(task()), None),
    # A protocol-1 task's own ETA wins over an x-delay beside it (the worker waits for it), and
    # an x-delay holds one with none; either is indexed under the task id, not the tag.
    "p1-wins-over-x-delay": (
        {**p1(task(eta=T.isoformat())), "headers": {"x-delay": 2000}},
        Due(T_MS, task_id="b1"),
    ),
    "p1-no-eta-x-delay": (
        {**p1(task()), "headers": {"x-delay": 2000}},
        Due(2000, relative=True, task_id="b1"),
    ),
    "not-celery-body": (p1({"eta": T.isoformat()}), None),
    "p1-under-a-task-header": (
        {**p1(task(eta=T.isoformat())), "headers": {"task": "t", "id": "h1"}},
        None,  # protocol 2 with no eta header; the body is the app's
    ),
    **{name: (p1(body), None) for name, body in APP_DATA.items()},
    **{f"{name}-plain": (p1(body, False), None) for name, body in APP_DATA.items()},
    "json-nested-too-deep": (
        {"content-type": "application/json", "headers": {}, "body": "[" * 100_000, "properties": {}},
        None,
    ),
    "x-delay-int": (xd(1500), Due(1500, relative=True, task_id="tag-1")),
    "x-delay-str": (xd("1500"), Due(1500, relative=True, task_id="tag-1")),
    "x-delay-float": (xd(1500.9), Due(1500, relative=True, task_id="tag-1")),
    "x-delay-text-exponent": (xd(" 1.5e3 "), Due(1500, relative=True, task_id="tag-1")),
    "x-delay-zero": (xd(0), None),
    "x-delay-negative": (xd(-3), None),
    # A raw kombu publish may put a datetime in the header: kombu's JSON carries it, and the
    # worker reads it as its ETA; it was "not ISO-8601", delivered at once.
    "p2-datetime": (p2(T), Due(T_MS, task_id="abc")),
    "p2-naive-datetime": (p2(T.replace(tzinfo=None)), Due(T_MS, task_id="abc")),
    "x-delay-minus-infinity": (xd(float("-inf")), None),
    "x-delay-minus-infinity-text": (xd("-Infinity"), None),
    "x-delay-minus-huge-int": (xd(-(10**400)), None),
    "plain-message": ({"headers": {}, "properties": {}}, None),
    "no-headers": ({"properties": {}}, None),
    # kombu sends headers and properties as it is given them: not objects, they hold no delay.
    "headers-text": ({"headers": "task", "properties": {}}, None),
    "headers-list": ({"headers": ["task", "x-delay"], "properties": {}}, None),
    "p1-headers-list": ({**p1(task(eta=T.isoformat()), encode=False), "headers": ["task"]}, None),
    "p1-properties-text": ({**p1(task(eta=T.isoformat()), encode=False), "properties": "base64"}, None),
}


@pytest.mark.parametrize("name", list(DUE_CASES))
def test_message_due(name):
    message, expected = DUE_CASES[name]
    assert message_due(message) == expected


BAD_CASES = {
    "p2-garbage": p2("next tuesday"),
    "p2-month-13": p2("2030-13-01T00:00:00"),
    "p2-number": p2(12345),
    "p2-object": p2({"year": 2030, "month": 5, "day": 6, "hour": 7}),
    "p2-list": p2(["2030-05-06T07:08:09Z"]),
    # False but not empty: a bad ETA, told and counted, whatever x-delay is beside it (a Celery
    # 5.7 worker fails on it, as on the empty one, on redis:// as here).
    **{
        f"p2-false-eta-{name}": p2(eta, **{"x-delay": 1500})
        for name, eta in {"zero": 0, "false": False, "list": [], "object": {}, "float": 0.0}.items()
    },
    "p1-number-eta": p1(task(eta=12)),
    "x-delay-word": xd("soon"),
    "p2-no-eta-x-delay-word": p2(None, **{"x-delay": "soon"}),
    "x-delay-bool": xd(True),
    "x-delay-list": xd([1]),
    "x-delay-nan": xd(float("nan")),
    "x-delay-nan-text": xd("nan"),
    # Python's float() reads these, no other reader of the header would.
    "x-delay-underscores": xd("1_500"),
    "x-delay-other-digits": xd("\u0661\u0665\u0660\u0660"),
}


@pytest.mark.parametrize("name", list(BAD_CASES))
def test_unusable_delays_raise_bad_eta(name):
    with pytest.raises(BadETA):
        message_due(BAD_CASES[name])


@pytest.mark.parametrize(
    "message", [p2("x" * 100_000), p1(task(eta="y" * 100_000)), xd("z" * 100_000), xd("9" * 100_000)]
)
def test_an_unusable_delay_of_any_length_is_told_in_a_line(message):
    """A header holds whatever a publisher put there: the error (logged by the transport)
    shows its start and its length, not a megabyte."""
    with pytest.raises((BadETA, DelayTooLong)) as told:
        message_due(message)
    assert len(str(told.value)) < 400 and "100,002 characters" in str(told.value)


@pytest.mark.parametrize("text", ["1" * 200_000 + "s", "1" * 200_000 + "e", "1." + "1" * 200_000 + "x"])
def test_a_long_x_delay_that_is_no_number_is_refused_in_one_reading(text):
    # It was matched in a time that grew with the square of its length: 16,000 digits and a
    # letter took 7.5 s of the publisher's CPU, and these would take about 20 minutes, far past
    # the suite's timeout of 300 s.
    with pytest.raises(BadETA):
        message_due(xd(text))


def test_an_x_delay_of_more_digits_than_python_shows_is_too_long():
    with pytest.raises(DelayTooLong, match="int too long to show"):
        message_due(xd(10**5000))


# Past a float's range too: 10**400 and infinity were "not a number" and delivered at once,
# while 10**30 was refused.
@pytest.mark.parametrize(
    "delay", [keys.MAX_DUE_MS, 10**30, "1e30", 10**400, "1e400", float("inf"), "Infinity"]
)
def test_an_x_delay_past_the_due_time_ceiling_is_too_long(delay):
    with pytest.raises(DelayTooLong, match=r"2109-05-15 07:35:11\.103 UTC"):
        message_due(xd(delay))


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("1970-01-01T00:00:00+00:00", 0),
        ("1970-01-01T00:00:00.000999+00:00", 0),  # floor to the ms: never later than the ETA
        ("1970-01-01T00:00:00.001+00:00", 1),
        ("1970-01-01T01:00:00+01:00", 0),
        ("2030-05-06T07:08:09.123456", T_MS),
        # Forms a Celery worker reads (dateutil's isoparse) that datetime.fromisoformat does not:
        # they were refused as bad ETAs and delivered at once.
        ("2030-126T07:08:09.123456Z", T_MS),  # an ordinal date: day 126 of 2030 is May 6
        ("2030-05-05T24:00:00Z", T_MS - (7 * 3600 + 8 * 60 + 9) * 1000 - 123),
    ],
)
def test_parse_iso_ms(text, ms):
    assert parse_iso_ms(text) == ms


@pytest.mark.parametrize(
    "text",
    [
        "2030-05-06T07:08:09+00:00",
        "2030-05-06T07:08:09.123+05:30",
        "2030-05-06T07:08:09.5Z",
        "2030-05-06 07:08:09.123456-03:00",
        "2030-05-06T07:08:09.1234567+00:00",
        "2030-05-06T07:08:09+0100",
        "20300506T070809",
        "2030-05-06",
        # Read by datetime.fromisoformat, refused by the worker: they were held until that time,
        # then the worker refused them.
        "2030-05-06T07:08:09 +01:00",
        "2030-05-06T07:08:09+01:00:30",
        "2030-05-06T07:08:09.123456+01:00:30.5",
        "2030-05-06T07:08:09+01:60",
        "2030-05-06T07:08:09+24:00",
        "2030-05-06T07:08:09.123-23:59",
    ],
)
def test_an_eta_is_read_as_a_celery_worker_reads_it_or_is_bad(text):
    try:
        when = maybe_iso8601(text)  # what a worker reads an ETA with
    except ValueError:
        with pytest.raises(BadETA):
            parse_iso_ms(text)
    else:
        assert parse_iso_ms(text) == to_ms(when if when.tzinfo else when.replace(tzinfo=UTC))


def test_to_ms_rejects_naive_datetimes():
    with pytest.raises(BadETA, match="naive"):
        to_ms(datetime(2030, 1, 1))
    assert to_ms(T) == T_MS


@pytest.mark.parametrize("ms", [1_796_228_704_814, 4_347_044_157_447, keys.MAX_DUE_MS, 0, -1])
def test_to_ms_is_exact_on_a_whole_millisecond(ms):
    """Through ``timestamp() * 1000`` in floating point, the second and third (in the years
    before the 2109 ceiling) come out one millisecond early."""
    when = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)
    assert to_ms(when) == ms
    assert to_ms(when + timedelta(microseconds=999)) == ms
    assert to_ms(when.astimezone(timezone(timedelta(hours=-5)))) == ms


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


@pytest.mark.parametrize("priority", range(10))
def test_queue_of_reads_kombus_names_under_an_empty_separator(priority):
    # kombu publishes with sep="" (celery, celery3, ...); the tools failed on it with
    # "ValueError: empty separator", and a mover with metrics logged it every second.
    channel = object.__new__(KombuChannel)
    channel.sep = ""
    stepped = channel.priority(priority)
    dest = channel._q_for_pri("celery", priority)
    assert keys.destination("", "celery", stepped, "") == dest
    assert keys.queue_of(dest, "", "") == "celery"


@pytest.mark.parametrize("due", [0, 1, 1_796_040_000_123, 2**41 - 1])
@pytest.mark.parametrize("seq", [0, 1, 1023, 2047])
def test_score_floor_is_the_due_ms_and_survives_redis_text(due, seq):
    score = keys.score(due, seq)
    assert math.floor(score) == due
    assert (score - due) * keys.SEQ_SLOTS == seq  # the seq is recoverable (the id index ref)
    assert float(keys.score_text(score)) == score


def test_score_floor_and_seq_hold_up_to_the_year_2109_ceiling():
    due = keys.MAX_DUE_MS
    for seq in range(keys.SEQ_SLOTS):
        score = keys.score(due, seq)
        assert math.floor(score) == due and (score - due) * keys.SEQ_SLOTS == seq


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


@pytest.mark.parametrize("prefix", ["", "app1:"])
def test_key_names_of_the_v2_layout(prefix):
    ns = f"{prefix}kombu_delay:"
    assert keys.ns(prefix) == ns
    assert keys.index(prefix) == f"{ns}index"
    assert keys.meta(prefix, 1_796_040_000_000) == f"{ns}m:1796040000000"
    assert keys.queue_set(prefix, 60_000, f"{prefix}celery") == f"{ns}z:60000:{prefix}celery"
    assert keys.queue_set(prefix, 0, "q:with:colons\x06\x169") == f"{ns}z:0:q:with:colons\x06\x169"
    assert keys.task_ids(prefix, 60_000) == f"{ns}t:60000"
    assert keys.drained(prefix) == f"{ns}gc"
    assert keys.dead(prefix) == f"{ns}dead"
    names = [
        keys.index(prefix),
        keys.meta(prefix, 1),
        keys.queue_set(prefix, 1, "celery"),
        keys.task_ids(prefix, 1),
        keys.drained(prefix),
        keys.ids(prefix),
        keys.counts(prefix),
        keys.totals(prefix),
        keys.movers(prefix),
        keys.dead(prefix),
    ]
    assert len(set(names)) == len(names)
    assert all(name.startswith(ns) for name in names)


# The id a stored payload is indexed under (Store.find checks it) must be the one the
# transport chose at publish (message_due): task id, message id or delivery tag.
INDEXED = {name: (message, due.task_id) for name, (message, due) in DUE_CASES.items() if due is not None}


@pytest.mark.parametrize("name", list(INDEXED))
def test_index_id_is_the_id_the_transport_indexed_at_publish(name):
    message, expected = INDEXED[name]
    assert expected  # every case names its message
    text = kombu_json.dumps(message)  # as kombu stores it: a datetime header too
    assert index_id(text) == expected
    assert index_id(text.encode()) == expected


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        # Protocol 2: the id header, even when the body is JSON with an id of its own.
        (
            {
                "content-type": "application/json",
                "headers": {"task": "t", "id": "hdr-id", "eta": None},
                "body": json.dumps({"id": "body-id"}),
                "properties": {"delivery_tag": "tag"},
            },
            "hdr-id",
        ),
        # Protocol 1 with a base64 body: the id inside the body.
        (p1(task(id="b64-id", eta=T.isoformat())), "b64-id"),
        (p1(task(id="plain-id", eta=T.isoformat()), encode=False), "plain-id"),
        # x-delay: the body is not looked into, the message id comes before the delivery tag.
        (
            {
                "content-type": "application/json",
                "headers": {"x-delay": 5},
                "body": json.dumps({"id": "not-this"}),
                "properties": {"message_id": "m-1", "delivery_tag": "tag-2"},
            },
            "m-1",
        ),
        ({"headers": {"x-delay": 5}, "properties": {"delivery_tag": "tag-3"}}, "tag-3"),
        ({"headers": {"x-delay": "7"}, "properties": {}}, ""),
    ],
    ids=["p2-header-wins", "p1-base64", "p1-plain", "x-delay-message-id", "x-delay-tag", "x-delay-no-id"],
)
def test_index_id_per_message_kind(message, expected):
    assert index_id(json.dumps(message)) == expected


@pytest.mark.parametrize("name", list(APP_DATA))
def test_inspection_leaves_app_data_alone(name):
    """payload.py reads and rewrites only what the transport held as protocol 1."""
    message = {**p1(APP_DATA[name]), "properties": {"body_encoding": "base64", "delivery_tag": "tag-9"}}
    text = json.dumps(message)
    assert index_id(text) == "tag-9"
    assert task_name(text) is None
    assert with_eta(text, T_MS) == text


def test_inspection_reads_and_rewrites_protocol_1():
    text = json.dumps(p1(task(task="proj.add", eta="2030-01-01T00:00:00+00:00")))
    assert (index_id(text), task_name(text)) == ("b1", "proj.add")
    rewritten = json.loads(with_eta(text, T_MS))
    assert parse_iso_ms(json.loads(base64.b64decode(rewritten["body"]))["eta"]) == T_MS


def test_a_task_headed_message_held_by_its_x_delay_keeps_its_headers_on_reschedule():
    """Held by its x-delay, not an ETA: only the stored due time moves, as for any x-delay."""
    message = {"headers": {"task": "resize", "x-delay": 60_000}, "properties": {"delivery_tag": "tag-1"}}
    text = json.dumps(message)
    assert with_eta(text, T_MS) == text
    with_none = json.dumps(p2(None, **{"x-delay": 60_000}))
    assert with_eta(with_none, T_MS) == with_none


@pytest.mark.parametrize("payload", [b"", b"garbage", b"[1, 2]", b'"text"', b"\xff{}", b"{"])
def test_index_id_of_what_is_not_a_kombu_message_is_empty(payload):
    assert index_id(payload) == ""


def at(due: int, seq: int, start: int, dest: str, rank: int = 1, member: bytes = b"m") -> Position:
    return Position(due, rank, keys.score(due, seq), start, dest, digest(member))


CURSORS = [
    Cursor(60_000, at(61_234, 7, 60_000, "celery")),
    Cursor(0, at(1_796_040_000_001, 2047, 1_796_040_000_000, "app1:emails:x\x06\x169", rank=0)),
    Cursor(0, at(5, 0, 0, "a:b:c:")),
    Cursor(2**42 - 60_000, at(2**42 - 1, 2047, 2**42 - 60_000, "z")),
]


@pytest.mark.parametrize("cursor", CURSORS, ids=range(len(CURSORS)))
def test_cursor_round_trips_through_its_text(cursor):
    text = str(cursor)
    # The destination percent-encoded (a priority list's name holds controls a terminal drops).
    shown = cursor.at.dest.replace("\x06\x16", "%06%16")
    assert text.endswith(f":{shown}") and text.startswith(f"{cursor.lo}:{cursor.at.due_ms}:")
    parsed = Cursor.parse(text)
    assert parsed == cursor and parsed.at.last == cursor.at.last


def test_cursor_text_keeps_a_destination_with_colons_whole():
    cursor = Cursor.parse("60000:61234:1:61234.5:60000:00000000000000ff:app1:celery:high")
    assert cursor.at.dest == "app1:celery:high" and cursor.at.score == 61234.5 and cursor.lo == 60_000


def test_a_cursor_digest_names_one_member():
    assert len(digest(b"a")) == 16 and digest(b"a") != digest(b"b")


def test_positions_order_by_due_time_then_space_then_score():
    cold = at(1000, 5, 0, "q", rank=0)
    ordinary = at(1000, 1, 1000, "q")
    assert cold < ordinary < at(1001, 0, 0, "a", rank=0)
    assert at(1000, 1, 0, "b") < at(1000, 2, 0, "a")  # the score before the destination


@pytest.mark.parametrize(
    "text",
    [
        "",
        "nonsense",
        "1:-inf:",
        "60000:1:2",
        "60000:61234.5:00000000000000ff:celery",  # 0.3's form: no due time, space or start
        "0:61234:2:61234.5:60000:00000000000000ff:q",  # no such space
        "0:61234:1:61235.5:60000:00000000000000ff:q",  # the score is not of that due time
        "0:61234:1:61234.5:60000:00000000000000f:q",  # a short digest
        "0:61234:1:61234.5:60000:00000000000000fg:q",
        "70000:61234:1:61234.5:60000:00000000000000ff:q",  # lo after the start
        "-1:61234:1:61234.5:60000:00000000000000ff:q",
        "x:61234:1:61234.5:60000:00000000000000ff:q",
    ],
)
def test_cursor_parse_rejects_anything_else(text):
    with pytest.raises(ValueError):
        Cursor.parse(text)


@pytest.mark.parametrize("seq", [0, 1, 1023, 2047])
@pytest.mark.parametrize("offset", [0, 1, 59_999])
def test_stored_ref_and_due_come_from_the_score(seq, offset):
    start = 1_796_040_000_000
    stored = Stored(start, keys.score(start + offset, seq), "celery", b"{}")
    assert stored.due_ms == start + offset
    assert stored.ref == f"{start}:{offset}:{seq}"  # the ref put() in _put.lua writes


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (p2(T.isoformat()), True),
        (p1(task(eta=T.isoformat())), True),
        (p2(None, **{"x-delay": 5_000}), False),  # held by its x-delay alone: run on arrival
        (xd(5_000), False),
        (p2(None), False),
        (p2("soon"), False),
    ],
    ids=["p2-eta", "p1-eta", "p2-x-delay", "kombu-x-delay", "p2-none", "p2-bad"],
)
def test_carries_eta_tells_a_message_a_worker_holds_until_its_eta(
    message: dict[str, Any], expected: bool
) -> None:
    assert carries_eta(json.dumps(message)) is expected
