"""``kombu-delay web`` at its edges: every --auth value given is parsed (an empty one refused,
never read as "no auth"), an address it cannot serve on is one line of error, a Redis that
stops answering fails a request in bounded time instead of holding a request thread, and a
request for a host it does not answer to (DNS rebinding) is refused unless --allowed-host names it."""

from __future__ import annotations

import os
import signal
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from kombu_delay.cli import main
from kombu_delay.tooling.redis_server import RedisServer, free_port
from kombu_delay.web.app import MAX_BODY
from kombu_delay.web.guard import AUTH_ENV, loopback_only
from tests.support.procs import wait_until

pytest.importorskip("flask")
pytest.importorskip("waitress")

#: A request against a silent Redis must be answered well within this, s.
BOUND_S = 120


def web(redis_server, *args: str, env: dict[str, str] | None = None):
    return CliRunner(env=env).invoke(main, ["-b", redis_server.delay_url, "web", *args])


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--auth", ""], {AUTH_ENV: "ops:a-long-password"}, "--auth"),  # an unset shell variable
        (["--auth", ""], {AUTH_ENV: None}, "--auth"),
        ([], {AUTH_ENV: ""}, AUTH_ENV),
        (["--auth", "ops"], {AUTH_ENV: None}, "--auth"),
        ([], {AUTH_ENV: "ops:"}, AUTH_ENV),
    ],
)
def test_an_empty_or_malformed_auth_is_refused_before_serving(redis_server, args, env, named):
    result = web(redis_server, "--port", str(free_port()), "--allow-actions", *args, env=env)
    assert result.exit_code == 2, result.output
    assert "expected USER:PASSWORD" in result.output and named in result.output, result.output
    assert "kombu-delay web: http" not in result.output  # it never served


def test_a_host_it_cannot_resolve_is_one_line_of_error(redis_server):
    result = web(redis_server, "--host", "no-such-host.invalid", "--port", str(free_port()))
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Error: cannot serve on no-such-host.invalid:" in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("refresh", ["inf", "nan", "1e306", "86401", "-1"])
def test_a_refresh_out_of_range_is_refused_before_serving(redis_server, refresh):
    # An infinite one made every page a 500; one past 2**31 - 1 ms made the page refresh at once,
    # without pause. On an address nobody can serve on: a value let through fails there instead.
    result = web(redis_server, "--host", "256.0.0.1", "--port", str(free_port()), f"--refresh={refresh}")
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--refresh'" in result.output and "from 0 (off) to 86,400" in result.output
    assert "kombu-delay web: http" not in result.output


@pytest.fixture
def silenced_later() -> Iterator[RedisServer]:
    """A redis-server of this test's own that accepts connections but never answers (SIGSTOP
    once the dashboard is up); continued and stopped by its PID afterwards."""
    server = RedisServer().start()
    assert server.process is not None
    try:
        yield server
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.cleanup()


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=BOUND_S) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_a_silent_redis_fails_dashboard_requests_in_bounded_time(silenced_later, spawn):
    port = free_port()
    args = [sys.executable, "-m", "kombu_delay", "-b", silenced_later.delay_url, "--log-level", "warning"]
    proc = spawn([*args, "web", "--port", str(port), "--threads", "1"], name="web")
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return status_of(base + "/") == 200
        except OSError:
            assert proc.popen.poll() is None, proc.output()
            return False

    wait_until(up, timeout=BOUND_S)
    assert silenced_later.process is not None
    os.kill(silenced_later.process.pid, signal.SIGSTOP)
    # Before: no socket timeout, so the request waited for ever (and held the only thread).
    assert status_of(base + "/scheduled") >= 500
    assert status_of(base + "/static/dashboard.css") == 200  # the thread is free again


def get(url: str, host: str) -> tuple[int, str]:
    """Status and body of a GET of ``url`` with this ``Host`` header."""
    request = urllib.request.Request(url, headers={"Host": host})
    try:
        with urllib.request.urlopen(request, timeout=BOUND_S) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def test_only_the_allowed_hosts_are_answered(redis_server, spawn):
    port = free_port()
    args = [sys.executable, "-m", "kombu_delay", "-b", redis_server.delay_url, "web", "--port", str(port)]
    proc = spawn([*args, "--allowed-host", "dash.example.com"], name="web")
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.popen.poll() is None, proc.output()
        try:
            return get(base + "/overview.json", f"127.0.0.1:{port}")[0] == 200
        except OSError:
            return False

    wait_until(up, timeout=BOUND_S)
    for host in (f"localhost:{port}", f"[::1]:{port}", "dash.example.com", f"dash.example.com:{port}"):
        assert get(base + "/", host)[0] == 200, host
    status, body = get(base + "/", f"attacker.example:{port}")
    assert status == 400 and "--allowed-host" in body and "csrf" not in body
    assert get(base + "/static/dashboard.css", "attacker.example")[0] == 400


@pytest.mark.parametrize("given", ["", "dash.example.com:443", "https://dash.example.com/"])
def test_an_allowed_host_that_is_no_name_is_refused_before_serving(redis_server, given):
    result = web(redis_server, "--port", str(free_port()), "--allowed-host", given)
    assert result.exit_code == 2, result.output
    assert "--allowed-host" in result.output and "not a host name" in result.output, result.output
    assert "kombu-delay web: http" not in result.output


def test_any_host_without_auth_is_warned_about(redis_server):
    # On an address nobody can serve on: it warns, then fails to serve.
    args = ["--host", "256.0.0.1", "--port", str(free_port()), "--allowed-host", "*"]
    result = web(redis_server, *args, env={AUTH_ENV: None})
    assert "warning: --allowed-host '*' without --auth" in result.output, result.output
    result = web(redis_server, *args, "--auth", "ops:a-long-password")
    assert "cannot serve on 256.0.0.1" in result.output and "warning" not in result.output, result.output


def test_a_port_in_use_is_told_alone(redis_server):
    # It said "kombu-delay web: http://...:PORT/" first, as if it served there.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = web(redis_server, "--port", str(port))
    assert result.exit_code == 1, result.output
    assert f"Error: cannot serve on 127.0.0.1:{port}:" in result.output, result.output
    assert "kombu-delay web: http" not in result.output, result.output


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1", "dash.internal"])
def test_actions_others_can_reach_need_auth_and_reading_is_warned_about(redis_server, host):
    # The Host and CSRF checks stop web pages, not other clients: with actions on every address
    # and no --auth, a client naming Host: localhost could cancel tasks, and nothing said so.
    result = web(
        redis_server, "--host", host, "--port", str(free_port()), "--allow-actions", env={AUTH_ENV: None}
    )
    assert result.exit_code == 2, result.output
    assert "--allow-actions on" in result.output and "needs --auth" in result.output, result.output
    assert "kombu-delay web: http" not in result.output
    # Read-only there is served, with a warning; actions with --auth too, without one. (On an
    # address nobody can serve on: it gets as far as serving, then fails.)
    result = web(redis_server, "--host", "256.0.0.1", "--port", str(free_port()), env={AUTH_ENV: None})
    assert "cannot serve on 256.0.0.1" in result.output, result.output
    assert "warning: 256.0.0.1 without --auth" in result.output, result.output
    args = [
        "--host",
        "256.0.0.1",
        "--port",
        str(free_port()),
        "--allow-actions",
        "--auth",
        "ops:a-long-password",
    ]
    result = web(redis_server, *args)
    assert "cannot serve on 256.0.0.1" in result.output and "warning" not in result.output, result.output


def test_only_a_loopback_address_is_taken_for_one_others_cannot_reach():
    assert all(map(loopback_only, ["127.0.0.1", "127.0.0.2", "localhost", "localhost.", "::1", "[::1]"]))
    assert loopback_only("::ffff:127.0.0.1") and not loopback_only("::ffff:192.0.2.1")
    assert not any(map(loopback_only, ["0.0.0.0", "::", "", "192.0.2.1", "dash.internal", "[::1]:80"]))


def test_a_body_over_the_limit_is_refused_before_it_is_read(redis_server, spawn):
    # The app reads no more than 64 KB, but waitress took up to 1 GiB first, into a file, before
    # the Host check or basic auth: one client with no password could fill the disk.
    port = free_port()
    args = [sys.executable, "-m", "kombu_delay", "-b", redis_server.delay_url, "web", "--port", str(port)]
    proc = spawn([*args, "--auth", "ops:s3cret", "--allow-actions"], name="web")

    def up() -> bool:
        try:
            return status_of(f"http://127.0.0.1:{port}/") == 401
        except OSError:
            assert proc.popen.poll() is None, proc.output()
            return False

    wait_until(up, timeout=BOUND_S)
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as sock:
        head = (
            f"POST /task/cancel?id=x HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 1000000000\r\n\r\n"
        )
        sock.sendall(head.encode())  # and no byte of the body: the answer must not wait for it
        assert sock.recv(4096).startswith(b"HTTP/1.1 413 ")
    # A body of the app's limit, whole, is the app's to answer (here: no password given).
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as sock:
        body = b"x" * MAX_BODY
        head = f"POST /task/cancel?id=x HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {len(body)}\r\n"
        sock.sendall(head.encode() + b"\r\n" + body)
        assert sock.recv(4096).startswith(b"HTTP/1.1 401 ")
