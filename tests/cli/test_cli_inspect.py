"""``kombu-delay stats|ls|cancel|reschedule|purge`` and ``celery -A app delay ...`` on a real Redis."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from celery import Celery
from click.testing import CliRunner
from kombu import Connection

from kombu_delay import ConfigError, DelayControl
from kombu_delay.cli import inspect as inspect_module
from kombu_delay.cli import main
from kombu_delay.cli.common import shown
from kombu_delay.cli.inspect import (
    COMMANDS,
    NAME_CHARS,
    NAME_COLUMN,
    cells,
    clipped,
    render_stats,
    span,
)
from kombu_delay.control import Slot, Stats
from kombu_delay.store import Store, keys
from kombu_delay.store.listing import Cursor
from kombu_delay.tooling.redis_server import free_port
from tests.support.cli import kd, options, publish
from tests.support.procs import ROOT
from tests.support.workers import INSPECT_APP

HOUR_MS = 3_600_000


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_every_command_documents_examples(command):
    result = CliRunner().invoke(main, [command.name, "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output
    assert f"kombu-delay {command.name}" in result.output


def test_stats_shows_queues_and_histogram_bars(r, redis_server, prefix):
    publish(redis_server, prefix, 4)
    publish(redis_server, prefix, 2, queue="emails", countdown=4000)
    code, out = kd(redis_server, prefix, "stats", "--hours", "2", "--slot", "30")
    assert code == 0, out
    assert "scheduled  6" in out
    assert "celery  4" in out and "emails  2" in out
    rows = [line for line in out.splitlines() if "\u2588" in line]
    assert [line.rsplit(" ", 1)[1] for line in rows] == ["4", "2"]
    code, out = kd(redis_server, prefix, "stats", "--json")
    data = json.loads(out)
    assert data["by_queue"] == {"celery": 4, "emails": 2}
    assert data["scheduled"] == 6 and data["overdue"] == 0


def test_stats_dates_its_rows_when_they_span_days(r, redis_server, prefix):
    # Rows labelled with the time of day only looked alike a day apart.
    publish(redis_server, prefix, 1, countdown=3600)
    publish(redis_server, prefix, 2, countdown=30 * 3600)
    code, out = kd(redis_server, prefix, "stats", "--hours", "72", "--slot", "1440")
    assert code == 0, out
    rows = out.split("row = start of slot)\n")[1].splitlines()[:4]
    labels = [" ".join(row.split()[:2]) for row in rows[:3]]
    days = [datetime.strptime(label, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC) for label in labels]
    assert days[1] - days[0] == days[2] - days[1] == timedelta(days=1)
    assert [row.split()[-1] for row in rows] == ["1", "2", "0", "0"] and rows[3].split()[0] == "later"
    code, out = kd(redis_server, prefix, "stats", "--hours", "2", "--slot", "60")
    assert re.search(r"^  \d\d:\d\d:\d\d  .* 1$", out, re.M), out


def cut_short(truncated: bool) -> Stats:
    """A snapshot whose census examined only some buckets (``truncated``), or all of them."""
    now = 1_796_300_000_000
    slots = [Slot(now + i * HOUR_MS, now + (i + 1) * HOUR_MS, n) for i, n in enumerate([3, 0, 2])]
    return Stats(now, 20, {"celery": 20}, {"celery": 20}, now + 60_000, 0, 0, slots, 15, truncated, {})


def test_stats_says_when_its_counts_are_cut_short():
    # A cut census printed the messages of buckets it never examined as due "later", and only
    # the overdue count said it was short.
    text = render_stats(cut_short(True))
    assert "overdue    0+" in text
    assert "NOTE       counts cut short" in text and "lower bounds" in text
    rows = text.split("row = start of slot)\n")[1].splitlines()
    assert [row.split()[-1] for row in rows] == ["3+", "0+", "2+", "15"]
    assert rows[-1].split()[:2] == ["not", "counted"] and not any("later" in row.split() for row in rows)
    whole = render_stats(cut_short(False))
    assert "NOTE" not in whole and "+" not in whole and "not counted" not in whole
    assert whole.rstrip().splitlines()[-1].split() == ["later", "\u2588" * 40, "15"]


def test_ls_pages_with_the_printed_cursor(r, redis_server, prefix):
    ids = publish(redis_server, prefix, 5)
    code, out = kd(redis_server, prefix, "ls", "--limit", "2")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split() == ["TASK", "ID", "TASK", "QUEUE", "ETA", "(UTC)", "LEFT", "SIZE"]
    assert [line.split()[0] for line in lines[1:3]] == ids[:2]
    assert lines[1].split()[1:3] == ["inspect.record", "celery"]
    assert lines[-1].startswith("next page: --cursor ")
    seen = [line.split()[0] for line in lines[1:3]]
    cursor = lines[-1].split()[-1]
    # The last message listed, by due time, space, score, bucket, destination and a digest of it.
    printed = Cursor.parse(cursor)
    assert printed.at.dest == f"{prefix}celery" and len(printed.at.last) == 16 and str(printed) == cursor
    while True:
        code, out = kd(redis_server, prefix, "ls", "--limit", "2", "--cursor", cursor, "--json")
        page = json.loads(out)
        seen += [item["task_id"] for item in page["items"]]
        if page["cursor"] is None:
            break
        cursor = page["cursor"]
    assert seen == ids
    item = page["items"][-1] if page["items"] else None
    if item is not None:
        assert 0 < item["left_ms"] <= 605_000 and item["queue"] == "celery"
    code, out = kd(redis_server, prefix, "ls", "--cursor", "nonsense")
    assert code == 2
    # A cursor of another form (0.3's "start:score:digest:dest") is refused.
    old_form = f"{printed.at.start_ms}:{printed.at.score}:{printed.at.last}:{printed.at.dest}"
    code, out = kd(redis_server, prefix, "ls", "--cursor", old_form)
    assert code == 2 and "is not a cursor printed by ls" in out


@pytest.mark.parametrize("form", ["text", "json"])
def test_ls_pages_with_cursors_a_terminal_and_a_shell_give_back_whole(r, redis_server, prefix, form):
    # kombu names a priority step's list "<queue>\x06\x16<step>", which the cursor carried raw:
    # a terminal drops such characters. The destination is percent-encoded in the cursor now, so
    # the text's cursor, quoted for a shell, and the JSON's both page through every message once.
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = options(prefix)
    odd = "a\\tb 'c\u00e9%41"  # a literal backslash-t, a space, a quote, an accent, a percent
    ids = [
        app.send_task("inspect.record", (i,), countdown=600 + i, **extra).id
        for i, extra in enumerate([{"priority": 5}, {"queue": odd}, {"priority": 5}, {"queue": odd}])
    ]
    app.close()
    seen, more = [], ["--limit", "1"]
    for _ in range(len(ids) + 1):
        if form == "json":
            code, out = kd(redis_server, prefix, "ls", *more, "--json")
            page = json.loads(out)
            seen += [item["task_id"] for item in page["items"]]
            if page["cursor"] is None:
                break
            more = ["--limit", "1", "--cursor", page["cursor"]]
            continue
        code, out = kd(redis_server, prefix, "ls", *more)
        assert code == 0 and "\x06" not in out, out
        lines = out.splitlines()
        seen += [line.split()[0] for line in lines[1:-1]]
        if lines[-1] == "end of listing":
            break
        assert "%06%16" in lines[-1] or "%5Ct" in lines[-1], lines[-1]
        more = ["--limit", "1", *shlex.split(lines[-1].removeprefix("next page: "))]
    assert seen == ids


def test_cancel_exit_codes(r, redis_server, prefix):
    ids = publish(redis_server, prefix, 3)
    code, out = kd(redis_server, prefix, "cancel", ids[0], ids[1])
    assert code == 0, out
    assert f"{ids[0]}: cancelled 1 message" in out
    code, out = kd(redis_server, prefix, "cancel", ids[0], ids[2])
    assert code == 1
    assert f"{ids[0]}: not scheduled" in out and f"{ids[2]}: cancelled 1 message" in out
    code, _ = kd(redis_server, prefix, "cancel")
    assert code == 2
    for command in ("cancel", "find"):  # an empty id is named, not left out
        code, out = kd(redis_server, prefix, command, "")
        assert code == 1 and out.splitlines()[-1] == "'': not scheduled", out


def test_reschedule_by_eta_or_countdown(r, redis_server, prefix):
    (task_id,) = publish(redis_server, prefix, 1)
    code, out = kd(redis_server, prefix, "reschedule", task_id, "--eta", "2031-02-03T04:05:06Z")
    assert code == 0, out
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        assert ctl.find(task_id)[0].eta == datetime(2031, 2, 3, 4, 5, 6, tzinfo=UTC)
        code, out = kd(redis_server, prefix, "reschedule", task_id, "--countdown", "120")
        assert code == 0, out
        left = ctl.find(task_id)[0].due_ms - ctl.store.time_ms()
        assert 100_000 < left <= 120_000
    assert kd(redis_server, prefix, "reschedule", task_id, "--eta", "2031-02-03T04:05:06")[0] == 2
    assert kd(redis_server, prefix, "reschedule", task_id)[0] == 2
    assert kd(redis_server, prefix, "reschedule", task_id, "--countdown", "1", "--eta", "2031-01-01Z")[0] == 2
    assert kd(redis_server, prefix, "reschedule", "no-such-id", "--countdown", "5")[0] == 1


def test_purge_needs_yes(r, redis_server, prefix):
    publish(redis_server, prefix, 3, queue="emails")
    publish(redis_server, prefix, 1)
    code, out = kd(redis_server, prefix, "purge", "--queue", "emails")
    assert code == 2 and "--yes" in out
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        assert ctl.stats().by_queue == {"celery": 1, "emails": 3}
        code, out = kd(redis_server, prefix, "purge", "--queue", "emails", "--yes")
        assert code == 0 and "purged 3 scheduled messages" in out
        assert ctl.stats().by_queue == {"celery": 1}
    assert kd(redis_server, prefix, "purge", "--queue", "emails", "--yes")[0] == 1


def test_purge_and_ls_name_priority_lists_under_another_separator(r, redis_server, prefix):
    # An app with its own `sep`, read without it: its priority lists were left behind unseen.
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = {**options(prefix), "sep": ":", "priority_steps": list(range(10))}
    for priority in (0, 4, 9):
        app.send_task("inspect.record", (priority,), countdown=600, priority=priority)
    app.close()
    code, out = kd(redis_server, prefix, "ls", "--queue", "celery")
    assert code == 0, out
    assert "celery:4 (1), celery:9 (1) look like priority lists of 'celery'" in out
    assert "were not listed" in out and "-o sep=..." in out
    code, out = kd(redis_server, prefix, "purge", "--queue", "celery", "--yes")
    assert code == 0 and "purged 1 scheduled message\n" in out and "were not purged" in out
    steps = "priority_steps=0,1,2,3,4,5,6,7,8,9"
    code, out = kd(redis_server, prefix, "-o", "sep=:", "-o", steps, "purge", "--queue", "celery", "--yes")
    assert code == 0 and "purged 2 scheduled messages" in out and "look like" not in out
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        assert ctl.stats().by_queue == {}
        assert ctl.look_alikes("celery") == {}


def test_purge_takes_a_queues_priority_lists_not_a_queue_named_like_one(r, redis_server, prefix):
    # With sep ':', 'tenant:9' is tenant's priority 9 list, but 'tenant:7' (7 is no step) is a
    # queue of its own, as kombu reads them: purging tenant must leave it whole.
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = {**options(prefix), "sep": ":"}
    app.send_task("inspect.record", (0,), countdown=600, queue="tenant")
    app.send_task("inspect.record", (9,), countdown=600, queue="tenant", priority=9)
    for n in range(3):
        app.send_task("inspect.record", (n,), countdown=600, queue="tenant:7")
    app.close()
    with DelayControl(redis_server.url, {**options(prefix), "sep": ":"}) as ctl:
        assert ctl.stats().by_queue == {"tenant": 2, "tenant:7": 3}
        assert {m.queue for m in ctl.scheduled(queue="tenant").items} == {"tenant"}
    code, out = kd(redis_server, prefix, "-o", "sep=:", "purge", "--queue", "tenant", "--yes")
    assert code == 0 and "purged 2 scheduled messages" in out, out
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        assert ctl.stats().by_destination == {f"{prefix}tenant:7": 3}
    assert kd(redis_server, prefix, "-o", "priority_steps=3,0", "stats")[0] == 2
    assert kd(redis_server, prefix, "-o", "priority_steps=-1,0", "stats")[0] == 2
    assert kd(redis_server, prefix, "-o", "priority_steps=3,6,9", "stats")[0] == 0  # a publisher takes it


def test_an_apps_own_priority_steps_under_kombus_separator_need_not_be_told(r, redis_server, prefix):
    # Celery's docs set priority_steps 0..9 for Redis; under kombu's own separator, which no
    # queue name holds, a tool not told them still takes every step list for the queue's.
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = {**options(prefix), "priority_steps": list(range(10))}
    for priority in range(10):
        app.send_task("inspect.record", (priority,), countdown=600, priority=priority)
    for n in range(3):
        app.send_task("inspect.record", (n,), countdown=600 + n * 60, queue="other")
    app.close()
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        assert ctl.stats().by_queue == {"celery": 10, "other": 3} and ctl.look_alikes("celery") == {}
        assert len(ctl.scheduled(queue="celery").items) == 10
    code, out = kd(redis_server, prefix, "purge", "--queue", "celery", "--yes")
    assert code == 0 and out == "celery: purged 10 scheduled messages\n", out
    with DelayControl(redis_server.url, options(prefix)) as ctl:
        assert ctl.store.purge([f"{prefix}other"], limit=1) == 3  # a limit of 1 looped for good


def test_edits_show_a_task_id_or_queue_with_control_characters_escaped(r, redis_server, prefix):
    # ``ls --json | jq | xargs cancel`` feeds ids from the data: one must not forge a line.
    forged, queue = "a\nFAKE: cancelled 99 messages", "q\x1b[2J"
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = options(prefix)
    for task_id in (forged, "b"):
        app.send_task("inspect.record", (), countdown=600, task_id=task_id, queue=queue)
    app.close()
    for args in (["reschedule", forged, "--countdown", "900"], ["cancel", forged], ["cancel", forged]):
        code, out = kd(redis_server, prefix, *args)
        assert out.count("\n") == 1 and out.startswith("a\\nFAKE: cancelled 99 messages: "), out
    code, out = kd(redis_server, prefix, "purge", "--queue", queue, "--yes")
    assert code == 0 and out == "q\\x1b[2J: purged 1 scheduled message\n", out


def test_redis_unavailable_exits_3():
    result = CliRunner().invoke(
        main, ["--broker", f"redis://127.0.0.1:{free_port()}/0", "--log-level", "error", "stats"]
    )
    assert result.exit_code == 3
    assert "Redis is unavailable" in result.output


@pytest.mark.process
def test_the_same_commands_under_celery_delay(r, redis_server, prefix):
    ids = publish(redis_server, prefix, 2)
    env = {
        **os.environ,
        "INSPECT_BROKER": redis_server.delay_url,
        "INSPECT_OPTIONS": json.dumps(options(prefix)),
    }

    def celery(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "celery", "-A", INSPECT_APP, "delay", *args]
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    listed = celery("ls", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [item["task_id"] for item in json.loads(listed.stdout)["items"]] == ids
    assert celery("cancel", ids[0]).returncode == 0
    assert celery("cancel", ids[0]).returncode == 1
    stats = celery("stats", "--json")
    assert json.loads(stats.stdout)["scheduled"] == 1


def test_span_reads_well():
    assert [span(ms) for ms in (950, 12_300, 245_000, 11_520_000, 190_800_000, -4_000)] == [
        "950ms",
        "12.3s",
        "4m05s",
        "3h12m",
        "2d05h",
        "-4.0s",
    ]


def test_stats_refuses_a_histogram_too_fine_to_draw(r, redis_server):
    code, out = kd(redis_server, "", "stats", "--hours", "1000", "--slot", "1")
    assert code == 2 and "at most 1000" in out


#: Broker URLs kombu reads as another transport than Redis (an empty one is AMQP's default).
NOT_REDIS = {"memory": "memory://", "filesystem": "filesystem://", "empty": ""}
#: The dashboard on an address nobody can serve on: a URL let through fails there, it never serves.
WEB = ["web", "--host", "256.0.0.1"]


@pytest.mark.parametrize("url", NOT_REDIS.values(), ids=NOT_REDIS.keys())
@pytest.mark.parametrize(
    ("command", "code"),
    [(["cancel", "some-id"], 3), (["ls"], 3), (["stats"], 3), (["health"], 2), (WEB, 3)],
    ids=["cancel", "ls", "stats", "health", "web"],
)
def test_a_broker_url_of_another_transport_is_refused_in_one_line(url, command, code):
    result = CliRunner().invoke(main, ["--broker", url, "--log-level", "error", *command])
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output, result.output
    said = "the broker URL is empty" if not url else f"broker URL {url}: '{url[:-3]}' is not a Redis scheme"
    assert said in result.output and "needs a delayredis://" in result.output, result.output


def test_a_kombu_connection_of_another_transport_is_refused():
    with Connection("memory://") as conn, pytest.raises(ConfigError, match="transport 'memory'"):
        DelayControl(conn).stats()


@pytest.mark.parametrize(
    "cursor",
    [
        "0:1:1:inf:0:0000000000000000:celery",
        "0:1:1:-inf:0:0000000000000000:celery",
        "0:1:1:1e400:0:0000000000000000:celery",
        "0:1:1:nan:0:0000000000000000:celery",
        f"0:{2**53}:1:{2**53}.0:0:0000000000000000:celery",
        # A priority list's name raw, or escaped, as ls printed it before it was percent-encoded
        # (read as a literal name, it sorted elsewhere: a page could skip messages).
        "0:1:1:1.0:0:0000000000000000:celery\x06\x169",
        "0:1:1:1.0:0:0000000000000000:celery\\x06\\x169",
        "0:1:1:1.0:0:0000000000000000:caf\u00e9",
    ],
    ids=["inf", "minus-inf", "overflow", "nan", "past-the-ceiling", "raw", "escaped", "not-encoded"],
)
def test_ls_refuses_a_cursor_out_of_range_as_a_usage_error(r, redis_server, cursor):
    code, out = kd(redis_server, "", "ls", "--cursor", cursor)
    assert code == 2 and "is not a cursor printed by ls" in out, out
    with DelayControl(redis_server.url) as ctl, pytest.raises(ValueError):
        ctl.scheduled(cursor=cursor)


@pytest.mark.parametrize("flag", ["--max-heartbeat-age", "--max-overdue"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e300", "-1"])
def test_health_refuses_a_threshold_out_of_range_as_a_usage_error(redis_server, flag, value):
    # Exit 1 would say "unhealthy": a usage error must not read as a verdict on the movers.
    code, out = kd(redis_server, "", "health", f"{flag}={value}")
    assert code == 2 and f"Invalid value for '{flag}'" in out and "Traceback" not in out, out


@pytest.mark.parametrize("flag", ["--max-heartbeat-age", "--max-overdue"])
@pytest.mark.parametrize("value", ["0.0004", "0.0009", "1e-9"])
def test_health_refuses_a_threshold_under_a_millisecond(redis_server, flag, value):
    # It was rounded to 0 ms, which turns the check off: a probe of nothing said OK.
    code, out = kd(redis_server, "", "health", f"{flag}={value}")
    assert code == 2 and f"Invalid value for '{flag}'" in out and "under 0.001 s" in out, out


def test_health_takes_a_zero_threshold_as_off(r, redis_server):
    code, out = kd(redis_server, "", "health", "--max-heartbeat-age", "0", "--max-overdue", "0")
    assert code == 0, out
    # "OK: movers 0" said why: a longer age than the 30 s movers are counted by, or none asked.
    assert "movers 0, freshest heartbeat none (heartbeats not checked)" in out, out
    Store(r).heartbeat("quiet")
    r.zadd(keys.movers(""), {"quiet": Store(r).time_ms() - 40_000})
    code, out = kd(redis_server, "", "health", "--max-heartbeat-age", "120")
    assert code == 0 and "(1 more silent for over 30 s)" in out and "(--max-heartbeat-age 120 s)" in out, out


def test_the_cursor_examples_in_help_and_docs_are_cursors_ls_prints():
    helped = CliRunner().invoke(main, ["ls", "--help"]).output
    docs = (ROOT / "docs" / "cli.md").read_text()
    examples = re.findall(r"(?:-c|--cursor) (\d\S*)", helped + docs)
    assert len(examples) >= 2, examples
    for example in examples:
        assert str(Cursor.parse(example)) == example


@pytest.mark.parametrize("command", [("stats",), ("ls",), ("find", "t1"), ("cancel", "t1")])
def test_a_shared_key_of_another_type_is_named_once(r, redis_server, prefix, command):
    """The format check, which reads the totals first, named the key, and the command's own
    handler named it again: the same sentence twice."""
    r.set(f"{prefix}kombu_delay:totals", "by hand")
    try:
        code, out = kd(redis_server, prefix, *command)
    finally:
        r.delete(f"{prefix}kombu_delay:totals")
    assert code == 3, out
    assert out.count("holds a string, not a hash") == 1, out


@pytest.mark.parametrize(("kind", "wanted"), [("cm", "hash"), ("cz", "zset")])  # (600 s ahead: cold)
def test_a_bucket_key_of_another_type_is_named_by_ls(r, redis_server, prefix, kind, wanted):
    # Redis's WRONGTYPE names no key: a bucket's meta hash or set written by hand as a string
    # stopped every page that reached it with nothing to say which key to put right.
    publish(redis_server, prefix, 1)
    (key,) = r.keys(f"{prefix}kombu_delay:{kind}:*")
    r.delete(key)
    r.set(key, "by hand")
    code, out = kd(redis_server, prefix, "ls")
    assert code == 3, out
    assert f"{key.decode()!r} holds a string, not a {wanted}" in out and "RENAME" in out, out
    assert out.count("holds a string") == 1, out


def test_stats_and_ls_align_their_columns_for_wide_characters(r, redis_server, prefix):
    """A queue named in CJK takes two terminal columns a character: padded by characters, every
    column after it stood out of line on that row."""
    publish(redis_server, prefix, 1)
    publish(redis_server, prefix, 1, queue="邮件队列")
    code, out = kd(redis_server, prefix, "ls")
    assert code == 0, out
    rows = [line for line in out.splitlines() if "inspect.record" in line]
    assert len(rows) == 2, out
    # The terminal column where each row's ETA begins.
    at = {cells(row[: re.search(r"\d{4}-\d\d-\d\d ", row).start()]) for row in rows}  # type: ignore[union-attr]
    assert len(at) == 1, out
    code, out = kd(redis_server, prefix, "stats")
    counts = [line for line in out.splitlines() if line.startswith("  ") and line.endswith("  1")]
    assert len(counts) == 2 and len({cells(line) for line in counts}) == 1, out


def test_a_long_wide_name_is_clipped_to_the_columns_of_a_long_narrow_one():
    assert cells(clipped("名" * 100)) <= NAME_COLUMN and cells(clipped("n" * 100)) == NAME_COLUMN
    assert clipped("名" * 30) == "名" * 30  # 60 columns: whole
    # Marks drawn over the character before take no column: Thai vowels, a skin tone, VS16.
    assert cells("ที่นี่") == 2 and cells("👍🏽") == 2 and cells("😀\ufe0f") == 2
    assert clipped("ที่" * 100).endswith("…") and cells(clipped("ที่" * 100)) == NAME_COLUMN


def test_a_name_of_marks_is_cut_too_and_a_long_one_is_measured_a_few_times(monkeypatch):
    """An accent repeated takes no column: such a name was shown whole, and the cut of a long
    one measured a longer start at each character (60,000 of them: seconds a name, a listing
    of them minutes, on the dashboard too)."""
    marks = "a" + "\u0301" * 30_000
    assert clipped(marks) == marks[: NAME_CHARS - 1] + "…"
    measured: list[int] = []

    def counted(text: str) -> int:
        measured.append(len(text))
        return cells(text)

    monkeypatch.setattr(inspect_module, "cells", counted)
    long = "n" * 58 + "\u0301" * 30_000 + "end"
    assert clipped(long) == long[: NAME_CHARS - 1] + "…"  # the marks stay with their n
    assert len(measured) <= 12 and max(measured) <= NAME_CHARS, measured


@pytest.mark.parametrize(
    "texts",
    [
        ("a\u202eb", "a\\u202eb"),  # an RTL override, and an id written with a backslash
        ("a\\\x07", "a\\x07", "a\x07"),  # a backslash before an escape
        ("q\nx", "q\\nx"),
        ("\U000e0001", "\\U000e0001"),  # a language tag: not printable
    ],
)
def test_no_two_names_show_alike(texts):
    # An id holding the six characters \u202e showed as an RTL override does: one id could
    # pass for another, in `ls` and on the dashboard.
    assert len({shown(text) for text in texts}) == len(texts), [shown(text) for text in texts]


def test_a_backslash_that_starts_no_escape_shows_as_it_is():
    assert shown("C:\\dir\\file") == "C:\\dir\\file" and shown("plain") == "plain"


@pytest.mark.parametrize(
    "texts",
    [
        ("dup", "dup ", " dup"),  # a space at an end shows as nothing in a table
        ("dup", "dup\ufe0f", "dup\u034f", "dup\U000e0101"),  # printable, and shown as nothing
        ("abc…", "abc\\u2026"),  # a name ending in the ellipsis a cut one ends with
    ],
)
def test_no_two_names_show_alike_in_a_table(texts):
    assert len({shown(text) for text in texts}) == len(texts), [shown(text) for text in texts]
    assert all(shown(text).strip(" ") == shown(text) for text in texts)
