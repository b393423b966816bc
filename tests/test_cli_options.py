"""``-o KEY=VALUE`` typing, and CLI inputs that must be usage errors, on a real Redis."""

from __future__ import annotations

import subprocess
import sys

import pytest
from celery import Celery
from click.testing import CliRunner, Result

from kombu_delay import DelayControl
from kombu_delay.cli import main, parse_option
from kombu_delay.config import Settings
from kombu_delay.eta import Due
from kombu_delay.store import Store

from .conftest import ROOT, wait_until
from .delay_helpers import behind, kombu_payload

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


def test_numeric_options_work_for_stats_and_health(r, redis_server):
    publish(redis_server, 2)
    result = invoke(redis_server, *TIMEOUTS, "stats", "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    assert '"scheduled": 2' in result.output
    result = invoke(redis_server, *TIMEOUTS, "health", "--max-heartbeat-age", "0", "--max-overdue", "0")
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.output.startswith("OK: ")
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


@pytest.mark.parametrize("command", [("stats",), ("ls",)], ids=lambda c: c[0])
def test_a_bad_transport_option_is_not_blamed_on_the_command_flags(r, redis_server, command):
    result = invoke(redis_server, "-o", "max_connections=many", *command)
    assert "--hours/--slot" not in result.output and "--cursor" not in result.output
    assert result.exit_code == 3, (result.output, result.exception)
    assert "Error: bad broker URL or option: " in result.output and "max_connections" in result.output


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
