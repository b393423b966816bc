"""What waiting cannot fix: ACL refusals, bad broker URLs and options, a busy metrics port,
and a server that stops answering. Each is a clear error, never a traceback or a lost message.

Every test starts its own redis-server or uses the session one, and stops every process it
starts by its PID.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import signals
from click.testing import CliRunner
from kombu import Connection, Exchange, Producer, Queue
from kombu.exceptions import ChannelError
from kombu.transport import redis as kombu_redis

from kombu_delay.cli import main
from kombu_delay.cli.common import parse_option
from kombu_delay.config import Settings
from kombu_delay.connect import Target, open_store
from kombu_delay.control import DelayControl
from kombu_delay.errors import (
    ConfigError,
    RedisPermissionError,
    RedisRefused,
    RedisUnavailable,
    translated_errors,
    waits_out,
)
from kombu_delay.message import Due
from kombu_delay.mover import check_pool, open_when_reachable
from kombu_delay.mover.embedded import EmbeddedMover
from kombu_delay.mover.loop import Mover
from kombu_delay.store import Store, keys
from kombu_delay.tooling.redis_server import RedisServer, free_port
from tests.support.procs import Proc, wait_for_exit, wait_until
from tests.support.stored import FakeClock, redis_ms, stored

#: Generous: the suite shares two cores with other work.
DEADLINE_S = 120.0
QUEUE = "refusals"


def pid_of(server: RedisServer) -> int:
    assert server.process is not None
    return server.process.pid


def add_user(client: redis.Redis, name: str, *rules: str) -> str:
    """An ACL user with password ``pw``; returns its ``delayredis://`` URL."""
    client.execute_command("ACL", "SETUSER", name, "on", ">pw", "~*", "&*", "+@all", *rules)
    port = client.connection_pool.connection_kwargs["port"]
    return f"delayredis://{name}:pw@127.0.0.1:{port}/0"


def publish_due_soon(url: str, count: int, delay_ms: int = 300) -> None:
    with Connection(url) as conn:
        producer = conn.Producer()
        for n in range(count):
            producer.publish({"n": n}, routing_key=QUEUE, headers={"x-delay": delay_ms}, retry=False)


def mover_args(url: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kombu_delay", "--broker", url, "mover", *extra]


def wait_until_due(client: redis.Redis, task_id: str | None = None) -> None:
    """Wait until Redis's clock has passed the due time of every stored message (or of
    ``task_id``'s)."""
    last = max(s.due_ms for s in stored(client) if task_id in (None, s.envelope.task_id))
    wait_until(lambda: redis_ms(client) > last)


def unanswered(port: int) -> bool:
    """True when the server on ``port`` has a connection holding bytes it has not read (Linux's
    /proc/net/tcp): with the server stopped (SIGSTOP), some call waits on its socket."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            _, local, _, state, queues, *_ = row.split()
            unread = int(queues.split(":")[1], 16)
            if state == "01" and int(local.rsplit(":", 1)[1], 16) == port and unread:  # established
                return True
    return False


def silence(server: RedisServer, mover: Proc) -> None:
    """Stop ``server`` (SIGSTOP) and wait until the mover's next call waits on it.

    The server is stopped while the mover is (SIGSTOP too), once it has read and answered
    everything the mover sent: a call it had read but not answered would leave the mover
    waiting with no unread bytes to see. The mover then goes on, and its next call's bytes wait
    unread."""
    os.kill(mover.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: not unanswered(server.port))  # every request read...
        with server.client() as admin:
            admin.ping()  # ...and answered: Redis answers in the order it reads
        os.kill(pid_of(server), signal.SIGSTOP)
    finally:
        os.kill(mover.pid, signal.SIGCONT)
    wait_until(lambda: unanswered(server.port))


# -- ACL ----------------------------------------------------------------------------------


def test_a_mover_refused_the_removal_stops_and_takes_nothing(
    server: RedisServer, spawn: Callable[..., Proc]
) -> None:
    """Redis does not undo a script's earlier writes when it refuses a later command. The
    move checks its removal first (an empty ZREMRANGEBYRANK) and pushes before it removes,
    so a refused ZREMRANGEBYRANK takes nothing and pushes nothing, on Redis 6 too, however
    often it is tried; the mover stops, naming the ACL."""
    admin = server.client()
    url = add_user(admin, "restricted", "-zremrangebyrank")
    publish_due_soon(server.delay_url, 3)
    wait_until_due(admin)
    with open_store(url) as store:
        for _ in range(3):  # an embedded mover retries with backoff
            with pytest.raises(RedisPermissionError):
                store.move_due(100)
    assert len(stored(admin)) == 3 and admin.llen(QUEUE) == 0  # nothing taken, nothing pushed
    mover = spawn(mover_args(url), name="mover")
    assert wait_for_exit(mover) != 0
    assert len(stored(admin)) == 3 and admin.llen(QUEUE) == 0
    output = mover.output()
    assert "ACL" in output and "zremrangebyrank" in output.lower(), output
    assert "Traceback" not in output and "retrying" not in output, output
    assert admin.zcard(keys.movers("")) == 0  # a stopped mover leaves no heartbeat for probes
    # With the rights, every message is delivered once.
    good = spawn(mover_args(server.delay_url), name="good")
    wait_until(lambda: admin.llen(QUEUE) == 3, timeout=DEADLINE_S)
    good.stop()
    assert stored(admin) == [] and admin.llen(QUEUE) == 3


@pytest.mark.parametrize(
    "rules", [["-lpush"], ["resetkeys", "~kombu_delay:*", "~other*"]], ids=["command", "key"]
)
def test_a_destination_the_acl_refuses_waits_and_the_others_move(
    server: RedisServer, spawn: Callable[..., Proc], rules: list[str]
) -> None:
    """One queue the mover's user may not LPUSH onto (a queue added outside its ACL pattern)
    stopped every move: each call raised. Its due messages now stay where they are, named in
    the mover's warning, taken by nothing, on Redis 6 (the push tells) and 7 (asked first);
    the other queues' messages move, when the ACL lets them."""
    admin = server.client()
    url = add_user(admin, "restricted", *rules)
    publish_due_soon(server.delay_url, 3)
    with Connection(server.delay_url) as conn:
        conn.Producer().publish({"n": 9}, routing_key="other", headers={"x-delay": 300}, retry=False)
    wait_until_due(admin)
    with open_store(url) as store:
        results = [store.move_due(100) for _ in range(3)]  # raised before
    if rules == ["-lpush"]:  # every destination is refused
        assert [(x.refused, sorted(x.refused_dests)) for x in results] == [(4, ["other", QUEUE])] * 3
        assert results[0].moved == 0 and admin.llen("other") == 0
    else:
        assert [(x.refused, x.refused_dests) for x in results] == [(3, [QUEUE])] * 3
        assert results[0].moved == 1 and admin.llen("other") == 1
    waiting = len(stored(admin))
    assert waiting == 4 - admin.llen("other") and admin.llen(QUEUE) == 0  # nothing taken, nothing pushed
    mover = spawn(mover_args(url), name="mover")
    wait_until(lambda: "ACL refuses LPUSH onto" in mover.output(), timeout=DEADLINE_S)
    assert mover.popen.poll() is None and len(stored(admin)) == waiting and admin.llen(QUEUE) == 0
    mover.stop()
    assert "Traceback" not in mover.output(), mover.output()
    # With the rights, every message is delivered once.
    good = spawn(mover_args(server.delay_url), name="good")
    wait_until(lambda: admin.llen(QUEUE) == 3, timeout=DEADLINE_S)
    good.stop()
    assert stored(admin) == [] and admin.llen(QUEUE) == 3 and admin.llen("other") == 1


def test_a_mover_refused_type_stops_and_blames_type_not_the_queue(server: RedisServer) -> None:
    # A refusal of TYPE, which the move asks of each destination, was taken for the queue's
    # refusal: every queue waited, and the warning asked for a grant the user already had.
    admin = server.client()
    url = add_user(admin, "notype", "-type")
    publish_due_soon(server.delay_url, 3)
    wait_until_due(admin)
    with open_store(url) as store, pytest.raises(RedisPermissionError, match="TYPE"):
        store.move_due(100)
    assert len(stored(admin)) == 3 and admin.llen(QUEUE) == 0


def test_a_refused_push_reads_no_more_than_the_queues_head(server: RedisServer) -> None:
    """Redis 6 cannot be asked whether a user may LPUSH: the first push onto a queue in a call
    is of its head alone, so a refusal, told again on every poll while it lasts, reads one
    member, not a batch (Redis 7 is asked, and reads none)."""
    admin = server.client()
    url = add_user(admin, "nolpush", "-lpush")
    publish_due_soon(server.delay_url, 50)
    wait_until_due(admin)
    reads: list[str] = []
    with open_store(url) as store, admin.monitor() as monitor:
        assert store.move_due(100).refused == 50
        store.client.echo("moved")  # the last command seen: the move's are all before it
        for seen in monitor.listen():
            command = seen["command"]
            if command == "ECHO moved":
                break
            words = command.split()
            if words[0].upper() in ("ZRANGE", "ZRANGEBYSCORE") and words[1].endswith(f":{QUEUE}"):
                reads.append(command)
    # Of the queue's sorted set, its head alone: ranks 0 to 0, or a limit of 1.
    one = [read for read in reads if read.split()[2:4] == ["0", "0"] or read.endswith("LIMIT 0 1")]
    assert reads and one == reads, reads
    assert len(stored(admin)) == 50 and admin.llen(QUEUE) == 0


def test_a_refused_head_of_16_mb_does_not_hide_the_other_refusals(server: RedisServer) -> None:
    """On Redis 6 the refused push of a queue's head of 17 MB spent the call's 16 MB: the call
    said more, and counted one refusal of 16 (Redis 7 is asked first, and reads none)."""
    admin = server.client()
    url = add_user(admin, "nolpush", "-lpush")
    clock = FakeClock(admin)
    due = clock() + 1000
    big = [(Due(due, task_id="big"), "blocked", "b" * (17 * 2**20))]
    small = [(Due(due + 1 + i, task_id=f"s{i}"), QUEUE, f"small-{i}") for i in range(15)]
    Store(admin, clock=clock).schedule_many(big + small, Settings())  # stored however slow this is
    clock.ms = due + 100
    with open_store(url) as store:
        store.clock = clock
        results = [store.move_due(500) for _ in range(2)]
    assert [(x.moved, x.refused, x.more) for x in results] == [(0, 16, False)] * 2
    assert len(stored(admin)) == 16 and admin.llen(QUEUE) == 0


def test_a_reschedule_to_the_past_refused_lpush_keeps_the_message(server: RedisServer) -> None:
    admin = server.client()
    url = add_user(admin, "nolpush", "-lpush")
    with Connection(server.delay_url) as conn:
        conn.Producer().publish(
            {"n": 1}, routing_key=QUEUE, headers={"x-delay": 600_000, "id": "t-1"}, retry=False
        )
    [before] = stored(admin)
    with DelayControl(url) as control, pytest.raises(RedisPermissionError) as refused:
        control.reschedule(before.envelope.task_id, countdown=0)
    assert stored(admin) == [before] and admin.llen(QUEUE) == 0  # nothing taken, nothing lost
    assert "LPUSH" in str(refused.value)


def test_a_cancel_refused_inside_its_script_says_where_to_look_and_keeps_the_message(
    server: RedisServer,
) -> None:
    # Redis names neither the command nor the key a script was refused: the text said only
    # "The user executing the script can't run this command or subcommand".
    admin = server.client()
    url = add_user(admin, "nozrem", "-zrem")
    with Connection(server.delay_url) as conn:
        conn.Producer().publish({"n": 1}, routing_key=QUEUE, headers={"x-delay": 600_000, "id": "t-1"})
    [before] = stored(admin)
    result = CliRunner().invoke(main, ["-b", url, "cancel", "t-1"])
    assert result.exit_code == 3, result.output
    assert "can't run this command" in result.output and "Security page" in result.output, result.output
    assert stored(admin) == [before]


def test_a_cancel_refused_after_some_of_its_messages_tells_how_many_it_cancelled(
    server: RedisServer,
) -> None:
    admin = server.client()
    if int(admin.info("server")["redis_version"].split(".")[0]) < 7:
        pytest.skip("Redis 6 has no read-only key patterns (%R~)")
    # May write every key of kombu-delay's but the sorted sets of queue "cb" (both are held
    # compressed, 500 and 700 s ahead).
    name, rules = (
        "notcb",
        ["resetkeys", "%R~*", "~kombu_delay:[^c]*", "~kombu_delay:c[^z]*", "~kombu_delay:cz:*:ca"],
    )
    admin.execute_command("ACL", "SETUSER", name, "on", ">pw", "&*", "+@all", *rules)
    with Connection(server.delay_url) as conn:
        for queue, delay in (("ca", 500_000), ("cb", 700_000)):
            conn.Producer().publish({"n": 1}, routing_key=queue, headers={"x-delay": delay, "id": "same"})
    url = f"delayredis://{name}:pw@127.0.0.1:{server.port}/0"
    told = "1 of its messages were cancelled before it"
    with DelayControl(url) as control, pytest.raises(RedisPermissionError, match=told):
        control.cancel("same")
    assert [s.envelope.dest for s in stored(admin)] == ["cb"]


@pytest.mark.parametrize("rule", ["-subscribe", "resetchannels"])
def test_a_mover_refused_the_wake_channel_polls_and_says_so(
    server: RedisServer, spawn: Callable[..., Proc], rule: str
) -> None:
    # Redis refuses a subscription only once the mover waits on it: that reply ended the mover
    # with a traceback, and its heartbeat stayed behind, so probes took it for a running one.
    admin = server.client()
    url = add_user(admin, "nowake", rule)
    mover = spawn(mover_args(url), name="mover")
    wait_until(lambda: "polls instead" in mover.output(), timeout=DEADLINE_S)
    publish_due_soon(server.delay_url, 3)
    wait_until(lambda: admin.llen(QUEUE) == 3, timeout=DEADLINE_S)
    assert mover.popen.poll() is None and stored(admin) == []
    mover.popen.send_signal(signal.SIGTERM)
    assert wait_for_exit(mover) == 0
    output = mover.output()
    assert "Traceback" not in output and "+subscribe &kombu_delay:*" in output, output
    assert admin.zcard(keys.movers("")) == 0 and admin.llen(QUEUE) == 3


def test_a_worker_user_with_only_kombus_keys_still_declares_and_sizes_its_queue(
    server: RedisServer, caplog
) -> None:
    # A queue's size counts its delayed messages, read from kombu-delay's counts: a worker's
    # user without those keys failed its queue declaration at start-up.
    url = add_user(server.client(), "worker", "resetkeys", "~refusals*", "~_kombu*", "~unacked*")
    with Connection(url) as conn:
        queue = conn.SimpleQueue(QUEUE)
        queue.put({"now": 1})
        with caplog.at_level(logging.WARNING, logger="kombu_delay"):
            assert queue.qsize() == 1
            assert conn.default_channel.queue_declare(QUEUE, passive=True).message_count == 1
        assert queue.get(timeout=10).payload == {"now": 1}
        queue.close()
    told = [rec.getMessage() for rec in caplog.records if "leave delayed messages out" in rec.getMessage()]
    assert len(told) <= 1 and (not told or "kombu_delay:counts" in told[0]), told


def test_a_counts_key_of_another_type_sizes_the_queue_and_says_what_to_do(
    server: RedisServer, caplog, monkeypatch
) -> None:
    # Told to grant read access, for a key written over by hand.
    monkeypatch.setattr("kombu_delay.transport._size_refusal_told", threading.Event())
    server.client().set(keys.counts(""), "by hand")
    with Connection(server.delay_url) as conn, caplog.at_level(logging.WARNING, logger="kombu_delay"):
        assert conn.default_channel.queue_declare(QUEUE).message_count == 0
    told = [rec.getMessage() for rec in caplog.records if "leave delayed messages out" in rec.getMessage()]
    assert len(told) == 1 and "kombu_delay:counts is no hash" in told[0] and "grant" not in told[0], told


def test_a_user_with_only_kombus_keys_delivers_a_message_with_a_bad_eta(server: RedisServer) -> None:
    # Its count (totals.bad_eta) was refused, and the refusal failed the publish: the message
    # was lost, and kombu's retry logged "delivering message ... now" each time. On redis://
    # it is delivered, and the worker tells the bad ETA.
    admin = server.client()
    url = add_user(admin, "publisher", "resetkeys", "~refusals*", "~_kombu*", "~unacked*")
    with Connection(url) as conn:
        headers = {"task": "t", "id": "bad", "eta": "not-a-date"}  # Celery protocol 2
        conn.Producer().publish({"n": 1}, routing_key=QUEUE, headers=headers, retry=False)
    assert admin.llen(QUEUE) == 1
    assert json.loads(admin.lpop(QUEUE) or b"")["headers"]["eta"] == "not-a-date"


def test_a_worker_user_with_only_kombus_keys_deletes_its_queues(server: RedisServer, caplog) -> None:
    # A deleted queue's delayed messages go with it, through purge.lua, which this user may not
    # run: Celery's start-up handshake (mingle) deletes its reply queue, and a channel's close
    # its auto-delete queues, so the refusal ended the worker ("Unrecoverable error"), and left
    # the channel's connections open. On redis:// both work.
    admin = server.client()
    url = add_user(admin, "worker", "resetkeys", "~refusals*", "~_kombu*", "~unacked*")
    direct, fanout = Exchange("refusals.reply"), Exchange("refusals.control", type="fanout", auto_delete=True)
    bindings = [f"_kombu.binding.{exchange.name}" for exchange in (direct, fanout)]
    with Connection(url) as conn, caplog.at_level(logging.WARNING, logger="kombu_delay"):
        channel = conn.channel()
        replies = Queue(f"{QUEUE}.reply", direct, routing_key=f"{QUEUE}.reply", channel=channel)
        replies.declare()
        Queue(f"{QUEUE}.pidbox", fanout, auto_delete=True, channel=channel).declare()
        assert admin.exists(*bindings) == 2
        replies.delete()
        channel.close()  # deletes the auto-delete queue
    assert admin.exists(*bindings) == 0
    told = [
        rec.getMessage()
        for rec in caplog.records
        if "delayed messages, if any, were left" in rec.getMessage()
    ]
    assert len(told) == 1 and "kombu_delay:* to delete them" in told[0], told


def test_a_mover_denied_scripting_stops_at_once_naming_the_acl(
    server: RedisServer, spawn: Callable[..., Proc]
) -> None:
    url = add_user(server.client(), "noscript", "-@scripting")
    mover = spawn(mover_args(url), name="mover")
    assert wait_for_exit(mover) != 0
    output = mover.output()
    assert "ACL refused" in output, output
    assert "Traceback" not in output and "retrying" not in output, output


@pytest.mark.parametrize("command", [["stats"], ["cancel", "some-id"]])
def test_inspection_commands_name_an_acl_refusal(server: RedisServer, command: list[str]) -> None:
    url = add_user(server.client(), "noscript", "-@scripting")
    result = CliRunner().invoke(main, ["-b", url, *command])
    assert result.exit_code == 3, result.output
    assert "ACL refused" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


def test_health_names_an_acl_refusal_at_connect(server: RedisServer) -> None:
    url = add_user(server.client(), "noping", "-ping")
    result = CliRunner().invoke(main, ["-b", url, "health"])
    assert result.exit_code == 2, result.output
    assert result.stdout.startswith("ERROR: Redis's ACL refused"), result.output


def test_health_tells_an_error_from_an_unreachable_redis(server: RedisServer) -> None:
    # Redis answered, with an error: it said UNREACHABLE, which sends an operator after the
    # network instead of the key.
    server.client().set(keys.movers(""), "not a sorted set")
    result = CliRunner().invoke(main, ["-b", server.delay_url, "health"])
    assert result.exit_code == 2, result.output
    assert result.stdout.startswith("ERROR: ") and "WRONGTYPE" in result.stdout, result.output
    assert len(result.stdout.splitlines()) == 1, result.output


# -- bad URLs and options -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "options", "error", "text"),
    [
        ("delayredis://127.0.0.1:notaport/0", [], ConfigError, "bad broker URL"),
        ("delayredis://127.0.0.1:{port}/abc", [], ConfigError, "bad broker URL"),
        ("http://127.0.0.1:{port}/0", [], ConfigError, "'http' is not a Redis scheme"),
        ("delayredis://127.0.0.1:{port}/0", ["socket_timeout=abc"], ConfigError, "bad broker URL or option"),
        ("delayredis://127.0.0.1:{port}/99", [], RedisRefused, "DB index is out of range"),
        (
            "delayredis://127.0.0.1:{port}/0",
            ["queue_order_strategy=bogus"],
            ConfigError,
            "No module named 'bogus'",
        ),
        # was redis-py's "unexpected keyword argument 'socket_timeout'" alone
        (
            "delayredis://127.0.0.1:{port}/0?socket_timeout=5",
            [],
            ConfigError,
            "give options with -o NAME=VALUE",
        ),
    ],
    ids=["port", "database", "scheme", "option", "database-range", "imported-option", "url-query"],
)
def test_a_bad_url_or_option_is_a_clear_error_everywhere(
    redis_server: RedisServer,
    spawn: Callable[..., Proc],
    url: str,
    options: list[str],
    error: type[Exception],
    text: str,
) -> None:
    url = url.format(port=redis_server.port)
    flags = [part for option in options for part in ("-o", option)]
    with pytest.raises(error, match=text), open_store(url, parse_option(tuple(options))):
        pass
    for command, code in ((["stats"], 3), (["health"], 2)):
        result = CliRunner().invoke(main, ["-b", url, *flags, *command])
        assert result.exit_code == code, result.output
        assert text in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    mover = spawn([sys.executable, "-m", "kombu_delay", "-b", url, *flags, "mover"], name="mover")
    assert wait_for_exit(mover) == 1
    output = mover.output()
    assert text in output and "Traceback" not in output, output


def test_a_plain_unix_socket_url_serves_the_mover_and_health(
    tmp_path: Path, spawn: Callable[..., Proc]
) -> None:
    """``redis+socket://`` is a CELERY_BROKER_URL a mover may be given, like ``redis://``."""
    sock = tmp_path / "r.sock"
    with RedisServer(extra_args=["--unixsocket", str(sock), "--unixsocketperm", "700"]) as unix_server:
        publish_due_soon(unix_server.delay_url, 2)
        url = f"redis+socket://{sock}"
        mover = spawn([sys.executable, "-m", "kombu_delay", "-b", url, "mover"], name="mover")
        client = unix_server.client()
        wait_until(lambda: client.llen(QUEUE) == 2, timeout=DEADLINE_S)
        result = CliRunner().invoke(main, ["-b", url, "health", "--max-heartbeat-age", "60"])
        assert result.exit_code == 0, result.output
        assert mover.stop() == 0


#: kombu reads "+" in a scheme as transport + inner URL: these name plain Redis on localhost:6379.
PLUS_SCHEMES = ["redis+delay", "rediss+delay", "delay+redis"]


@pytest.mark.parametrize("scheme", PLUS_SCHEMES)
def test_a_plus_scheme_is_refused_not_read_as_localhost(
    redis_server: RedisServer, spawn: Callable[..., Proc], scheme: str
) -> None:
    url = f"{scheme}://127.0.0.1:{redis_server.port}/0"
    # Were the URL let through, it would mean localhost:6379, which the suite never touches:
    # an option redis-py refuses before it opens a socket keeps even that from connecting.
    no_socket = ["-o", "socket_connect_timeout=abc"]
    text = f"kombu reads the '+' in {scheme!r} as transport {scheme.split('+')[0]!r} plus an inner URL"
    with pytest.raises(ConfigError, match=re.escape(text)):
        DelayControl(url, parse_option(tuple(no_socket[1::2])))
    for command, code in ((["stats"], 3), (["ls"], 3), (["health"], 2)):
        result = CliRunner().invoke(main, ["-b", url, *no_socket, *command])
        assert result.exit_code == code, result.output
        assert text in result.output and "use delayredis://" in result.output, result.output
    mover = spawn([sys.executable, "-m", "kombu_delay", "-b", url, *no_socket, "mover"], name="mover")
    assert wait_for_exit(mover) == 1
    assert text in mover.output() and "Traceback" not in mover.output(), mover.output()


def test_dash_o_keeps_names_as_typed() -> None:
    options = parse_option(("global_keyprefix=0123", "master_name=1", "socket_timeout=5", "x=0123"))
    assert options == {"global_keyprefix": "0123", "master_name": "1", "socket_timeout": 5, "x": 123}


def test_a_taken_metrics_port_is_a_clear_error(redis_server: RedisServer, spawn: Callable[..., Proc]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        mover = spawn(mover_args(redis_server.delay_url, "--metrics-port", str(port)), name="mover")
        assert wait_for_exit(mover) == 1
    output = mover.output()
    assert f"cannot serve metrics on 127.0.0.1:{port}" in output and "Traceback" not in output, output


# -- a server that stops answering --------------------------------------------------------


def test_a_mover_stops_on_sigterm_while_redis_does_not_answer(
    server: RedisServer, spawn: Callable[..., Proc]
) -> None:
    """redis-py waits forever by default; a mover's connection gives up after its socket
    timeout, so a stop request is heard (and kubelet need not SIGKILL it)."""
    mover = spawn(mover_args(server.delay_url), name="mover")
    client = server.client()
    wait_until(lambda: client.keys("*mover*"), timeout=DEADLINE_S)
    client.close()
    try:
        silence(server, mover)  # the mover's next call waits on a silent socket
        mover.popen.send_signal(signal.SIGTERM)
        assert wait_for_exit(mover, timeout=60) == 0
    finally:
        os.kill(pid_of(server), signal.SIGCONT)


def test_a_move_call_its_mover_gave_up_on_moves_nothing_when_the_server_reads_it_later(
    server: RedisServer,
) -> None:
    """A server paused (SIGSTOP, a frozen VM) reads a move call whose mover gave up on it when
    it resumes: the call moved what had fallen due meanwhile, onto this server's lists, where
    a worker still waiting took it, while its mover, gone over to a promoted replica, moved the
    same messages there (Sentinel: doubled). Past the deadline its mover gave it, it moves
    nothing; the next call moves them, once."""
    admin = server.client()
    store = Store(server.client(socket_timeout=2.0))
    assert store.move_due(100).moved == 0  # a first reply: the next call's deadline is known
    publish_due_soon(server.delay_url, 3)
    wait_until_due(admin)
    admin.close()
    os.kill(pid_of(server), signal.SIGSTOP)
    try:
        with pytest.raises(RedisUnavailable):  # its socket timed out: the mover gave it up
            store.move_due(100)
    finally:
        os.kill(pid_of(server), signal.SIGCONT)
    # The server reads what waited, the call first, then its closed connection: once every other
    # connection is gone, the call has run.
    wait_until(lambda: [c["id"] for c in admin.client_list()] == [str(admin.client_id())], timeout=DEADLINE_S)
    assert admin.llen(QUEUE) == 0 and len(stored(admin)) == 3  # it ran, and moved nothing
    assert store.move_due(100).moved == 3 and admin.llen(QUEUE) == 3


def test_a_move_call_past_its_deadline_says_so_and_the_next_allows_longer(server: RedisServer) -> None:
    # A server paused for less than the mover's socket_timeout, while a failover promoted a
    # replica, ran the call it read as it resumed, in time by that timeout: it pushed what had
    # fallen due, for a worker still there to take, and the mover moved on there until the old
    # master was demoted (R125: 47 of 600 doubled after 6 s). A call now moves nothing a second
    # after it is sent, and says so.
    admin = server.client()
    store = Store(server.client(socket_timeout=10.0))
    publish_due_soon(server.delay_url, 3)
    wait_until_due(admin)
    store.give_up.heard(redis_ms(admin) - 5_000)  # as if sent 5 s ago, by Redis's clock
    late = store.move_due(100)
    assert late.late and late.moved == 0 and late.more and admin.llen(QUEUE) == 0
    store.heartbeat("m")  # (a mover's beat comes first in its next round: it reset the allowance)
    assert store.give_up.allowed_ms == 2_000
    moved = store.move_due(100)
    assert not moved.late and moved.moved == 3 and store.give_up.allowed_ms == 1_000


def test_a_busy_redis_leaves_the_replica_check_on(server: RedisServer) -> None:
    # A BUSY reply (another client's script past busy-reply-threshold) to the INFO a mover asks at
    # each heartbeat was taken for the ACL's refusal: it asked no more, and moved on the replica
    # that takes writes the server became later.
    admin, store = server.client(), Store(server.client())
    try:
        admin.config_set("busy-reply-threshold", 100)
    except redis.ResponseError:  # Redis 6: the setting's older name
        admin.config_set("lua-time-limit", 100)
    busy = threading.Thread(target=_loop_until_killed, args=(server.client(),), daemon=True)
    busy.start()
    try:
        wait_until(lambda: _busy(admin), timeout=DEADLINE_S)
        assert store.replica_of() is None  # it cannot tell now
    finally:
        with contextlib.suppress(redis.ResponseError):
            admin.script_kill()
        busy.join(DEADLINE_S)
    admin.replicaof("127.0.0.1", str(free_port()))  # (a master not there)
    admin.config_set("replica-read-only", "no")
    try:
        assert (store.replica_of() or "").startswith("Redis here is a replica")
    finally:
        admin.replicaof("NO", "ONE")


def _loop_until_killed(client: redis.Redis) -> None:
    with contextlib.suppress(redis.ResponseError):  # "Script killed by user"
        client.eval("while true do end", 0)


def _busy(client: redis.Redis) -> bool:
    try:
        client.ping()
    except redis.ResponseError as exc:
        return "BUSY" in str(exc)
    return False


def blocked_calls(client: redis.Redis) -> int:
    """How many calls of other clients wait on ``client``'s server (flag ``b``: here, a pause)."""
    return sum("b" in c["flags"] for c in client.client_list() if int(c["id"]) != client.client_id())


def freeze_backing_off(server: RedisServer, mover: Proc, client: redis.Redis) -> None:
    """Leave ``mover`` stopped (SIGSTOP) with no call of its waiting on ``server``, whose writes
    are paused: it is in its back-off after a call that timed out. Stopped with a call waiting,
    it is let go on until that call has timed out, and stopped again."""
    while True:
        os.kill(mover.pid, signal.SIGSTOP)
        wait_until(lambda: not unanswered(server.port))  # what it sent is read: a waiting call shows
        if not blocked_calls(client):
            return
        os.kill(mover.pid, signal.SIGCONT)
        wait_until(lambda: not blocked_calls(client), timeout=DEADLINE_S)


def stopped_in_a_back_off(server: RedisServer, spawn: Callable[..., Proc], client: redis.Redis) -> Proc:
    """Start a mover, make its calls time out until it backs off for seconds, and send it SIGTERM
    there, once Redis answers again; return it, stopping."""
    args = [*mover_args(server.delay_url)[:-1], "--log-level", "debug", "-o", "socket_timeout=0.5", "mover"]
    mover = spawn(args, name="mover")  # (a retry is told at debug level after the first)
    wait_until(lambda: client.zcard(keys.movers("")) == 1, timeout=DEADLINE_S)
    # Writes wait, reads answer (the test's looks): each call of the mover writes, and times
    # out, for as long as the pause lasts. Six of them: its back-off is seconds long by then.
    # (Only the first is a WARNING: the rest are at debug level, once a minute at WARNING.)
    client.execute_command("CLIENT", "PAUSE", 600_000, "WRITE")
    try:
        wait_until(lambda: mover.output().count("Redis unavailable") >= 6, timeout=DEADLINE_S)
        freeze_backing_off(server, mover, client)
    finally:
        client.execute_command("CLIENT", "UNPAUSE")
    mover.popen.send_signal(signal.SIGTERM)  # heard when it goes on, in its back-off
    os.kill(mover.pid, signal.SIGCONT)
    return mover


def test_a_mover_stopped_after_an_outage_takes_its_heartbeat_away(
    server: RedisServer, spawn: Callable[..., Proc]
) -> None:
    """A stop that came while the mover backed off after Redis was away left its heartbeat,
    even though Redis answered again: health said a mover ran for 30 s after it had gone."""
    client = server.client()
    for _ in range(3):
        mover = stopped_in_a_back_off(server, spawn, client)
        assert wait_for_exit(mover) == 0, mover.output()
        assert client.zcard(keys.movers("")) == 0, mover.output()
        # A call that succeeded after the back-off, before the signal was heard (stopped in the
        # instant between the two), says so: that run tested a stop after a success: again.
        if "Redis calls succeed again" not in mover.output():
            return
    pytest.fail("no stop came in a back-off in three runs")


def test_a_second_sigterm_stops_a_mover_at_once(server: RedisServer, spawn: Callable[..., Proc]) -> None:
    # A long socket timeout: here only the second signal can end the wait. The second signal's
    # SystemExit ran the mover's clean-up, which waited on the silent server once more (for
    # its socket timeout): a third signal was needed.
    url = server.delay_url
    mover = spawn(
        [sys.executable, "-m", "kombu_delay", "-b", url, "-o", "socket_timeout=600", "mover"], name="mover"
    )
    client = server.client()
    wait_until(lambda: client.keys("*mover*"), timeout=DEADLINE_S)
    client.close()
    try:
        silence(server, mover)  # the mover's next call waits on a silent socket
        mover.popen.send_signal(signal.SIGTERM)
        wait_until(lambda: "stopping on SIGTERM" in mover.output(), timeout=DEADLINE_S)
        mover.popen.send_signal(signal.SIGTERM)
        assert wait_for_exit(mover, timeout=DEADLINE_S) == 1, mover.output()
        assert "second SIGTERM" in mover.output()
    finally:
        os.kill(pid_of(server), signal.SIGCONT)


STOP_WHILE_WAITING = """
import os, signal, threading
from kombu_delay.cli.mover import handle_stop_signals
stopping = threading.Event()
handle_stop_signals("t", stopping, [])
with stopping._cond:  # held by the main thread, as inside stopping.wait(), when the signal comes
    os.kill(os.getpid(), signal.SIGTERM)
    sum(range(1000))  # the handler runs here, in this thread
print("stopped" if stopping.wait(60) else "not stopped")
"""


def test_a_sigterm_that_comes_inside_a_wait_stops_the_mover() -> None:
    # The handler set the Event itself: a signal that came while the main thread held the
    # Event's lock, inside its wait, deadlocked the mover, deaf to every later signal.
    try:
        done = subprocess.run(
            [sys.executable, "-c", STOP_WHILE_WAITING], capture_output=True, text=True, timeout=DEADLINE_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the signal handler deadlocked on the Event's lock")
    assert done.stdout.strip() == "stopped", done.stderr


# -- a read-only replica ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("writable", "user"),
    [(False, None), (True, None), (True, "noconfig")],
    ids=["read-only", "writable", "writable, CONFIG refused"],
)
def test_a_mover_on_a_replica_waits_for_its_promotion(
    server: RedisServer, caplog, writable: bool, user: str | None
) -> None:
    """During a failover a mover may talk to a replica for a while: every move is refused
    (READONLY) before it writes anything. The mover says so in one line per try, without a
    traceback, keeps everything stored, and moves it all once the replica is promoted. A
    replica that takes writes (replica-read-only no) refused none: the mover moved there, and
    what it moved stayed scheduled on the master (run twice). The mover refuses to move on any
    replica itself, by INFO alone (the documented ACL line grants no CONFIG)."""
    import threading

    from kombu_delay.config import Settings
    from kombu_delay.mover.loop import Mover

    publish_due_soon(server.delay_url, 3, delay_ms=200)
    primary = server.client()
    taking = ["--replica-read-only", "no"] if writable else []
    with RedisServer(extra_args=["--replicaof", "127.0.0.1", str(server.port), *taking]) as replica:
        client = replica.client()
        wait_until(lambda: len(stored(client)) == 3, timeout=DEADLINE_S, interval=0.1)
        wait_until_due(client)
        caplog.set_level("WARNING", logger="kombu_delay")
        url = replica.delay_url if user is None else add_user(client, user, "-config")
        with open_store(url) as store:
            mover = Mover(store, Settings())
            thread = threading.Thread(target=mover.run, daemon=True)
            thread.start()
            try:
                wait_until(lambda: mover.stats.errors >= 2, timeout=DEADLINE_S, interval=0.1)
                assert len(stored(client)) == 3 and client.llen(QUEUE) == 0  # nothing taken
                assert len(stored(primary)) == 3 and primary.llen(QUEUE) == 0
                told = "a mover moves only on a master"
                refused = [r for r in caplog.records if told in r.getMessage()]
                assert refused and all(r.levelname == "WARNING" and not r.exc_info for r in refused)
                assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info]

                client.execute_command("REPLICAOF", "NO", "ONE")  # the failover completes
                wait_until(lambda: client.llen(QUEUE) == 3, timeout=DEADLINE_S, interval=0.1)
            finally:
                mover.stop()
                thread.join(timeout=DEADLINE_S)
            assert not thread.is_alive()
        assert stored(client) == [] and client.llen(QUEUE) == 3
        client.close()


@pytest.mark.skipif(
    not hasattr(kombu_redis.Channel, "_get_queue_expire"), reason="kombu before 5.7 has no x-expires on Redis"
)
def test_a_user_without_pexpire_still_moves_an_x_expires_queue_once(server: RedisServer) -> None:
    """Renewing a queue's x-expires is best effort, as in kombu's publish: a refused PEXPIRE
    must neither stop the move nor leave a pushed message stored (it would come twice)."""
    admin = server.client()
    url = add_user(admin, "nopexpire", "-pexpire")
    temp = Queue(QUEUE, Exchange(QUEUE), QUEUE, expires=30)
    with Connection(server.delay_url) as conn:
        for n, delay in ((1, 200), (2, 600_000)):
            conn.Producer().publish(
                {"n": n},
                exchange=temp.exchange,
                routing_key=QUEUE,
                headers={"x-delay": delay, "id": f"t-{n}"},
                declare=[temp],
                retry=False,
            )
    wait_until_due(admin, "t-1")
    with open_store(url) as store:
        assert store.move_due(100).moved == 1
        with DelayControl(url) as control:
            assert control.reschedule("t-2", countdown=0) == 1
        assert store.move_due(100).moved == 0
    assert stored(admin) == [] and admin.llen(QUEUE) == 2
    assert admin.pttl(QUEUE) == -1  # not renewed: the user may not


def test_too_few_replicas_is_a_refusal_that_waiting_ends(server: RedisServer) -> None:
    """min-replicas-to-write with no replica: Redis refuses every write (NOREPLICAS) and
    writes nothing. That is a RedisRefused, as READONLY is: a thaw then looks again a second
    later, not after the pause for a key damaged by hand, which would make messages late."""
    from kombu_delay.config import Settings
    from kombu_delay.message import Due
    from kombu_delay.mover.loop import Mover

    client = server.client()
    with open_store(server.delay_url) as store:
        due = redis_ms(client) + 120_000
        store.schedule(Due(due, task_id="t"), "q", "payload", Settings(compress_after_ms=30_000))
        mover = Mover(store, Settings(thaw_ahead_ms=3_600_000), watch=False)
        client.config_set("min-replicas-to-write", 1)
        try:
            with pytest.raises(RedisRefused, match="NOREPLICAS"):
                store.thaw(3_600_000, 100)
            assert mover.thaw() == 1.0
        finally:
            client.config_set("min-replicas-to-write", 0)
        mover.thawer._next_look = 0.0
        mover.thaw()
        assert mover.stats.thawed == 1
    client.close()


def test_a_worker_started_in_a_failover_waits_for_writes_and_for_its_master(r, redis_server, server, spawn):
    # A worker started (or reconnecting) while Redis refused writes (a failover's NOREPLICAS)
    # stopped at kombu's first writes: its sweep of unacknowledged messages, its queue's binding.
    # One whose master was demoted (REPLICAOF) stopped on the UNBLOCKED answer to its BRPOP.
    from celery import Celery

    from tests.support.e2e_app import QUEUE
    from tests.support.workers import records, start_worker, wait_worker_ready

    admin = server.client()
    admin.config_set("min-replicas-to-write", 1)
    worker = start_worker(spawn, server.delay_url, redis_server.url, "failover")
    wait_until(lambda: "to record the binding of queue" in worker.output(), timeout=120)
    assert worker.popen.poll() is None, worker.output()
    assert "not restored now" in worker.output()
    admin.config_set("min-replicas-to-write", 0)
    wait_worker_ready(r, server.delay_url, worker)
    told_before = worker.output().count("refuses to hand out")
    admin.replicaof("127.0.0.1", str(free_port()))  # (a master not there: its data stays)
    wait_until(lambda: worker.output().count("refuses to hand out") > told_before, timeout=120)
    admin.replicaof("NO", "ONE")
    app = Celery("failover-publisher", broker=server.delay_url)
    try:
        app.send_task("e2e.record", ("after",), queue=QUEUE)
    finally:
        app.close()
    wait_until(lambda: records(r, "after"), timeout=120)
    assert worker.popen.poll() is None, worker.output()
    assert "Unrecoverable error" not in worker.output()


def test_a_worker_told_to_stop_while_it_waits_to_bind_its_queue_stops_cleanly(r, redis_server, server, spawn):
    # It stopped with "Unrecoverable error" and exit status 1: a stop asked for read as a crash.
    from tests.support.workers import start_worker

    server.client().config_set("min-replicas-to-write", 1)
    worker = start_worker(spawn, server.delay_url, redis_server.url, "stopped")
    wait_until(lambda: "to record the binding of queue" in worker.output(), timeout=120)
    worker.popen.send_signal(signal.SIGTERM)
    assert wait_for_exit(worker, timeout=120) == 0, worker.output()
    assert "Unrecoverable error" not in worker.output()


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_green_pools_worker_started_in_a_failover_waits_for_writes(r, redis_server, server, spawn, pool):
    # Under eventlet's monkey-patching the consumer's thread was not taken for the worker's own
    # (current_thread() is not main_thread() there): it raised NOREPLICAS, and the worker
    # stopped with "Unrecoverable error".
    pytest.importorskip(pool)
    from tests.support.workers import start_worker, wait_worker_ready

    admin = server.client()
    admin.config_set("min-replicas-to-write", 1)
    worker = start_worker(spawn, server.delay_url, redis_server.url, f"failover-{pool}", pool=pool)
    wait_until(lambda: "to record the binding of queue" in worker.output(), timeout=120)
    assert worker.popen.poll() is None, worker.output()
    admin.config_set("min-replicas-to-write", 0)
    wait_worker_ready(r, server.delay_url, worker)
    assert "Unrecoverable error" not in worker.output()


def test_only_a_workers_consumer_waits_for_its_binding_not_a_task(monkeypatch: pytest.MonkeyPatch) -> None:
    # A task publishing to a queue not yet bound waited too: two minutes in a prefork child (a
    # warm shutdown, which a child never hears, did not end it), and in a threads pool a warm
    # shutdown cut the task short, its message acknowledged: lost.
    from celery._state import _task_stack

    from kombu_delay.mover import embedded

    monkeypatch.setattr(embedded, "_worker_pid", os.getpid())
    monkeypatch.setattr(embedded, "_worker_thread", threading.get_ident())
    assert embedded.consuming()  # the worker's own process and thread, outside a task
    seen: list[bool] = []
    thread = threading.Thread(target=lambda: seen.append(embedded.consuming()))  # a threads pool's
    thread.start()
    thread.join()
    assert seen == [False]
    _task_stack.push(object())  # a task running here (the solo pool's)
    try:
        assert not embedded.consuming()
    finally:
        _task_stack.pop()
    monkeypatch.setattr(embedded, "_worker_pid", -1)  # a prefork child, forked from the worker
    assert not embedded.consuming()


def watch_threads() -> int:
    names = ("kombu-delay-watch", "kombu-delay-walk")
    return sum(1 for t in threading.enumerate() if t.name in names and t.is_alive())


def test_a_refused_mover_stops_its_checks_and_an_embedded_one_waits_longer_each_try(server, caplog):
    # An embedded mover retried a refusal every 0.1 s, and each try left the mover's
    # background checks running, with a connection of their own: threads and connections
    # grew without end in the worker.
    url = add_user(server.client(), "celeryonly", "resetkeys", "~celery*")  # none of kombu-delay's keys
    before = watch_threads()
    with Target(url).open() as store:
        mover = Mover(store, Settings())
        with pytest.raises(RedisPermissionError):
            mover.run()
    assert watch_threads() == before
    caplog.set_level(logging.WARNING, logger="kombu_delay.mover.embedded")
    caplog.set_level(logging.WARNING, logger="kombu_delay.mover.watch")
    embedded = EmbeddedMover(Target(url))
    embedded.start()
    try:

        def failures() -> list[str]:
            return [r.getMessage() for r in caplog.records if "; retrying in" in r.getMessage()]

        def waits() -> list[float]:
            found = (re.search(r"retrying in ([0-9.]+) s", text) for text in failures())
            return [float(m[1]) if m else 0.0 for m in found]

        wait_until(lambda: len(failures()) >= 5, timeout=DEADLINE_S)
        assert watch_threads() <= before + 1  # the try under way, at most
    finally:
        embedded.stop()
    # Full jitter over doublings from 0.1 s: the fifth wait is at least 0.8 s.
    assert waits()[4] >= 0.8, waits()
    assert watch_threads() == before
    # Each try told in a line that names the refusal, with no traceback: the refusal is
    # kombu-delay's own error, not a bug (each try logged one, 11 in 75 s).
    tries = [r for r in caplog.records if "; retrying in" in r.getMessage()]
    assert all("ACL" in r.getMessage() and not r.exc_info for r in tries), tries[0].getMessage()
    # The test's Redis keeps nothing on disk: told once, not again at each try.
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"mover {embedded.name}:")]
    assert len([t for t in told if "keeps nothing on disk" in t]) <= 1, told


def test_an_embedded_mover_with_a_pool_too_small_for_it_fails_its_start(server):
    with pytest.raises(ConfigError, match="max_connections=2 is too few for a mover"):
        EmbeddedMover(Target(server.delay_url, {"max_connections": 2})).start()
    for enough in (3, 4, 10, None, 0, False):  # None: kombu's default, 10; 0 and False: redis-py's
        check_pool(Target(server.delay_url, {"max_connections": enough}))


def test_an_embedded_mover_given_an_option_its_connection_cannot_use_stops_and_says_so(server, caplog):
    # It retried for ever at WARNING, every 30 s at most: an option no retry can fix.
    caplog.set_level(logging.WARNING, logger="kombu_delay.mover.embedded")
    embedded = EmbeddedMover(Target(server.delay_url, {"queue_order_strategy": "bogus"}))
    embedded.start()
    try:
        wait_until(lambda: not embedded._thread.is_alive(), timeout=DEADLINE_S)  # type: ignore[union-attr]
    finally:
        embedded.stop()
    (told,) = [r for r in caplog.records if "stopped" in r.getMessage()]
    assert told.levelno == logging.ERROR and "No module named 'bogus'" in told.getMessage()
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


@pytest.mark.parametrize("command", ["EVALSHA", "SCRIPT"])
def test_a_command_renamed_away_is_named_and_the_mover_retries_without_a_traceback(command, caplog):
    # The mover logged "unexpected error; retrying" with a traceback at each try.
    with RedisServer(extra_args=["--rename-command", command, ""]) as renamed:
        store = Store(renamed.client())
        with pytest.raises(
            RedisRefused, match=rf"(?i)renamed or disabled by rename-command\?\): unknown command .{command}"
        ):
            store.move_due(100)
        caplog.set_level(logging.WARNING, logger="kombu_delay.mover.loop")
        mover = Mover(store, Settings())
        thread = threading.Thread(target=mover.run)
        thread.start()
        try:
            wait_until(
                lambda: any("renamed or disabled" in r.getMessage() for r in caplog.records), DEADLINE_S
            )
        finally:
            mover.stop()
            thread.join(DEADLINE_S)
        assert not [r for r in caplog.records if r.exc_info or "unexpected" in r.getMessage()]


def test_an_embedded_mover_stops_when_its_worker_is_told_to_stop(server):
    # Its step's stop comes after the consumer's, which waits for ever on a Redis that does not
    # answer: the mover went on retrying that Redis for as long (65 s in one run).
    embedded = EmbeddedMover(Target(server.delay_url), hostname="w@host")
    embedded.start()
    try:
        wait_until(lambda: embedded.mover is not None, timeout=DEADLINE_S)
        signals.worker_shutting_down.send(sender="other@host", sig="SIGTERM", how="Warm", exitcode=0)
        assert not embedded.mover.stopping  # type: ignore[union-attr]  # another worker's
        signals.worker_shutting_down.send(sender="w@host", sig="SIGTERM", how="Warm", exitcode=0)
        wait_until(lambda: not embedded._thread.is_alive(), timeout=DEADLINE_S)  # type: ignore[union-attr]
    finally:
        embedded.stop()


# -- connecting -------------------------------------------------------------------------------


@contextlib.contextmanager
def counting_listener() -> Iterator[tuple[int, list[int]]]:
    """A port that accepts connections and closes each at once (a server going away), and the
    list its accepts are counted in."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)  # a closed socket does not end an accept() waiting on it
    accepted: list[int] = []
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(1)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], accepted
    finally:
        done.set()
        thread.join(DEADLINE_S)
        listener.close()


@pytest.mark.parametrize("entry", ["open_store", "DelayControl"])
def test_kombu_delays_own_connections_tell_a_failure_after_one_attempt(entry: str) -> None:
    # kombu's own retries spent about 6 s, three attempts, before a mover, `health` or `stats`
    # heard of a closed port or a wrong password; the mover's log said "retrying in 0.1 s".
    with counting_listener() as (port, accepted):
        url = f"delayredis://127.0.0.1:{port}/0"
        with pytest.raises(RedisUnavailable):
            if entry == "open_store":
                with open_store(url):
                    pass
            else:
                with DelayControl(url) as control:
                    control.stats()
        assert accepted == [1]


def test_one_attempt_still_tries_each_of_the_brokers_urls(redis_server: RedisServer) -> None:
    with counting_listener() as (port, accepted):
        url = f"delayredis://127.0.0.1:{port}/0;{redis_server.delay_url}"
        with open_store(url) as store:
            assert store.client.ping()  # the second URL's server
        assert accepted == [1]


def test_a_user_of_prefixed_keys_only_declares_passively(server: RedisServer) -> None:
    # kombu's own look at a queue runs EXISTS on its list's name without the global_keyprefix:
    # a user granted the prefixed keys only (as Security's ACL line has it) was refused it.
    admin = server.client()
    url = add_user(admin, "prefixed", "resetkeys", "~app9:*")
    options = {"global_keyprefix": "app9:"}
    with Connection(url, transport_options=options) as conn:
        channel = conn.channel()
        Queue("held", Exchange("held"), routing_key="held", channel=channel).declare()
        producer = Producer(channel)
        producer.publish({"n": 1}, exchange="held", routing_key="held")
        producer.publish({"n": 2}, exchange="held", routing_key="held", headers={"x-delay": 600_000})
        assert channel.queue_declare("held", passive=True).message_count == 2
        with pytest.raises(ChannelError, match="NOT_FOUND"):
            channel.queue_declare("nothing", passive=True)
        channel.close()


def test_a_purge_refused_the_delayed_messages_still_purges_the_list(server: RedisServer, caplog) -> None:
    # A user with only kombu's keys (a worker's, `celery purge` run with its credentials) is
    # refused the delayed messages: it is told so, and what it may purge is purged first.
    # Logged too: `celery purge` takes the error for a queue that is not there ("No messages
    # purged"), and said nothing of the delayed messages left to run.
    caplog.set_level("WARNING", logger="kombu_delay")
    admin = server.client()
    url = add_user(admin, "listsonly", "resetkeys", "~refusals*", "~_kombu*", "~unacked*")
    with Connection(url) as conn:
        channel = conn.channel()
        queue = Queue(QUEUE, Exchange(QUEUE), routing_key=QUEUE, channel=channel)
        queue.declare()
        Producer(channel).publish({"n": 1}, exchange=QUEUE, routing_key=QUEUE)
        with pytest.raises(RedisPermissionError):
            queue.purge()
        channel.close()
    assert admin.llen(QUEUE) == 0
    told = [r.getMessage() for r in caplog.records if "none of its delayed messages" in r.getMessage()]
    assert len(told) == 1 and f"queue {QUEUE}: the messages on its lists were purged (1)" in told[0], told


@pytest.mark.parametrize("rule", ["-zremrangebyrank", "-hincrby"])
def test_a_purge_refused_a_command_leaves_every_message_findable_and_cancellable(
    server: RedisServer, rule: str
) -> None:
    # A purge refused ZREMRANGEBYRANK had dropped the id-index refs of compressed messages
    # first: they stayed scheduled, and find and cancel answered "not scheduled" for them.
    admin = server.client()
    with Connection(server.delay_url) as conn:
        producer = conn.Producer()
        for n, delay_ms in enumerate([30_000] * 3 + [600_000] * 3):  # the last three compressed
            headers = {"task": "t", "id": f"id{n}", "x-delay": delay_ms}
            producer.publish({"n": n}, routing_key=QUEUE, headers=headers)
    control = DelayControl(server.delay_url)
    before = control.stats().totals
    assert sum(control.store.counts().values()) == 6
    narrow = DelayControl(add_user(admin, "nopurge", rule))
    purged = None
    try:
        purged = narrow.purge(QUEUE)
    except RedisPermissionError as exc:  # named on Redis 7, which is asked first
        assert rule.lstrip("-").upper() in str(exc).upper() or "can't run this command" in str(exc), exc
    finally:
        narrow.close()
    found = {n: len(control.find(f"id{n}")) for n in range(6)}
    if purged is None:  # refused: everything is where it was, and can be found
        assert found == dict.fromkeys(range(6), 1), found
        assert sum(control.store.counts().values()) == 6
        assert control.cancel("id5") == 1
    else:  # Redis 6, which cannot be asked first, refused only a counter: all of it purged
        assert purged == 6 and found == dict.fromkeys(range(6), 0), (purged, found)
        assert control.stats().totals.get("purged", 0) - before.get("purged", 0) in (0, 6)
    control.close()


@pytest.mark.parametrize("rule", ["-hdel", "-zremrangebyrank"])
def test_on_redis_7_a_purge_the_acl_refuses_leaves_no_purge_mark(server: RedisServer, rule: str) -> None:
    # The mark was written before the purge asked the ACL: where the user may not end it
    # (no HDEL), reschedules of the queue were refused for its minute, and nothing was purged.
    admin = server.client()
    if int(admin.info("server")["redis_version"].split(".")[0]) < 7:
        pytest.skip("Redis 6 has no redis.acl_check_cmd: a purge cannot ask the ACL first")
    with Connection(server.delay_url) as conn:
        conn.Producer().publish(
            {"n": 1}, routing_key=QUEUE, headers={"task": "t", "id": "m", "x-delay": 600_000}
        )
    narrow = DelayControl(add_user(admin, "nomark", rule))
    try:
        with pytest.raises(RedisPermissionError, match=rule.lstrip("-").upper()):
            narrow.purge(QUEUE)
    finally:
        narrow.close()
    assert not admin.exists(keys.purging("")) and admin.hgetall(keys.counts("")) == {QUEUE.encode(): b"1"}


def test_a_refused_publish_raises_what_plain_kombus_would_and_counts_no_bad_eta(
    server: RedisServer, caplog
) -> None:
    """A write Redis refuses raises, delayed or not, a class that plain kombu's refused
    ``LPUSH`` is too (redis-py's ``OutOfMemoryError``, ``ReadOnlyError``), besides the
    kombu-delay one. A message with a bad ETA is counted and told as delivered only once it
    is pushed: a refused push raises instead."""
    admin = server.client()
    caplog.set_level("WARNING", logger="kombu_delay")
    big = {"pad": "x" * 200_000}

    def publish(url: str, headers: dict[str, object]) -> None:
        with Connection(url) as conn:
            conn.Producer().publish(big, routing_key=QUEUE, headers=headers, retry=False)

    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", used + 50_000)
    try:
        for url in (server.url, server.delay_url):
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                publish(url, {"task": "t", "id": "late", "x-delay": 600_000})
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            publish(server.delay_url, {"task": "t", "id": "bad", "eta": "not-a-date"})
    finally:
        admin.config_set("maxmemory", 0)
    assert admin.hget(keys.totals(""), "bad_eta") is None and admin.llen(QUEUE) == 0
    assert not [r for r in caplog.records if "delivered now" in r.getMessage()]
    publish(server.delay_url, {"task": "t", "id": "bad", "eta": "not-a-date"})
    assert admin.hget(keys.totals(""), "bad_eta") == b"1" and admin.llen(QUEUE) == 1
    assert len([r for r in caplog.records if "message 'bad' delivered now" in r.getMessage()]) == 1

    with RedisServer(extra_args=["--replicaof", "127.0.0.1", str(server.port)]) as replica:
        for url in (replica.url, replica.delay_url):
            with pytest.raises(redis.exceptions.ReadOnlyError):
                publish(url, {"task": "t", "id": "late", "x-delay": 600_000})


@pytest.mark.parametrize(
    ("major", "command"),
    [
        (7, "hgetall"),
        (7, "zcard"),
        (7, "del"),
        (7, "hset"),
        (7, "time"),
        (7, "zremrangebyscore"),
        (6, "hgetall"),
        (6, "zcard"),
        (6, "exists"),
        (6, "del"),
        (6, "time"),
    ],
    ids=lambda value: str(value),
)
def test_a_mover_refused_a_command_it_needs_stops_and_loses_nothing(
    spawn: Callable[..., Proc], major: int, command: str
) -> None:
    """A refused HGETALL or ZCARD was read as a bucket damaged by hand, and the bucket written
    off ("lost"), its messages left in Redis with nothing to move them; a thaw refused DEL or
    HSET, after it had taken its messages out of the cold space, lost them. On Redis 7 a mover
    asks the ACL at each heartbeat, and a thaw before its first write; Redis 6 cannot be asked,
    and each command that can be tried without writing is tried: it stops, naming the command,
    before it writes anything."""
    from tests.support.servers import binary_before, binary_from

    binary = binary_from(7) if major == 7 else binary_before(7)
    with RedisServer(binary=binary) as server:
        admin = server.client()
        url = add_user(admin, "narrow", f"-{command}")
        now = redis_ms(admin)
        with open_store(server.delay_url) as store:
            for n in range(3):  # due soon, and compressed ones a thaw ahead of 10 minutes takes now
                store.schedule(Due(now + 2_000 + n, task_id=f"o-{n}"), QUEUE, f"o-{n}", Settings())
                due = Due(now + 120_000 + n, task_id=f"c-{n}")
                store.schedule(due, QUEUE, f"c-{n}", Settings(compress_after_ms=60_000, thaw_ahead_ms=30_000))
        assert len(stored(admin)) == 6 and sum(s.cold for s in stored(admin)) == 3
        wait_until(lambda: redis_ms(admin) > now + 2_010)
        mover = spawn(mover_args(url, "--thaw-ahead", "600"), name="mover")
        assert wait_for_exit(mover) != 0
        output = mover.output()
        assert "ACL" in output and command in output.lower(), output
        assert "were lost" not in output, output
        on_list = admin.lrange(QUEUE, 0, -1)
        assert on_list == [] and len(stored(admin)) == 6  # nothing moved, thawed or written off
        good = spawn(mover_args(server.delay_url, "--thaw-ahead", "600"), name="good")
        wait_until(lambda: admin.llen(QUEUE) == 3, timeout=DEADLINE_S)  # the ones due
        wait_until(lambda: not any(s.cold for s in stored(admin)), timeout=DEADLINE_S)  # thawed
        good.stop()
        assert sorted(admin.lrange(QUEUE, 0, -1)) == [b"o-0", b"o-1", b"o-2"]
        assert sorted(s.envelope.payload for s in stored(admin)) == [b"c-0", b"c-1", b"c-2"]


@pytest.mark.parametrize("command", ["del", "hset", "zadd"])
def test_a_thaw_refused_a_command_after_the_heartbeat_asked_takes_nothing(command: str) -> None:
    """The ACL may change between a mover's heartbeat and its thaw: the thaw asks again, before
    its first write (it took the messages out of the cold space, then a refused DEL or HSET
    lost them)."""
    from tests.support.servers import binary_from

    with RedisServer(binary=binary_from(7)) as server:
        admin = server.client()
        url = add_user(admin, "narrow", f"-{command}")
        now = redis_ms(admin)
        with open_store(server.delay_url) as store:
            for n in range(3):
                due = Due(now + 120_000 + n, task_id=f"c-{n}")
                store.schedule(due, QUEUE, f"c-{n}", Settings(compress_after_ms=60_000, thaw_ahead_ms=30_000))
        with open_store(url) as narrow, pytest.raises(RedisPermissionError, match=f"(?i){command}"):
            narrow.thaw(600_000, 100)
        assert [(s.envelope.payload, s.cold) for s in stored(admin)] == [
            (f"c-{n}".encode(), True) for n in range(3)
        ]


def test_on_redis_6_the_commands_are_tried_once_on_keys_of_their_kind_and_miss_nothing_more() -> None:
    """Redis 6 cannot be asked, so a mover tries the commands it needs: it tried them on a key
    of its own that a user whose patterns name each kind of key may not touch (refused, on
    Redis 6 only), and at every heartbeat, each read a miss in keyspace_misses (12 a beat)."""
    from tests.support.servers import binary_before

    with RedisServer(binary=binary_before(7)) as server:
        admin = server.client()
        kinds = [
            "index",
            "cindex",
            "m:*",
            "cm:*",
            "z:*",
            "cz:*",
            "t:*",
            "gc",
            "ids",
            "counts",
            "totals",
            "movers",
        ]
        patterns = [f"~app1:kombu_delay:{kind}" for kind in kinds]
        admin.execute_command("ACL", "SETUSER", "fine", "on", ">pw", "resetkeys", *patterns, "+@all")
        store = Store(redis.Redis(port=server.port, username="fine", password="pw"), "app1:")
        store.heartbeat("m")  # tried, and allowed
        misses = admin.info("stats")["keyspace_misses"]
        for _ in range(5):
            store.heartbeat("m")
        assert admin.info("stats")["keyspace_misses"] == misses
        assert admin.dbsize() == 2  # the heartbeat's own keys (movers, totals): the tries wrote nothing
        store.client.close()


@contextlib.contextmanager
def answering_busy() -> Iterator[tuple[RedisServer, Callable[[], None]]]:
    """A private server that answers BUSY (a script of another client runs past
    busy-reply-threshold) until the caller calls the function yielded, which returns once it
    answers again."""
    with RedisServer() as busy, busy.client() as client:
        client.config_set("lua-time-limit", 100)  # (busy-reply-threshold, on Redis 7)

        def spin() -> None:  # until SCRIPT KILL
            with busy.client() as spinner, contextlib.suppress(redis.ResponseError):
                spinner.eval("while true do end", 0)

        def answers_busy() -> bool:
            try:
                client.ping()
            except redis.ResponseError as exc:
                return "BUSY" in str(exc)
            return False

        def stop() -> None:
            with contextlib.suppress(redis.ResponseError):  # (killed already: NOTBUSY)
                client.script_kill()
            spinning.join(DEADLINE_S)
            wait_until(lambda: not answers_busy(), timeout=DEADLINE_S)  # (a kill takes a moment)

        spinning = threading.Thread(target=spin, daemon=True)
        spinning.start()
        try:
            wait_until(answers_busy, timeout=DEADLINE_S)
            yield busy, stop
        finally:
            stop()


def test_a_mover_started_while_its_redis_runs_a_long_script_waits_for_it(caplog):
    # Redis answers BUSY while a script runs past busy-reply-threshold: a mover started then
    # exited 1, where one already running waits it out.
    with answering_busy() as (busy, stop):
        stopping, opened = threading.Event(), []

        def start() -> None:
            with open_when_reachable(Target(busy.delay_url), stopping, "starting") as store:
                opened.append(store is not None and store.client.ping())

        caplog.set_level(logging.WARNING, logger="kombu_delay.mover")
        starting = threading.Thread(target=start, daemon=True)
        starting.start()
        try:
            wait_until(lambda: "BUSY" in caplog.text and "retrying in" in caplog.text, timeout=DEADLINE_S)
            assert opened == []
            stop()
            starting.join(DEADLINE_S)
        finally:
            stopping.set()
        assert opened == [True]


def test_a_plan_read_while_redis_answers_busy_is_a_refusal_not_a_type_error():
    # The plans' pipelined read took a BUSY reply to TIME for the time: "cannot unpack
    # non-iterable ResponseError", logged as an unexpected error with a traceback.
    with answering_busy() as (busy, stop):
        store = Store(busy.client(), "")
        for read in (store.ordinary_buckets, store.cold_buckets):
            with pytest.raises(RedisRefused, match="BUSY"):
                read(10)
        stop()
        assert store.ordinary_buckets(10)[1] == []
        store.client.close()


def test_a_node_of_a_redis_cluster_is_refused_in_one_line_unless_the_prefix_has_a_hash_tag(
    tmp_path: Path, caplog
) -> None:
    # A mover logged "unexpected error" with a traceback at each try, stats printed a bare
    # redirect ("201 127.0.0.1:port"), ls said "end of listing".
    extra = ["--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf")]
    with RedisServer(extra_args=extra) as node, node.client() as client:
        client.execute_command("CLUSTER", "ADDSLOTS", *range(16384))  # one node, every slot
        wait_until(
            lambda: b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO"), timeout=DEADLINE_S
        )
        with pytest.raises(
            ConfigError, match="is a node of a Redis Cluster, which kombu-delay does not support"
        ):
            DelayControl(node.delay_url).stats()
        done = CliRunner().invoke(main, ["-b", node.delay_url, "stats"])
        assert done.exit_code == 3 and "Redis Cluster" in done.output and "Traceback" not in done.output
        mover = subprocess.run(
            [sys.executable, "-m", "kombu_delay", "-b", node.delay_url, "mover"],
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
        )
        told = mover.stdout + mover.stderr
        assert mover.returncode == 1 and "Error: " in told and "Traceback" not in told, told
        assert "is a node of a Redis Cluster" in told, told
        # Every key in one slot, which this node holds: it works, and says it is unsupported.
        caplog.set_level(logging.WARNING, logger="kombu_delay")
        with DelayControl(node.delay_url, {"global_keyprefix": "{app1}:"}) as control:
            assert control.stats().scheduled == 0
        assert "works only while this node holds it" in caplog.text


def test_a_replica_cut_off_from_its_master_is_a_refusal_waiting_ends():
    # redis-py takes the MASTERDOWN code into its error's class: the mover took the refusal
    # for a bug ("unexpected error", a traceback at each try).
    with RedisServer() as replica, replica.client() as client:
        client.config_set("replica-serve-stale-data", "no")
        client.replicaof("127.0.0.1", str(free_port()))  # a master that is not there
        with pytest.raises(RedisRefused, match="MASTERDOWN") as told, translated_errors():
            client.get("x")
        assert waits_out(told.value)


def test_a_mover_is_not_kept_waiting_by_a_refusal_no_wait_ends(server):
    target = Target(server.delay_url.rsplit("/", 1)[0] + "/99")
    with (
        pytest.raises(RedisRefused, match="DB index is out of range"),
        open_when_reachable(target, threading.Event(), "x"),
    ):
        pass


def test_the_end_of_an_outage_is_timed_from_the_call_that_waited_on_it(
    server: RedisServer, spawn: Callable[..., Proc]
) -> None:
    # A call that waited its socket timeout on a Redis that stopped answering, and failed, was
    # timed from its failure: "Redis calls succeed again, after 0 s" after 10 s of outage.
    mover = spawn([*mover_args(server.delay_url)[:-1], "-o", "socket_timeout=6", "mover"], name="mover")
    with server.client() as client:
        wait_until(lambda: client.zcard(keys.movers("")) == 1, timeout=DEADLINE_S)
    silence(server, mover)
    try:
        wait_until(lambda: "Redis unavailable" in mover.output(), timeout=DEADLINE_S)
    finally:
        os.kill(pid_of(server), signal.SIGCONT)
    ended = wait_until(lambda: re.search(r"succeed again, after (\d+) s", mover.output()), timeout=DEADLINE_S)
    assert isinstance(ended, re.Match) and int(ended[1]) >= 6, mover.output()
