"""What endangers scheduled messages beyond any one move, told while it lasts: an evicting
``maxmemory-policy`` (and what it deletes), and messages stranded under another key prefix in
a database with a million other keys. Each is found by a real mover process and shown by its
log, ``stats``, ``health`` and its metrics.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from kombu_delay import DelayControl
from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.mover import watch as watch_module
from kombu_delay.mover.watch import Watch
from kombu_delay.store import Store, keys
from kombu_delay.tooling.redis_server import RedisServer, free_port
from tests.support.metrics import try_scrape
from tests.support.procs import ROOT, Proc, wait_until
from tests.support.stored import kombu_payload, sweep_all

DEADLINE_S = 60.0


def cli(url: str, *args: str, prefix: str = "") -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kombu_delay", "--broker", url, "--log-level", "error"]
    if prefix:
        command += ["--prefix", prefix]
    return subprocess.run([*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def mover(spawn: Callable[..., Proc], url: str, *extra: str, prefix: str = "") -> Proc:
    args = [sys.executable, "-m", "kombu_delay", "--broker", url, "--log-level", "info"]
    if prefix:
        args += ["--prefix", prefix]
    return spawn([*args, "mover", *extra], name="mover")


@pytest.fixture
def evicting() -> Iterator[RedisServer]:
    with RedisServer(extra_args=["--maxmemory-policy", "volatile-ttl"]) as server:
        yield server


def test_an_evicting_policy_is_an_error_in_the_log_stats_health_and_metrics(evicting, spawn):
    url = evicting.delay_url
    port = free_port()
    proc = mover(spawn, url, "--metrics-port", str(port))
    wait_until(lambda: "maxmemory-policy is volatile-ttl" in proc.output(), timeout=DEADLINE_S)
    line = next(x for x in proc.output().splitlines() if "maxmemory-policy is volatile-ttl" in x)
    assert " ERROR " in line and "set maxmemory-policy noeviction" in line
    samples = wait_until(lambda: try_scrape(port), timeout=DEADLINE_S)
    assert samples[("kombu_delay_eviction_policy_unsafe", ())] == 1  # type: ignore[index]

    probe = cli(url, "health")
    assert probe.returncode == 1 and "maxmemory-policy is volatile-ttl" in probe.stdout, probe
    assert cli(url, "health", "--liveness").returncode == 0  # a restart cannot fix it
    stats = cli(url, "stats")
    assert stats.returncode == 0 and "WARNING    Redis's maxmemory-policy is volatile-ttl" in stats.stdout
    with DelayControl(url) as ctl:
        assert any("volatile-ttl" in w for w in ctl.stats().warnings)

    evicting.client().config_set("maxmemory-policy", "noeviction")
    assert cli(url, "health").returncode == 0
    assert "WARNING" not in cli(url, "stats").stdout


def test_what_an_eviction_takes_is_counted_lost_and_stats_stops_counting_it(evicting):
    """Under volatile-ttl Redis evicts the buckets due soonest: the counts of what it took are
    settled as expired, and what ``stats`` calls scheduled is what Redis still holds."""
    client = evicting.client()
    store = Store(client)
    now = store.time_ms()
    body = "x" * 1000
    items = [
        (Due(now + 600_000 + 7_000 * i, task_id=f"e{i}"), "q", kombu_payload(f"e{i}", body=body))
        for i in range(600)
    ]
    store.schedule_many(items, Settings(compress_after_ms=0))
    client.config_set("maxmemory", client.info("memory")["used_memory"] + 200_000)
    filler = 0
    while _held(client) > 400:  # Redis evicts the volatile keys with the nearest expiry
        try:
            client.set(f"filler:{filler}", b"f" * 20_000)
        except redis.exceptions.OutOfMemoryError:
            break
        filler += 1
    client.config_set("maxmemory", 0)  # or every command evicts more, reads too
    held = _held(client)
    assert 0 < held < 600, held
    # A bucket whose meta hash Redis evicted together with its set leaves nothing that says how
    # many it held: those cannot be told apart from scheduled ones (the logs and health say the
    # policy is unsafe). Everything else is counted exactly.
    per_bucket = Counter(keys.bucket_start(due.ms, 60_000) for due, _, _ in items)
    untold = sum(
        n
        for start, n in per_bucket.items()
        if not client.exists(keys.meta("", start)) and not client.exists(keys.queue_set("", start, "q"))
    )
    with DelayControl(evicting.delay_url) as ctl:
        assert ctl.stats(hours=24).scheduled == held + untold
        sweep_all(store)
        stats = ctl.stats(hours=24)
        assert (stats.scheduled, stats.vanished) == (held + untold, 0)
        assert stats.totals["expired"] == 600 - held - untold
        assert stats.by_queue == {"q": held + untold}


def _held(client: redis.Redis) -> int:
    return sum(client.zcard(key) for key in client.scan_iter(match="kombu_delay:z:*", count=1000))


def fill(client: redis.Redis, n: int) -> None:
    """``n`` keys of someone else's (a result backend, a cache) in the database."""
    pipe = client.pipeline(transaction=False)
    for first in range(0, n, 1000):
        pipe.mset({f"celery-task-meta-{k}": b"{}" for k in range(first, first + 1000)})
        if first % 100_000 == 0:
            pipe.execute()
    pipe.execute()


@pytest.mark.parametrize("space", ["cold", "ordinary"])
def test_a_stranded_prefix_is_found_among_a_million_keys_and_told_while_it_lasts(
    space, spawn, tmp_path: Path
):
    """A publisher with another global_keyprefix stores messages that no mover serves, in a
    database with a million other keys: the mover of this prefix says so within seconds of its
    start, and stats, health and the metrics say so too, until a mover serves that prefix."""
    with RedisServer() as server:
        client = server.client()
        fill(client, 1_000_000)
        other = Store(client, "app2:")
        countdown = 600_000 if space == "cold" else 30_000  # compressed beyond 60 s by default
        other.schedule(
            Due(countdown, relative=True, task_id="lost-1"),
            "app2:celery",
            kombu_payload("lost-1"),
            Settings(),
        )
        assert client.exists(keys.cold_index("app2:") if space == "cold" else keys.index("app2:"))
        port = free_port()
        proc = mover(spawn, server.delay_url, "--metrics-port", str(port))
        wait_until(lambda: "stranded under key prefix 'app2:'" in proc.output(), timeout=DEADLINE_S)
        assert "kombu-delay --prefix 'app2:' mover" in proc.output()
        samples = wait_until(lambda: try_scrape(port), timeout=DEADLINE_S)
        assert samples[("kombu_delay_stranded_messages", ())] == 1  # type: ignore[index]
        probe = cli(server.delay_url, "health")
        assert probe.returncode == 1 and "stranded under key prefix 'app2:'" in probe.stdout, probe
        assert "stranded under key prefix 'app2:'" in cli(server.delay_url, "stats").stdout

        # Told again on each check while it lasts; gone once a mover serves app2:.
        watch = Watch(Store(client), "test")
        watch.check_prefixes()
        assert watch.findings.stranded == {"app2:": 1}
        other.heartbeat("app2-mover")
        watch.check_prefixes()
        assert watch.findings.stranded == {}
        assert cli(server.delay_url, "health").returncode == 0


def test_a_prefix_whose_mover_starts_later_leaves_the_alert_at_the_next_look(prefix):
    """Movers of two key prefixes started together: the first scans before the second has a
    heartbeat, and finds its messages stranded. The alert stayed until the next scan, minutes
    later, and ``health`` failed the first mover's probes meanwhile. A look at the prefixes found
    stranded (no SCAN) now clears it once their mover beats."""
    other_prefix = prefix + "late:"
    with RedisServer() as server:  # its own: a SCAN here must find no other test's prefixes
        r = server.client()
        other = Store(r, other_prefix)
        due = Due(600_000, relative=True, task_id="late-1")
        other.schedule(due, f"{other_prefix}celery", kombu_payload("late-1"), Settings())
        watch = Watch(Store(r, prefix), "test")
        watch.check_prefixes()
        assert watch.findings.stranded == {other_prefix: 1}
        assert "stranded" in Store(r, prefix).alerts(60_000)
        watch.recheck_stranded()  # no mover yet: still stranded
        assert watch.findings.stranded == {other_prefix: 1}
        other.heartbeat("late-mover")
        watch.recheck_stranded()
        assert watch.findings.stranded == {}
        assert Store(r, prefix).alerts(60_000) == {}
        probe = cli(server.delay_url, "health", prefix=prefix)
        assert "stranded" not in probe.stdout, probe


def test_the_watch_looks_again_at_stranded_prefixes_between_its_scans(monkeypatch):
    # The look again was scheduled with the next scan, so it never ran: the alert stayed the
    # five minutes to that scan. With scans an hour apart, only the look clears it.
    monkeypatch.setattr(watch_module, "PREFIX_CHECK_EVERY_S", 3600.0)
    monkeypatch.setattr(watch_module, "POLICY_CHECK_EVERY_S", 3600.0)
    monkeypatch.setattr(watch_module, "STRANDED_RECHECK_S", 0.1)
    with RedisServer() as server:
        r = server.client()
        other = Store(r, "late:")
        due = Due(600_000, relative=True, task_id="late-1")
        other.schedule(due, "late:celery", kombu_payload("late-1"), Settings())
        store = Store(r)
        watch = Watch(store, "test")
        watch.start()
        try:
            kept = watch_module.ALERT_KEEP_MS  # as health reads it: the alert does not age out here
            wait_until(lambda: "stranded" in store.alerts(kept), timeout=DEADLINE_S)
            other.heartbeat("late-mover")
            wait_until(lambda: store.alerts(kept) == {} and watch.findings.stranded == {}, timeout=DEADLINE_S)
        finally:
            watch.stop()
