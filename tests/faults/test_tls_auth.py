"""TLS that cannot be switched off by ``ssl=True``, and credentials that are refused at once.

Every test starts its own redis-server (plain, TLS-only, or with ``requirepass``) and
stops it, and every mover process by its PID.
"""

from __future__ import annotations

import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from click.testing import CliRunner
from kombu import Connection
from kombu.exceptions import OperationalError

from kombu_delay.cli import main
from kombu_delay.connect import app_target, open_store
from kombu_delay.errors import ConfigError, KombuDelayError, RedisAuthError, RedisUnavailable
from kombu_delay.mover import open_when_reachable
from kombu_delay.mover.loop import Mover
from kombu_delay.tooling.redis_server import RedisServer, free_port
from tests.support.procs import Proc, wait_until
from tests.support.servers import PasswordServer, TLSRedisServer, running_tls_server, tls_files
from tests.support.stored import calls, stored

PASSWORD = "s3cret"
#: Generous: the suite shares two cores with other work.
DEADLINE_S = 120.0
#: Bounds on one connection attempt, so a TLS client facing a plaintext server cannot hang:
#: generous, for connections that must succeed on a busy machine.
TIMEOUTS = {"socket_connect_timeout": 10, "socket_timeout": 10, "max_retries": 0}
#: The same for a connection that must fail (it fails by a timeout too): short, as it changes
#: no outcome.
MUST_FAIL = {"socket_connect_timeout": 3, "socket_timeout": 3, "max_retries": 0}


# -- delayrediss:// with ssl=True ---------------------------------------------------------


@pytest.fixture
def password_server() -> Iterator[PasswordServer]:
    with PasswordServer(PASSWORD) as server:
        yield server


def _kombu_channel(url: str, options: dict[str, Any] = TIMEOUTS) -> Any:
    with Connection(url, ssl=True, transport_options=options) as conn:
        return conn.default_channel


def _celery_channel(url: str, options: dict[str, Any] = TIMEOUTS) -> Any:
    app = Celery("tls", broker=url, set_as_current=False)
    app.conf.broker_use_ssl = True
    app.conf.broker_transport_options = options
    with app.connection_for_write() as conn:
        return conn.default_channel


@pytest.mark.parametrize(
    "channel", [_kombu_channel, _celery_channel], ids=["kombu-ssl-true", "celery-use-ssl-true"]
)
def test_delayrediss_with_ssl_true_never_talks_plaintext(
    password_server: PasswordServer, channel: Callable[[str], Any]
) -> None:
    """``ssl=True`` (kombu) or ``broker_use_ssl=True`` (Celery) against a server that speaks
    no TLS: the connection fails; no password and no command reach the server in the clear."""
    url = f"delayrediss://:{PASSWORD}@127.0.0.1:{password_server.port}/0"
    admin = password_server.client()
    try:
        before = calls(admin, "auth"), calls(admin, "hello"), calls(admin, "ping")
        started = time.monotonic()
        with pytest.raises((OperationalError, redis.RedisError, OSError)):
            channel(url, MUST_FAIL)
        assert time.monotonic() - started < DEADLINE_S
        assert (calls(admin, "auth"), calls(admin, "hello"), calls(admin, "ping")) == before
    finally:
        admin.close()


def test_delayrediss_ssl_true_means_verified_tls(password_server: PasswordServer) -> None:
    conn = Connection(f"delayrediss://127.0.0.1:{password_server.port}/0", ssl=True)
    try:
        conn.transport  # noqa: B018  (creating the transport settles the options)
        assert conn.ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    finally:
        conn.release()


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[TLSRedisServer]:
    with running_tls_server(tmp_path) as server:
        yield server


def test_delayrediss_with_ssl_true_verifies_then_works_against_a_tls_server(
    tls_server: TLSRedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"delayrediss://127.0.0.1:{tls_server.port}/0"
    # Verified against the system CAs, which do not know our test CA: refused.
    with pytest.raises(OperationalError, match="certificate verify failed"):
        _kombu_channel(url)
    # Trusting our CA the way OpenSSL's defaults allow, the same ssl=True connects over TLS.
    monkeypatch.setenv("SSL_CERT_FILE", tls_server.ca)
    with Connection(url, ssl=True, transport_options=TIMEOUTS) as conn:
        channel = conn.default_channel
        assert issubclass(channel.pool.connection_class, redis.SSLConnection)
        conn.Producer().publish({"n": 1}, routing_key="tls", headers={"x-delay": 30_000}, retry=False)
    admin = tls_server.client()
    try:
        [held] = stored(admin)
        assert held.envelope.dest == "tls"
    finally:
        admin.close()


def test_the_app_movers_and_commands_use_broker_use_ssl(
    tls_server: TLSRedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``celery -A app delay ...`` and the embedded mover connect as the app's publishers
    do, with its ``broker_use_ssl``: here a private CA that the system does not trust."""
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    app = Celery("tls", broker=f"delayrediss://127.0.0.1:{tls_server.port}/0", set_as_current=False)
    app.conf.broker_use_ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": tls_server.ca}
    app.conf.broker_transport_options = {"socket_timeout": 10, "socket_connect_timeout": 10}
    with app.connection_for_write() as conn:
        producer = conn.Producer()
        producer.publish({"n": 1}, routing_key="tls", headers={"x-delay": 600_000}, retry=False)
        producer.publish({"n": 2}, routing_key="tls", headers={"x-delay": 200}, retry=False)
    target = app_target(app)
    # The embedded mover's way in: open_when_reachable(app_target(app)).
    with open_when_reachable(target, threading.Event(), "tls-test") as store:
        assert store is not None
        due = store.earliest_due_ms()
        assert due is not None
        wait_until(lambda: store.time_ms() > due)  # the 200 ms one, by Redis's clock
        assert Mover(store, target.settings(), watch=False).drain().moved == 1
    admin = tls_server.client()
    try:
        assert admin.llen("tls") == 1
    finally:
        admin.close()
    # celery -A app delay stats builds its command on the same target.
    result = CliRunner().invoke(main, ["stats", "--json"], obj=target)
    assert result.exit_code == 0, result.output
    assert '"scheduled": 1' in result.output


# -- credentials --------------------------------------------------------------------------


def _urls(server: RedisServer) -> dict[str, str]:
    where = f"127.0.0.1:{server.port}/0"
    return {
        "wrong-password": f"delayredis://:wrong@{where}",
        "no-password": f"delayredis://{where}",
        "wrong-user": f"delayredis://nobody:{PASSWORD}@{where}",
    }


@pytest.mark.parametrize("case", ["wrong-password", "no-password"])
def test_mover_with_bad_credentials_exits_at_once_naming_authentication(
    password_server: PasswordServer, spawn: Callable[..., Proc], case: str
) -> None:
    """README: a wrong password stops the mover at once, with the error; it is not an outage.
    (``spawn`` stops the process by its PID if it is still running at the end.)"""
    url = _urls(password_server)[case]
    mover = spawn([sys.executable, "-m", "kombu_delay", "--broker", url, "mover"], name="mover")
    deadline = time.monotonic() + DEADLINE_S
    while mover.popen.poll() is None and "retrying" not in mover.output():
        assert time.monotonic() < deadline, f"the mover neither exited nor retried: {mover.output()}"
        time.sleep(0.1)
    output = mover.output()
    assert "retrying" not in output, output
    assert mover.popen.returncode not in (None, 0), output
    assert "authentication failed" in output.lower(), output
    assert "Traceback" not in output, output  # one line that names the problem


def test_a_password_changed_under_a_running_mover_stops_it_with_one_line(
    password_server: PasswordServer, spawn: Callable[..., Proc]
) -> None:
    """A password rotated while the mover runs: its reconnect is refused, and it stops as it
    does at start-up, naming authentication. The wake-up subscription's reconnect, which reads
    outside the store's calls, raised redis-py's error raw, and the CLI printed a traceback."""
    url = f"delayredis://:{PASSWORD}@127.0.0.1:{password_server.port}/0"
    mover = spawn([sys.executable, "-m", "kombu_delay", "--broker", url, "mover"], name="mover")
    admin = password_server.client()
    # Running, and subscribed (after its first round's calls): the subscription is what is cut.
    wake = b"kombu_delay:wake"
    wait_until(lambda: admin.zcard("kombu_delay:movers") == 1, timeout=DEADLINE_S)
    wait_until(lambda: dict(admin.pubsub_numsub(wake))[wake] == 1, timeout=DEADLINE_S)
    admin.config_set("requirepass", "rotated")  # this admin connection stays logged in
    # The subscription alone, so that its reconnect, not a store call's, meets the refusal.
    admin.client_kill_filter(_type="pubsub")
    wait_until(lambda: mover.popen.poll() is not None, timeout=DEADLINE_S)
    output = mover.output()
    assert mover.popen.returncode == 1, output
    assert "authentication failed" in output.lower(), output
    assert "Traceback" not in output, output


@pytest.mark.parametrize("case", ["wrong-password", "no-password", "wrong-user"])
def test_open_store_raises_an_authentication_error_not_an_outage(
    password_server: PasswordServer, case: str
) -> None:
    with (
        pytest.raises(RedisAuthError, match="authentication failed") as caught,
        open_store(_urls(password_server)[case]),
    ):
        pass
    assert not isinstance(caught.value, RedisUnavailable)  # what the mover waits out


def test_health_names_the_authentication_failure(password_server: PasswordServer) -> None:
    result = CliRunner().invoke(main, ["-b", _urls(password_server)["wrong-password"], "health"])
    assert result.exit_code == 2, result.output
    assert result.stdout.startswith("ERROR: Redis authentication failed"), result.output


@pytest.mark.parametrize("command", [["stats"], ["ls"], ["cancel", "some-id"]])
def test_inspection_commands_name_the_authentication_failure(
    password_server: PasswordServer, command: list[str]
) -> None:
    result = CliRunner().invoke(main, ["-b", _urls(password_server)["wrong-password"], *command])
    assert result.exit_code == 3, result.output
    assert "authentication failed" in result.output.lower(), result.output
    assert "unavailable" not in result.output.lower(), result.output


def test_publisher_sees_an_authentication_error_from_a_held_message(
    password_server: PasswordServer,
) -> None:
    """The password changes under a running publisher: the held-message path (kombu-delay's
    own Redis call) raises what plain kombu's LPUSH would, a ``redis.AuthenticationError``,
    which kombu's retry policy treats as a connection error and reports as its own."""
    admin = password_server.client()
    conn = Connection(
        f"delayredis://:{PASSWORD}@127.0.0.1:{password_server.port}/0", transport_options=TIMEOUTS
    )
    try:
        producer = conn.Producer()
        producer.publish({"n": 0}, routing_key="auth", headers={"x-delay": 30_000}, retry=False)
        admin.config_set("requirepass", "rotated")  # this admin connection stays logged in
        conn.default_channel.pool.disconnect()  # the next call logs in again, with the old password
        with pytest.raises(redis.AuthenticationError) as caught:
            producer.publish({"n": 1}, routing_key="auth", headers={"x-delay": 30_000}, retry=False)
        assert isinstance(caught.value, RedisAuthError) and isinstance(caught.value, KombuDelayError)
        assert not isinstance(caught.value, RedisUnavailable)
        assert "authentication failed" in str(caught.value).lower()
        with pytest.raises(OperationalError):
            producer.publish(
                {"n": 2},
                routing_key="auth",
                headers={"x-delay": 30_000},
                retry=True,
                retry_policy={"max_retries": 1},
            )
        assert len(stored(admin)) == 1
    finally:
        conn.release()
        admin.close()


def test_a_tls_url_at_a_port_without_tls_says_what_its_timeout_may_mean(
    password_server: PasswordServer,
) -> None:
    # The handshake goes unanswered, and the connection timed out as a Redis away would, saying
    # only "Timeout connecting to server".
    url = f"delayrediss://127.0.0.1:{password_server.port}/0"
    timeouts = {"socket_connect_timeout": 2, "socket_timeout": 2}
    with (
        pytest.raises(RedisUnavailable, match="over TLS: a port that does not speak TLS"),
        open_store(url, timeouts),
    ):
        pass
    closed = f"delayredis://127.0.0.1:{free_port()}/0"  # a plain URL at a closed port: no such hint
    with pytest.raises(RedisUnavailable) as raised, open_store(closed, timeouts):
        pass
    assert "TLS" not in str(raised.value)


def test_a_plain_url_at_a_port_that_speaks_tls_says_what_its_closing_may_mean(
    tls_server: TLSRedisServer,
) -> None:
    # Redis closes a connection without TLS at its TLS port: "Connection reset by peer", no more.
    url = f"delayredis://127.0.0.1:{tls_server.port}/0"
    timeouts = {"socket_connect_timeout": 5, "socket_timeout": 5}
    with pytest.raises(RedisUnavailable, match="if it does, use delayrediss://"), open_store(url, timeouts):
        pass


def test_a_tls_file_that_cannot_be_read_is_a_configuration_error_naming_it(
    tls_server: TLSRedisServer, spawn: Callable[..., Proc]
) -> None:
    # redis-py told it as "Error 2 connecting to 127.0.0.1:PORT. No such file or directory.":
    # Redis unavailable, which a mover tried again for ever.
    url = (
        f"delayrediss://127.0.0.1:{tls_server.port}/0?ssl_cert_reqs=required&ssl_ca_certs=/nonexistent/ca.pem"
    )
    told = "ssl_ca_certs '/nonexistent/ca.pem' (no readable file)"
    for command, code in ((["stats"], 3), (["health"], 2)):
        result = CliRunner().invoke(main, ["-b", url, *command])
        assert result.exit_code == code and told in result.output, result.output
    mover = spawn([sys.executable, "-m", "kombu_delay", "-b", url, "mover"], name="mover")
    assert mover.popen.wait(timeout=DEADLINE_S) == 1
    assert told in mover.output() and "Traceback" not in mover.output(), mover.output()


def test_a_refused_certificate_is_told_as_one(tls_server: TLSRedisServer, tmp_path: Path) -> None:
    # A wrong CA read "Redis is unavailable: ... certificate verify failed", with nothing to check.
    (tmp_path / "other").mkdir()
    stranger, _, _ = tls_files(tmp_path / "other")  # a CA that signed no certificate of this server
    url = f"delayrediss://127.0.0.1:{tls_server.port}/0?ssl_cert_reqs=required&ssl_ca_certs={stranger}"
    refused = "TLS certificate was refused: check ssl_ca_certs"
    with pytest.raises(RedisUnavailable, match=refused), open_store(url, MUST_FAIL):
        pass


def test_a_client_certificate_asked_for_and_not_given_is_told(tmp_path: Path) -> None:
    # A server with tls-auth-clients yes closes a client that gives no certificate: told as
    # "Redis is unavailable", at times "EOF occurred in violation of protocol", with no hint.
    ca, cert, key = tls_files(tmp_path)

    class AskingServer(TLSRedisServer):  # its own looks give the server's certificate as theirs
        def client(self, **kwargs: object) -> redis.Redis:
            return super().client(ssl_certfile=cert, ssl_keyfile=key, **kwargs)

    server = AskingServer(ca, cert, key)
    server.extra_args[server.extra_args.index("--tls-auth-clients") + 1] = "yes"
    try:
        server.start()
    except RuntimeError as exc:
        server.cleanup()
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server has no TLS support: {exc}")
        raise
    try:
        url = f"delayrediss://127.0.0.1:{server.port}/0?ssl_cert_reqs=required&ssl_ca_certs={server.ca}"
        with (
            pytest.raises(RedisUnavailable, match="asks for client certificates"),
            open_store(url, MUST_FAIL),
        ):
            pass
        (tmp_path / "other").mkdir()  # a client certificate of a CA the server does not trust
        _, stranger, stranger_key = tls_files(tmp_path / "other")
        url += f"&ssl_certfile={stranger}&ssl_keyfile={stranger_key}"
        with (
            pytest.raises(RedisUnavailable, match="asks for client certificates"),
            open_store(url, MUST_FAIL),
        ):
            pass
    finally:
        server.cleanup()


@pytest.mark.parametrize("damage", ["no certificate in the CA file", "a key not the certificate's"])
def test_a_tls_file_openssl_cannot_use_is_a_configuration_error_for_publishers_too(
    tls_server: TLSRedisServer, tmp_path: Path, damage: str
) -> None:
    # Told as "Redis is unavailable", and tried again for ever; a worker's own consumer and
    # apply_async said "Error 2 connecting ..." even for a file not there.
    (tmp_path / "other").mkdir()
    _, other_cert, _ = tls_files(tmp_path / "other")  # a certificate, and (below) our server's key
    ssl_options: dict[str, Any] = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": tls_server.ca}
    if damage.startswith("no certificate"):
        empty = tmp_path / "empty.pem"
        empty.write_text("not a certificate\n")
        ssl_options["ssl_ca_certs"] = str(empty)
    else:
        ssl_options.update(ssl_certfile=other_cert, ssl_keyfile=str(tmp_path / "key.pem"))
        (tmp_path / "key.pem").write_text(Path(tls_server.ca).with_name("s.key").read_text())
    url = f"delayrediss://127.0.0.1:{tls_server.port}/0"
    with (
        pytest.raises(ConfigError, match="bad TLS option: OpenSSL cannot use"),
        open_store(url, MUST_FAIL, ssl_options),
    ):
        pass
    with (
        Connection(url, ssl=ssl_options, transport_options=MUST_FAIL) as publisher,
        pytest.raises(ConfigError, match="bad TLS option"),
    ):
        publisher.Producer().publish({"n": 1}, routing_key="tls", headers={"x-delay": 30_000}, retry=False)
