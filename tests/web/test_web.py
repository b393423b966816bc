"""The dashboard's app without a browser: Flask's test client over a real Redis, with and without
``global_keyprefix``; the per-queue overdue count and the dead letters it reads; its guards
(read-only, CSRF, basic auth, the Host allow-list, the audit log, path prefix); and that neither
the mover nor the CLI loads it."""

from __future__ import annotations

import base64
import hashlib
import html
import json
import logging
import re
import shutil
import ssl
import subprocess
import sys
import urllib.request
from datetime import UTC, datetime, timedelta

import pytest
from celery import Celery
from click.testing import CliRunner
from flask import Request
from kombu import Connection

from kombu_delay import DeadLetter, DelayControl, RedisUnavailable
from kombu_delay.cli import main
from kombu_delay.config import Settings
from kombu_delay.connect import app_target
from kombu_delay.message import Due
from kombu_delay.ops.checks import stranded_problem
from kombu_delay.store import Store, keys
from kombu_delay.tooling.redis_server import free_port
from kombu_delay.web import overview, present
from kombu_delay.web.app import PathPrefix, create_app
from kombu_delay.web.cli import url_prefix_path
from kombu_delay.web.guard import (
    CSRF_COOKIE,
    LOOPBACK_HOSTS,
    MAX_REASONS,
    Credentials,
    Refusals,
    allowed_hosts_of,
    host_allowed,
    host_name,
    url_host,
)
from tests.support.procs import ROOT, wait_until
from tests.support.servers import full_but_for_an_idle_connection, running_tls_server
from tests.support.stored import behind, kombu_payload


def publish(redis_server, prefix: str, *calls: tuple[str, tuple, dict, dict]) -> list[str]:
    """Publish Celery tasks (name, args, kwargs, apply_async options); return their ids."""
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = {"global_keyprefix": prefix, "delay_compress_after": 0}
    try:
        return [app.send_task(name, args, kwargs, **opts).id for name, args, kwargs, opts in calls]
    finally:
        app.close()


@pytest.fixture
def control(r, redis_server, prefix):
    with DelayControl(redis_server.delay_url, {"global_keyprefix": prefix}) as ctl:
        yield ctl


def client_of(control, **kwargs):
    app = create_app(control, **kwargs)
    app.testing = True
    return app.test_client()


def token(client) -> str:
    client.get("/")
    cookie = client.get_cookie(CSRF_COOKIE)
    assert cookie is not None, "the first page sets the CSRF cookie"
    return cookie.value


def test_overdue_per_queue_counts_only_due_messages_and_the_oldest(r, control, prefix):
    # Published by a clock a minute behind Redis's: due "soon" there is overdue by Redis's clock,
    # as a mover outage leaves it.
    store = control.store
    store.clock = behind(r)
    start = store.clock()
    settings = Settings.from_options({"delay_bucket_width": 10})
    items = [
        (Due(start + 1_000, task_id="a"), f"{prefix}emails", kombu_payload("a", "emails")),
        (Due(start + 25_000, task_id="b"), f"{prefix}emails", kombu_payload("b", "emails")),
        (Due(start + 40_000, task_id="c"), f"{prefix}celery\x06\x163", kombu_payload("c")),
        (Due(start + 50_000, task_id="d"), f"{prefix}celery", kombu_payload("d")),
    ]
    store.schedule_many(items, settings)
    now = start + 45_000
    found, truncated = store.overdue(now)
    assert not truncated
    assert found == {f"{prefix}emails": (2, start + 1_000), f"{prefix}celery\x06\x163": (1, start + 40_000)}
    # By Redis's clock all four are due; per queue, the priorities are folded together.
    store.clock = None
    by_queue, _ = control.overdue()
    assert by_queue == {"emails": (2, start + 1_000), "celery": (2, start + 40_000)}
    # A bucket limit says the count is cut short.
    assert store.overdue(now, max_buckets=1)[1] is True


def test_a_dead_letter_key_of_another_type_is_named_with_what_to_do(r, control, prefix):
    # The page said only Redis's "Command # 1 (LLEN ...) of pipeline caused error: WRONGTYPE".
    r.set(keys.dead(prefix), "written by hand")
    page = client_of(control).get("/dead")
    assert page.status_code == 503
    assert f"{keys.dead(prefix)!r} holds a string, not a list" in html.unescape(page.get_data(as_text=True))


def test_dead_letters_list_newest_first_and_remove_by_digest(r, control, prefix):
    dead = keys.dead(prefix)
    r.lpush(dead, b"\x01\x03abc\xff\xfe broken", b"\x07junk", b"\x01\x03xyz<script>")
    total, letters = control.dead_letters(0, 2)
    assert total == 3
    assert [d.member for d in letters] == [b"\x01\x03xyz<script>", b"\x07junk"]
    assert letters[0].task_id == "xyz"
    assert control.remove_dead_letter(letters[1].digest, near=1) == 1
    assert control.remove_dead_letter(letters[1].digest, near=1) == 0
    assert r.lrange(dead, 0, -1) == [b"\x01\x03xyz<script>", b"\x01\x03abc\xff\xfe broken"]


def test_a_dead_letter_pushed_far_from_where_it_was_seen_is_still_removed(r, control, prefix):
    # Only the 100 letters around where a page showed it were looked at: 150 letters added
    # since pushed it past them, and the dashboard said "gone already" of a letter still there.
    dead = keys.dead(prefix)
    r.lpush(dead, *(f"old-{i}".encode() for i in range(20)))
    _, letters = control.dead_letters(10, 1)
    r.lpush(dead, *(f"new-{i}".encode() for i in range(150)))
    assert control.remove_dead_letter(letters[0].digest, near=10) == 1
    assert r.llen(dead) == 169 and letters[0].member not in r.lrange(dead, 0, -1)
    assert control.remove_dead_letter(letters[0].digest, near=10) == 0  # the whole list looked at


def test_overview_lists_queues_chart_warnings_and_totals(r, redis_server, control, prefix):
    publish(
        redis_server,
        prefix,
        ("tasks.a", (1,), {}, {"countdown": 600}),
        ("tasks.b", (2,), {}, {"countdown": 7200, "queue": "emails"}),
    )
    client = client_of(control)
    page = client.get("/")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    assert re.search(r'id="total-scheduled">2<', html)
    assert ">emails</a>" in html and ">celery</a>" in html
    assert len(re.findall(r'class="bar"[^>]*data-count="[1-9]', html)) == 2
    # No mover runs here: the first warning says so, and claims nothing of the past (a mover
    # that stops takes its heartbeat away: "none ever seen" was wrong just after one stopped).
    assert "No mover is running (no heartbeat in the last 30 s; none is kept)" in html
    assert "Server-Timing" in page.headers
    data = client.get("/overview.json?range=minutes").get_json()
    assert data["scheduled"] == 2 and {q["name"] for q in data["queues"]} == {"celery", "emails"}
    assert len(data["histogram"]) == 60


def test_the_movers_card_counts_movers_as_stats_and_health_do(r, control, prefix):
    # The card counted every kept heartbeat (a mover killed 5 minutes ago too), and one far
    # ahead of Redis's clock read "0ms ago" with no "No mover is running" warning.
    now = int(r.time()[0]) * 1000
    r.zadd(keys.movers(prefix), {"host:1:live": now, "host:2:killed": now - 300_000})
    html = client_of(control).get("/").get_data(as_text=True)
    assert re.search(r'id="movers-count">1 \(1 more silent for over 30 s\)<', html), html
    assert "No mover is running" not in html
    r.delete(keys.movers(prefix))
    r.zadd(keys.movers(prefix), {"host:3:ahead": now + 3_600_000})
    html = client_of(control).get("/").get_data(as_text=True)
    assert re.search(r'id="movers-count">0 \(1 more silent', html), html
    assert "No mover is running (no heartbeat in the last 30 s; none is kept)" in html
    assert "ahead of Redis&#39;s clock" in html or "ahead of Redis's clock" in html


def test_a_task_page_shows_a_page_of_its_messages_and_says_how_many_more(r, control, prefix):
    # 20,000 messages under one id made a task page of 72 MB.
    store, now = Store(r, prefix), int(r.time()[0]) * 1000
    for n in range(total := 60):
        store.schedule(
            Due(now + 600_000 + n, task_id="same"),
            f"{prefix}celery",
            kombu_payload("same", body=base64.b64encode(b"%d" % n).decode()),
            Settings(),
        )
    page = client_of(control).get("/task?id=same")
    html = page.get_data(as_text=True)
    assert page.status_code == 200 and html.count('<section class="message">') == 50
    assert f"The first 50 of {total} messages under this id are shown" in html


def test_a_cut_census_shows_its_counts_as_lower_bounds(r, redis_server, control, prefix):
    # Two buckets in the chart's window, one examined: the other's message is not "due after".
    publish(
        redis_server,
        prefix,
        ("tasks.a", (1,), {}, {"countdown": 600}),
        ("tasks.b", (2,), {}, {"countdown": 7200}),
    )
    html = client_of(control, max_buckets=1).get("/").get_data(as_text=True)
    assert "1 due after the chart or not counted; counts cut short by the census's limits." in html
    assert re.search(r"UTC: at least 1 due</title>", html)
    data = client_of(control, max_buckets=1).get("/overview.json").get_json()
    assert data["truncated"] is True and data["later"] == 1
    whole = client_of(control).get("/").get_data(as_text=True)
    assert "0 due after the chart." in whole and "at least" not in whole


def test_overview_shows_wake_ups_the_acl_refused_and_members_counted_again(r, control, prefix):
    """A publisher refused the wake-up channel stores its messages and counts the refusals; a
    bucket whose counts missed members counts them again (see tests/store/test_recount.py)."""
    r.hset(keys.totals(prefix), mapping={"wake_refused": 3, "recounted": 4})
    html = client_of(control).get("/").get_data(as_text=True)
    assert re.search(r"<td>wake_refused</td><td class=\"num\">3</td>", html)
    assert re.search(r"<td>recounted</td><td class=\"num\">4</td>", html)


def test_listing_filters_by_queue_and_task_and_pages_with_the_cursor(redis_server, control, prefix):
    ids = publish(
        redis_server,
        prefix,
        *[("tasks.a", (i,), {}, {"countdown": 600 + i}) for i in range(3)],
        ("tasks.b", (9,), {}, {"countdown": 605, "queue": "emails"}),
    )
    client = client_of(control)
    first = client.get("/scheduled?limit=2").get_data(as_text=True)
    assert re.findall(r'data-task-id="([^"]+)"', first) == ids[:2]
    cursor = re.search(r'id="next-page" href="[^"]*cursor=([^"&]+)', first)
    assert cursor is not None
    second = client.get(f"/scheduled?limit=2&cursor={cursor.group(1)}").get_data(as_text=True)
    assert re.findall(r'data-task-id="([^"]+)"', second) == [ids[2], ids[3]]
    emails = client.get("/scheduled?queue=emails").get_data(as_text=True)
    assert re.findall(r'data-task-id="([^"]+)"', emails) == [ids[3]]
    named = client.get("/scheduled?task=s.b").get_data(as_text=True)
    assert re.findall(r'data-task-id="([^"]+)"', named) == [ids[3]]
    assert client.get(f"/scheduled?id={ids[1]}").headers["Location"].endswith(f"/task?id={ids[1]}")
    assert client.get("/scheduled?cursor=nonsense").status_code == 400


def test_message_text_is_escaped_and_argsrepr_wins_over_the_body(redis_server, control, prefix):
    evil = "<script>alert(1)</script>"
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = {"global_keyprefix": prefix}
    shown = app.send_task("tasks.evil", (evil,), {"k": evil}, countdown=600).id
    hidden = app.send_task("tasks.login", ("s3cret-pw",), countdown=600, argsrepr="('****',)").id
    app.close()
    client = client_of(control)
    for url in ("/scheduled", f"/task?id={shown}"):
        html = client.get(url).get_data(as_text=True)
        assert evil not in html
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    secret_page = client.get(f"/task?id={hidden}").get_data(as_text=True)
    assert "****" in secret_page and "s3cret-pw" not in secret_page
    assert "s3cret-pw" not in client.get("/scheduled").get_data(as_text=True)
    assert client.get("/task?id=no-such-task").status_code == 404


def test_read_only_refuses_every_action_and_shows_no_buttons(redis_server, control, prefix):
    [task_id] = publish(redis_server, prefix, ("tasks.a", (1,), {}, {"countdown": 600}))
    client = client_of(control)
    csrf = token(client)
    assert 'id="cancel"' not in client.get(f"/task?id={task_id}").get_data(as_text=True)
    for path, form in (
        ("/task/cancel", {"id": task_id, "confirm": "yes"}),
        ("/task/reschedule", {"id": task_id, "countdown": "0"}),
        ("/dead/remove", {"digest": "0" * 64, "confirm": "yes"}),
    ):
        refused = client.post(path, data={**form, "csrf": csrf})
        assert refused.status_code == 403 and "read-only" in refused.get_data(as_text=True)
    assert len(control.find(task_id)) == 1


def test_actions_need_the_csrf_token_and_a_confirmation(redis_server, control, prefix, caplog):
    [task_id] = publish(redis_server, prefix, ("tasks.a", (1,), {}, {"countdown": 600}))
    client = client_of(control, allow_actions=True)
    csrf = token(client)
    for form in ({}, {"csrf": "forged"}):
        refused = client.post("/task/cancel", data={"id": task_id, "confirm": "yes", **form})
        assert refused.status_code == 403 and "CSRF" in refused.get_data(as_text=True)
    # A token holding an encoded lone surrogate (as the id may) answered 500, not 403.
    for sent in ("%ED%B3%BF", f"{csrf}%ED%B3%BF"):
        body = f"id={task_id}&confirm=yes&csrf={sent}"
        for path in ("/task/cancel", "/task/reschedule", "/dead/remove"):
            refused = client.post(path, data=body, content_type="application/x-www-form-urlencoded")
            assert refused.status_code == 403 and "CSRF" in refused.get_data(as_text=True), path
    other = client.post(
        "/task/cancel",
        data={"id": task_id, "confirm": "yes", "csrf": csrf},
        headers={"Origin": "http://evil.example"},
    )
    assert other.status_code == 403
    assert len(control.find(task_id)) == 1
    asked = client.post("/task/cancel", data={"id": task_id, "csrf": csrf})
    assert asked.status_code == 200 and 'id="confirm"' in asked.get_data(as_text=True)
    assert len(control.find(task_id)) == 1, "nothing is cancelled before the confirmation"
    with caplog.at_level("WARNING", logger="kombu_delay.web.audit"):
        done = client.post("/task/cancel", data={"id": task_id, "csrf": csrf, "confirm": "yes"})
    assert done.status_code == 200 and "Cancelled 1 message" in done.get_data(as_text=True)
    assert control.find(task_id) == []
    assert any(f"cancel {task_id!r} by -@" in rec.getMessage() for rec in caplog.records)


def test_reschedule_by_countdown_and_by_time(r, redis_server, control, prefix):
    [task_id] = publish(redis_server, prefix, ("tasks.a", (1,), {}, {"countdown": 600}))
    client = client_of(control, allow_actions=True)
    csrf = token(client)
    moved = client.post("/task/reschedule", data={"id": task_id, "countdown": "3600", "csrf": csrf})
    assert moved.status_code == 303
    now = control.store.time_ms()
    [found] = control.find(task_id)
    assert now + 3_590_000 <= found.due_ms <= now + 3_600_000
    at = client.post("/task/reschedule", data={"id": task_id, "eta": "2099-01-02T03:04:05", "csrf": csrf})
    assert at.status_code == 303
    [found] = control.find(task_id)
    assert found.eta.isoformat() == "2099-01-02T03:04:05+00:00"  # no offset given: UTC
    bad = client.post("/task/reschedule", data={"id": task_id, "eta": "not a time", "csrf": csrf})
    # The time quoted as typed (the form's space read as ISO-8601's T was quoted: 'notTaTtime').
    assert bad.status_code == 400 and "&#39;not a time&#39; is not a time" in bad.get_data(as_text=True)


def test_a_cancel_of_what_has_gone_meanwhile_offers_nothing_to_confirm(redis_server, control, prefix):
    # Moved (or cancelled) between the task page and the click: the confirmation offered to
    # remove "0 scheduled message(s)", with its button.
    client = client_of(control, allow_actions=True)
    asked = client.post("/task/cancel", data={"id": "gone-meanwhile", "csrf": token(client)})
    text = asked.get_data(as_text=True)
    assert (
        asked.status_code == 200 and "Nothing is scheduled under task" in text and 'id="confirm"' not in text
    )


def test_an_action_redis_did_not_answer_is_told_as_perhaps_done():
    with DelayControl(f"delayredis://127.0.0.1:{free_port()}/0") as down:  # nothing listens there
        client = client_of(down, allow_actions=True)
        csrf = token(client)
        for path, form in (("/task/cancel", {"confirm": "yes"}), ("/task/reschedule", {"countdown": "60"})):
            reply = client.post(path, data={"id": "t", "csrf": csrf, **form})
            text = reply.get_data(as_text=True)
            assert reply.status_code == 503 and "may or may not have been done" in text, path
        asked = client.post("/task/cancel", data={"id": "t", "csrf": csrf})  # only reads, to confirm
        assert asked.status_code == 503 and "may or may not" not in asked.get_data(as_text=True)
        assert "may or may not" not in client.get("/").get_data(as_text=True)  # a read is only a read


def test_a_reschedule_another_edit_refuses_is_told_so_not_as_a_redis_error(
    r, redis_server, control, prefix, caplog
):
    # A reschedule refused while its queue was being purged was answered with the "Redis error"
    # page (503, "Redis cannot be read") and audited as "failed", Redis being well all along.
    [task_id] = publish(redis_server, prefix, ("tasks.a", (1,), {}, {"countdown": 600}))
    mark, dests = keys.purging(prefix), [f"{prefix}celery"]
    control.store._scripts["purging"](keys=[mark], args=[1, 60_000, *dests])  # a purge under way
    client = client_of(control, allow_actions=True)
    form = {"id": task_id, "countdown": "3600", "csrf": token(client)}
    with caplog.at_level("WARNING", logger="kombu_delay.web.audit"):
        refused = client.post("/task/reschedule", data=form)
    page = refused.get_data(as_text=True)
    assert refused.status_code == 409 and "try again" in page and "Redis error" not in page
    assert any("refused, another edit first" in rec.getMessage() for rec in caplog.records)
    control.store._scripts["purging"](keys=[mark], args=[-1, 60_000, *dests])  # it ended
    assert client.post("/task/reschedule", data=form).status_code == 303


def test_dead_letter_pages_and_removal(r, control, prefix):
    r.lpush(keys.dead(prefix), b"\x01\x05tid-1<b>bold</b>\x00\x01")
    client = client_of(control, allow_actions=True)
    csrf = token(client)
    listing = client.get("/dead").get_data(as_text=True)
    assert "tid-1" in listing and "<b>bold" not in listing and "&lt;b&gt;bold" in listing
    [digest] = re.findall(r"digest=([0-9a-f]{64})", listing)
    assert client.get(f"/dead/letter?digest={digest}&near=0").status_code == 200
    form = {"digest": digest, "near": "0", "csrf": csrf, "confirm": "yes"}
    removed = client.post("/dead/remove", data=form)
    assert removed.status_code == 200 and r.llen(keys.dead(prefix)) == 0


#: A position past any list Redis can address (a 64-bit integer).
HUGE = "99999999999999999999"
#: Cursors of the right shape whose numbers no listing prints.
OUT_OF_RANGE_CURSORS = [
    "0:1:1:inf:0:0000000000000000:celery",
    "0:1:1:1e400:0:0000000000000000:celery",
    "0:1:1:nan:0:0000000000000000:celery",
    f"0:{2**53}:1:{2**53}.0:0:0000000000000000:celery",  # past the due-time ceiling
]


@pytest.mark.parametrize("cursor", OUT_OF_RANGE_CURSORS)
def test_a_cursor_out_of_range_is_a_bad_request(control, cursor):
    assert client_of(control).get(f"/scheduled?cursor={cursor}").status_code == 400


def test_dead_letter_positions_past_any_list_are_a_bad_request(r, control, prefix, caplog):
    r.lpush(keys.dead(prefix), b"\x01\x05junk")
    client = client_of(control, allow_actions=True)
    csrf = token(client)
    [digest] = re.findall(r"digest=([0-9a-f]{64})", client.get("/dead").get_data(as_text=True))
    assert client.get(f"/dead?offset={HUGE}").status_code == 400
    assert client.get(f"/dead/letter?digest={digest}&near={HUGE}").status_code == 400
    form = {"digest": digest, "near": HUGE, "csrf": csrf, "confirm": "yes"}
    assert client.post("/dead/remove", data=form).status_code == 400
    assert r.llen(keys.dead(prefix)) == 1
    # Far, but a position Redis reads: an empty page, not an error.
    assert client.get(f"/dead?offset={2**62}").status_code == 200
    # No whole number: refused, as a bad limit is, not taken for 0 (the first page, or letter).
    # Its checks first: actions off, a bad position is refused as any action is (403, audited).
    assert client_of(control).post("/dead/remove", data={**form, "near": "abc"}).status_code == 403
    caplog.set_level(logging.WARNING, logger="kombu_delay.web.audit")
    bad_ones = ("abc", "1e3", "-5", "+3", "1_0", " 7", "\u0667", "9" * 5000)
    for bad in bad_ones:
        assert client.get(f"/dead?offset={bad}").status_code == 400
        assert client.get(f"/dead/letter?digest={digest}&near={bad}").status_code == 400
        assert client.post("/dead/remove", data={**form, "near": bad}).status_code == 400
    assert r.llen(keys.dead(prefix)) == 1
    refused = [rec for rec in caplog.records if "not a whole number" in rec.getMessage()]
    assert len(refused) == len(bad_ones)  # each refused removal audited, as any refused action
    with pytest.raises(ValueError, match="past any list position"):
        control.dead_letters(int(HUGE), 50)


def test_a_damaged_envelope_shows_as_text_not_an_error():
    for damaged in (
        {"headers": "oops", "properties": {}, "body": ""},
        {"headers": {"task": "t.x", "id": "x"}, "properties": "oops", "body": "[[], {}, {}]"},
    ):
        raw = json.dumps(damaged).encode()
        assert present.preview(raw) == ""
        shown = present.show(raw)
        assert shown.source == "" and shown.body == raw.decode()


def test_basic_auth_guards_every_path(control):
    client = client_of(control, credentials=Credentials.parse("ops:pa:ss"))
    for path in ("/", "/static/dashboard.css", "/overview.json"):
        assert client.get(path).status_code == 401
    wrong = base64.b64encode(b"ops:nope").decode()
    assert client.get("/", headers={"Authorization": f"Basic {wrong}"}).status_code == 401
    # Not ASCII: base64 refuses it with a plain ValueError (a 500 that showed the page's header).
    refused = client.get("/", headers={"Authorization": "Basic \xe9\xe9\xe9\xe9"})
    assert refused.status_code == 401 and "kombu-delay" not in refused.get_data(as_text=True)
    right = base64.b64encode(b"ops:pa:ss").decode()
    assert client.get("/", headers={"Authorization": f"Basic {right}"}).status_code == 200
    with pytest.raises(ValueError):
        Credentials.parse("no-password")


@pytest.mark.parametrize(
    ("sent", "status"),
    [
        ("cross-site no-cors image", 403),  # an <img> of any page of the web
        ("same-site cors empty", 403),  # a fetch by a page on another port of the same host
        ("cross-site navigate iframe", 403),  # a frame: built whole before X-Frame-Options hides it
        ("none navigate document prefetch;prerender", 403),  # a prerender no one asked to see yet
        ("cross-site navigate document", 200),  # a link followed from another site
        ("same-origin cors empty", 200),  # the dashboard's own refresh
        ("none navigate document", 200),  # typed in, a bookmark
        ("", 200),  # no browser, or one that sends no Sec-Fetch headers (plain HTTP off loopback)
    ],
)
def test_a_request_of_another_sites_page_is_refused_before_it_costs_redis_anything(r, control, sent, status):
    # Three <img> tags or frames on any page made the browser of whoever opened it run the
    # dashboard's costliest reads (a listing of every bucket for a queue with none).
    client = client_of(control)
    names = ("Sec-Fetch-Site", "Sec-Fetch-Mode", "Sec-Fetch-Dest", "Sec-Purpose")
    headers = dict(zip(names, sent.split(), strict=False))
    before = int(r.info("stats")["total_commands_processed"])
    reply = client.get("/scheduled?queue=none", headers=headers)
    commands = int(r.info("stats")["total_commands_processed"]) - before - 1  # (less the INFO)
    assert reply.status_code == status
    assert commands == 0 if status == 403 else commands > 0


def test_an_action_on_a_huge_task_id_writes_an_audit_line_cut_as_documented(control, caplog):
    # Refused POSTs were cut, but a done action wrote the id whole: 60,103 characters a line.
    client = client_of(control, allow_actions=True)
    caplog.set_level(logging.WARNING, logger="kombu_delay.web.audit")
    reply = client.post(f"/task/cancel?id={'x' * 60_000}", data={"confirm": "yes", "csrf": token(client)})
    assert reply.status_code == 200
    (line,) = [record.getMessage() for record in caplog.records]
    assert line.startswith("cancel 'xxx") and line.endswith(
        "... (60,002 characters) by -@127.0.0.1: 0 message(s) cancelled"
    )
    assert len(line) < 400


@pytest.mark.parametrize("field", ["eta", "countdown"])
def test_a_reschedule_to_a_huge_bad_time_writes_an_audit_line_cut_as_documented(control, caplog, field):
    # Its refusal's reason quoted the value whole: 60,134 characters a line.
    client = client_of(control, allow_actions=True)
    caplog.set_level(logging.WARNING, logger="kombu_delay.web.audit")
    reply = client.post(
        "/task/reschedule", data={"id": "t1", field: "9" * 60_000 + "x", "csrf": token(client)}
    )
    assert reply.status_code == 400
    (line,) = [record.getMessage() for record in caplog.records]
    assert line.startswith("reschedule 't1' by -@127.0.0.1 failed: ") and len(line) < 400, line[:500]


def test_the_csrf_cookie_is_lax_so_a_link_from_another_site_keeps_the_token(control):
    # Strict: a link from another site sent no cookie, so the page it opened set a new token,
    # and the forms of the tabs already open were refused ("token does not match").
    reply = client_of(control).get("/")
    cookie = reply.headers["Set-Cookie"]
    assert "SameSite=Lax" in cookie and "HttpOnly" in cookie


def test_wrong_passwords_are_told_on_the_audit_log_and_flood_it_not(control, caplog):
    # 300 wrong passwords at some 900 a second left no trace.
    client = client_of(control, credentials=Credentials.parse("ops:s3cret"))
    caplog.set_level(logging.WARNING, logger="kombu_delay.web.audit")
    assert client.get("/").status_code == 401  # a browser's first request: no password sent, none told
    assert caplog.records == []
    wrong = {"Authorization": "Basic " + base64.b64encode(b"ops:guess").decode()}
    for _ in range(300):
        assert client.get("/", headers=wrong).status_code == 401
    (line,) = [record.getMessage() for record in caplog.records]  # the first; the rest within 10 s
    assert line == (
        "refused login by -@127.0.0.1: wrong user or password; 1 refused, from any address, since the "
        "last such line (this one included)"
    )
    caplog.clear()  # and POSTs: one line each before
    for _ in range(300):
        assert client.post("/task/cancel?id=x", data={"csrf": "t"}, headers=wrong).status_code == 401
    (line,) = [record.getMessage() for record in caplog.records]
    assert line == "refused POST '/task/cancel?id=x' by -@127.0.0.1: authentication failed"
    caplog.clear()  # under --url-prefix, the path asked for (it was told without the prefix)
    client = client_of(control, credentials=Credentials.parse("ops:s3cret"))  # (its own pace)
    kd = client.post("/task/cancel?id=y", data={"csrf": "t"}, headers=wrong, base_url="http://localhost/kd")
    assert kd.status_code == 401
    (line,) = [record.getMessage() for record in caplog.records]
    assert line.startswith("refused POST '/kd/task/cancel?id=y' by"), line


def test_refused_logins_are_told_at_most_every_ten_seconds_with_their_count(caplog):
    now = [0.0]
    refusals = Refusals(clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="kombu_delay.web.audit")
    request = Request.from_values("/", headers={"Authorization": "Basic eDp5"})
    for step in range(60):  # 30 s, a refusal every half second
        now[0] = step * 0.5
        refusals.login(request)
    counts = [int(re.findall(r"; (\d+) refused", r.getMessage())[0]) for r in caplog.records]
    assert counts == [1, 20, 20]  # at 0, 10 and 20 s; the 19 since are told at the next


def test_refused_posts_are_paced_each_reason_apart(caplog):
    # 2,000 POSTs with a wrong password wrote 2,000 lines; a page looping refused POSTs, 672
    # lines in 3 s. Each reason is paced apart, so one flood hides no refusal of another kind.
    now = [0.0]
    refusals = Refusals(clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="kombu_delay.web.audit")
    for step in range(40):  # 20 s, a refusal of each kind every half second
        now[0] = step * 0.5
        refusals.post("POST '/task/cancel?id=a'", "-@127.0.0.1", "authentication failed")
        origin = f"the request comes from another origin ('https://evil{step}.example')"
        refusals.post("cancel 'a'", "ops@127.0.0.1", origin)
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "refused POST '/task/cancel?id=a' by -@127.0.0.1: authentication failed",
        "refused cancel 'a' by ops@127.0.0.1: the request comes from another origin ('https://evil0.example')",
        "refused POST '/task/cancel?id=a' by -@127.0.0.1: authentication failed; 20 refused for this "
        "reason since the last such line (this one included)",
        "refused cancel 'a' by ops@127.0.0.1: the request comes from another origin "
        "('https://evil20.example'); 20 refused for this reason since the last such line (this one included)",
    ]


def test_refusal_reasons_past_the_limit_share_one_pace(caplog):
    refusals = Refusals(clock=lambda: 0.0)
    caplog.set_level(logging.WARNING, logger="kombu_delay.web.audit")
    for i in range(100):
        refusals.post("POST '/x'", "-@127.0.0.1", f"reason {i}")
    assert len(caplog.records) == MAX_REASONS + 1  # each reason up to the limit, then one for the rest


#: What a page that rebound its own name to the dashboard's address sends (DNS rebinding).
REBOUND = "attacker.example:26001"


def test_a_host_not_allowed_gets_nothing_and_can_do_nothing(redis_server, control, prefix):
    [task_id] = publish(redis_server, prefix, ("tasks.a", (1,), {}, {"countdown": 600}))
    client = client_of(control, allow_actions=True)
    csrf = token(client)
    for path in ("/", f"/task?id={task_id}", "/overview.json", "/static/dashboard.css", "/nowhere"):
        refused = client.get(path, headers={"Host": REBOUND})
        assert refused.status_code == 400, path
        assert refused.mimetype == "text/plain" and "--allowed-host" in refused.get_data(as_text=True)
        assert "Set-Cookie" not in refused.headers and csrf not in refused.get_data(as_text=True)
    # Before: the page's own token and an Origin naming the same (attacker's) host passed.
    form = {"id": task_id, "confirm": "yes", "csrf": csrf}
    cancel = client.post("/task/cancel", data=form, headers={"Host": REBOUND, "Origin": f"http://{REBOUND}"})
    assert cancel.status_code == 400 and len(control.find(task_id)) == 1
    # The loopback names, at any port, are the default.
    for host in ("localhost", "127.0.0.1:9809", "[::1]:1", "LOCALHOST:80"):
        assert client.get("/overview.json", headers={"Host": host}).status_code == 200, host
    for host in ("localhost.", "127.0.0.2", "[::2]", "localhost:x", "", "a b"):
        assert client.get("/overview.json", headers={"Host": host}).status_code == 400, host


def test_allowed_hosts_answer_a_proxy_name_and_its_actions(redis_server, control, prefix):
    [task_id] = publish(redis_server, prefix, ("tasks.a", (1,), {}, {"countdown": 600}))
    proxied = {"Host": "dash.example.com:8443", "Origin": "https://dash.example.com:8443"}
    client = client_of(control, allow_actions=True, allowed_hosts=["Dash.Example.com"])
    assert client.get("/", headers={"Host": "localhost"}).status_code == 400  # not given: not allowed
    csrf = token_at(client, proxied["Host"])
    done = client.post("/task/cancel", data={"id": task_id, "confirm": "yes", "csrf": csrf}, headers=proxied)
    assert done.status_code == 200 and control.find(task_id) == []
    anyone = client_of(control, allowed_hosts=["*"])
    assert anyone.get("/", headers={"Host": REBOUND}).status_code == 200


def token_at(client, host: str) -> str:
    client.get("/", headers={"Host": host})
    cookie = client.get_cookie(CSRF_COOKIE, domain=host.rpartition(":")[0])
    assert cookie is not None, "the first page sets the CSRF cookie"
    return cookie.value


@pytest.mark.parametrize(
    ("bound", "given", "allowed"),
    [
        ("127.0.0.1", (), set(LOOPBACK_HOSTS)),
        ("localhost", (), set(LOOPBACK_HOSTS)),
        ("::1", (), set(LOOPBACK_HOSTS)),
        ("0.0.0.0", (), set(LOOPBACK_HOSTS)),
        ("::", ("dash.example.com",), {*LOOPBACK_HOSTS, "dash.example.com"}),
        ("10.1.2.3", (), {"10.1.2.3"}),
        ("127.0.0.2", (), {*LOOPBACK_HOSTS, "127.0.0.2"}),  # the URL it prints names it
        ("fd00::0:7", ("[FD00::7]", "Dash.Example.COM"), {"[fd00::7]", "dash.example.com"}),
        ("dash.internal", ("*",), {"dash.internal", "*"}),
    ],
)
def test_the_default_allow_list_follows_the_bound_address(bound, given, allowed):
    assert allowed_hosts_of(bound, given) == allowed


@pytest.mark.parametrize(
    "given", ["", "dash.example.com:443", "http://dash.example.com", "a/b", ".x", "a..b"]
)
def test_an_allowed_host_with_a_port_scheme_or_path_is_refused(given):
    with pytest.raises(ValueError, match="not a host name or address"):
        host_name(given)


#: A user name that, written as it is, starts a log line of its own.
FORGED = "x\n2026-01-01 00:00:00,000 WARNING kombu_delay.web.audit: cancel 'y' by admin@10.0.0.1"


def test_the_audit_log_names_only_a_checked_user_and_escapes_what_a_request_sends(
    redis_server, control, prefix, caplog
):
    [task_id, other] = publish(
        redis_server, prefix, *[("tasks.a", (i,), {}, {"countdown": 600}) for i in range(2)]
    )
    forged = {"Authorization": "Basic " + base64.b64encode(f"{FORGED}:pw".encode()).decode()}
    client = client_of(control, allow_actions=True)  # no --auth: a user name is anyone's to send
    csrf = token(client)
    form = {"id": task_id, "csrf": csrf, "confirm": "yes"}
    xff = {"HTTP_X_FORWARDED_FOR": "1.2.3.4\nforged line"}
    with caplog.at_level("WARNING", logger="kombu_delay.web.audit"):
        assert (
            client.post("/task/cancel", data=form, headers=forged, environ_overrides=xff).status_code == 200
        )
    [line] = [rec.getMessage() for rec in caplog.records if rec.name == "kombu_delay.web.audit"]
    assert "\n" not in line and FORGED.splitlines()[1] not in line, line
    assert f"cancel {task_id!r} by -@127.0.0.1 (forwarded for '1.2.3.4\\nforged line'):" in line
    caplog.clear()
    right = base64.b64encode(b"ops:pw").decode()
    checked = client_of(control, allow_actions=True, credentials=Credentials.parse("ops:pw"))
    headers = {"Authorization": f"Basic {right}"}
    checked.get("/", headers=headers)
    csrf = checked.get_cookie(CSRF_COOKIE).value  # type: ignore[union-attr]
    with caplog.at_level("WARNING", logger="kombu_delay.web.audit"):
        form = {"id": other, "csrf": csrf, "confirm": "yes"}
        assert checked.post("/task/cancel", data=form, headers=headers).status_code == 200
    assert any(f"cancel {other!r} by 'ops'@127.0.0.1:" in rec.getMessage() for rec in caplog.records)


def test_an_action_refused_by_the_host_check_or_basic_auth_is_in_the_audit_log(control, caplog):
    client = client_of(control, allow_actions=True, credentials=Credentials.parse("ops:pw"))
    wrong = {"Authorization": "Basic " + base64.b64encode(b"ops:guess").decode()}
    right = {"Authorization": "Basic " + base64.b64encode(b"ops:pw").decode()}
    form = {"csrf": "x", "confirm": "yes"}
    with caplog.at_level("WARNING", logger="kombu_delay.web.audit"):
        assert client.post("/task/cancel?id=guessed", data=form, headers=wrong).status_code == 401
        rebound = {**right, "Host": REBOUND}
        assert client.post("/dead/remove?id=d", data=form, headers=rebound).status_code == 400
        # Reading changes nothing: its wrong password is told as a login refused, not an action.
        assert client.get("/?id=read", headers=wrong).status_code == 401
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kombu_delay.web.audit"]
    assert lines == [
        "refused POST '/task/cancel?id=guessed' by -@127.0.0.1: authentication failed",
        "refused POST '/dead/remove?id=d' by -@127.0.0.1: host not allowed",
        "refused login by -@127.0.0.1: wrong user or password; 1 refused, from any address, since the "
        "last such line (this one included)",
    ]


@pytest.mark.parametrize(
    "bound, shown",
    [
        ("0.0.0.0", "127.0.0.1"),
        ("::", "[::1]"),
        ("::1", "[::1]"),
        ("127.0.0.2", "127.0.0.2"),
        ("dash", "dash"),
    ],
)
def test_the_url_it_prints_names_a_host_it_answers_to(bound, shown):
    assert url_host(bound) == shown
    assert host_allowed(f"{shown}:9809", allowed_hosts_of(bound))


def test_an_action_from_the_null_origin_is_refused(redis_server, control, prefix):
    # A sandboxed frame, a data: URL or a file: page of any site sends "Origin: null".
    [task_id] = publish(redis_server, prefix, ("tasks.a", (1,), {}, {"countdown": 600}))
    client = client_of(control, allow_actions=True)
    form = {"id": task_id, "confirm": "yes", "csrf": token(client)}
    refused = client.post("/task/cancel", data=form, headers={"Origin": "null"})
    assert refused.status_code == 403 and "another origin" in refused.get_data(as_text=True)
    assert len(control.find(task_id)) == 1
    # Without an Origin (curl, a script: no page of another site) the token is what counts.
    assert client.post("/task/cancel", data=form).status_code == 200 and control.find(task_id) == []


def test_the_task_page_shows_only_the_count_it_redirects_with(redis_server, control, prefix):
    [task_id] = publish(redis_server, prefix, ("tasks.a", (1,), {}, {"countdown": 600}))
    client = client_of(control, allow_actions=True)
    csrf = token(client)
    moved = client.post("/task/reschedule", data={"id": task_id, "countdown": "60", "csrf": csrf})
    assert moved.status_code == 303
    page = client.get(moved.headers["Location"]).get_data(as_text=True)
    assert "Done: rescheduled 1 message(s)." in page
    for done in ("ALL tasks were cancelled, call +1 555 0100", "-1", "1e3", "\uff11", "rescheduled 1"):
        page = client.get("/task", query_string={"id": task_id, "done": done})
        text = page.get_data(as_text=True)
        assert page.status_code == 200 and 'class="notice"' not in text and "ALL tasks" not in text, done


def test_a_failed_refresh_is_shared_by_every_range():
    # Behind a Redis that stalled, the minutes, days and hours overviews each waited out their
    # own socket timeout, one after another (10 s, 20 s, 30 s).
    with DelayControl(f"delayredis://127.0.0.1:{free_port()}/0") as down:  # nothing listens there
        shared = overview.Shared(down, 1000, share_s=3600)
        with pytest.raises(RedisUnavailable) as first:
            shared.get("minutes")
        for name in overview.RANGES:
            with pytest.raises(RedisUnavailable) as again:
                shared.get(name)
            assert again.value is first.value


def test_a_json_route_answers_errors_as_json():
    with DelayControl(f"delayredis://127.0.0.1:{free_port()}/0") as down:  # nothing listens there
        client = client_of(down)
        reply = client.get("/overview.json")
        assert reply.status_code == 503 and reply.mimetype == "application/json"
        assert reply.get_json()["error"].startswith("Redis is unavailable: ")
        page = client.get("/")  # a page still answers with the error page
        assert page.status_code == 503 and page.mimetype == "text/html"


def test_after_a_refused_connect_the_next_page_gets_the_place_an_idle_connection_held(server):
    # At Redis's maxclients, a page whose connect was refused left the connection on top of the
    # pool, and every page after took it again and was refused, while an idle connection of
    # the dashboard's held the last place: Redis errors until a client of another went away.
    with DelayControl(server.delay_url) as ctl:
        client = client_of(ctl)
        assert client.get("/dead").status_code == 200
        admin = server.client()  # (kept: its connection is one of the places)
        full_but_for_an_idle_connection(admin, ctl.store.client.connection_pool)
        assert client.get("/dead").status_code == 503
        # The dashboard closed its idle connection; Redis frees the place once it reads the close,
        # which may come after the next connect (the page then refused too: a race of the test's).
        # On the old code the connection stayed, and this wait failed.
        limit = int(admin.config_get("maxclients")["maxclients"])
        wait_until(lambda: len(admin.client_list()) < limit, timeout=30)
        assert client.get("/dead").status_code == 200


def test_path_prefix_serves_and_links_under_it(control):
    app = create_app(control)
    app.wsgi_app = PathPrefix(app.wsgi_app, "/ops/delay/")  # type: ignore[method-assign]
    client = app.test_client()
    page = client.get("/ops/delay/")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    assert 'href="/ops/delay/static/dashboard.css"' in html and 'href="/ops/delay/scheduled"' in html
    assert client.get("/ops/delay/static/dashboard.js").status_code == 200
    elsewhere = client.get("/elsewhere")  # outside the prefix: as guarded as the pages
    assert elsewhere.status_code == 404 and elsewhere.headers["X-Frame-Options"] == "DENY"
    guarded = ("Content-Security-Policy", "Cache-Control")
    assert all(elsewhere.headers[name] == page.headers[name] for name in guarded)
    assert elsewhere.get_data(as_text=True) == "not found: the dashboard is under /ops/delay/\n"
    assert client.get("/scheduled").status_code == 404  # a page's path, outside the prefix


def test_a_path_outside_the_prefix_is_told_only_to_whom_the_checks_let_in(control):
    # It was answered before the Host check and basic auth, naming the prefix to anyone.
    app = create_app(control, credentials=Credentials.parse("ops:pw"))
    app.wsgi_app = PathPrefix(app.wsgi_app, "/ops/delay/")  # type: ignore[method-assign]
    client = app.test_client()
    right = {"Authorization": "Basic " + base64.b64encode(b"ops:pw").decode()}
    assert client.get("/elsewhere").status_code == 401
    assert client.get("/elsewhere", headers={**right, "Host": REBOUND}).status_code == 400
    found = client.get("/elsewhere", headers=right)
    assert found.status_code == 404 and "/ops/delay/" in found.get_data(as_text=True)


def test_previews_are_clipped_and_plain_messages_show_their_body():
    long = base64.b64encode(b'[["' + b"x" * 500 + b'"], {}, {}]').decode()
    message = {"body": long, "headers": {"task": "t", "id": "i"}, "properties": {"body_encoding": "base64"}}
    assert len(present.preview(json.dumps(message).encode())) == present.PREVIEW_CHARS
    plain = present.show(b'{"body": "hello <there>", "headers": {}, "properties": {}}')
    assert plain.source == "" and plain.body == "hello <there>"
    assert DeadLetter(b"ab\x00\xff", 0).preview() == "ab\\x00\\xff"


def test_no_crafted_message_breaks_its_rows_or_its_page(redis_server, control, prefix):
    # A body nested too deep for Python, and an argsrepr whose int has no repr (over 4,300
    # digits), gave a 500 on every listing that held them and on their task page.
    deep = b"[" * 5000 + b"]" * 5000
    with Connection(redis_server.delay_url, transport_options={"global_keyprefix": prefix}) as conn:
        eta = (datetime.now(UTC) + timedelta(minutes=30)).isoformat()
        conn.Producer().publish(
            b"[" + deep + b",{},{}]",
            routing_key="celery",
            content_type="application/json",
            content_encoding="utf-8",
            headers={"task": "t.deep", "id": "deep", "eta": eta},
        )
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = {"global_keyprefix": prefix}
    app.send_task("t.hex", (1,), countdown=600, task_id="hex", argsrepr="(0x" + "f" * 4000 + ",)")
    app.close()
    client = client_of(control)
    for url in ("/scheduled", "/task?id=deep", "/task?id=hex"):
        assert client.get(url).status_code == 200, url
    assert "0xffff" in client.get("/task?id=hex").get_data(as_text=True)  # shown as it came


def test_a_task_page_cuts_its_heading_as_every_part(r, redis_server, control, prefix):
    # Each part of a message was cut to DETAIL_CHARS, but a task name of 200,000 characters was
    # printed whole in the page's heading: a page of 223 KB.
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = {"global_keyprefix": prefix}
    app.send_task("t." + "n" * 200_000, countdown=600, task_id="huge-name", queue="q" * 100_000)
    app.close()
    page = client_of(control).get("/task?id=huge-name").get_data(as_text=True)
    assert "n" * present.DETAIL_CHARS not in page and "n" * (present.DETAIL_CHARS - 10) in page
    assert len(page) < 4 * present.DETAIL_CHARS + 50_000, len(page)


def test_a_long_argsrepr_is_not_parsed_for_a_row(monkeypatch):
    # A row parsed and laid out a whole argsrepr before cutting it to 120 characters: one of
    # 1.4 MB cost seconds of CPU, each row of each listing.
    parsed: list[int] = []
    literal_eval = present.ast.literal_eval
    monkeypatch.setattr(
        present.ast, "literal_eval", lambda text: parsed.append(len(text)) or literal_eval(text)
    )
    argsrepr = "[" + "{'a': [1, 2, {'b': 3}]}, " * 500 + "]"  # 12,502 characters
    message = {"body": "W10=", "headers": {"task": "t", "id": "i", "argsrepr": argsrepr}, "properties": {}}
    raw = json.dumps(message).encode()
    assert present.preview(raw).startswith("[{'a': [1, 2, {'b': 3}]}, ")
    assert parsed == []
    assert present.show(raw).args.startswith("[{'a': [1, 2, {'b': 3}]},\n")  # laid out on its page
    huge = dict(message, headers={**message["headers"], "argsrepr": argsrepr * 20})
    assert present.show(json.dumps(huge).encode()).args.startswith("[{'a'")
    assert max(parsed) == len(argsrepr)  # (and "{}", the kwargsrepr): past DETAIL_CHARS as it came


def test_names_and_ids_are_cut_in_rows_and_their_controls_escaped(r, redis_server, control, prefix):
    # A name of a megabyte was printed whole in every row (22 MB pages); an RTL override or a
    # NUL in an id reached the page as it was, so one id could pass for another.
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = {"global_keyprefix": prefix}
    app.send_task("t." + "n" * 100_000, countdown=600, task_id="x\u202eabc\x00")
    app.close()
    client = client_of(control)
    html = client.get("/scheduled").get_data(as_text=True)
    text = re.sub(r"<[^>]*>", "", html)  # what the page shows, without its tags and attributes
    assert "n" * 100 not in html and "x\\u202eabc\\x00" in text and "\u202e" not in text
    page = client.get("/task", query_string={"id": "x\u202eabc\x00"}).get_data(as_text=True)
    text = re.sub(r"<[^>]*>", "", page)
    # On its own page, escaped, and cut as each part of a message is (at 20,000 characters).
    assert "n" * (present.DETAIL_CHARS - 10) in text and "\u202e" not in text
    assert "\u202e" not in html  # nor in the row's attributes
    # A dead letter's task id (a compressed member, version 1: its id's length, then the id).
    tid = "dead\u202eevil\x00".encode()
    member = b"\x01" + bytes([len(tid)]) + tid + b"garbage"
    r.lpush(keys.dead(prefix), member)
    digest = hashlib.sha256(member).hexdigest()
    for url in ("/dead", f"/dead/letter?near=0&digest={digest}"):
        shown = client.get(url).get_data(as_text=True)
        assert "dead\\u202eevil\\x00" in shown and "\u202e" not in shown and "\x00" not in shown, url


def test_an_action_redis_fails_is_a_503_and_in_the_audit_log(caplog):
    with DelayControl(f"delayredis://127.0.0.1:{free_port()}/0") as down:  # nothing listens there
        client = client_of(down, allow_actions=True)
        csrf = token(client)
        caplog.set_level(logging.WARNING, logger="kombu_delay.web.audit")
        sent = [
            ("/task/cancel?id=a", {"confirm": "yes"}),
            ("/task/reschedule?id=b", {"countdown": "5"}),
            ("/dead/remove", {"digest": "c" * 64, "confirm": "yes"}),
        ]
        replies = [client.post(url, data={**form, "csrf": csrf}).status_code for url, form in sent]
    assert replies == [503, 503, 503]
    # Not "failed": where Redis went away, the action may have been done before its reply was
    # lost (the user's retry then finds nothing to do), and nothing tells the two apart (nor
    # a Redis not reached: an action of several calls may have made some before).
    lines = [r.getMessage() for r in caplog.records if "may or may not have been done" in r.getMessage()]
    assert [line.split()[0] for line in lines] == ["cancel", "reschedule", "remove"], caplog.text
    assert "failed" not in caplog.text


@pytest.mark.parametrize("refresh_s", [float("inf"), float("nan"), 1e306, 86_401, -1])
def test_a_refresh_out_of_range_is_refused_when_the_app_is_built(control, refresh_s):
    with pytest.raises(ValueError, match="refresh_s"):
        create_app(control, refresh_s=refresh_s)


def test_the_longest_refresh_fits_a_browser_timer(control):
    page = client_of(control, refresh_s=86_400).get("/").get_data(as_text=True)
    assert 'data-refresh-ms="86400000"' in page


#: The dashboard's script run by node with a stub DOM: it prints the delay its timer was given.
TIMER_STUB = """
const listeners = {};
const box = { getAttribute: () => "/overview/part", setAttribute() {}, querySelectorAll: () => [] };
global.document = { hidden: false, body: { getAttribute: () => process.argv[2] },
  getElementById: () => box, querySelectorAll: () => [], addEventListener: (e, f) => { listeners[e] = f; } };
global.setInterval = (f, every) => console.log(every);
eval(require("fs").readFileSync(process.argv[1], "utf8"));
listeners.DOMContentLoaded();
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
@pytest.mark.parametrize(("served", "timer"), [("5000", "5000"), ("3000000000", "2147483647"), ("0", "")])
def test_the_page_never_gives_its_timer_more_than_it_holds(served, timer):
    # A delay past 2**31 - 1 ms fires at once: the overview refreshed without pause.
    script = ROOT / "kombu_delay" / "web" / "static" / "dashboard.js"
    run = ["node", "-e", TIMER_STUB, str(script), served]
    out = subprocess.run(run, capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == timer


def test_the_mover_and_the_cli_do_not_import_the_web_stack():
    code = (
        "import sys, kombu_delay.cli, kombu_delay.mover.loop, kombu_delay.transport, kombu_delay.control;"
        "from click.testing import CliRunner;"
        "CliRunner().invoke(kombu_delay.cli.main, ['mover', '--help']);"
        "web = ('flask', 'waitress', 'jinja2', 'werkzeug');"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in web or m.startswith('kombu_delay.web.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

    def cli(*args: str) -> str:
        run = [sys.executable, "-m", "kombu_delay", *args]
        return subprocess.run(run, cwd=ROOT, capture_output=True, text=True, check=True).stdout

    assert re.search(r"^\s+web\s", cli("--help"), re.M)
    helped = cli("web", "--help")
    assert "--allow-actions" in helped and "9809" in helped


def test_the_bench_web_scenario_times_every_page(tmp_path):
    out = tmp_path / "bench.json"
    args = [sys.executable, "-m", "kombu_delay", "bench", "--only", "web", "--scale-large", "3000"]
    args += ["--json-out", str(out), "--plot-out", str(tmp_path / "bench.png")]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    web = report["results"]["web"]
    assert report["errors"] == {} and web["scheduled"] == 3000
    assert {"overview_hours", "overview_days", "scheduled_page_50", "task_detail"} <= set(web["pages"])
    assert all(page["runs"] == 100 and page["median_ms"] > 0 for page in web["pages"].values())


def test_celery_delay_web_reads_the_apps_broker_and_prefix(r, redis_server, spawn):
    options = {"global_keyprefix": "eco9:"}
    [task_id] = publish(redis_server, "eco9:", ("eco.record", ("x",), {}, {"countdown": 600}))
    port = free_port()
    env = {"ECO_BROKER": redis_server.delay_url, "ECO_OPTIONS": json.dumps(options)}
    args = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tests.support.ecosystem_app",
        "delay",
        "web",
        "--port",
        str(port),
    ]
    server = spawn(args, env=env, name="web")

    def overview() -> dict | None:
        assert server.popen.poll() is None, server.output()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/overview.json", timeout=5) as reply:
                return dict(json.loads(reply.read()))
        except OSError:
            return None

    data = wait_until(overview, timeout=90)
    assert isinstance(data, dict) and data["scheduled"] == 1
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/task?id={task_id}", timeout=5) as reply:
        html = reply.read().decode()
    assert "key prefix &#39;eco9:&#39;" in html and "read-only" in html


@pytest.mark.parametrize("prefix", ["../x", "/a?b", "/a#b", "/a%2Fb", "/a//b", "/ä", "/a\\b"])
def test_a_url_prefix_no_browser_reaches_is_refused_at_start(prefix: str) -> None:
    # Each started, and printed an address that answered 404 to a browser.
    result = CliRunner().invoke(main, ["-b", "delayredis://127.0.0.1:1/0", "web", "--url-prefix", prefix])
    assert result.exit_code == 2, result.output
    assert "give a path of segments of ASCII letters, digits and -._~!$&'()*+,;=:@" in result.output, (
        result.output
    )


def test_a_url_prefix_of_what_a_path_takes_as_it_is_is_served(control) -> None:
    # Such prefixes (/a:b, /a@b, /a+b, ...) were served, and a browser reached them; the first
    # check of reachable prefixes refused them.
    prefix = url_prefix_path(None, None, "/ops/a:b@c+d,e;f=g!h$i&j'k(l)m*n~o/")  # type: ignore[arg-type]
    assert prefix == "/ops/a:b@c+d,e;f=g!h$i&j'k(l)m*n~o"
    app = create_app(control)
    app.wsgi_app = PathPrefix(app.wsgi_app, prefix)  # type: ignore[method-assign]
    assert app.test_client().get(prefix + "/overview.json").status_code == 200


def test_the_dashboard_reads_a_tls_broker_as_the_cli_does(tmp_path, monkeypatch):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with running_tls_server(tmp_path) as server:
        app = Celery("tls", broker=f"delayrediss://127.0.0.1:{server.port}/0", set_as_current=False)
        app.conf.broker_use_ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": server.ca}
        app.conf.broker_transport_options = {"global_keyprefix": "tls:"}
        task_id = app.send_task("tasks.a", ("over tls",), countdown=600).id
        app.close()
        tgt = app_target(app)  # what `celery -A app delay web` serves from
        with DelayControl(tgt.url, tgt.transport_options, ssl=tgt.ssl) as ctl:
            client = client_of(ctl, where=tgt.describe())
            assert client.get("/overview.json").get_json()["scheduled"] == 1
            page = client.get(f"/task?id={task_id}").get_data(as_text=True)
            assert "over tls" in page and "delayrediss://127.0.0.1" in page


def test_overview_puts_an_evicting_policy_and_stranded_prefixes_first(r, control):
    # As a mover records it: another key prefix holds messages no mover serves.
    other = Store(r, "other:")
    for i in range(5):
        other.schedule(
            Due(600_000, relative=True, task_id=f"o{i}"), "other:q", kombu_payload(f"o{i}"), Settings()
        )
    control.store.renew_stranded(["other:"], 30_000, 60_000, stranded_problem)
    r.config_set("maxmemory-policy", "allkeys-lru")
    try:
        html = client_of(control).get("/").get_data(as_text=True)
    finally:
        r.config_set("maxmemory-policy", "noeviction")
    section = html.split('<section class="warnings" role="alert">', 1)[1].split("</section>", 1)[0]
    warnings = re.findall(r'<p class="warning">(.*?)</p>', section, re.S)
    assert len(warnings) == 3
    assert warnings[0].startswith("No mover is running")
    assert "maxmemory-policy is allkeys-lru" in warnings[1]
    assert "&#39;other:&#39; (5)" in warnings[2]
    assert html.index('class="warnings"') < html.index('class="cards"')


def test_past_its_row_limit_the_queue_table_shows_the_busiest_and_sums_the_rest(
    r, redis_server, control, prefix, monkeypatch
):
    # With thousands of queues, every refresh sent every browser a row per queue.
    monkeypatch.setattr(overview, "QUEUE_ROWS", 2)
    calls = [
        ("tasks.a", (i,), {}, {"countdown": 600, "queue": f"q{n}"}) for n in range(4) for i in range(n + 1)
    ]
    publish(redis_server, prefix, *calls)
    html = client_of(control).get("/").get_data(as_text=True)
    table = html.split('id="queues"')[1].split("</table>")[0]
    assert re.findall(r">(q\d)</a>", table) == ["q3", "q2"]
    assert "(the 2 busiest of 4)" in html
    more = r'2 more queues \(<a href="[^"]*overview.json">all in JSON</a>\)</td><td class="num">3</td>'
    assert re.search(more + r'\s*<td class="num">0</td>', table)
    data = client_of(control).get("/overview.json").get_json()
    assert sorted(q["name"] for q in data["queues"]) == ["q0", "q1", "q2", "q3"]


def test_the_queue_table_counts_the_overdue_messages_of_the_queues_it_leaves_out(
    r, control, prefix, monkeypatch
):
    # Its "N more queues" row summed what they held and left their overdue blank: 30 of 294
    # overdue were in no row.
    monkeypatch.setattr(overview, "QUEUE_ROWS", 1)
    store = control.store
    store.clock = behind(r)  # due soon by it: overdue by Redis's clock
    start = store.clock()
    sizes = {"a": 3, "b": 2, "c": 1}
    items = [
        (Due(start + 1_000, task_id=f"{q}{i}"), f"{prefix}{q}", kombu_payload(f"{q}{i}", q))
        for q, n in sizes.items()
        for i in range(n)
    ]
    store.schedule_many(items, Settings())
    store.clock = None
    table = client_of(control).get("/").get_data(as_text=True).split('id="queues"')[1].split("</table>")[0]
    assert re.findall(r">([abc])</a>", table) == ["a"]
    more = r'2 more queues .*?</td><td class="num">3</td>\s*<td class="num bad">3</td>'
    assert re.search(more, table), table


#: The content type of a browser's form.
FORM = "application/x-www-form-urlencoded"


def listed_ids(client, url: str) -> list[str]:
    """The task ids of a listing page's rows, as the page writes them."""
    return re.findall(r'data-task-id="([^"]+)"', client.get(url).get_data(as_text=True))


def test_a_task_id_with_a_lone_surrogate_is_shown_escaped_and_linked_exactly(redis_server, control, prefix):
    # kombu-delay indexes such an id (message.id_arg): its pages, links and forms must carry it.
    odd = "\udcff-odd"
    publish(
        redis_server,
        prefix,
        ("tasks.a", (1,), {}, {"countdown": 600, "task_id": "ok-1"}),
        ("tasks.\ud800", (2,), {}, {"countdown": 601, "task_id": odd}),
        ("tasks.a", (3,), {}, {"countdown": 602, "task_id": "\udcfe-body"}),
    )
    client = client_of(control, allow_actions=True)
    csrf = token(client)
    for url in ("/scheduled", "/scheduled?queue=celery", "/scheduled?limit=1"):
        listing = client.get(url)
        assert listing.status_code == 200, url
    html = client.get("/scheduled").get_data(as_text=True)
    assert re.findall(r'data-task-id="([^"]+)"', html) == ["ok-1", "\\udcff-odd", "\\udcfe-body"]
    assert "<td>tasks.\\ud800</td>" in html
    link = re.search(r'href="([^"]*)">\\udcff-odd</a>', html)
    assert link is not None and link.group(1) == "/task?id=%ED%B3%BF-odd"
    # The search box's redirect, and the task page the link leads to.
    found = client.get("/scheduled?id=%ED%B3%BF-odd")
    assert found.headers["Location"].endswith(link.group(1))
    page = client.get(link.group(1)).get_data(as_text=True)
    assert "<h1>Task <code>\\udcff-odd</code></h1>" in page and 'id="not-scheduled"' not in page
    # Near misses name other ids: the escape as text, and the replacement character.
    for other in ("%5Cudcff-odd", "%EF%BF%BD-odd", "%ED%B3%BF-odd%20"):
        assert client.get(f"/task?id={other}").status_code == 404, other
    # Its forms reschedule and cancel it, and say so with a link that leads back to it.
    actions = re.findall(r'<form method="post" action="([^"]+)"', page)
    assert actions == ["/task/cancel?id=%ED%B3%BF-odd", *2 * ["/task/reschedule?id=%ED%B3%BF-odd"]]
    moved = client.post(actions[1], data={"countdown": "3600", "csrf": csrf})
    assert moved.status_code == 303 and moved.headers["Location"].endswith("/task?id=%ED%B3%BF-odd&done=1")
    assert "Done: rescheduled 1 message(s)." in client.get(moved.headers["Location"]).get_data(as_text=True)
    asked = client.post(actions[0], data={"csrf": csrf}).get_data(as_text=True)
    assert "Cancel task <code>\\udcff-odd</code>? Its 1 scheduled" in asked
    [confirm] = re.findall(r'<form method="post" action="([^"]+)"', asked)
    assert 'href="/task?id=%ED%B3%BF-odd">No, keep it' in asked
    done = client.post(confirm, data={"csrf": csrf, "confirm": "yes"}).get_data(as_text=True)
    assert "Cancelled 1 message(s) of <code>\\udcff-odd</code>." in done
    assert control.find(odd) == [] and len(control.find("ok-1")) == 1
    # A script may send the id in the form's body, read the same way.
    form = f"id=%ED%B3%BE-body&confirm=yes&csrf={csrf}"
    body = client.post("/task/cancel", data=form, content_type=FORM).get_data(as_text=True)
    assert "Cancelled 1 message(s) of <code>\\udcfe-body</code>." in body
    assert control.find("\udcfe-body") == [] and len(control.find("ok-1")) == 1
    # A queue filter or task name with one: shown escaped, and carried by the pager's links.
    cursor = "0:1:1:1.0:0:0000000000000000:celery"
    page = client.get(f"/scheduled?queue=%ED%B3%BF&task=%ED%A0%80&cursor={cursor}")
    text = page.get_data(as_text=True)
    assert page.status_code == 200 and 'name="queue" value="\\udcff"' in text
    assert 'href="/scheduled?queue=%ED%B3%BF&amp;task=%ED%A0%80&amp;limit=50">First page' in text


def test_filters_and_the_id_search_take_their_values_as_given(redis_server, control, prefix):
    # A queue named " celery" (kombu allows it) is not the queue "celery"; nor is an id.
    spaced, _, named = publish(
        redis_server,
        prefix,
        ("tasks.a", (1,), {}, {"countdown": 600, "queue": " celery", "task_id": " spaced "}),
        ("tasks.a", (2,), {}, {"countdown": 601, "queue": "celery"}),
        ("tasks.b", (3,), {}, {"countdown": 602, "queue": "celery"}),
    )
    client = client_of(control)
    overview = client.get("/").get_data(as_text=True)
    link = re.search(r'href="([^"]*)">\\x20celery</a>', overview)  # (a space at its start shown)
    assert link is not None and link.group(1) == "/scheduled?queue=+celery"
    assert spaced == " spaced " and listed_ids(client, link.group(1)) == ["\\x20spaced\\x20"]  # (shown)
    found = client.get("/scheduled?id=+spaced+")
    assert found.headers["Location"].endswith("/task?id=+spaced+")
    assert client.get(found.headers["Location"]).status_code == 200
    assert client.get("/task?id=spaced").status_code == 404
    # A part of the task name, spaces included: "s.b " is in no name.
    assert listed_ids(client, "/scheduled?task=s.b") == [named]
    assert listed_ids(client, "/scheduled?task=s.b+") == []
    # Empty, a filter is no filter.
    assert len(listed_ids(client, "/scheduled?queue=&task=&id=")) == 3


def test_a_damaged_compressed_message_shows_on_its_task_page_and_its_cancel_counts_it(
    r, redis_server, control, prefix
):
    """find, ls and cancel see a compressed message whose bytes were damaged in Redis: its
    task page said nothing was scheduled, and the cancel it then offered no button for
    confirmed 0 messages (and removed it)."""
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = {"global_keyprefix": prefix}  # compressed: 600 s ahead
    try:
        damaged = app.send_task("tasks.a", (1,), countdown=600).id
    finally:
        app.close()
    [key] = r.keys(keys.ns(prefix) + "cz:*")
    [(member, score)] = r.zrange(key, 0, -1, withscores=True)
    r.zrem(key, member)
    r.zadd(key, {member[:-12] + bytes(b ^ 0xFF for b in member[-12:]): score})
    client = client_of(control, allow_actions=True)
    page = client.get(f"/task?id={damaged}")
    html = page.get_data(as_text=True)
    assert page.status_code == 200 and "Damaged in Redis" in html and 'id="cancel"' in html
    form = {"csrf": token(client)}
    confirm = client.post(f"/task/cancel?id={damaged}", data=form).get_data(as_text=True)
    assert re.search(r"\b1 scheduled message", confirm), confirm
    assert client.post(f"/task/cancel?id={damaged}", data={**form, "confirm": "yes"}).status_code == 200
    assert control.find(damaged, unreadable=True) == []


def test_a_dead_letter_far_from_where_a_page_showed_it_is_still_shown(r, control, prefix):
    dead = keys.dead(prefix)
    r.lpush(dead, b"\x01\x05first")
    client = client_of(control)
    [digest] = re.findall(r"digest=([0-9a-f]{64})", client.get("/dead").get_data(as_text=True))
    r.lpush(dead, *[f"\x01\x05newer-{i}".encode() for i in range(150)])  # it is now at 150
    shown = client.get(f"/dead/letter?digest={digest}&near=0")
    assert shown.status_code == 200 and "first" in shown.get_data(as_text=True)
    assert client.get(f"/dead/letter?digest={'0' * 64}&near=0").status_code == 404


def test_another_method_is_refused_in_plain_text_with_what_is_allowed(control):
    client = client_of(control)
    for path in ("/overview.json", "/", "/task/cancel"):
        refused = client.open(path, method="PUT" if path == "/task/cancel" else "POST")
        assert refused.status_code == 405 and refused.mimetype == "text/plain", path
        assert refused.headers["Allow"], path


def test_an_action_too_large_to_read_is_in_the_audit_log(control, caplog):
    client = client_of(control, allow_actions=True)
    with caplog.at_level("WARNING", logger="kombu_delay.web.audit"):
        refused = client.post("/task/cancel?id=big", data={"pad": "x" * 200_000})
    assert refused.status_code == 413
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kombu_delay.web.audit"]
    assert lines == ["refused POST '/task/cancel?id=big' by -@127.0.0.1: request too large"]


def test_actions_for_any_host_need_a_password(redis_server):
    args = ["-b", redis_server.delay_url, "web", "--allowed-host", "*", "--allow-actions", "--port", "1"]
    done = CliRunner().invoke(main, args, env={"KOMBU_DELAY_WEB_AUTH": None})
    assert done.exit_code == 2 and "needs --auth" in done.output, done.output


def test_the_served_dashboards_audit_log_names_the_forwarded_address(redis_server, control, prefix, spawn):
    """waitress drops X-Forwarded-For unless told to keep it: the audit line of every action
    behind a proxy named only the proxy."""
    [task_id] = publish(redis_server, prefix, ("tasks.a", (1,), {}, {"countdown": 600}))
    port = free_port()
    args = [sys.executable, "-m", "kombu_delay", "-b", redis_server.delay_url, "--prefix", prefix]
    server = spawn([*args, "web", "--port", str(port), "--allow-actions"], name="web")
    base = f"http://127.0.0.1:{port}"

    def cookie() -> str | None:
        assert server.popen.poll() is None, server.output()
        try:
            with urllib.request.urlopen(f"{base}/", timeout=5) as reply:
                found = re.search(rf"{CSRF_COOKIE}=([^;]+)", reply.headers.get("Set-Cookie", ""))
                return found.group(1) if found else None
        except OSError:
            return None

    csrf = wait_until(cookie, timeout=90)
    form = f"csrf={csrf}&confirm=yes".encode()
    # Sent as UTF-8 (http.client sends a header's text as Latin-1): read back as UTF-8, escaped.
    forwarded = "10.0.3.7, b\u00e9 \u202e".encode().decode("latin-1")
    headers = {"Cookie": f"{CSRF_COOKIE}={csrf}", "X-Forwarded-For": forwarded, "Origin": base}
    request = urllib.request.Request(f"{base}/task/cancel?id={task_id}", form, headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200
    wait_until(lambda: "cancel" in server.output() and "forwarded for" in server.output(), timeout=60)
    said = f"cancel {task_id!r} by -@127.0.0.1 (forwarded for '10.0.3.7, b\u00e9 \\u202e'): 1 message(s)"
    assert said in server.output(), server.output()


def test_a_dead_letters_page_looks_for_it_only_near_where_it_was_shown(r, control, prefix):
    """A GET reads no list whole: the page looks 10,000 entries either side of ``near``."""
    dead = keys.dead(prefix)
    r.lpush(dead, b"\x01\x05far")
    client = client_of(control)
    [digest] = re.findall(r"digest=([0-9a-f]{64})", client.get("/dead").get_data(as_text=True))
    for first in range(0, 12_000, 2_000):
        r.lpush(dead, *[f"\x01\x05newer-{i}".encode() for i in range(first, first + 2_000)])
    assert client.get(f"/dead/letter?digest={digest}&near=0").status_code == 404  # at 12,000
    assert client.get(f"/dead/letter?digest={digest}&near=11900").status_code == 200

    def reads(near: int) -> int:
        """The list reads of a page that looks for a letter not there."""
        r.config_resetstat()
        assert client.get(f"/dead/letter?digest={'0' * 64}&near={near}").status_code == 404
        return int(r.info("commandstats").get("cmdstat_lrange", {}).get("calls", 0))

    assert reads(0) <= 2 + 10_000 // 100 and reads(6_000) <= 2 + 16_000 // 100
    assert reads(10**12) <= 2  # past the list: nothing but where it was said to be


def test_what_a_request_sends_is_cut_in_the_audit_log(control, caplog):
    client = client_of(control, allow_actions=True, credentials=Credentials.parse("ops:pw"))
    xff = {"HTTP_X_FORWARDED_FOR": "1.2.3.4, " * 20_000}
    with caplog.at_level("WARNING", logger="kombu_delay.web.audit"):
        refused = client.post("/task/cancel?id=x", data={"csrf": "x"}, environ_overrides=xff)
    assert refused.status_code == 401
    [line] = [rec.getMessage() for rec in caplog.records if rec.name == "kombu_delay.web.audit"]
    assert len(line) < 500 and "(180,002 characters)" in line, line[:600]
