"""Metrics scraped from a real mover process, and the ``health`` probe against real movers."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from kombu_delay.config import Settings
from kombu_delay.connect import open_store
from kombu_delay.control import DelayControl
from kombu_delay.message import Due
from kombu_delay.mover import mover_id
from kombu_delay.mover.loop import Mover
from kombu_delay.ops.metrics import MoverMetrics, serve_metrics
from kombu_delay.ops.series import MAX_QUEUE_SERIES, OTHER_QUEUES, QueueSeries
from kombu_delay.store import Store, keys, spaces
from kombu_delay.store.replies import MoveResult
from kombu_delay.tooling.redis_server import RedisServer, free_port
from tests.support.cli import health, kd
from tests.support.metrics import scrape, try_scrape, value
from tests.support.procs import wait_until
from tests.support.stored import FakeClock, calls, kombu_payload

SOON, LATER = 40, 10


@pytest.fixture
def private_server() -> Iterator[RedisServer]:
    """A server of this test's own, so it can be stopped mid-test."""
    with RedisServer() as server:
        yield server


def test_metrics_while_moving(private_server, spawn, prefix):
    client = private_server.client()
    port = free_port()
    started = time.time()
    args = [sys.executable, "-m", "kombu_delay", "-b", private_server.delay_url]
    if prefix:
        args += ["--prefix", prefix]
    mover = spawn([*args, "mover", "--metrics-port", str(port)], name="mover")
    wait_until(lambda: try_scrape(port), timeout=90)

    app = Celery("pub", broker=private_server.delay_url)
    app.conf.broker_transport_options = {"global_keyprefix": prefix}

    def publish_soon(numbers: range) -> None:
        for i in numbers:  # due 5 s on (stored however slow the publish), half on a priority list
            app.send_task("eco.record", countdown=5, priority=3 if i % 2 else None)

    def lists() -> int:
        return int(client.llen(f"{prefix}celery") + client.llen(f"{prefix}celery\x06\x163"))

    last_moved = [0.0]

    def moved_reaches(target: int) -> dict | None:
        samples = scrape(port)
        moved = value(samples, "kombu_delay_moved_total")
        # Invariants at every scrape, mid-move included.
        assert moved == value(samples, "kombu_delay_lateness_seconds_count")
        assert last_moved[0] <= moved <= target
        last_moved[0] = moved
        return samples if moved == target else None

    # Two waves: the second is published only once a scrape has seen the first moved, so
    # scrapes land mid-move (half moved, half to come) whatever the machine's speed.
    half = SOON // 2
    publish_soon(range(half))
    for _ in range(LATER // 2):
        app.send_task("eco.record", countdown=600)
        app.send_task("eco.record", countdown=600, queue="other")
    wait_until(lambda: moved_reaches(half), timeout=90, interval=0.2)
    assert lists() == half
    publish_soon(range(half, SOON))
    app.close()
    wait_until(lambda: moved_reaches(SOON), timeout=90, interval=0.2)

    def settled() -> dict | None:
        samples = scrape(port)
        done = (
            value(samples, "kombu_delay_moved_total") == SOON
            and samples.get(("kombu_delay_scheduled_messages", (("queue", "celery"),))) == LATER // 2
        )
        return samples if done else None

    samples = wait_until(settled, timeout=90, interval=0.2)
    assert isinstance(samples, dict)
    assert lists() == SOON
    assert value(samples, "kombu_delay_lateness_seconds_count") == SOON
    assert value(samples, "kombu_delay_lateness_seconds_bucket", le="+Inf") == SOON
    assert value(samples, "kombu_delay_scheduled_messages", queue="other") == LATER // 2
    assert value(samples, "kombu_delay_oldest_overdue_seconds") == 0
    assert started <= value(samples, "kombu_delay_last_move_timestamp_seconds") <= time.time()
    assert started <= value(samples, "kombu_delay_last_pass_timestamp_seconds") <= time.time()
    assert value(samples, "kombu_delay_redis_errors_total") == 0
    assert value(samples, "kombu_delay_mover_errors_total") == 0
    assert value(samples, "kombu_delay_dead_letters_total") == 0
    assert value(samples, "kombu_delay_expired_total") == 0

    # Redis goes away: errors are counted, the last pass stops advancing.
    private_server.stop()

    def errors_seen() -> dict | None:
        samples = scrape(port)
        return samples if value(samples, "kombu_delay_redis_errors_total") > 0 else None

    samples = wait_until(errors_seen, timeout=90, interval=0.2)
    assert isinstance(samples, dict)
    assert value(samples, "kombu_delay_moved_total") == SOON
    assert value(samples, "kombu_delay_mover_errors_total") == 0  # a Redis error is not a bug
    assert mover.stop() == 0, mover.output()
    client.close()


def test_health_follows_the_mover(private_server, spawn, prefix):
    client = private_server.client()
    env = {"KOMBU_DELAY_HEARTBEAT_INTERVAL": "0.5"}
    args = [sys.executable, "-m", "kombu_delay", "-b", private_server.delay_url]
    if prefix:
        args += ["--prefix", prefix]

    empty = health(private_server, prefix)
    assert empty.returncode == 1, empty.stdout + empty.stderr
    assert empty.stdout.startswith("UNHEALTHY: no mover heartbeat")

    mover = spawn([*args, "mover"], env=env, name="mover")
    wait_until(lambda: client.zcard(keys.movers(prefix)) == 1, timeout=90)
    ok = health(private_server, prefix, "--max-heartbeat-age", "30", "--max-overdue", "5")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith("OK: movers 1")

    here = health(private_server, prefix, "--this-host")
    assert here.returncode == 0, here.stdout
    # A heartbeat from another host does not make this host's probe healthy.
    store = Store(client, prefix)
    store.heartbeat("elsewhere.example:1:abcd")
    assert mover.stop() == 0, mover.output()
    assert health(private_server, prefix).returncode == 0
    other = health(private_server, prefix, "--this-host")
    assert other.returncode == 1, other.stdout
    assert other.stdout.startswith("UNHEALTHY: no mover heartbeat")
    store.forget_mover("elsewhere.example:1:abcd")

    # A clean stop removes the heartbeat at once.
    stopped = health(private_server, prefix)
    assert stopped.returncode == 1, stopped.stdout
    assert "no mover heartbeat" in stopped.stdout

    # With the heartbeat check off, overdue messages alone make it unhealthy.
    app = Celery("pub", broker=private_server.delay_url)
    app.conf.broker_transport_options = {"global_keyprefix": prefix}
    app.send_task("eco.record", countdown=5)  # stored, however slow the publish
    app.close()
    due = store.earliest_due_ms()
    assert due is not None
    # Not overdue, or by far less than a minute (the probe is a process of its own).
    assert health(private_server, prefix, "--max-heartbeat-age", "0", "--max-overdue", "60").returncode == 0
    wait_until(lambda: store.time_ms() > due + 2000)  # overdue by more than 2 s, by Redis's clock
    overdue = health(private_server, prefix, "--max-heartbeat-age", "0", "--max-overdue", "2")
    assert overdue.returncode == 1, overdue.stdout
    assert "oldest overdue message waits" in overdue.stdout

    # A mover killed with SIGKILL leaves its heartbeat behind; it ages out.
    killed = spawn([*args, "mover"], env=env, name="mover")
    wait_until(lambda: client.llen(f"{prefix}celery") == 1, timeout=90)
    again = health(private_server, prefix, "--max-heartbeat-age", "60", "--max-overdue", "2")
    assert again.returncode == 0, again.stdout
    killed.kill()
    wait_until(
        lambda: health(private_server, prefix, "--max-heartbeat-age", "5").returncode == 1,
        timeout=90,
        interval=0.5,
    )
    stale = health(private_server, prefix, "--max-heartbeat-age", "5")
    assert "no mover heartbeat within 5 s" in stale.stdout

    private_server.stop()
    gone = health(private_server, prefix)
    assert gone.returncode == 2, gone.stdout
    assert gone.stdout.startswith("UNREACHABLE:")
    # An option it does not read is told, as stats tells it, before the connect that fails (it
    # was told nothing, then that the connect failed: "check ssl_ca_certs").
    unread = [
        sys.executable,
        "-m",
        "kombu_delay",
        "-b",
        private_server.delay_url,
        "-o",
        "ssl_ca_certs=/ca.pem",
    ]
    told = subprocess.run([*unread, "health"], capture_output=True, text=True, timeout=120)
    assert told.returncode == 2 and "transport option 'ssl_ca_certs' is not read" in told.stderr, told.stderr
    client.close()


def test_custom_priority_separator(redis_server, r, prefix):
    """With kombu's ``sep`` transport option set, a priority list is still told from its
    queue: the mover moves onto kombu's own key, and metrics and DelayControl count it
    under the queue's name."""
    options = {"global_keyprefix": prefix, "sep": ":", "priority_steps": [0, 3, 6, 9]}
    app = Celery("pub", broker=redis_server.delay_url)
    app.conf.broker_transport_options = options
    for priority in (None, 3, 6):
        app.send_task("eco.record", countdown=600, priority=priority, queue="mail")
    app.send_task("eco.record", countdown=30, priority=3, queue="mail")
    app.close()

    with open_store(redis_server.delay_url, options) as store:
        assert store.sep == ":"
        assert set(store.counts()) == {f"{prefix}mail", f"{prefix}mail:3", f"{prefix}mail:6"}
        clock = FakeClock(r)
        store.clock = clock
        clock.advance(60_000)  # the 30 s one is due, the others not
        port = free_port()
        mover = Mover(store, Settings.from_options(options), name="sep", **serve_metrics(store, port).hooks())

        def settled() -> dict | None:
            mover.drain()
            samples = scrape(port)
            done = samples.get(("kombu_delay_scheduled_messages", (("queue", "mail"),))) == 3
            return samples if done and r.llen(f"{prefix}mail:3") == 1 else None

        samples = wait_until(settled, timeout=60, interval=0.2)
    assert isinstance(samples, dict)
    labels = {labels for name, labels in samples if name == "kombu_delay_scheduled_messages"}
    assert labels == {(("queue", "mail"),)}

    with DelayControl(redis_server.delay_url, options) as control:
        assert control.stats().by_queue == {"mail": 3}
        assert {m.queue for m in control.scheduled().items} == {"mail"}
        assert control.purge("mail") == 3


def test_queue_series_are_bounded_however_many_queues_come_and_go() -> None:
    """A day of short-lived queues, in steps: never more series than the limit plus (other),
    an emptied queue reads 0 for a while and is then dropped, and nothing is lost from the sum."""
    series = QueueSeries(limit=50, zero_keep_s=300)
    shown: set[str] = set()
    now = 0.0
    for step in range(1440):  # a minute each
        now += 60
        waiting = {f"job-{step}-{i}": 1 + i for i in range(60)}  # 60 new queues a minute
        waiting["steady"] = 1000
        values, dropped = series.values(waiting, now)
        assert not set(dropped) & set(values)
        shown = (shown | set(values)) - set(dropped)
        assert len(values) <= 51 and shown == set(values)
        assert sum(values.values()) == sum(waiting.values())
        assert values["steady"] == 1000
    # 86,400 queues came and went; 50 series and (other) remain.
    assert len(shown) == 51
    values, dropped = series.values({}, now + 301)
    assert values == {OTHER_QUEUES: 0} and len(dropped) == 50
    assert QueueSeries(limit=2).values({"a": 1, "b": 2}, 0) == ({"a": 1, "b": 2}, [])  # no (other) yet
    # A queue named "(other)" shares the overflow's series: before, the overflow overwrote it.
    values, _ = QueueSeries(limit=1).values({"a": 5, "b": 2, OTHER_QUEUES: 1000}, 0)
    assert values == {"a": 5, OTHER_QUEUES: 1002}
    assert QueueSeries(limit=2).values({"a": 5, OTHER_QUEUES: 7}, 0) == ({"a": 5, OTHER_QUEUES: 7}, [])


def test_a_mover_with_thousands_of_queues_serves_a_bounded_set_of_series(private_server, spawn):
    client = private_server.client()
    store = Store(client)
    due = store.time_ms() + 3_600_000
    items = [(Due(due, task_id=f"q{i}"), f"short-{i}", f"m{i}") for i in range(1500)]
    store.schedule_many(items, Settings(compress_after_ms=0))
    port = free_port()
    spawn(
        [
            sys.executable,
            "-m",
            "kombu_delay",
            "-b",
            private_server.delay_url,
            "mover",
            "--metrics-port",
            str(port),
        ]
    )

    def bounded() -> dict | None:
        samples = try_scrape(port)
        if not samples:
            return None
        queues = {
            dict(labels)["queue"]: v
            for (name, labels), v in samples.items()
            if name == "kombu_delay_scheduled_messages"
        }
        return queues if sum(queues.values()) == 1500 else None

    queues = wait_until(bounded, timeout=90, interval=0.2)
    assert isinstance(queues, dict)
    assert len(queues) == MAX_QUEUE_SERIES + 1 and queues[OTHER_QUEUES] == 1500 - MAX_QUEUE_SERIES


@pytest.mark.parametrize(
    ("key", "code", "said"),
    [
        (keys.movers, 2, "ERROR: WRONGTYPE "),
        (keys.index, 2, "ERROR: WRONGTYPE "),
        (keys.alerts, 2, "ERROR: WRONGTYPE "),
        (keys.ids, 1, "UNHEALTHY: "),
        (keys.totals, 2, "ERROR: WRONGTYPE "),  # read first, for the storage format
        (keys.taken, 1, "UNHEALTHY: "),  # a hint: passed over, and only this tells
    ],
    ids=["movers", "index", "alerts", "ids", "totals", "taken"],
)
def test_health_names_a_shared_key_of_another_type(redis_server, r, prefix, key, code, said):
    # Every script that writes it fails on it: health printed Redis's WRONGTYPE text, which
    # names no key. A key it reads is an error, as before; another, a reason to be unhealthy,
    # which a liveness probe (its mover beats) does not take for a dead mover.
    Store(r, prefix).heartbeat(mover_id())  # of this host: --liveness counts only those
    r.set(key(prefix), "written by hand")
    try:
        done = health(redis_server, prefix)
        alive = health(redis_server, prefix, "--liveness")
    finally:
        r.delete(key(prefix), keys.movers(prefix))
    assert done.returncode == code, done.stdout + done.stderr
    assert done.stdout.startswith(said), done.stdout
    assert f"{key(prefix)!r} holds a string, not a " in done.stdout, done.stdout
    assert alive.returncode == (0 if code == 1 else 2), alive.stdout + alive.stderr


@pytest.mark.parametrize("command", [["stats"], ["ls"], ["cancel", "x"]], ids=lambda c: c[0])
def test_inspection_commands_name_a_shared_key_of_another_type(redis_server, r, prefix, command):
    # Redis's WRONGTYPE from a script names no key: the commands ended on it alone.
    r.set(keys.totals(prefix), "written by hand")
    try:
        code, out = kd(redis_server, prefix, *command)
    finally:
        r.delete(keys.totals(prefix))
    assert code == 3, out
    assert f"{keys.totals(prefix)!r} holds a string, not a hash" in out, out


@pytest.mark.parametrize(
    ("key", "kind", "lost"),
    [
        (keys.ids, "hash", "the scripts that write it fail on it"),
        # The hints, which the scripts pass over on a key of another type: nothing else told.
        (keys.taken, "zset", "can store a message cancelled meanwhile again"),
        (keys.lists, "hash", "renews the expiry of its own priority list only"),
        (keys.walk, "hash", "every mover walks the id index"),
        (spaces.ORDINARY.large, "zset", "miss its large buckets"),
        (spaces.COLD.large, "zset", "miss its large cold buckets"),
    ],
    ids=["ids", "taken", "lists", "walk", "large", "cold-large"],
)
def test_stats_warns_of_a_shared_key_of_another_type_it_does_not_read(
    redis_server, r, prefix, key, kind, lost
):
    r.set(key(prefix), "written by hand")
    try:
        code, out = kd(redis_server, prefix, "stats")
    finally:
        r.delete(key(prefix))
    assert code == 0, out
    assert f"{key(prefix)!r} holds a string, not a {kind} (written by hand?): " in out, out
    assert lost in out, out


def test_a_liveness_probe_reads_no_queue_head_and_health_still_reads_the_overdue_age(redis_server, r, prefix):
    # Each probe sent one ZRANGE per queue of the earliest bucket, one round trip each: with
    # 20,000 queues about 2 s on loopback, --liveness too, which checks no overdue age.
    store = Store(r, prefix)
    store.heartbeat(mover_id())
    now = int(r.time()[0]) * 1000
    for n in range(50):
        due = Due(now + 3_600_000, task_id=f"t{n}")
        store.schedule(due, f"{prefix}q{n}", kombu_payload(f"t{n}"), Settings(compress_after_ms=0))
    before = calls(r, "zrange")
    alive = health(redis_server, prefix, "--liveness")
    assert alive.returncode == 0, alive.stdout + alive.stderr
    assert calls(r, "zrange") - before < 5 and "oldest overdue" not in alive.stdout, alive.stdout
    done = health(redis_server, prefix)
    assert done.returncode == 0 and "oldest overdue 0.0 s" in done.stdout, done.stdout + done.stderr
    r.delete(keys.movers(prefix))


def test_health_and_stats_say_when_redis_refuses_every_write(server: RedisServer) -> None:
    # health said OK while the master refused every write (NOREPLICAS), then blamed the mover's
    # heartbeat; and OK on a replica, whose every move is refused.
    admin = server.client()
    admin.config_set("min-replicas-to-write", 1)
    done = health(server, "")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith("UNHEALTHY: Redis refuses every write (NOREPLICAS)"), done.stdout
    admin.config_set("min-replicas-to-write", 0)
    admin.replicaof("127.0.0.1", str(free_port()))  # (a master not there)
    try:
        done = health(server, "")
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.stdout.startswith("UNHEALTHY: Redis here is a replica (of 127.0.0.1:"), done.stdout
        # A liveness probe said "no mover heartbeat" (exit 1), and restarted a mover that could not
        # beat: Redis's refusal is no mover's fault.
        done = health(server, "", "--liveness")
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stdout.startswith("ERROR: Redis here is a replica (of 127.0.0.1:"), done.stdout
        assert "a mover restart cannot cure this" in done.stdout
        # A writable replica refuses no write, but movers refuse to move there: no mover beats
        # there, and a restart cures nothing (exit 2; exit 1 restarted a mover in a loop).
        admin.config_set("replica-read-only", "no")
        try:
            done = health(server, "", "--liveness")
            assert done.returncode == 2 and "a mover restart cannot cure this" in done.stdout, done.stdout
            done = health(server, "")
            assert done.returncode == 1 and "movers refuse to move here" in done.stdout, done.stdout
        finally:
            admin.config_set("replica-read-only", "yes")
        with DelayControl(server.delay_url) as control:
            assert any("is a replica" in w for w in control.stats().warnings)
    finally:
        admin.replicaof("NO", "ONE")
    assert "refuses every write" not in health(server, "").stdout


def test_health_says_when_fewer_replicas_are_in_time_than_min_replicas_to_write_asks_for(
    server: RedisServer,
) -> None:
    # With one replica in time of the two asked for, Redis refused every write, and health blamed
    # the mover's heartbeat (exit 1, and --liveness too: a restart that cannot help).
    admin = server.client()
    with RedisServer(extra_args=["--replicaof", "127.0.0.1", str(server.port)]):
        wait_until(lambda: admin.info("replication")["connected_slaves"] == 1, timeout=120)
        admin.config_set("min-replicas-to-write", 2)
        try:
            wait_until(lambda: admin.info("replication").get("min_slaves_good_slaves") == 1, timeout=120)
            done = health(server, "")
            assert done.returncode == 1, done.stdout + done.stderr
            assert done.stdout.startswith("UNHEALTHY: Redis refuses every write (NOREPLICAS): only 1 of"), (
                done.stdout
            )
            assert "asks for 2" in done.stdout
            done = health(server, "", "--liveness")
            assert done.returncode == 2 and "a mover restart cannot cure this" in done.stdout, done.stdout
        finally:
            admin.config_set("min-replicas-to-write", 0)


def test_a_heartbeat_ahead_of_redis_is_no_sign_of_life(redis_server, r, prefix):
    # Scored inf by hand, it was read as a heartbeat 0 s old for ever: OK, with no mover.
    r.zadd(keys.movers(prefix), {mover_id(): "inf"})
    try:
        done = health(redis_server, prefix, "--liveness")
    finally:
        r.delete(keys.movers(prefix))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no mover heartbeat" in done.stdout, done.stdout


def test_stats_counts_no_mover_for_a_heartbeat_ahead_of_redis(redis_server, r, prefix):
    # health passed it over, stats counted it: "movers 1, last heartbeat -26689d22h ago".
    r.zadd(keys.movers(prefix), {"ghost": 4102444800000})
    try:
        code, out = kd(redis_server, prefix, "stats")
        with DelayControl(redis_server.url, {"global_keyprefix": prefix}) as ctl:
            assert ctl.stats().last_heartbeat_ms is None
        # Nor does a publisher that asks whether a mover serves it, nor the stranded check.
        store = Store(r, prefix)
        due = Due(store.time_ms() + 600_000, task_id="t")
        assert (
            store.schedule(due, f"{prefix}q", kombu_payload("t"), Settings(), movers_fresh_ms=30_000).movers
            == 0
        )
        assert Store(r, "elsewhere:").still_stranded([prefix], 30_000) == {prefix: 1}
    finally:
        r.delete(keys.movers(prefix))
        Store(r, prefix).purge([f"{prefix}q"])
    assert code == 0 and "movers     0 (1 more silent for over 30 s), last heartbeat none heard" in out, out


def test_dead_lettered_messages_count_as_expired_in_the_metrics_as_in_the_totals(r):
    # The totals count a dead letter as expired too (lost to delivery), and the docs say the
    # metric does; it counted it in dead_letters_total alone, so it and `stats` disagreed.
    prom = pytest.importorskip("prometheus_client")
    from kombu_delay.ops.metrics import MoverMetrics
    from kombu_delay.store import cold

    clock = FakeClock(r)
    store = Store(r, clock=clock)
    settings = Settings(compress_after_ms=2050, thaw_ahead_ms=2000)
    for tag in ("good", "bad"):
        store.schedule(Due(clock() + 2100, task_id=tag), "q", kombu_payload(tag), settings)
    [start] = [int(s) for s in r.zrange(keys.cold_index(""), 0, -1)]
    key = keys.queue_set("", start, "q", keys.COLD)
    [bad] = [m for m in r.zrange(key, 0, -1) if cold.unpack(m)[0] == "bad"]
    r.zadd(key, {bad[:-4]: r.zscore(key, bad)})
    r.zrem(key, bad)
    clock.advance(150)
    metrics = MoverMetrics(store, prom)
    metrics.on_thaw(store.thaw(2000, 10))
    samples = {
        (s.name, tuple(s.labels.items())): s.value for m in metrics.registry.collect() for s in m.samples
    }
    assert samples[("kombu_delay_dead_letters_total", ())] == 1
    assert samples[("kombu_delay_expired_total", ())] == store.totals()["expired"] == 1
    # How many are kept now: the counter restarts with the mover, and the list keeps them until
    # they are removed, which nothing but `kombu-delay dead` showed.
    metrics.collect_scheduled()
    assert metrics.dead_kept._value.get() == 1
    r.delete(keys.dead(""))
    metrics.collect_scheduled()
    assert metrics.dead_kept._value.get() == 0
    # A dead-letter key of another type (by hand) leaves the other counts read, and no error.
    r.set(keys.dead(""), "written by hand")
    store.schedule(Due(clock() + 60_000, task_id="later"), "q2", kombu_payload("later"), settings)
    errors = metrics.errors._value.get()
    metrics.collect_scheduled()
    assert metrics.scheduled.labels(queue="q2")._value.get() == 1 and metrics.errors._value.get() == errors


def test_a_mover_killed_an_hour_ago_is_not_counted_as_running(r, redis_server, prefix):
    # Its heartbeat is kept for a day: health and stats counted it among the movers ("movers
    # 2") for that long, and an operator checking that two run for redundancy was misled.
    store = Store(r, prefix)
    now = store.time_ms()
    store.heartbeat("host:1:alive", now_ms=now)
    store.heartbeat("host:2:killed", now_ms=now - 3_600_000)

    code, out = kd(redis_server, prefix, "health")
    assert code == 0 and "movers 1 (1 more silent for over 30 s)," in out, out
    code, out = kd(redis_server, prefix, "stats")
    assert code == 0 and "movers     1 (1 more silent for over 30 s), last heartbeat" in out, out


def test_the_overdue_gauge_sees_a_compressed_message_whose_thaw_lags(r, prefix):
    # The gauge read the ordinary space only, from each move: a compressed message overdue
    # because no thaw ran read 0, and the documented overdue alert never fired for it.
    prom = pytest.importorskip("prometheus_client")
    from kombu_delay.ops.metrics import MoverMetrics

    clock = FakeClock(r)
    store = Store(r, prefix, clock=clock)
    settings = Settings(compress_after_ms=2050, thaw_ahead_ms=2000)
    due = clock() + 2100
    store.schedule(Due(due, task_id="cold"), f"{prefix}q", kombu_payload("cold"), settings)
    assert r.zcard(keys.cold_index(prefix)) == 1

    def gauge(metrics: MoverMetrics | None = None) -> float:
        metrics = metrics or MoverMetrics(store, prom)  # a new one reads the compressed space
        metrics.on_result(store.move_due(100))
        samples = {(s.name, ()): s.value for m in metrics.registry.collect() for s in m.samples}
        return value(samples, "kombu_delay_oldest_overdue_seconds")

    clock.advance(2099)
    assert gauge() == 0  # compressed, and not due yet
    clock.advance(1 + 7_000)  # due 7 s ago, and never thawed
    assert gauge() == 7.0
    assert store.thaw(2000, 10).thawed == 1
    assert gauge() == 0  # thawed, and moved by the gauge's move
    assert r.llen(f"{prefix}q") == 1

    # Read before its due time, a compressed message thawed and moved on time is no overdue
    # one after it, until the next read (5 s on): the gauge counted from the due time it read.
    due = clock() + 2100
    store.schedule(Due(due, task_id="later"), f"{prefix}q", kombu_payload("later"), settings)
    metrics = MoverMetrics(store, prom)
    assert gauge(metrics) == 0
    clock.advance(2100 - 2000)
    assert store.thaw(2000, 10).thawed == 1
    clock.advance(2000 + 1500)
    assert gauge(metrics) == 0 and r.llen(f"{prefix}q") == 2


@pytest.mark.parametrize("host_off_s", [-600, 3600])
def test_the_liveness_gauges_carry_redis_s_clock_not_the_mover_host_s(host_off_s):
    # They took the mover host's clock, which needs no sync: 10 minutes behind, a healthy
    # mover read 600 s silent and KombuDelayNoMover paged for ever; an hour ahead, the alert
    # would have stayed quiet for an hour after it stopped.
    import prometheus_client

    metrics = MoverMetrics(None, prometheus_client)
    redis_ms = int(time.time() * 1000) - host_off_s * 1000  # Redis's clock, the host's off by that
    for moved in (3, 0):
        metrics.on_result(
            MoveResult(moved, None, redis_ms + moved, 0, held=0, expired=0, wrongtype=0, more=False)
        )
    sample = metrics.registry.get_sample_value
    assert sample("kombu_delay_last_pass_timestamp_seconds") == redis_ms / 1000
    assert sample("kombu_delay_last_move_timestamp_seconds") == (redis_ms + 3) / 1000


def test_a_scrape_reads_the_moved_count_and_the_latenesses_of_one_instant():
    # A scrape read kombu_delay_moved_total, then the lateness count a move had raised meanwhile:
    # 8 moved, 9 latenesses.
    import prometheus_client

    metrics = MoverMetrics(None, prometheus_client)
    inside, go_on = threading.Event(), threading.Event()
    observe = metrics.lateness.observe

    def observed_slowly(seconds: float) -> None:  # a move's result, counted, not yet observed
        inside.set()
        go_on.wait(60)
        observe(seconds)

    metrics.lateness.observe = observed_slowly
    result = MoveResult(1, None, int(time.time() * 1000), 0, 0, 0, 0, False, lateness_ms=[3])
    mover = threading.Thread(target=metrics.on_result, args=(result,), daemon=True)
    mover.start()
    assert inside.wait(60)
    scraped: list[tuple[float | None, float | None]] = []

    def scrape_now() -> None:
        families = list(metrics.registry.collect())
        samples = {s.name: s.value for family in families for s in family.samples}
        scraped.append(
            (samples.get("kombu_delay_moved_total"), samples.get("kombu_delay_lateness_seconds_count"))
        )

    scraper = threading.Thread(target=scrape_now, daemon=True)
    scraper.start()
    scraper.join(2)  # waits for the result's series, or reads them before it: either is whole
    go_on.set()
    scraper.join(60)
    mover.join(60)
    assert scraped == [(1.0, 1.0)]


def test_the_gauges_read_from_redis_are_unknown_while_it_cannot_be_read(private_server, monkeypatch):
    # They were re-read after a move call that succeeded only: with Redis gone (or failed over
    # to an empty master that refused the mover's writes) they read on as holding what it held.
    prom = pytest.importorskip("prometheus_client")
    from kombu_delay.ops import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "SCHEDULED_REFRESH_S", 0.0)
    store = Store(private_server.client(socket_timeout=5))
    store.schedule(Due(store.time_ms() + 600_000, task_id="t"), "q", kombu_payload("t"), Settings())
    metrics = MoverMetrics(store, prom)
    metrics.on_result(store.move_due(100))

    def gauges() -> list[float]:
        return [
            g._value.get()
            for g in (metrics.scheduled.labels(queue="q"), metrics.dead_kept, metrics.overdue_age)
        ]

    assert gauges() == [1, 0, 0]
    private_server.stop()
    metrics.on_error(redis.ConnectionError("gone"))  # as a failed move call tells it
    assert all(math.isnan(v) for v in gauges())
    private_server.start()  # empty: it keeps nothing on disk
    metrics.on_error(redis.ReadOnlyError("READONLY"))  # a call refused, Redis answering reads
    assert gauges()[:2] == [0, 0]


def test_the_overdue_gauge_reads_what_waits_while_moves_fail(server: RedisServer, prefix: str) -> None:
    # It was set from a move call's result only: while Redis refused writes (a failover under
    # way) but answered reads, it read 0 with 60 messages due for 80 s, and the overdue alert
    # never fired; a compressed index that failed every thaw read 0 too.
    prom = pytest.importorskip("prometheus_client")
    r = server.client()
    store = Store(r, prefix)
    early = FakeClock(r)
    early.ms -= 60_000  # published a minute ago, due 50 s ago (by Redis's clock)
    Store(r, prefix, clock=early).schedule(
        Due(early() + 10_000, task_id="t"), f"{prefix}q", kombu_payload("t"), Settings()
    )
    metrics = MoverMetrics(store, prom)
    sample = metrics.registry.get_sample_value
    r.config_set("min-replicas-to-write", 1)
    try:
        with pytest.raises(redis.RedisError) as refused:
            store.move_due(100)
        metrics.on_error(refused.value)
    finally:
        r.config_set("min-replicas-to-write", 0)
    assert 50 <= sample("kombu_delay_oldest_overdue_seconds") < 600

    metrics = MoverMetrics(store, prom)
    sample = metrics.registry.get_sample_value
    kept = r.dump(keys.cold_index(prefix))
    r.set(keys.cold_index(prefix), "written by hand")  # (no compressed message: none to lose)
    metrics.on_result(store.move_due(100))  # moves the one due: ordinary space, nothing overdue
    assert math.isnan(sample("kombu_delay_oldest_overdue_seconds"))  # the compressed space unread
    assert kept is None and r.llen(f"{prefix}q") == 1


def test_the_gauges_are_unknown_until_redis_has_answered() -> None:
    # A mover started before its Redis served 0 overdue and 0 dead letters (claims), and a last
    # move at 0, which the dashboard's "Last move" panel showed as 57 years ago.
    prom = pytest.importorskip("prometheus_client")
    metrics = MoverMetrics(None, prom)
    sample = metrics.registry.get_sample_value
    for name in ("oldest_overdue_seconds", "dead_letters_kept", "last_move_timestamp_seconds"):
        assert math.isnan(sample(f"kombu_delay_{name}")), name


def test_the_gauges_read_from_redis_are_unknown_while_a_call_waits_on_it(private_server):
    # A Redis stopped, paused or cut off answers nothing: the mover's call waits its socket
    # timeout, and told nothing meanwhile, so the gauges read on as they were (0 overdue while
    # messages fell due, for as long as the timeout).
    prom = pytest.importorskip("prometheus_client")
    store = Store(private_server.client(socket_timeout=300))
    store.schedule(Due(store.time_ms() + 600_000, task_id="t"), "q", kombu_payload("t"), Settings())
    metrics = MoverMetrics(None, prom)
    metrics.attach(store, 1.0)
    mover = Mover(store, Settings(), name="waits", **metrics.hooks())
    thread = threading.Thread(target=mover.run, daemon=True)
    thread.start()

    def scheduled() -> float | None:
        return metrics.registry.get_sample_value("kombu_delay_scheduled_messages", {"queue": "q"})

    wait_until(lambda: scheduled() == 1, timeout=120)
    assert private_server.process is not None
    os.kill(private_server.process.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: math.isnan(scheduled() or 0), timeout=120)  # silent 6 s, not 300
        assert math.isnan(metrics.registry.get_sample_value("kombu_delay_oldest_overdue_seconds") or 0)
    finally:
        os.kill(private_server.process.pid, signal.SIGCONT)
    wait_until(lambda: scheduled() == 1, timeout=120)
    mover.stop()
    thread.join(120)
    assert not thread.is_alive()
