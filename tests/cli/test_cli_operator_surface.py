"""What an operator sees at the edges: a Redis that stops answering fails ``health``, ``stats``
and ``ls`` in bounded time; names that hold control characters cannot forge ``ls`` rows; a port
out of range is one line of usage error, not a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from celery import Celery

from kombu_delay.cli.common import shown
from kombu_delay.connect import SOCKET_TIMEOUT_S, Target, with_socket_timeouts
from kombu_delay.message import Due
from kombu_delay.store import Store
from tests.support.cli import kd
from tests.support.procs import ROOT
from tests.support.stored import ORDINARY
from tests.support.workers import ECOSYSTEM_APP

#: A command against a silent Redis must end well within this, s (it hung for ever before).
BOUND_S = 120


def test_commands_against_a_silent_redis_fail_in_bounded_time(silent_server):
    base = [sys.executable, "-m", "kombu_delay", "-b", silent_server.delay_url, "--log-level", "error"]
    commands = {"health": ["health", "--liveness"], "stats": ["stats"], "ls": ["ls"]}
    started = time.monotonic()
    procs = {
        name: subprocess.Popen(
            [*base, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, argv in commands.items()
    }
    outputs: dict[str, tuple[int, str, str]] = {}
    try:
        for name, proc in procs.items():  # they run side by side: each waits at most BOUND_S
            out, err = proc.communicate(timeout=BOUND_S)
            outputs[name] = (proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert time.monotonic() - started < BOUND_S
    code, out, err = outputs["health"]
    assert code == 2, out + err
    assert out.startswith("UNREACHABLE: ") and len(out.splitlines()) == 1, out
    for name in ("stats", "ls"):
        code, out, err = outputs[name]
        assert code == 3, out + err
        assert "Traceback" not in err and "Error: Redis is unavailable" in err, err


def test_socket_timeouts_default_to_the_movers_and_yield_to_the_users():
    tgt = Target("delayredis://127.0.0.1:1/0", {"global_keyprefix": "a:"})
    assert with_socket_timeouts(tgt).transport_options == {
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": SOCKET_TIMEOUT_S,
        "global_keyprefix": "a:",
    }
    given = {"socket_timeout": 2, "socket_connect_timeout": None}
    own = Target("delayredis://127.0.0.1:1/0", dict(given))
    assert with_socket_timeouts(own).transport_options == given
    assert own.transport_options == given  # not changed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("report.build", "report.build"),
        ("a b", "a b"),
        ("a\nb", "a\\nb"),
        ("a\tb\r", "a\\tb\\r"),
        ("\x1b[31mred", "\\x1b[31mred"),
        ("zero\u200bwidth", "zero\\u200bwidth"),
        ("caf\u00e9", "caf\u00e9"),
    ],
)
def test_shown_escapes_only_what_is_not_printable(text, expected):
    assert shown(text) == expected


def test_ls_text_escapes_control_characters_and_json_keeps_them(r, redis_server):
    forged = "report.build\nfeedc0de-0000-0000-0000-000000000000  billing.refund_all  celery"
    queue = "mail\x1b[2J"
    app = Celery("pub", broker=redis_server.delay_url)
    sent = app.send_task(forged, countdown=900, queue=queue).id
    app.close()
    code, out = kd(redis_server, "", "ls")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[-1] == "end of listing" and len(lines) == 3, out  # header, one row, the end
    assert "\x1b" not in out
    assert lines[1].startswith(sent) and "report.build\\nfeedc0de" in lines[1] and "mail\\x1b[2J" in lines[1]
    code, out = kd(redis_server, "", "stats")
    assert code == 0 and "\x1b" not in out and "mail\\x1b[2J" in out, out
    code, out = kd(redis_server, "", "ls", "--json")
    assert code == 0, out
    (item,) = json.loads(out)["items"]
    assert item["task"] == forged and item["queue"] == queue


def test_a_long_name_is_clipped_in_tables_and_whole_in_json(r, redis_server, prefix):
    # A 500-character queue name pushed every row's figures 500 columns to the right; so did a
    # task id of 10,000 characters.
    queue, task, task_id = "q" * 500, "tasks." + "t" * 300, "i" * 10_000
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = {"global_keyprefix": prefix}
    app.send_task(task, countdown=900, queue=queue, task_id=task_id)
    app.send_task("short", countdown=900, queue="mail")
    app.close()
    for command in ("ls", "stats"):
        code, out = kd(redis_server, prefix, command)
        assert code == 0, out
        assert "q" * 59 + "…" in out and "q" * 60 not in out, out
        assert max(len(line) for line in out.splitlines()) < 300, out  # three clipped columns
    code, out = kd(redis_server, prefix, "ls")
    assert "i" * 59 + "…" in out and "i" * 60 not in out, out
    code, out = kd(redis_server, prefix, "ls", "--json")
    assert {(item["task"], item["queue"]) for item in json.loads(out)["items"]} == {
        (task, queue),
        ("short", "mail"),
    }
    assert task_id in {item["task_id"] for item in json.loads(out)["items"]}


def test_a_metrics_port_out_of_range_is_a_usage_error(redis_server):
    # Before: an OverflowError traceback from the metrics server's bind(), exit 1.
    kombu_delay = [sys.executable, "-m", "kombu_delay", "-b", redis_server.delay_url]
    celery = [sys.executable, "-m", "celery", "-A", ECOSYSTEM_APP, "delay"]
    env = {**os.environ, "ECO_BROKER": redis_server.delay_url}
    for args in (kombu_delay, celery):
        done = subprocess.run(
            [*args, "mover", "--metrics-port", "70000"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=BOUND_S,
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert "Traceback" not in done.stderr and "70000 is not in the range" in done.stderr, done.stderr


def test_a_listing_whose_reader_went_away_exits_as_sigpipe_would(r, redis_server):
    # `kombu-delay ls | head -1` exited 1, which means "not found" to a script under pipefail.
    store = Store(r)
    due = store.time_ms() + 3_600_000
    store.schedule_many([(Due(due, task_id=f"t{i}"), "q", f"m{i}") for i in range(3000)], ORDINARY)
    command = [sys.executable, "-m", "kombu_delay", "-b", redis_server.delay_url, "ls", "--limit", "3000"]
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().split()[:2] == [b"TASK", b"ID"]
        proc.stdout.close()  # with far more than a pipe holds still to write
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=BOUND_S) == 141, err
    assert "Traceback" not in err and "Error" not in err, err
