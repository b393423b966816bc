"""Faults, load and bad input: nothing lost, nothing doubled, nothing early.

Every test keeps a ledger of what it published and counts what arrives on the
destination list, stamped by the Redis clock at the instant it was popped. The
default sizes fit CI; ``KOMBU_DELAY_CHAOS=1`` (``tox -e chaos``) runs the large
ones and the soak. Tests that restart or reconfigure Redis start their own server.
"""

from __future__ import annotations

import random
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection
from kombu.exceptions import OperationalError

from kombu_delay import keys
from kombu_delay.config import Settings
from kombu_delay.errors import RedisUnavailable
from kombu_delay.eta import Due, to_ms
from kombu_delay.redis_server import RedisServer
from kombu_delay.store import RedisRefused, Scheduled, Store

from .faults_support import (
    Consumer,
    Ledger,
    Movers,
    chaos_only,
    consistency,
    figures,
    message,
    started,
    wait_for,
)

#: Generous: the suite shares two cores with other work.
DEADLINE_S = 240.0


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


# -- 1. mover crashes -------------------------------------------------------------------

BURSTS = {
    # messages, due instants, min kills during the burst, per-mover rate cap (msgs/s)
    "ci": (30_000, 10, 4, 900),
    "chaos": (100_000, 20, 20, 800),
}


@pytest.mark.parametrize("size", ["ci", pytest.param("chaos", marks=chaos_only)])
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

        first_due = store.time_ms() + 3000 + n // 5
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
            time.sleep(0.5)  # anything a mover pushed late would show up now
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
    pytest.param("always", True, "ci", id="always-sigkill-ci"),
    pytest.param("everysec", False, "ci", id="everysec-sigterm-ci"),
    pytest.param("everysec", True, "ci", id="everysec-sigkill-ci"),
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
        restart_at = {n * (k + 1) // (restarts + 1) for k in range(restarts)}
        threads: list[threading.Thread] = []

        def restart() -> None:
            kill_times.append(time.monotonic())
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
            time.sleep(0.5)
        assert consumer.poll_once() == 0

        def near_kill(when: float) -> bool:
            return any(t - EVERYSEC_WINDOW_S <= when <= t + 1 for t in kill_times)

        lost = ledger.lost()
        doubled = ledger.doubled()
        figures(
            f"redis_restart_{fsync}_{'kill' if kill else 'term'}_{size}",
            restarts=len(kill_times),
            retried_publishes=len(ledger.uncertain),
            consumer_reconnects=consumer.errors,
            **ledger.summary(),
        )
        if fsync == "everysec" and kill:
            assert all(near_kill(acked_at[mid]) for mid in lost), lost
        else:
            assert lost == []
        # A publish retried after an error may have landed the first time too (at least once).
        assert set(doubled) <= ledger.uncertain | {m for m in doubled if kill and fsync == "everysec"}
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
        retried: list[BaseException] = []
        timer = threading.Timer(1.5, server.start)
        timer.start()
        patient = {"max_retries": 100, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.2}
        patient["errback"] = lambda exc, interval: retried.append(exc)
        publish("retried-0", retry=True, retry_policy=patient)
        ledger.published("retried-0", 0)
        timer.join()
        app.send_task("faults.noop", task_id="retried-1", countdown=0.5, queue="faults", retry=True)
        ledger.published("retried-1", 0)
        assert retried, "the publish should have needed a retry"

        with Consumer(server.client(), "faults", ledger) as consumer:
            assert wait_for(ledger.complete, DEADLINE_S), ledger.summary()
            time.sleep(1.0)
        assert consumer.poll_once() == 0
        assert ledger.doubled() == [] and ledger.unknown() == []  # down-0/down-1 never land
        assert movers.stop() == [0]
        conn.release()
        assert consistency(server.client())["stored"] == 0


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
        # The first due message's task id has a second envelope (as a Celery retry would),
        # and a corrupt member comes first of all: both used to need a memory-growing first
        # write, which Redis refuses in a script while over maxmemory.
        for i, mid in enumerate(["twice", "twice", *(f"d{k}" for k in range(50))]):
            items.append((Due(due + i, task_id=mid), "faults", message(mid, iso(due + i))))
        results = store.schedule_many(items, Settings())
        assert all(r.outcome is Scheduled.STORED for r in results)
        for mid in ["twice", *(f"d{k}" for k in range(50))]:
            ledger.published(mid, due)
        client.zadd(keys.bucket("", keys.bucket_start(due, 60_000)), {b"corrupt member": due - 1})
        app = Celery("faults", broker=server.delay_url, set_as_current=False)
        app.send_task("faults.noop", task_id="declared", countdown=1, queue="faults")  # declares
        ledger.published("declared", 0)
        movers.start(1)
        assert wait_for(lambda: store.heartbeats(), 60), movers.logs()

        filler = 0
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            client.config_set("maxmemory", client.info("memory")["used_memory"] + 200_000)
            while True:
                client.set(f"filler:{filler}", b"x" * 4096)
                filler += 1
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
            assert client.lrange(keys.dead(""), 0, -1) == [b"corrupt member"]
            assert "unexpected error" not in movers.logs()
            # The refused publishes wrote nothing.
            assert [client.hexists(keys.ids(""), m) for m in ("oom-0", "oom-1", "oom-2")] == [False] * 3
            rest = consistency(client)
            assert rest["stored"] == 0 and rest["dead"] == 1

            # Memory freed and the limit raised: publishing works again, delivered once.
            for start in range(0, filler, 500):
                client.delete(*(f"filler:{k}" for k in range(start, min(filler, start + 500))))
            client.config_set("maxmemory", 0)
            producer.publish({}, routing_key="faults", headers={"id": "after", "x-delay": 300}, retry=False)
            ledger.published("after", 0)
            assert wait_for(ledger.complete, DEADLINE_S), ledger.summary()
            time.sleep(0.5)
        assert consumer.poll_once() == 0
        assert sorted(ledger.doubled()) == ["twice"] and len(ledger.arrivals["twice"]) == 2
        assert ledger.early() == [] and ledger.unknown() == []
        assert movers.stop() == [0]
        conn.release()
