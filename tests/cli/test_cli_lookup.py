"""``kombu-delay find|dead`` on a real Redis."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest
from click.testing import CliRunner

from kombu_delay.cli import main
from kombu_delay.cli.lookup import COMMANDS
from kombu_delay.store import cold, keys
from tests.support.cli import kd, publish


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_every_command_documents_examples(command):
    result = CliRunner().invoke(main, [command.name, "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output and f"kombu-delay {command.name}" in result.output


def test_find_shows_each_ids_pending_messages_and_exits_1_for_one_not_scheduled(r, redis_server, prefix):
    ids = publish(redis_server, prefix, 3, queue="emails")
    code, out = kd(redis_server, prefix, "find", ids[2], ids[0])
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split() == ["TASK", "ID", "TASK", "QUEUE", "ETA", "(UTC)", "LEFT", "SIZE"]
    rows = [line.split()[:3] for line in lines[1:]]
    assert rows == [[i, "inspect.record", "emails"] for i in (ids[2], ids[0])]

    code, out = kd(redis_server, prefix, "find", ids[1], "never-scheduled", "--json")
    assert code == 1
    assert "never-scheduled: not scheduled" in out
    found = json.loads(out[: out.rindex("}") + 1])
    assert list(found) == [ids[1], "never-scheduled"] and found["never-scheduled"] == []
    (message,) = found[ids[1]]
    assert message["task_id"] == ids[1] and message["queue"] == "emails" and 0 < message["left_ms"] <= 601_000

    assert kd(redis_server, prefix, "cancel", ids[1])[0] == 0
    code, out = kd(redis_server, prefix, "find", ids[1])
    assert code == 1 and out.strip() == f"{ids[1]}: not scheduled"


def test_dead_lists_newest_first_pages_and_removes_by_digest(r, redis_server, prefix):
    dead = keys.dead(prefix)
    letters = [b"\x01\x03abc\xff\xfe broken" + b"x" * 100, b"\x07junk", b"\x01\x06tid-2\nforged line"]
    r.lpush(dead, *letters)  # the last pushed is the newest
    code, out = kd(redis_server, prefix, "dead", "--limit", "2")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "3 dead letters"
    assert lines[1].split() == ["POS", "DIGEST", "TASK", "ID", "SIZE", "BYTES"]
    newest, junk = hashlib.sha256(letters[2]).hexdigest(), hashlib.sha256(letters[1]).hexdigest()
    assert lines[2].split()[:4] == ["0", newest, "tid-2\\n", str(len(letters[2]))]  # no line forged
    assert lines[3].split()[:4] == ["1", junk, "-", "5"]
    assert lines[4] == "more: --offset 2" and len(lines) == 5

    code, out = kd(redis_server, prefix, "dead", "--offset", "2", "--json")
    assert code == 0, out
    listed = json.loads(out)
    assert listed["total"] == 3 and [x["index"] for x in listed["items"]] == [2]
    assert base64.b64decode(listed["items"][0]["member_base64"]) == letters[0]
    assert listed["items"][0]["task_id"] == "abc"

    code, out = kd(redis_server, prefix, "dead", "--remove", junk.upper(), "--remove", "0" * 64)
    assert code == 1
    assert f"{junk}: removed" in out and f"{'0' * 64}: no such dead letter" in out
    assert r.lrange(dead, 0, -1) == [letters[2], letters[0]]
    # stats tells how many are kept (its lifetime count says how many there ever were)
    code, out = kd(redis_server, prefix, "stats")
    assert code == 0 and "dead       2 compressed messages could not be restored: `kombu-delay dead`" in out
    assert json.loads(kd(redis_server, prefix, "stats", "--json")[1])["dead_letters"] == 2


def test_dead_says_when_there_are_none(r, redis_server, prefix):
    assert kd(redis_server, prefix, "dead") == (0, "0 dead letters\n")
    assert "dead  " not in kd(redis_server, prefix, "stats")[1]
    assert json.loads(kd(redis_server, prefix, "dead", "--json")[1]) == {"total": 0, "items": []}
    # A dead-letter key of another type (by hand) is a warning of stats, not its failure.
    r.set(keys.dead(prefix), "written by hand")
    code, out = kd(redis_server, prefix, "stats")
    assert code == 0 and "WARNING" in out and keys.dead(prefix) in out, out


def test_find_shows_a_damaged_compressed_message_and_says_so(r, redis_server, prefix):
    # find said "not scheduled" (exit 1) of it, though ls listed it and cancel removed it.
    damaged, other = publish(redis_server, prefix, 2)  # 600 and 601 s ahead: compressed
    # (In one bucket or two: one of them, 1 run in 60, falls in the next minute's.)
    [(key, member, score)] = [
        (key, m, sc)
        for key in r.keys(keys.ns(prefix) + "cz:*")
        for m, sc in r.zrange(key, 0, -1, withscores=True)
        if cold.task_id_of(m) == damaged
    ]
    r.zrem(key, member)
    r.zadd(key, {member[:-12] + bytes(b ^ 0xFF for b in member[-12:]): score})
    code, out = kd(redis_server, prefix, "find", damaged, other)
    assert code == 0, out
    rows = [line.split()[:3] for line in out.splitlines()[1:] if not line.startswith(damaged + ":")]
    assert rows == [[damaged, "-", "celery"], [other, "inspect.record", "celery"]]
    assert f"{damaged}: 1 message damaged in Redis" in out
    code, out = kd(redis_server, prefix, "find", damaged, "--json")
    [found] = json.loads(out[out.index("{") : out.rindex("}") + 1])[damaged]
    assert found["task_id"] == damaged and found["task"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--offset", str(2**63 - 1)], "reach past any list position"),
        (["--remove", "0" * 63], "is not a digest"),
        (["--remove", "x\ny" + "0" * 61], "is not a digest"),
        (["--remove", "0" * 64, "--json"], "--remove lists nothing"),
        (["--remove", "0" * 64, "--offset", "3"], "--remove lists nothing"),
        (["--remove", "0" * 64, "--limit", "3"], "--remove lists nothing"),  # was ignored, unsaid
    ],
    ids=[
        "offset-past-any-position",
        "short-digest",
        "not-hex",
        "remove-json",
        "remove-offset",
        "remove-limit",
    ],
)
def test_dead_refuses_what_it_cannot_do_as_a_usage_error(r, redis_server, args, message):
    code, out = kd(redis_server, "", "dead", *args)
    assert code == 2 and message in out and "Traceback" not in out, out


def test_dead_removes_a_digest_pasted_with_spaces_around_it(r, redis_server):
    r.lpush(keys.dead(""), b"\x07junk")
    digest = hashlib.sha256(b"\x07junk").hexdigest()
    assert kd(redis_server, "", "dead", "--remove", f" {digest}\n") == (0, f"{digest}: removed\n")
    assert not r.exists(keys.dead(""))


def test_find_of_an_id_not_scheduled_points_to_the_dead_letters_where_there_are_some(r, redis_server, prefix):
    # A compressed message a mover could not restore is dead-lettered: find said only "not
    # scheduled", and nothing led to `dead`.
    code, out = kd(redis_server, prefix, "find", "gone")
    assert code == 1 and "dead letter" not in out, out
    r.lpush(keys.dead(prefix), b"\x07not a member", b"\x07nor this")
    code, out = kd(redis_server, prefix, "find", "gone")
    assert code == 1 and "2 dead letters kept: `kombu-delay dead` lists them" in out, out
    code, out = kd(redis_server, prefix, "find", "gone", "--json")
    assert code == 1 and "dead letter" not in out, out
    # A hint only: a dead-letter list it cannot read (another type, by hand; an ACL) leaves
    # "not scheduled" as it was, not an error.
    r.delete(keys.dead(prefix))
    r.set(keys.dead(prefix), "by hand")
    code, out = kd(redis_server, prefix, "find", "gone")
    assert code == 1 and out.strip() == "gone: not scheduled", out
