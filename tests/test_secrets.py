"""No part of a broker password reaches what kombu-delay prints, logs or raises, whatever the URL.

Hostile passwords (``/``, ``#``, ``?``, ``@``, ``:``, ``%2F``, spaces) are given raw, with a user
name, percent-encoded and in the query string, to every command of ``kombu-delay`` and of
``celery -A app delay``, against a real redis-server that wants another password. Then a
server that wants such a password is reached with the percent-encoded URL. Every process is
stopped by its PID.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from urllib.parse import quote, unquote

import pytest
import redis
from celery import Celery

from kombu_delay import DelayControl
from kombu_delay.connect import connection
from kombu_delay.errors import ConfigError, KombuDelayError
from kombu_delay.redact import MASK, RedactingFilter, Redactor, mask_url, url_secrets
from tests.support.procs import ROOT, Proc, wait_until
from tests.support.servers import PasswordServer
from tests.support.workers import ECOSYSTEM_APP

#: What the server wants: none of the hostile passwords.
SERVER_PASSWORD = "s3cret"
HOSTILE = ["Zq7/Xk#Wv?Jp", "Hm@Ty:Rb Nc", "Lw%2FGd Qx#Vb", "Fy?Uo/Pe@Sa:Ki%2F Dm", "Bq;Xt7Rn"]
#: kombu retries a refused connection for several seconds by default; once is enough here.
NO_RETRIES = ["-o", "max_retries=0"]
#: Each command, with arguments that reach Redis.
COMMANDS = {
    "mover": ["mover"],
    "health": ["health"],
    "stats": ["stats", "--json"],
    "ls": ["ls"],
    "cancel": ["cancel", "some-id"],
    "reschedule": ["reschedule", "some-id", "--countdown", "5"],
    "purge": ["purge", "--queue", "celery", "--yes"],
    "find": ["find", "some-id"],
    "dead": ["dead"],
}


def urls(port: int) -> list[tuple[str, str]]:
    """(password, URL) pairs: raw, with a user, percent-encoded, and in the query string."""
    where = f"127.0.0.1:{port}/0"
    pairs = []
    for password in HOSTILE:
        pairs.append((password, f"delayredis://:{password}@{where}"))
        pairs.append((password, f"delayredis://kd-user:{password}@{where}"))
        pairs.append((password, f"delayredis://:{quote(password, safe='')}@{where}"))
    pairs.append((HOSTILE[0], f"delayredis://{where}?password={quote(HOSTILE[0], safe='')}"))
    return pairs


def leaks(text: str, password: str) -> list[str]:
    """The pieces of ``password`` (raw, percent-decoded or -encoded; any 3 characters in a row)
    found in ``text``."""
    forms = {password, unquote(password), quote(password, safe="")}
    found = [form for form in forms if form in text]
    for form in (password, unquote(password)):
        found += [form[i : i + 3] for i in range(len(form) - 2) if form[i : i + 3] in text]
    return found


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def password_server() -> Iterator[PasswordServer]:
    with PasswordServer(SERVER_PASSWORD) as server:
        yield server


# -- the pieces, on their own ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("delayredis://:pa/ss@127.0.0.1:6399/0", "delayredis://:****@127.0.0.1:6399/0"),
        ("delayredis://u:a#b?c@d@h:1/2", "delayredis://u:****@h:1/2"),
        ("delayredis://secret@h", "delayredis://****@h"),
        ("delayredis://alice:hunter2;x@h:1/0", "delayredis://alice:****@h:1/0"),  # (a ';', unescaped)
        ("delayredis://:a;b@h1;delayredis://:c;d@h2", "delayredis://:****@h1;delayredis://:****@h2"),
        ("delayredis://h:1/0?password=x%2Fy&ssl_cert_reqs=none", "delayredis://h:1/0?password=****&ssl_cert_reqs=none"),
        ("delaysentinel://:a1@h1:26379;delaysentinel://:b2@h2:26379", "delaysentinel://:****@h1:26379;delaysentinel://:****@h2:26379"),
        ("delayredis://h:6379/0?ssl_ca_certs=/etc/ca@2.pem", "delayredis://h:6379/0?ssl_ca_certs=/etc/ca@2.pem"),
        ("redis+socket:///run/redis.sock", "redis+socket:///run/redis.sock"),
        ("nonsense", "nonsense"),
    ],
)  # fmt: skip
def test_mask_url_masks_even_urls_kombu_cannot_read(url, masked):
    assert mask_url(url) == masked


def test_url_secrets_come_from_the_url_and_the_transport_options():
    options = {"password": "opt-pw", "sentinel_kwargs": {"password": "sentinel-pw"}}
    assert url_secrets("delayredis://u:p/w@h;delayredis://h?password=q%2F", options) == [
        "p/w",
        "q%2F",
        "opt-pw",
        "sentinel-pw",
    ]


def test_a_redactor_masks_the_password_its_forms_and_its_pieces():
    redact = Redactor(["Zq7/Xk#Wv?Jp%2FHm"])
    text = "as 'Zq7' ... Zq7%2FXk%23Wv%3FJp%252FHm ... Zq7/Xk#Wv?Jp/Hm ... 2FHm ... 'Jp' and Xk#Wv stay"
    assert redact(text) == "as '****' ... **** ... **** ... **** ... 'Jp' and Xk#Wv stay"
    assert Redactor([])("unchanged") == "unchanged"


@pytest.mark.parametrize("password", ["x", "ab", "-", "0", "a"])
def test_a_password_shorter_than_a_fragment_is_masked_where_a_url_holds_it(password):
    # Every "x" was masked: "key prefi****" told the password, and garbled every message; then
    # every one standing alone: "127.****.****.1", "without **** trace".
    redact = Redactor([password])
    url = f"redis://:{password}@h:1/0;redis://u:{password}@h2;redis://{password}@h3?password={password}&a=1"
    assert redact(url) == "redis://:****@h:1/0;redis://u:****@h2;redis://****@h3?password=****&a=1"
    text = "prefix_ab-xab abc a-b: a 127.0.0.1 moved 0 messages without a trace (-)"
    assert redact(text) == text


def test_the_log_filter_scrubs_messages_arguments_and_tracebacks():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log_filter = RedactingFilter()
    log_filter.redactor = Redactor.for_url("delayredis://:Hm@Ty:Rb Nc@h/0")
    handler.addFilter(log_filter)
    logger = logging.getLogger("tests.secrets")
    logger.addHandler(handler)
    try:
        logger.warning("connecting with %s", "Hm@Ty:Rb Nc")
        try:
            raise ValueError("bad port 'Hm@Ty:Rb Nc'")
        except ValueError:
            logger.exception("failed")
        # The stack shows the line of the call, where the password is written too.
        logger.warning("%d characters", len("Hm@Ty:Rb Nc"), stack_info=True)
    finally:
        logger.removeHandler(handler)
    # The redactor's promise: the password and its pieces between delimiters of 3 or more
    # characters (here only the whole), not two-character pieces like "Ty" and "Rb".
    assert stream.getvalue().count("Hm@Ty:Rb Nc") == 0
    assert "connecting with ****" in stream.getvalue() and "ValueError" in stream.getvalue()


@pytest.mark.parametrize("password", HOSTILE)
def test_delay_control_raises_no_part_of_a_password(password_server, password):
    for url in (f"delayredis://:{password}@127.0.0.1:{password_server.port}/0",
                f"delayredis://:{quote(password, safe='')}@127.0.0.1:{password_server.port}/0"):  # fmt: skip
        with pytest.raises(KombuDelayError) as caught:
            DelayControl(url, {"max_retries": 0}).stats()
        chain: BaseException | None = caught.value
        while chain is not None:
            assert not leaks(str(chain), password), (url, str(chain))
            chain = chain.__cause__ or chain.__context__


@pytest.mark.parametrize(
    "url",
    [
        "delayredis://:longsecret;x1@127.0.0.1:6399/0",
        "delayredis://127.0.0.1:6399/0?password=longsecret;x1&a=b",
    ],
)
def test_a_semicolon_in_a_password_is_refused_naming_the_fix_and_never_shown(url):
    # One in the query's password= was split off as a URL "with no scheme", shown whole.
    with pytest.raises(ConfigError) as caught:
        DelayControl(url)
    message = str(caught.value)
    assert "holds an unescaped ';'" in message and "percent-encode it" in message, message
    assert "longsecret" not in message and "x1" not in message, message


def test_a_password_that_ends_the_user_info_early_is_refused_naming_the_fix():
    with pytest.raises(ConfigError) as caught:
        DelayControl("delayredis://:pa/ss#x@127.0.0.1:6399/0")
    message = str(caught.value)
    assert message == (
        "broker URL delayredis://:****@127.0.0.1:6399/0: the user name or password holds an unescaped "
        "'/' '#', which ends it early for kombu; percent-encode it: urllib.parse.quote(password, safe=\"\")"
    )


def test_an_at_sign_in_the_query_is_not_a_user_info_part():
    url = "delayrediss://127.0.0.1:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca@2.pem"
    conn = connection(url)  # not refused, and not connected
    assert (conn.hostname, conn.port, conn.password) == ("127.0.0.1", 6380, None)
    assert url_secrets(url) == [] and mask_url(url) == url


def test_a_wrong_password_is_an_authentication_error_without_the_password(password_server):
    url = f"delayredis://:{quote('Hm@Ty:Rb Nc', safe='')}@127.0.0.1:{password_server.port}/0"
    with pytest.raises(redis.AuthenticationError) as caught:
        DelayControl(url, {"max_retries": 0}).stats()
    assert "authentication failed" in str(caught.value).lower()


# -- every command, end to end ----------------------------------------------------------


@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_command_of_kombu_delay_shows_any_part_of_a_password(password_server, command):
    for password, url in urls(password_server.port):
        done = run([sys.executable, "-m", "kombu_delay", "-b", url, *NO_RETRIES, *COMMANDS[command]])
        output = done.stdout + done.stderr
        assert done.returncode not in (0, None), output
        assert not leaks(output, password), (url, leaks(output, password), output)
        assert "Traceback" not in output, output
        assert "kombu-delay: broker delayredis://" in output, output
        assert (
            "percent-encode it" in output
            or "authentication failed" in output.lower()
            or "bad broker URL" in output
        ), output


@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_command_of_celery_delay_shows_any_part_of_a_password(password_server, command):
    # The app's configuration carries the URL.
    for password, url in urls(password_server.port)[::2]:
        env = {"ECO_BROKER": url, "ECO_OPTIONS": '{"max_retries": 0}'}
        done = run([sys.executable, "-m", "celery", "-A", ECOSYSTEM_APP, "delay", *COMMANDS[command]], env)
        output = done.stdout + done.stderr
        assert done.returncode not in (0, None), output
        assert not leaks(output, password), (url, leaks(output, password), output)
        assert "Traceback" not in output, output


def test_a_password_with_url_delimiters_works_percent_encoded(spawn: Callable[..., Proc]) -> None:
    password = "Zq7/Xk#Wv?Jp@Hm:Ty%2F"
    with PasswordServer(password) as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "kd-user", "on", f">{password}", "~*", "&*", "+@all")
        encoded = quote(password, safe="")
        where = f"127.0.0.1:{server.port}/0"
        for user in ("", "kd-user"):
            url = f"delayredis://{user}:{encoded}@{where}"
            masked = f"delayredis://{user}:{MASK}@{where}"
            app = Celery("pub", broker=url, set_as_current=False)
            task_id = app.send_task("secrets.noop", countdown=600).id
            app.send_task("secrets.noop", countdown=0.5)
            app.close()
            base = [sys.executable, "-m", "kombu_delay", "-b", url]
            listed = run([*base, "ls", "--json"])
            assert listed.returncode == 0, listed.stderr
            assert task_id in listed.stdout
            assert f"kombu-delay: broker {masked} (--broker), key prefix ''" in listed.stderr
            mover = spawn([*base, "mover"], name="mover")
            wait_until(lambda: admin.llen("celery") == 1)
            probe = run([*base, "health", "--max-overdue", "0"])
            assert probe.returncode == 0 and probe.stdout.startswith("OK: "), probe.stdout + probe.stderr
            assert run([*base, "cancel", task_id]).returncode == 0
            assert mover.stop() == 0, mover.output()
            for output in (listed.stdout + listed.stderr, probe.stdout + probe.stderr, mover.output()):
                assert not leaks(output, password), output
            assert masked in mover.output()
            admin.delete("celery")
        admin.close()
