"""``-o KEY=VALUE`` typing, and CLI inputs that must be usage errors, on a real Redis."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import click
import pytest
from celery import Celery
from click.testing import CliRunner, Result

import kombu_delay
from kombu_delay import DelayControl
from kombu_delay.cli import main
from kombu_delay.cli.common import parse_option
from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import Store
from kombu_delay.tooling.redis_server import RedisServer, free_port
from tests.support.procs import ROOT, wait_until
from tests.support.stored import behind, kombu_payload

TIMEOUTS = ("-o", "socket_timeout=5", "-o", "socket_connect_timeout=2.5", "-o", "max_connections=20")


def publish(redis_server, n: int = 1, countdown: float = 600) -> list[str]:
    app = Celery("pub", broker=redis_server.delay_url)
    ids = [app.send_task("options.record", (i,), countdown=countdown + i).id for i in range(n)]
    app.close()
    return ids


def invoke(redis_server, *args: str) -> Result:
    """Run ``kombu-delay`` in-process; exceptions stay on the result."""
    return CliRunner().invoke(main, ["--broker", redis_server.url, "--log-level", "warning", *args])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5", 5),
        ("-3", -3),
        ("2.5", 2.5),
        ("1e3", 1000.0),
        ("true", True),
        ("False", False),
        ("none", None),
        ("NONE", None),
        ("mymaster", "mymaster"),
        ("", ""),
        ("nan", "nan"),  # not a finite number: stays a string
        ("inf", "inf"),
        ("5s", "5s"),
        ("a=b", "a=b"),  # only the first "=" splits
    ],
)
def test_option_values_are_typed(text, expected):
    value = parse_option((f"key={text}",))["key"]
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("item", ["=x", " =x", "novalue"])
def test_an_option_with_no_key_or_no_value_is_a_usage_error(item):
    # "-o =x" was taken, as an option named "".
    with pytest.raises(click.BadParameter, match="expected KEY=VALUE"):
        parse_option((item,))


def test_version_is_told_and_is_no_release_between_releases():
    # Main called itself 1.0.0 while it held what 1.0.0 did not, and an upgrade's order
    # (docs/upgrading.md) depends on telling the two apart.
    result = CliRunner().invoke(main, ["--version"])
    assert (result.exit_code, result.output) == (0, f"kombu-delay {kombu_delay.__version__}\n")
    unreleased, last = (ROOT / "CHANGELOG.md").read_text().split("## [Unreleased]")[1].split("\n## [", 1)
    if unreleased.strip():  # changes since the last release: a development version past it
        assert ".dev" in kombu_delay.__version__ and not last.startswith(f"{kombu_delay.__version__}]")


def test_stats_rows_finer_than_a_second_are_told_apart(r, redis_server):
    # --slot 0.001 (60 ms rows) labelled every row with the same HH:MM:SS.
    result = invoke(redis_server, "stats", "--hours", "0.001", "--slot", "0.001")
    assert result.exit_code == 0, result.output
    rows = [
        line.split()[0] for line in result.stdout.splitlines() if re.match(r"  \d\d:\d\d:\d\d\.\d{3} ", line)
    ]
    assert len(rows) == 60 and len(set(rows)) == 60, result.stdout


def test_numeric_options_work_for_stats_and_health(r, redis_server):
    publish(redis_server, 2)
    result = invoke(redis_server, *TIMEOUTS, "stats", "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    assert '"scheduled": 2' in result.output
    result = invoke(redis_server, *TIMEOUTS, "health", "--max-heartbeat-age", "0", "--max-overdue", "0")
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.stdout.startswith("OK: ")
    result = invoke(redis_server, *TIMEOUTS, "ls", "--json")
    assert result.exit_code == 0, (result.output, result.exception)


def test_mover_runs_with_numeric_options(r, redis_server, spawn):
    base = [sys.executable, "-m", "kombu_delay", "--broker", redis_server.delay_url, "--log-level", "debug"]
    proc = spawn([*base, *TIMEOUTS, "mover"], name="mover")
    clock = behind(r)  # stored however slow this is, and due at once for the mover
    Store(r, clock=clock).schedule(Due(clock() + 500, task_id="o"), "celery", kombu_payload("o"), Settings())

    def delivered() -> bool:
        assert proc.popen.poll() is None, f"mover exited {proc.popen.returncode}: {proc.output()}"
        return bool(r.llen("celery") == 1)

    wait_until(delivered)
    assert Store(r).totals()["moved"] == 1  # by the mover
    assert proc.stop() == 0, proc.output()


@pytest.mark.parametrize("given", ["bogus", "%62ogus"], ids=["plain", "percent-encoded"])
def test_a_bad_ssl_cert_reqs_is_named_with_what_it_takes(given: str) -> None:
    # "bad broker URL delayrediss://...: 'bogus'" named neither the option nor its values.
    url = f"delayrediss://127.0.0.1:1/0?ssl_cert_reqs={given}"
    result = CliRunner().invoke(main, ["-b", url, "stats"])
    assert result.exit_code == 3, result.output
    assert "'bogus': ssl_cert_reqs takes required, optional or none" in result.output, result.output


@pytest.mark.parametrize("command", [("stats",), ("ls",), ("dead",)], ids=lambda c: c[0])
def test_a_bad_transport_option_is_not_blamed_on_the_command_flags(r, redis_server, command):
    result = invoke(redis_server, "-o", "max_connections=many", *command)
    assert "--hours/--slot" not in result.output and "--cursor" not in result.output
    assert result.exit_code == 3, (result.output, result.exception)
    assert "Error: bad broker URL or option: max_connections='many' (takes a number): " in result.output


@pytest.mark.parametrize(
    "args",
    [
        ("--prefix", "p\udcff", "health"),
        ("--prefix", "p\udcff", "mover"),
        ("--prefix", "p\udcff", "dead"),
        ("purge", "-Q", "q\udcff", "--yes"),
        ("ls", "--queue", "q\udcff"),
    ],
    ids=["health", "mover", "dead", "purge", "ls"],
)
def test_a_prefix_or_queue_that_is_not_utf8_is_a_usage_error(r, redis_server, args):
    # Bytes a shell passes that are not UTF-8 (read as lone surrogates) gave a traceback; health
    # exited 1, "unhealthy"; the mover logged "unexpected error" every second, for ever.
    result = invoke(redis_server, *args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert "is not UTF-8 text" in result.output


def test_a_prefix_or_queue_that_is_not_utf8_is_refused_by_the_api(r, redis_server):
    with pytest.raises(kombu_delay.ConfigError, match="not UTF-8 text"):
        Store(r, "p\udcff")
    with DelayControl(redis_server.url) as ctl, pytest.raises(ValueError, match="not UTF-8 text"):
        ctl.purge("q\udcff")


def test_a_redis_error_kombu_delay_names_none_for_is_one_line(tmp_path):
    # A hardened Redis that renamed a command away: a traceback, and health said "unhealthy".
    with RedisServer(extra_args=["--rename-command", "TIME", ""]) as server:
        for command, code in (("health", 2), ("stats", 3)):
            result = invoke(server, command)
            assert result.exit_code == code, (result.output, result.exception)
            assert "Traceback" not in result.output and "TIME" in result.output, result.output


def test_a_fractional_count_in_o_is_refused_not_switched_off(r, redis_server):
    # delay_max_rate=0.5 used to become 0, "no cap": the mover started without one.
    argv = [sys.executable, "-m", "kombu_delay", "--broker", redis_server.delay_url, "--log-level", "warning"]
    done = subprocess.run(
        [*argv, "-o", "delay_max_rate=0.5", "mover"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "delay_max_rate must be a whole number, got 0.5" in done.stderr
    result = invoke(redis_server, "-o", "delay_max_queue_length=2.5", "stats")
    assert result.exit_code == 3 and "delay_max_queue_length must be a whole number" in result.output


@pytest.mark.parametrize("flag", ["--max-rate", "--batch-size", "--max-queue-length"])
def test_a_count_flag_reads_a_number_as_its_variable_does(r, redis_server, flag):
    # KOMBU_DELAY_MAX_RATE=1e3 and -o delay_max_rate=1e3 are 1000; the flag refused "1e3".
    # (The pool refused after the settings are read: the mover gets that far, and no further.)
    result = invoke(redis_server, "-o", "max_connections=1", "mover", flag, "1e3")
    assert result.exit_code == 2 and "too few for a mover" in result.output, result.output
    result = invoke(redis_server, "mover", flag, "2.5")
    assert result.exit_code == 2 and "must be a whole number, got '2.5'" in result.output, result.output


def test_a_duration_too_large_for_a_float_is_one_line_of_error(r, redis_server, monkeypatch):
    # Seconds * 1000 overflowed to infinity: OverflowError and a traceback, from every command.
    argv = [sys.executable, "-m", "kombu_delay", "--broker", redis_server.delay_url, "--log-level", "warning"]
    done = subprocess.run(
        [*argv, "mover", "--max-sleep", "1e308"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "delay_max_sleep must be at most 4398046511 s" in done.stderr and "Traceback" not in done.stderr
    result = invoke(redis_server, "-o", "delay_grace=1e306", "stats")
    assert result.exit_code == 3, (result.output, result.exception)
    assert "Error: delay_grace must be at most 4398046511 s" in result.output
    monkeypatch.setenv("KOMBU_DELAY_MAX_DELAY", "1e308")
    result = invoke(redis_server, "health")
    assert result.exit_code == 2, (result.output, result.exception)
    assert "delay_max_delay must be at most 4398046511 s" in result.output


@pytest.mark.parametrize("pool", ["1", "2", "true"])  # true: redis-py's pool of one
def test_a_mover_refuses_a_pool_too_small_for_it(r, redis_server, pool):
    # It ran, and logged "Redis unavailable (Too many connections); retrying" for a limit of
    # its own making. Three of its pool are what it holds at once.
    result = invoke(redis_server, "-o", f"max_connections={pool}", "mover")
    assert result.exit_code == 2, (result.output, result.exception)
    shown = "True" if pool == "true" else pool
    assert f"max_connections={shown} is too few for a mover" in result.output
    assert "at least 3" in result.output
    assert not r.exists("kombu_delay:movers")  # refused before it connected


def test_a_mover_refuses_a_negative_pool_as_no_number_of_connections(r, redis_server):
    result = invoke(redis_server, "-o", "max_connections=-1", "mover")
    assert result.exit_code == 2, (result.output, result.exception)
    assert "max_connections=-1 is no number of connections" in result.output


def test_a_mover_told_to_serve_metrics_it_cannot_is_a_usage_error(r, redis_server, monkeypatch):
    # Without the metrics extra it exited 1, where the docs say 2 for a flag it cannot use.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "prometheus_client" else real(name, *a)
    )
    result = invoke(redis_server, "mover", "--metrics-port", str(free_port()))
    assert result.exit_code == 2, (result.output, result.exception)
    assert "needs the metrics extra: pip install 'prometheus-client>=0.17'" in result.output


@pytest.mark.parametrize("countdown", ["nan", "inf", "-inf"])
def test_reschedule_refuses_a_non_finite_countdown(r, redis_server, countdown):
    (task_id,) = publish(redis_server, 1)
    with DelayControl(redis_server.url) as ctl:
        before = ctl.find(task_id)[0].due_ms
        result = invoke(redis_server, "reschedule", task_id, "--countdown", countdown)
        assert result.exit_code == 2, (result.output, result.exception)
        assert "Invalid value for --countdown" in result.output and "finite" in result.output
        assert ctl.find(task_id)[0].due_ms == before


@pytest.mark.parametrize(("flag", "value"), [("--hours", "inf"), ("--hours", "nan"), ("--slot", "inf")])
def test_stats_refuses_a_non_finite_histogram(r, redis_server, flag, value):
    result = invoke(redis_server, "stats", flag, value)
    assert result.exit_code == 2, (result.output, result.exception)
    assert "--hours and --slot must be" in result.output


# -- global options after the sub-command ----------------------------------------------


def every_command() -> list[str]:
    return sorted(main.commands)


@pytest.mark.parametrize("name", every_command())
def test_every_sub_command_takes_the_global_options(name):
    result = CliRunner().invoke(main, [name, "--help"])
    assert result.exit_code == 0, result.output
    # bench keeps its own --broker (a Redis it flushes), which has no -b.
    flags = ["--broker", "--prefix", "--transport-option", "-o,", "--log-level"] + ["-b,"] * (name != "bench")
    for flag in flags:
        assert flag in result.output, (flag, result.output)


def test_options_after_the_sub_command_reach_the_inspection_commands(r, redis_server):
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = {"global_keyprefix": "after:"}
    task_id = app.send_task("options.record", countdown=600).id
    app.close()
    url = redis_server.url
    runner = CliRunner()

    def run(*args: str) -> Result:
        return runner.invoke(main, list(args))

    stats = run("stats", "-b", url, "--prefix", "after:", *TIMEOUTS, "--log-level", "error", "--json")
    assert stats.exit_code == 0, stats.output
    assert json.loads(stats.stdout)["scheduled"] == 1
    listed = run("ls", "--json", "--broker", url, "-o", "global_keyprefix=after:")
    assert [item["task_id"] for item in json.loads(listed.stdout)["items"]] == [task_id], listed.output
    healthy = run("health", "-b", url, "--prefix", "after:", "--max-heartbeat-age", "0", "--max-overdue", "0")
    assert healthy.exit_code == 0 and healthy.stdout.startswith("OK: "), healthy.output
    moved = run("reschedule", task_id, "--countdown", "900", "-b", url, "--prefix", "after:")
    assert moved.exit_code == 0 and "rescheduled 1 message" in moved.stdout, moved.output
    assert run("cancel", task_id, "-b", url, "--prefix", "after:").exit_code == 0
    assert run("purge", "--queue", "celery", "--yes", "-b", url, "--prefix", "after:").exit_code == 1


def test_the_sub_command_value_wins(r, redis_server):
    publish(redis_server, 2)
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    argv = ["-b", nowhere, "--prefix", "wrong:", "-o", "max_connections=many"]
    result = CliRunner().invoke(
        main, [*argv, "stats", "--json", "-b", redis_server.url, "--prefix", "", "-o", "max_connections=20"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["scheduled"] == 2
    assert f"kombu-delay: broker {redis_server.url} (--broker), key prefix ''" in result.stderr
    # The group's value stays when the sub-command gives none.
    result = CliRunner().invoke(main, [*argv[:2], "stats", "--json"])
    assert result.exit_code == 3 and "Redis is unavailable" in result.output


def test_mover_takes_the_global_options_after_the_sub_command(r, redis_server, spawn):
    # "kombu-delay mover -b URL" used to fail with "No such option '-b'".
    args = [sys.executable, "-m", "kombu_delay", "mover", "-b", redis_server.delay_url]
    proc = spawn([*args, "--prefix", "late:", "-o", "socket_timeout=5", "--log-level", "debug"], name="mover")
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = {"global_keyprefix": "late:"}
    app.send_task("options.record", countdown=0.5)
    app.close()

    def delivered() -> bool:
        assert proc.popen.poll() is None, f"mover exited {proc.popen.returncode}: {proc.output()}"
        return bool(r.llen("late:celery") == 1)

    wait_until(delivered)
    assert proc.stop() == 0, proc.output()
    output = proc.output()
    assert f"kombu-delay: broker {redis_server.delay_url} (--broker), key prefix 'late:'" in output
    assert " DEBUG kombu_delay." in output  # --log-level after the sub-command took effect


# -- which broker each command reads ------------------------------------------------------


INSPECTION = {
    "stats": ["stats", "--json"],
    "ls": ["ls", "--json"],
    "cancel": ["cancel", "no-such-id"],
    "reschedule": ["reschedule", "no-such-id", "--countdown", "5"],
    "purge": ["purge", "--queue", "nothing", "--yes"],
    "health": ["health", "--max-heartbeat-age", "0"],
}


@pytest.mark.parametrize("command", list(INSPECTION))
def test_every_inspection_command_names_its_broker_and_prefix_on_stderr(r, redis_server, command):
    # The server wants no password: its user "default" takes any (redis-py before 8 sends a
    # password alone with AUTH <password>, which such a server refuses).
    url = f"redis://default:s3cret@127.0.0.1:{redis_server.port}/0"
    result = CliRunner().invoke(main, ["-b", url, "--prefix", "p1:", *INSPECTION[command]])
    masked = f"redis://default:****@127.0.0.1:{redis_server.port}/0"
    assert result.stderr.startswith(f"kombu-delay: broker {masked} (--broker), key prefix 'p1:'\n"), (
        result.stderr
    )
    assert "s3cret" not in result.output
    assert "kombu-delay: broker" not in result.stdout
    if "--json" in INSPECTION[command]:
        json.loads(result.stdout)  # stdout is the JSON alone


@pytest.mark.parametrize("variable", ["KOMBU_DELAY_BROKER", "CELERY_BROKER_URL"])
def test_the_broker_line_names_the_environment_variable(r, redis_server, monkeypatch, variable):
    monkeypatch.delenv("KOMBU_DELAY_BROKER", raising=False)
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    monkeypatch.setenv(variable, redis_server.delay_url)
    result = CliRunner().invoke(main, ["stats", "--json"])
    assert result.exit_code == 0, result.output
    assert f"kombu-delay: broker {redis_server.delay_url} ({variable}), key prefix ''" in result.stderr


def connections(client) -> int:
    return int(client.info("stats")["total_connections_received"])


def test_the_broker_line_says_when_it_is_the_default(r, redis_server, monkeypatch):
    """The default is localhost:6379, which the suite must never touch. A socket option that
    redis-py refuses before it opens a socket stops each command before any connection; the
    first half shows that on the suite's own server."""
    monkeypatch.delenv("KOMBU_DELAY_BROKER", raising=False)
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    no_socket = ["-o", "socket_connect_timeout=abc"]
    before = connections(r)
    for argv in (["stats"], ["health"]):
        result = CliRunner().invoke(main, ["-b", redis_server.url, *no_socket, *argv])
        assert "bad broker URL or option" in result.output, result.output
    assert connections(r) == before
    default = "delayredis://localhost:6379/0 (default; give --broker or KOMBU_DELAY_BROKER), key prefix ''"
    for argv, code in ((["stats"], 3), (["health"], 2)):
        result = CliRunner().invoke(main, [*no_socket, *argv])
        assert result.exit_code == code, result.output
        assert result.stderr.startswith(f"kombu-delay: broker {default}\n"), result.stderr
    assert "delayredis://localhost:6379/0" in CliRunner().invoke(main, ["--help"]).output


def test_a_quiet_healthy_probe_prints_nothing(r, redis_server):
    result = CliRunner().invoke(
        main, ["-b", redis_server.url, "health", "--max-heartbeat-age", "0", "--quiet"]
    )
    assert result.exit_code == 0 and result.output == "", result.output
    result = CliRunner().invoke(main, ["-b", redis_server.url, "health", "--quiet"])
    assert result.exit_code == 1 and result.stderr.startswith("kombu-delay: broker "), result.output


@pytest.mark.parametrize("name", ["username", "password"])
def test_a_user_or_password_given_as_an_option_is_told_to_be_unused(r, redis_server, name, caplog):
    # kombu's Redis transport reads them from the URL only: the connection failed "NOAUTH"
    # where a server asks for one, and nothing said the option was passed over.
    caplog.set_level("WARNING", logger="kombu_delay")
    result = invoke(redis_server, "-o", f"{name}=Qz8vLm2w", "stats")
    assert result.exit_code == 0, result.output
    told = f"does not read the transport option {name!r}: give it in the broker URL"
    assert told in caplog.text and "Qz8vLm2w" not in caplog.text + result.output, caplog.text
