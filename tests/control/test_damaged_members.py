"""A stored member damaged in Redis: a JSON object whose ``headers`` or ``properties`` is not an
object, in either space. Listing shows it as unreadable (no task id), as it shows a compressed
member that cannot be restored; find, cancel and the dashboard's pages go on around it. None of
them ends in an ``AttributeError``."""

from __future__ import annotations

import json

import pytest
from celery import Celery

from kombu_delay import DelayControl
from kombu_delay.config import Settings
from kombu_delay.message import Due, index_id, task_name
from kombu_delay.store import Store, keys, listing
from kombu_delay.store.replies import Stored
from kombu_delay.web.app import create_app
from tests.support.cli import kd

#: Damaged members: each is a JSON object, but not a kombu message.
DAMAGED = {
    "headers-a-string": {"headers": "oops", "properties": {}, "body": ""},
    "properties-a-string": {"headers": {}, "properties": "oops", "body": ""},
    "headers-a-list": {"headers": ["id", "task"], "properties": {"delivery_tag": "t"}, "body": ""},
    "properties-a-number": {"headers": {"task": "t.x", "id": "x"}, "properties": 5, "body": ""},
}
#: ``delay_compress_after`` that keeps a message 600 s out in each space.
SPACES = {"ordinary": 0, "cold": 60}


def publish(redis_server, options: dict[str, object]) -> list[str]:
    """Three tasks, 600 s out and more."""
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = options
    try:
        return [app.send_task("t.x", (i,), countdown=600 + i).id for i in range(3)]
    finally:
        app.close()


def damage(r, stored: Stored, task_id: str, prefix: str, content: dict[str, object]) -> None:
    """Replace the member of ``stored`` in place (same set, same score) with ``content``."""
    key = stored.space.queue_set(prefix, stored.start_ms, stored.dest)
    assert r.zrem(key, stored.payload) == 1
    r.zadd(key, {stored.space.member(json.dumps(content), task_id): stored.score})


@pytest.mark.parametrize("damaged", DAMAGED.values(), ids=DAMAGED.keys())
def test_stored_payload_readers_take_a_damaged_member_for_no_message(damaged):
    payload = json.dumps(damaged)
    assert index_id(payload) == "" and task_name(payload) is None


@pytest.mark.parametrize("compress_after", SPACES.values(), ids=SPACES.keys())
@pytest.mark.parametrize("damaged", DAMAGED.values(), ids=DAMAGED.keys())
def test_a_damaged_member_is_listed_unreadable_and_find_and_cancel_go_on(
    r, redis_server, prefix, compress_after, damaged
):
    options = {"global_keyprefix": prefix, "delay_compress_after": compress_after}
    ids = publish(redis_server, options)
    with DelayControl(redis_server.url, options) as ctl:
        [stored] = ctl.store.find(ids[1])
        assert stored.space.compressed == bool(compress_after)
        damage(r, stored, ids[1], prefix, damaged)

        page = ctl.scheduled()
        assert [m.task_id for m in page.items] == [ids[0], "", ids[2]]
        unreadable = page.items[1]
        assert unreadable.task is None and unreadable.due_ms == stored.due_ms and unreadable.queue == "celery"
        # Its id is gone with its headers: nothing is found or cancelled under it, and no other
        # id is disturbed.
        assert ctl.find(ids[1]) == []
        assert ctl.cancel(ids[1]) == 0
        assert [m.task_id for m in ctl.find(ids[2])] == [ids[2]]
        assert ctl.cancel(ids[2]) == 1
        assert [m.task_id for m in ctl.scheduled().items] == [ids[0], ""]

        code, out = kd(redis_server, prefix, "ls")
        assert code == 0, out
        rows = out.splitlines()[1:-1]
        assert [row.split()[0] for row in rows] == [ids[0], "(unreadable)"], out
        code, out = kd(redis_server, prefix, "cancel", ids[1])
        assert code == 1 and f"{ids[1]}: not scheduled" in out, out

        client = create_app(ctl).test_client()
        listing = client.get("/scheduled")
        assert listing.status_code == 200
        assert "<em>unreadable</em>" in listing.get_data(as_text=True)
        assert client.get(f"/task?id={ids[1]}").status_code == 404
        assert client.get(f"/task?id={ids[0]}").status_code == 200


#: Written by hand into kombu-delay's keys: a score no publish gives, an index member that
#: names no bucket.
ODD = {
    "score-+inf": ("score", float("inf")),
    "score--inf": ("score", float("-inf")),
    "score-1e300": ("score", 1e300),
    "index-abc": ("index", "abc"),
    "index-1.5": ("index", "1.5"),
    "cold-index-abc": ("cold index", "abc"),
}


@pytest.mark.parametrize("odd", ODD.values(), ids=ODD.keys())
def test_stats_ls_and_health_read_past_scores_and_index_members_written_by_hand(r, redis_server, prefix, odd):
    # Each ended the command in a traceback (OverflowError, ValueError), health too: a liveness
    # probe would have restarted a mover that works.
    options = {"global_keyprefix": prefix, "delay_compress_after": 0}
    ids = publish(redis_server, options)
    with DelayControl(redis_server.url, options) as ctl:
        [stored] = ctl.store.find(ids[0])
        where, value = odd
        if where == "score":
            r.zadd(stored.space.queue_set(prefix, stored.start_ms, stored.dest), {"by hand": value})
        else:
            index = (keys.cold_index if where == "cold index" else keys.index)(prefix)
            r.zadd(index, {value: 0})
        assert [m.task_id for m in ctl.scheduled().items if m.task_id] == ids
    for command in (["stats"], ["ls"], ["health", "--max-heartbeat-age", "0"]):
        code, out = kd(redis_server, prefix, *command)
        assert "Traceback" not in out and "Error" not in out, out
        assert code in (0, 1), (command, out)


@pytest.mark.parametrize(
    "score", [float("inf"), float("-inf"), 1e300, -5.0], ids=["+inf", "-inf", "1e300", "-5"]
)
def test_ls_pages_one_by_one_past_a_score_written_by_hand(r, redis_server, prefix, score):
    # The cursor of a page that ended on such a member was refused as no cursor ls printed
    # (or, first in order, it hid every message after it).
    options = {"global_keyprefix": prefix, "delay_compress_after": 0}
    ids = publish(redis_server, options)
    with DelayControl(redis_server.url, options) as ctl:
        [stored] = ctl.store.find(ids[0])
        r.zadd(stored.space.queue_set(prefix, stored.start_ms, stored.dest), {"by hand": score})
        listed, cursor = [], None
        for _ in range(10):
            page = ctl.scheduled(limit=1, cursor=cursor)
            listed += [m.task_id for m in page.items]
            cursor = page.cursor
            if cursor is None:
                break
            code, out = kd(redis_server, prefix, "ls", "--limit", "1", "--cursor", str(cursor))
            assert code == 0, out
    assert sorted(listed) == sorted([*ids, ""])


def test_a_start_shared_by_an_index_member_written_by_hand_is_listed(r, redis_server, prefix):
    # The listing read the index in pages and went on after the last score it read: a member
    # written by hand with a start's score, read last, made it pass over that start's bucket.
    store, now = Store(r, prefix), int(r.time()[0]) * 1000
    first = (now // 60_000 + 10) * 60_000
    starts = [first + i * 60_000 for i in range(2 * listing.STARTS + 5)]
    for i, start in enumerate(starts):
        store.schedule(Due(start + 1, task_id=f"t{i}"), f"{prefix}q", f"p{i}", Settings(compress_after_ms=0))
    # Byte order puts "0abc" first among the members at starts[STARTS - 1]'s score.
    r.zadd(keys.index(prefix), {"0abc": starts[listing.STARTS - 1]})
    with DelayControl(redis_server.url, {"global_keyprefix": prefix}) as ctl:
        items = ctl.scheduled(limit=1000).items
        assert len(items) == len(starts)
        # And the earliest due time is read past any number of such members first.
        r.zadd(keys.index(prefix), {f"x{i}": i for i in range(40)})
        assert ctl.store.earliest_due_ms() == starts[0] + 1


def test_an_index_member_written_with_a_leading_zero_lists_no_bucket_twice(r, redis_server, prefix):
    # "0<start>" read as the bucket <start> in Python, and as another (empty) one in Lua: ls
    # listed that bucket's messages twice.
    store, now = Store(r, prefix), int(r.time()[0]) * 1000
    start = (now // 60_000 + 10) * 60_000
    store.schedule(Due(start + 1, task_id="t"), f"{prefix}q", "p", Settings(compress_after_ms=0))
    r.zadd(keys.index(prefix), {f"0{start}": start})
    with DelayControl(redis_server.url, {"global_keyprefix": prefix}) as ctl:
        assert [m.task_id for m in ctl.scheduled(limit=1000).items] == [""]
        assert ctl.store.earliest_due_ms() == start + 1
    code, out = kd(redis_server, prefix, "ls")
    assert code == 0 and out.count("(unreadable)") == 1, out
    assert keys.start_of(f"0{start}") is None and keys.start_of("0") == 0


def test_find_and_cancel_read_past_a_ref_and_score_written_by_hand(r, redis_server, prefix):
    # A ref naming a start too large for a float, at whose score (inf) a member written by hand
    # sat: find returned it, and every command that takes its ref (cancel, reschedule) ended in
    # an OverflowError.
    options = {"global_keyprefix": prefix, "delay_compress_after": 0}
    [task_id] = publish(redis_server, options)[:1]
    with DelayControl(redis_server.url, options) as ctl:
        [stored] = ctl.store.find(task_id)
        start = "9" * 400
        r.hset(keys.ids(prefix), task_id, r.hget(keys.ids(prefix), task_id).decode() + f" {start}:0:0")
        r.hset(keys.meta(prefix, start), f"q:{stored.dest}", 1)
        r.zadd(stored.space.queue_set(prefix, start, stored.dest), {stored.payload: float("inf")})
        assert len(ctl.store.find(task_id)) == 2
    code, out = kd(redis_server, prefix, "cancel", task_id)
    assert "Traceback" not in out and "Error" not in out, out
    assert code == 0, out
    with DelayControl(redis_server.url, options) as ctl:
        assert ctl.store.find(task_id) == []
