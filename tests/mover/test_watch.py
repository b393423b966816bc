"""What endangers scheduled messages beyond any one move, told while it lasts: an evicting
``maxmemory-policy`` (and what it deletes), a Redis that keeps nothing on disk, and messages
stranded under another key prefix in a database with a million other keys. Each is found by a
real mover process and shown by its log, ``stats``, ``health`` and its metrics.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kombu_delay import DelayControl
from kombu_delay.config import Settings
from kombu_delay.errors import RedisUnavailable
from kombu_delay.message import Due
from kombu_delay.mover import watch as watch_module
from kombu_delay.mover.watch import Watch
from kombu_delay.ops import checks
from kombu_delay.ops.checks import (
    AT_MAXMEMORY_BYTES,
    FRESH_HEARTBEAT_MS,
    memory_problem,
    persistence_problem,
    snapshot_note,
    unread_policy,
)
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
    # The gauge is set once the watch has made all its checks, after this line: waited for.
    unsafe = ("kombu_delay_eviction_policy_unsafe", ())
    wait_until(lambda: (try_scrape(port) or {}).get(unsafe) == 1, timeout=DEADLINE_S)

    probe = cli(url, "health")
    assert probe.returncode == 1 and "maxmemory-policy is volatile-ttl" in probe.stdout, probe
    assert cli(url, "health", "--liveness").returncode == 0  # a restart cannot fix it
    stats = cli(url, "stats")
    assert stats.returncode == 0 and "WARNING    Redis's maxmemory-policy is volatile-ttl" in stats.stdout
    with DelayControl(url) as ctl:
        assert any("volatile-ttl" in w for w in ctl.stats().warnings)

    evicting.client().config_set("maxmemory-policy", "noeviction")
    assert cli(url, "health").returncode == 0
    assert "maxmemory-policy" not in cli(url, "stats").stdout


def test_no_heartbeat_beside_an_evicting_policy_says_it_may_have_been_evicted(evicting):
    # "no mover heartbeat", "is `kombu-delay mover` running?": with movers running, whose
    # heartbeats the policy deleted as they were written, that advice would restart them.
    url = evicting.delay_url
    probe = cli(url, "health")
    assert probe.returncode == 1 and "no mover heartbeat (or deleted: the maxmemory-policy" in probe.stdout
    assert "evicts the movers' heartbeats too" in cli(url, "stats").stdout
    evicting.client().config_set("maxmemory-policy", "noeviction")
    assert "evicts" not in cli(url, "health").stdout + cli(url, "stats").stdout


def test_redis_at_maxmemory_is_a_warning_in_the_log_stats_health_and_metrics(spawn, caplog):
    """Under noeviction, Redis at its maxmemory refuses every publish: the mover told it only
    from its thaw, and only with compressed messages near their due time (with none stored,
    health said OK, stats nothing, for minutes)."""
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as server:
        client, url, port = server.client(), server.delay_url, free_port()
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) // 2)
        proc = mover(spawn, url, "--metrics-port", str(port))
        wait_until(lambda: "Redis is at its maxmemory (" in proc.output(), timeout=DEADLINE_S)
        line = next(x for x in proc.output().splitlines() if "Redis is at its maxmemory (" in x)
        assert " WARNING " in line and "none left): it refuses every write larger" in line, line
        at = ("kombu_delay_redis_at_maxmemory", ())
        wait_until(lambda: (try_scrape(port) or {}).get(at) == 1, timeout=DEADLINE_S)
        probe = cli(url, "health")
        assert probe.returncode == 1 and "UNHEALTHY: Redis is at its maxmemory (" in probe.stdout, probe
        assert cli(url, "health", "--liveness").returncode == 0  # a restart cannot fix it
        assert "WARNING    Redis is at its maxmemory (" in cli(url, "stats").stdout
        with DelayControl(url) as ctl:
            assert any("at its maxmemory" in w for w in ctl.stats().warnings)

        # A watch of this process's own: told once while it lasts, whatever its figures (they
        # change from look to look), and over only with twice the margin left.
        caplog.set_level(logging.INFO, logger="kombu_delay.mover.watch")
        watch = Watch(Store(client), "mem")
        watch.check_policy()
        assert watch.findings.memory_problem and [level for level, _ in said(caplog)] == [logging.WARNING]
        used = int(client.info("memory")["used_memory"])
        for limit in (used // 3, used + AT_MAXMEMORY_BYTES + 20_000):
            client.config_set("maxmemory", limit)
            watch.check_policy()
        assert len(said(caplog)) == 1
        client.config_set("maxmemory", 0)
        watch.check_policy()
        assert watch.findings.memory_problem is None
        assert said(caplog)[1:] == [(logging.INFO, f"mover mem: {watch_module.RESOLVED['memory']}")]
        assert cli(url, "health").returncode == 0 and "maxmemory" not in cli(url, "stats").stdout


def test_at_maxmemory_is_said_within_a_margin_and_only_under_noeviction() -> None:
    # Redis judges a write with its arguments read already: one filled by publishes stops short
    # of the limit as INFO counts it (448 bytes, in a test run), refusing every 1 KB publish.
    mb = 2**20
    assert "(3.0 MB used of 1.0 MB, none left)" in (memory_problem("noeviction", (3 * mb, mb)) or "")
    assert "(10.0 MB used of 10.0 MB, 0.4 KB left)" in (
        memory_problem("noeviction", (10 * mb - 448, 10 * mb)) or ""
    )
    assert memory_problem("noeviction", (10 * mb - AT_MAXMEMORY_BYTES, 10 * mb)) is None
    assert memory_problem("noeviction", (10 * mb - AT_MAXMEMORY_BYTES, 10 * mb), 2 * AT_MAXMEMORY_BYTES)
    # An evicting policy deletes keys to make room (that is its own problem, said as such).
    assert memory_problem("allkeys-lru", (3 * mb, mb)) is None
    assert memory_problem("noeviction", None) is None and memory_problem(None, None) is None


def test_a_policy_that_cannot_be_read_is_said_by_the_mover_health_and_stats(evicting, caplog):
    # A user of `+@all -@dangerous` (INFO is @dangerous) read no policy: health said OK under
    # volatile-ttl, stats said nothing, and the mover told it at INFO only.
    admin = evicting.client()
    admin.execute_command("ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "&*", "+@all", "-@dangerous")
    user = evicting.client(username="noinfo", password="pw")
    caplog.set_level(logging.INFO, logger="kombu_delay.mover.watch")
    watch = Watch(Store(user), "acl")
    watch.check_policy()
    watch.check_policy()
    assert said(caplog) == [(logging.WARNING, f"mover acl: {unread_policy(None)}")]
    assert "INFO refused by this user's ACL" in unread_policy(None)
    url = f"delayredis://noinfo:pw@127.0.0.1:{evicting.port}/0"
    probe = cli(url, "health", "--max-heartbeat-age", "0")
    assert probe.returncode == 0 and f"WARNING: {unread_policy(None)}" in probe.stdout, probe
    assert f"WARNING    {unread_policy(None)}" in cli(url, "stats").stdout
    assert unread_policy(None) not in cli(evicting.delay_url, "stats").stdout


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
        # A SCAN of a million keys: seconds here, over a minute on a machine at a load of 14.
        wait_until(lambda: "stranded under key prefix 'app2:'" in proc.output(), timeout=3 * DEADLINE_S)
        assert "kombu-delay --broker <broker URL> --prefix 'app2:' mover" in proc.output()
        stranded = ("kombu_delay_stranded_messages", ())  # (set after the line: waited for)
        wait_until(lambda: (try_scrape(port) or {}).get(stranded) == 1, timeout=DEADLINE_S)
        probe = cli(server.delay_url, "health")
        assert probe.returncode == 1 and "stranded under key prefix 'app2:'" in probe.stdout, probe
        assert "or give the publishers the global_keyprefix of the movers that run" in probe.stdout, probe
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


def test_one_movers_look_again_does_not_take_back_what_another_found(prefix):
    """Every mover of a prefix wrote the one alert with what it had found itself: an older
    mover's look again, every 15 s, took back a prefix stranded since its scan, which a newer
    mover had found, so health said OK a quarter of the time, and always once that mover
    stopped. Each now writes what it found and what the others recorded, looked at again."""
    with RedisServer() as server:  # its own: a SCAN here must find no other test's prefixes
        r = server.client()

        def strand(other_prefix: str) -> Store:
            other = Store(r, other_prefix)
            due = Due(600_000, relative=True, task_id=f"{other_prefix}1")
            other.schedule(due, f"{other_prefix}celery", kombu_payload("x"), Settings())
            return other

        def told() -> str:
            return Store(r, prefix).alerts(60_000).get("stranded", "")

        strand("early:")
        older, newer = Watch(Store(r, prefix), "older"), Watch(Store(r, prefix), "newer")
        older.check_prefixes()
        late = strand("late:")
        newer.check_prefixes()
        assert newer.findings.stranded == {"early:": 1, "late:": 1}
        older.recheck_stranded()
        assert older.findings.stranded == {"early:": 1, "late:": 1}
        assert "'late:'" in told() and "'early:'" in told()
        older.check_prefixes()  # a scan keeps both too
        assert "'late:'" in told() and "'early:'" in told()
        late.heartbeat("late-mover")  # served now: the next look by either mover takes it back
        older.recheck_stranded()
        assert older.findings.stranded == {"early:": 1}
        assert "'late:'" not in told() and "'early:'" in told()
        newer.recheck_stranded()
        assert "'late:'" not in told() and "'early:'" in told()


def test_a_scan_does_not_take_back_what_another_mover_found_during_it(prefix, monkeypatch):
    """A scan read the record, put the lost buckets back in their index (minutes, at scale),
    then wrote the record whole: what another mover found meanwhile was gone, and health said
    OK. A mover now takes out only what it looked at again and found served or gone."""
    with RedisServer() as server:  # its own: a SCAN here must find no other test's prefixes
        r = server.client()
        older, newer = Watch(Store(r, prefix), "older"), Watch(Store(r, prefix), "newer")
        real_check_index = Watch.check_index

        def check_index(watch: Watch) -> None:
            real_check_index(watch)
            if watch is older:  # the newer mover finds a prefix stranded since the older one's scan
                other = Store(r, "during:")
                due = Due(600_000, relative=True, task_id="d1")
                other.schedule(due, "during:celery", kombu_payload("d1"), Settings())
                newer.check_prefixes()

        monkeypatch.setattr(Watch, "check_index", check_index)
        older.check_prefixes()
        assert "'during:'" in Store(r, prefix).alerts(60_000).get("stranded", "")
        assert older.findings.stranded == newer.findings.stranded == {"during:": 1}


def test_a_stranded_record_is_written_only_as_it_was_read(prefix, monkeypatch, caplog):
    """Three ways the record went wrong: a scan's finding written minutes later unchecked (its
    mover had started meanwhile); a finding another mover recorded between a mover's look and
    its write, taken out; and a record of another type (by hand), which failed every check,
    retried every 5 s, in silence."""
    with RedisServer() as server:  # its own: a SCAN here must find no other test's prefixes
        r = server.client()
        late = Store(r, "late:")
        late.schedule(
            Due(600_000, relative=True, task_id="l1"), "late:celery", kombu_payload("x"), Settings()
        )
        older, newer = Watch(Store(r, prefix), "older"), Watch(Store(r, prefix), "newer")
        real_check_index = Watch.check_index
        monkeypatch.setattr(
            Watch, "check_index", lambda w: (late.heartbeat("late-mover"), real_check_index(w))
        )
        older.check_prefixes()  # found by the scan, served by the time it is written
        assert older.findings.stranded == {} and "stranded" not in Store(r, prefix).alerts(60_000)
        monkeypatch.setattr(Watch, "check_index", real_check_index)

        r.zrem(keys.movers("late:"), "late-mover")
        real_still = Store.still_stranded
        raced: list[int] = []

        def still_stranded(store: Store, prefixes, fresh_ms, reader=None):
            found = real_still(store, prefixes, fresh_ms, reader)
            if store is older.store and not raced:  # the newer mover records it meanwhile
                raced.append(1)
                newer.check_prefixes()
            return found

        monkeypatch.setattr(Store, "still_stranded", still_stranded)
        older.recheck_stranded()
        assert raced and older.findings.stranded == newer.findings.stranded == {"late:": 1}
        assert "'late:'" in Store(r, prefix).alerts(60_000)["stranded"]
        monkeypatch.setattr(Store, "still_stranded", real_still)

        r.delete(keys.stranded(prefix))
        r.set(keys.stranded(prefix), "by hand")
        with caplog.at_level(logging.ERROR, logger="kombu_delay.mover.watch"):
            older.check_prefixes()  # returns: the next scan waits its five minutes
        assert f"'{keys.stranded(prefix)}' holds a string" in caplog.text, caplog.text


@pytest.fixture
def quick_looks(monkeypatch):
    """Scans and policy reads an hour apart, looks at the stranded record every 0.1 s: what a
    running watch finds between its scans is found by the look."""
    monkeypatch.setattr(watch_module, "PREFIX_CHECK_EVERY_S", 3600.0)
    monkeypatch.setattr(watch_module, "POLICY_CHECK_EVERY_S", 3600.0)
    monkeypatch.setattr(watch_module, "STRANDED_RECHECK_S", 0.1)
    monkeypatch.setattr(watch_module, "FIRST_SCAN_AFTER_S", 0.0)


def test_the_watch_looks_again_at_stranded_prefixes_between_its_scans(quick_looks):
    # The look again was scheduled with the next scan, so it never ran: the alert stayed the
    # five minutes to that scan. With scans an hour apart, only the look clears it.
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


def test_a_failed_check_is_named_and_its_end_told(quick_looks, monkeypatch, caplog):
    # "a background check failed (...NOREPLICAS...); retrying" named no check, and nothing said
    # when it worked again.
    monkeypatch.setattr(watch_module, "PREFIX_RETRY_S", 0.5)
    with RedisServer() as server:
        r = server.client()
        watch = Watch(Store(r), "test")
        r.config_set("min-replicas-to-write", 1)  # the stranded record's write is refused
        with caplog.at_level(logging.INFO, logger=watch_module.__name__):
            watch.start()
            try:
                wait_until(lambda: any("the scan for stranded messages failed" in t for _, t in said(caplog)))
                r.config_set("min-replicas-to-write", 0)
                wait_until(
                    lambda: any("the scan for stranded messages works again" in t for _, t in said(caplog))
                )
            finally:
                r.config_set("min-replicas-to-write", 0)
                watch.stop()
        failed = [(level, t) for level, t in said(caplog) if "stranded messages failed" in t]
        assert len(failed) == 1 and failed[0][0] == logging.WARNING and "NOREPLICAS" in failed[0][1], failed


def test_movers_of_two_prefixes_started_together_do_not_report_each_other(monkeypatch):
    # Each mover scanned as it started, before the other had written a heartbeat: it found the
    # other prefix's messages stranded, and health failed until its next look, 15 s later.
    monkeypatch.setattr(watch_module, "FIRST_SCAN_AFTER_S", 5.0)
    with RedisServer() as server:  # its own: a SCAN here must find no other test's prefixes
        r = server.client()
        other = Store(r, "other:")
        due = Due(600_000, relative=True, task_id="o1")
        other.schedule(due, "other:celery", kombu_payload("o1"), Settings())
        store = Store(r)
        scans: list[float] = []
        real_stranded = Store.stranded

        def stranded(self: Store, *args: Any, **kwargs: Any) -> dict[str, int]:
            scans.append(time.monotonic())
            return real_stranded(self, *args, **kwargs)

        monkeypatch.setattr(Store, "stranded", stranded)
        reports: list[tuple[float, dict[str, int]]] = []
        watch = Watch(
            store, "test", on_findings=lambda f: reports.append((time.monotonic(), dict(f.stranded)))
        )
        started = time.monotonic()
        watch.start()
        try:
            other.heartbeat("other-mover")  # the other prefix's mover, started with this one
            wait_until(lambda: scans and reports[-1][0] > scans[0], timeout=DEADLINE_S)  # its scan's
        finally:
            watch.stop()
        assert scans[0] - started >= 5.0
        assert [found for _, found in reports] == [{}] * len(reports)
        assert r.exists(keys.stranded("")) == 0 and "stranded" not in store.alerts(60_000)


def test_keys_of_another_type_under_a_found_prefix_do_not_end_the_stranded_check():
    # Queues named like kombu-delay's keys ("reports.kombu_delay:index"), or another prefix's
    # counts written by hand as a string: the first WRONGTYPE ended the whole check, and what
    # was truly stranded went untold (health OK, the gauge 0).
    with RedisServer() as server:  # its own: a SCAN here must find no other test's prefixes
        r = server.client()
        for name in ("index", "counts"):
            r.rpush(f"reports.kombu_delay:{name}", "a message")
        damaged = Store(r, "damaged:")
        due = Due(600_000, relative=True, task_id="d1")
        damaged.schedule(due, "damaged:celery", kombu_payload("d1"), Settings())
        r.delete(keys.counts("damaged:"))
        r.set(keys.counts("damaged:"), "by hand")
        late = Store(r, "late:")
        late.schedule(
            Due(600_000, relative=True, task_id="l1"), "late:celery", kombu_payload("l1"), Settings()
        )
        beatless = Store(r, "beatless:")  # its heartbeats' key written by hand: no mover beats there
        due = Due(600_000, relative=True, task_id="b1")
        beatless.schedule(due, "beatless:celery", kombu_payload("b1"), Settings())
        r.set(keys.movers("beatless:"), "by hand")
        watch = Watch(Store(r), "test")
        watch.check_prefixes()
        assert watch.findings.stranded == {"late:": 1, "beatless:": 1}


def test_commands_told_to_operators_name_the_prefix_as_a_shell_and_a_glob_read_it():
    # `--prefix 'q\\*'` (Python's repr) started a mover of another, empty prefix in a shell;
    # an ACL pattern or a --pattern with the prefix as it is matched other prefixes' keys.
    # bash's $'...' for what no terminal shows ran what followed a quote in sh (dash): none now.
    for prefix in ["app2:", "", "q\\*", "it's", "é😀\\'x", "a'; touch x; '", '$(touch x)`x`"$y']:
        word = checks.shell_word(prefix)
        assert word is not None
        for shell in ("sh", "bash"):
            echoed = subprocess.run(
                [shell, "-c", f"printf %s {word}"], capture_output=True, text=True, check=True
            )
            assert echoed.stdout == prefix, (shell, prefix, word)
    blanks = ["app\ufe0f:", "cafe\u0301", "a\u3000b", "\u3164", "\u2800"]  # shown as nothing or a blank
    for prefix in ["\x06\x16", "a\u200fb:", "tab\there", "q'\t; touch x; #", "new\nline", *blanks]:
        assert checks.shell_word(prefix) is None
        assert "cannot be typed" in checks.mover_command(prefix) and prefix not in checks.mover_command(
            prefix
        )
        # A publisher's warning offered `celery -A <your app> delay mover` twice, the second
        # with this explanation inside its backquotes.
        ways = checks.ways_to_start(prefix)
        assert ways == "`celery -A <your app> delay mover` (its key prefix cannot be typed in a shell)"
    assert checks.ways_to_start("app2:") == (
        "`celery -A <your app> delay mover` or `kombu-delay --broker <broker URL> --prefix 'app2:' mover`"
    )
    assert checks.shell_word("app2:") == "'app2:'"
    told = str(checks.stranded_problem({"q\\*": 4}))
    assert "kombu-delay --broker <broker URL> --prefix 'q\\*' mover" in told
    # The command is for the prefix that strands the most of those that can be typed: one
    # written to come first sorted, or one that cannot be typed, does not take it.
    told = str(checks.stranded_problem({"!x:": 1, "app2:": 500, "\x06": 900}))
    assert "--prefix 'app2:' mover" in told
    with RedisServer() as server:
        r = server.client()
        for key in ["[ab]:kombu_delay:h", "a:kombu_delay:h", "p*:kombu_delay:h", "pq:kombu_delay:h"]:
            r.set(key, 1)
        for prefix in ["[ab]:", "p*:"]:
            found = {k.decode() for k in r.scan_iter(match=checks.glob_escaped(prefix) + "kombu_delay:*")}
            assert found == {f"{prefix}kombu_delay:h"}, (prefix, found)


def test_an_alert_written_by_hand_reaches_no_terminal_as_escape_sequences():
    # stats and health printed the alerts hash as stored: whoever may write it could send an
    # operator's terminal escape sequences (clear the screen, rewrite what it shows).
    with RedisServer() as server:
        r = server.client()
        now = Store(r).time_ms()
        r.hset(keys.alerts(""), "stranded\x1b[2J", f"{now} all clear\x1b[1A\x1b[2K\rOK")
        for command in ("health", "stats"):
            shown = cli(server.url, command)
            assert "\x1b" not in shown.stdout + shown.stderr, command
            assert "all clear\\x1b[1A" in shown.stdout + shown.stderr, command


def test_a_stranded_warning_is_new_with_a_prefix_not_with_a_count(caplog):
    # Its text holds the count: every look (every 15 s, on every mover) while a publisher of the
    # other prefix went on logged it again, where the docs promise once per 10 minutes.
    with RedisServer() as server:  # its own: a SCAN here must find no other test's prefixes
        r = server.client()

        def strand(other_prefix: str, task_id: str) -> None:
            due = Due(600_000, relative=True, task_id=task_id)
            Store(r, other_prefix).schedule(due, f"{other_prefix}celery", kombu_payload(task_id), Settings())

        def warned() -> list[str]:
            return [text for level, text in said(caplog) if level == logging.WARNING and "stranded" in text]

        watch = Watch(Store(r), "test")
        with caplog.at_level(logging.INFO, logger=watch_module.__name__):
            strand("other:", "o1")
            watch.check_prefixes()
            strand("other:", "o2")
            watch.recheck_stranded()
            assert watch.findings.stranded == {"other:": 2}
            assert len(warned()) == 1, warned()
            strand("third:", "t1")
            watch.check_prefixes()
            assert len(warned()) == 2 and "'third:'" in warned()[-1], warned()


@pytest.mark.parametrize("prefix", ["", "app1:"])
def test_messages_in_another_database_that_no_mover_serves_are_told(prefix, caplog):
    # A publisher whose URL named database 2, beside movers on database 0, warned once as it
    # started; the movers and health said nothing while its messages waited, overdue.
    with RedisServer() as server:
        mine, other = server.client(), redis.Redis(port=server.port, db=2)
        due = Due(600_000, relative=True, task_id="t")
        for n in range(3):
            Store(other, prefix).schedule(due, f"{prefix}q{n}", kombu_payload(f"t{n}"), Settings())
        Store(redis.Redis(port=server.port, db=3), "elsewhere:").schedule(
            due, "q", kombu_payload("e"), Settings()
        )
        store = Store(mine, prefix)
        store.schedule(due, f"{prefix}q", kombu_payload("mine"), Settings())
        watch = Watch(store, "test")
        with caplog.at_level(logging.INFO, logger=watch_module.__name__):
            assert store.stranded_databases(30_000) == {2: 3}  # db 3's prefix is its own movers' to tell
            watch.check_prefixes()
            assert not [
                text for level, text in said(caplog) if level == logging.WARNING
            ]  # (its mover may be starting)
            watch.check_prefixes()
            # Another message there: the same database, told again only after LOG_REPEAT_S (at
            # every scan before, as its count changed).
            Store(other, prefix).schedule(due, f"{prefix}q9", kombu_payload("t9"), Settings())
            watch.check_prefixes()
            Store(other, prefix).heartbeat("served")  # a mover of database 2 starts
            assert store.stranded_databases(30_000) == {}
            watch.check_prefixes()
        (told,) = [text for level, text in said(caplog) if level == logging.WARNING]
        assert f"stranded in database 2 (3) of this Redis, under this mover's key prefix {prefix!r}" in told
        assert any("no messages are stranded in other databases any more" in text for _, text in said(caplog))
        assert mine.connection_pool.connection_kwargs["db"] == 0 and mine.exists(keys.counts(prefix))
        other.close()


def test_a_mover_whose_scan_found_nothing_takes_up_what_another_mover_recorded(quick_looks):
    # Only a mover whose own scan had found a stranded prefix looked again between scans: one
    # whose scan came before the messages did said nothing in its log and showed 0 in its
    # gauge for the five minutes to its next scan, while health reported them.
    with RedisServer() as server:
        r = server.client()
        store = Store(r)
        seen: list[dict[str, int]] = []
        watch = Watch(store, "first", on_findings=lambda found: seen.append(dict(found.stranded)))
        watch.start()
        try:
            wait_until(lambda: seen, timeout=DEADLINE_S)  # its scan: nothing stranded yet
            assert r.exists(keys.stranded("")) == 0
            other = Store(r, "late:")
            due = Due(600_000, relative=True, task_id="late-1")
            other.schedule(due, "late:celery", kombu_payload("late-1"), Settings())
            Watch(Store(r), "second").check_prefixes()  # another mover's scan records it
            wait_until(lambda: watch.findings.stranded == {"late:": 1}, timeout=DEADLINE_S)
            assert seen[-1] == {"late:": 1}  # what its metrics show
        finally:
            watch.stop()


#: How the warning for a Redis that keeps nothing on disk starts, everywhere.
NOTHING_KEPT = "Redis keeps nothing on disk"


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    """What the watch logged: (level, message)."""
    return [(rec.levelno, rec.getMessage()) for rec in caplog.records if rec.name == watch_module.__name__]


def test_persistence_is_worded_only_when_nothing_is_kept_or_only_snapshots():
    assert persistence_problem(False, "") == persistence_problem(False, "  ")
    assert "set appendonly yes" in str(persistence_problem(False, ""))
    # The AOF on, save rules, or what could not be read: no warning.
    for aof, rules in [(True, None), (True, ""), (False, "3600 1"), (None, None), (False, None)]:
        assert persistence_problem(aof, rules) is None, (aof, rules)
    assert "save 3600 1 300 100" in str(snapshot_note(False, "3600 1 300 100"))
    for aof, rules in [(True, "3600 1"), (False, ""), (None, None), (False, None)]:
        assert snapshot_note(aof, rules) is None, (aof, rules)


def test_a_redis_that_keeps_nothing_on_disk_is_a_warning_that_fails_no_probe(spawn):
    """Started with ``--save '' --appendonly no``, a Redis restart loses every scheduled message,
    and nothing said so. The mover now logs a WARNING naming ``appendonly yes``; ``stats`` and
    the metrics show it; ``health`` prints it after its verdict but exits as it would without:
    many run such a Redis knowingly (tests, a cache). Once the AOF is on, all is quiet."""
    with RedisServer() as server:  # the suite's default: --save '' --appendonly no
        url = server.delay_url
        warning = f"WARNING: {persistence_problem(False, '')}"
        alone = cli(url, "health").stdout.splitlines()  # no mover: unhealthy for that only
        assert alone[0].startswith("UNHEALTHY: no mover heartbeat") and NOTHING_KEPT not in alone[0]
        assert alone[1:] == [warning]

        port = free_port()
        proc = mover(spawn, url, "--metrics-port", str(port))
        wait_until(lambda: NOTHING_KEPT in proc.output(), timeout=DEADLINE_S)
        line = next(x for x in proc.output().splitlines() if NOTHING_KEPT in x)
        assert " WARNING " in line and "set appendonly yes" in line

        # The gauge is set from the check's findings, told just after the line is logged.
        def gauge() -> float | None:
            samples = try_scrape(port)
            return None if samples is None else samples.get(("kombu_delay_redis_persistence_off", ()))

        wait_until(lambda: gauge() == 1, timeout=DEADLINE_S)
        wait_until(lambda: cli(url, "health").returncode == 0, timeout=DEADLINE_S, interval=0.5)
        probe = cli(url, "health")
        assert probe.returncode == 0 and probe.stdout.splitlines()[0].startswith("OK: movers 1"), probe
        assert probe.stdout.splitlines()[1:] == [warning]
        liveness = cli(url, "health", "--liveness")  # a restart cannot fix it: not even read
        assert liveness.returncode == 0 and liveness.stdout.splitlines()[0].startswith("OK: ")
        assert "WARNING" not in liveness.stdout, liveness
        quiet = cli(url, "health", "--quiet")
        assert (quiet.returncode, quiet.stdout) == (0, ""), quiet
        stats = cli(url, "stats")
        assert stats.returncode == 0 and f"WARNING    {NOTHING_KEPT}" in stats.stdout, stats
        with DelayControl(url) as ctl:
            assert [w for w in ctl.stats().warnings if NOTHING_KEPT in w] == [warning[len("WARNING: ") :]]

        server.client().config_set("appendonly", "yes")
        probe = cli(url, "health")
        assert probe.returncode == 0 and "WARNING" not in probe.stdout, probe
        assert "WARNING" not in cli(url, "stats").stdout


def test_the_aof_or_save_rules_keep_it_quiet_and_a_change_is_told(redis_server, r, caplog):
    """With ``appendonly yes`` (the session's server) nothing is said. With RDB save rules only,
    a crash loses just what changed since the last snapshot: no warning, one INFO line. A
    Redis that starts keeping something on disk is told at INFO, as a fixed problem is."""
    caplog.set_level(logging.INFO, logger="kombu_delay.mover.watch")
    store = Store(r)
    assert store.persistence() == (True, None)  # the rules are not read: the AOF keeps all
    watch = Watch(store, "aof")
    watch.check_persistence()
    assert not watch.findings.volatile and said(caplog) == []
    probe = cli(redis_server.delay_url, "health", "--max-heartbeat-age", "0")
    assert probe.returncode == 0 and "WARNING" not in probe.stdout, probe
    assert "WARNING" not in cli(redis_server.delay_url, "stats").stdout

    with RedisServer() as server:
        client = server.client()
        watch = Watch(Store(client), "rdb")
        watch.check_persistence()
        assert watch.findings.volatile
        assert said(caplog) == [(logging.WARNING, f"mover rdb: {persistence_problem(False, '')}")]
        caplog.clear()
        client.config_set("save", "3600 1")
        for _ in range(2):  # the note once, however often it is checked
            watch.check_persistence()
        assert not watch.findings.volatile
        assert said(caplog) == [
            (logging.INFO, f"mover rdb: {snapshot_note(False, '3600 1')}"),
            (logging.INFO, f"mover rdb: {watch_module.RESOLVED['persistence']}"),
        ]
        probe = cli(server.delay_url, "health", "--max-heartbeat-age", "0")
        assert probe.returncode == 0 and "WARNING" not in probe.stdout, probe
        assert "WARNING" not in cli(server.delay_url, "stats").stdout


def test_persistence_that_cannot_be_read_is_not_checked_and_said_once(caplog):
    """``CONFIG`` refused by the ACL (it is ``@dangerous``) or renamed away (managed Redis), or
    ``INFO`` refused: nothing to judge by, so no warning. The mover says once, at INFO, that it
    did not check, and asks a refused ``CONFIG GET`` no more (one ``ACL LOG`` entry)."""
    caplog.set_level(logging.INFO, logger="kombu_delay.mover.watch")
    with RedisServer() as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "noconfig", "on", ">pw", "~*", "&*", "+@all", "-config")
        admin.execute_command("ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "&*", "+@all", "-info")
        user = server.client(username="noconfig", password="pw")
        assert Store(user).persistence() == (False, None)
        assert Store(server.client(username="noinfo", password="pw")).persistence() == (None, None)
        admin.acl_log_reset()
        watch = Watch(Store(user), "acl")
        for _ in range(3):
            watch.check_persistence()
        assert not watch.findings.volatile
        assert said(caplog) == [
            (
                logging.INFO,
                "mover acl: cannot read what Redis keeps on disk (INFO persistence or CONFIG GET "
                "save refused, or Redis still loading its data); persistence not checked until it can "
                "be read",
            )
        ]
        assert [entry["count"] for entry in admin.acl_log()] == [1]
        url = f"delayredis://noconfig:pw@127.0.0.1:{server.port}/0"
        probe = cli(url, "health", "--max-heartbeat-age", "0")
        assert probe.returncode == 0 and "WARNING" not in probe.stdout, probe
        # Known to keep nothing, then CONFIG refused: that is no news that it keeps anything now.
        admin.execute_command("ACL", "SETUSER", "later", "on", ">pw", "~*", "&*", "+@all")
        later = Watch(Store(server.client(username="later", password="pw")), "later")
        later.check_persistence()
        assert later.findings.volatile
        admin.execute_command("ACL", "SETUSER", "later", "-config")
        caplog.clear()
        later.check_persistence()
        assert later.findings.volatile, "a refusal was taken for persistence turned on"
        assert "keeps scheduled messages on disk now" not in caplog.text
    with RedisServer(extra_args=["--rename-command", "CONFIG", ""]) as renamed:
        assert Store(renamed.client()).persistence() == (False, None)
        probe = cli(renamed.delay_url, "health", "--max-heartbeat-age", "0")
        assert probe.returncode == 0 and "WARNING" not in probe.stdout, probe


@pytest.mark.slow  # a load of 10 s at least, to be read during it
def test_a_redis_loading_its_aof_is_not_taken_for_one_that_keeps_nothing() -> None:
    # Redis turns its AOF off while it loads it, and INFO then reads aof_enabled:0: a mover that
    # looked then (a Redis restarted with a large AOF, or one restarted under load: a CI run)
    # said it kept nothing on disk, and told the restart as "all scheduled lost".
    # The load lasts however fast the machine: Redis waits key-load-delay (µs) after each key
    # it loads from an RDB image, here the AOF's, rewritten. It answers between each 2 MB read
    # (uncompressed, so there are ten of them).
    keys_n, delay_us = 20_000, 500
    load_args = ["--key-load-delay", str(delay_us), "--rdbcompression", "no"]
    with RedisServer(persistence=True, extra_args=load_args) as server:
        client = server.client()
        pipe = client.pipeline(transaction=False)
        for i in range(keys_n):
            pipe.set(f"k{i}", "v" * 1000)
        pipe.execute()
        client.bgrewriteaof()
        wait_until(lambda: rewritten(client), timeout=DEADLINE_S)
        wait_until(lambda: int(client.info("persistence")["aof_pending_bio_fsync"]) == 0, timeout=DEADLINE_S)
        server.restart(kill=True)  # it answers as soon as it listens, while it loads
        client.connection_pool.disconnect()
        store, read, loading_seen = Store(client), [], 0
        while True:
            loading = int(client.info("persistence")["loading"])
            loading_seen += loading
            read.append(store.persistence())
            if not loading:
                break
        assert loading_seen, "the load ended before it was read: nothing was tested"
        assert set(read) <= {(None, None), (True, None)}, read
        assert read[-1] == (True, None)


def rewritten(client: redis.Redis) -> bool:
    """Whether the AOF rewrite asked for is done, and went well."""
    info = client.info("persistence")
    busy = int(info["aof_rewrite_in_progress"]) or int(info["aof_rewrite_scheduled"])
    if not busy:
        assert info["aof_last_bgrewrite_status"] == "ok", info
    return not busy


@pytest.mark.parametrize("kept", ["nothing-on-disk", "aof", "snapshot-saved-by-hand"])
def test_a_redis_that_restarted_is_told_with_what_it_kept(kept, caplog):
    # A Redis restarted empty took every scheduled message with it, and the mover logged only
    # its retries: nothing said, after the fact, that Redis had restarted or what it had kept.
    # (appendfsync always: with everysec, the kill -9 below may come before the write's fsync.)
    # One with no save rules and no AOF still loads a dump.rdb that SAVE wrote by hand: the
    # mover told "all scheduled lost" from its settings alone, with every message still there.
    with RedisServer(persistence=kept == "aof", appendfsync="always") as server:
        store = Store(server.client())
        store.schedule(Due(600_000, relative=True, task_id="t"), "q", kombu_payload("t"), Settings())
        watch = Watch(store, "test")
        with caplog.at_level(logging.INFO, logger="kombu_delay.mover.watch"):
            watch.check_persistence()
            watch.check_restart()
            assert "Redis restarted" not in caplog.text
            if kept == "snapshot-saved-by-hand":
                store.client.save()
            server.restart(kill=True)
            store.client.connection_pool.disconnect()
            watch.check_persistence()
            watch.check_restart()
        told = [r.getMessage() for r in caplog.records if "Redis restarted" in r.getMessage()]
        assert len(told) == 1 and "another Redis server" not in told[0], caplog.text
        assert (store.counts() == {}) is (kept == "nothing-on-disk")
        redis_7 = int(store.client.info("server")["redis_version"].split(".")[0]) >= 7
        if kept == "aof":
            assert "all scheduled lost" not in told[0]
        elif kept == "nothing-on-disk" or not redis_7:  # Redis 6 does not say what it loaded
            assert (
                "all scheduled lost" in told[0] and ("unless it loaded a snapshot" in told[0]) is not redis_7
            )
        else:
            assert "all scheduled lost" not in told[0] and "keys of a snapshot saved by hand" in told[0]
        store.client.close()


def test_another_redis_server_is_told_as_a_failover_not_as_a_loss(caplog):
    # A replica promoted (up long before the last look) holds what was replicated to it: the
    # warning said a failover, onto a Redis that keeps nothing on disk, lost everything.
    with RedisServer() as first, RedisServer() as second:
        store = Store(first.client())
        watch = Watch(store, "test")
        watch.check_persistence()
        watch.check_restart()
        store.client = second.client()
        with caplog.at_level(logging.WARNING, logger="kombu_delay.mover.watch"):
            # As if the last look were an hour after the second server started (the test cannot
            # wait that long): it was up then, so it did not restart since.
            watch._run_id = (watch._run_id[0], watch._run_id[1] + 3600)  # type: ignore[index]
            watch.check_restart()
        assert "another Redis server answers (a failover" in caplog.text, caplog.text
        assert "all scheduled lost" not in caplog.text and "what was replicated to it" in caplog.text


def test_a_replica_started_since_and_promoted_is_told_as_a_failover_not_as_a_loss(caplog):
    # A replica started after the mover's last look, then promoted (a failover onto a server
    # restarted shortly before), was taken for the old Redis restarted: onto a Redis that keeps
    # nothing on disk, the warning said every scheduled message was lost, and none was.
    with RedisServer() as first, RedisServer() as second:
        store = Store(first.client())
        store.schedule(Due(600_000, relative=True, task_id="t"), "q", kombu_payload("t"), Settings())
        watch = Watch(store, "test")
        watch.check_persistence()
        watch.check_restart()
        replica = second.client()
        replica.replicaof("127.0.0.1", first.port)
        wait_until(lambda: replica.info("replication")["master_link_status"] == "up", timeout=60)
        wait_until(lambda: replica.exists(keys.ids("")), timeout=60)
        replica.replicaof("NO", "ONE")
        store.client = replica
        with caplog.at_level(logging.WARNING, logger="kombu_delay.mover.watch"):
            watch.check_restart()
        assert "a failover promoted a replica:" in caplog.text
        assert "all scheduled lost" not in caplog.text and "what was replicated to it" in caplog.text
        assert store.counts() == {"q": 1}


def test_a_redis_with_a_replica_restarted_from_its_snapshot_is_told_as_a_restart(caplog):
    # Redis 7 reloads its replication id from the snapshot as a second one, as a promoted
    # replica keeps its master's: the restart was told as a failover, "holding what was
    # replicated to it". A second id means a promotion only where nothing is kept on disk.
    with RedisServer(extra_args=["--save", "3600", "1"]) as master, RedisServer() as second:
        store = Store(master.client())
        store.schedule(Due(600_000, relative=True, task_id="t"), "q", kombu_payload("t"), Settings())
        replica = second.client()
        replica.replicaof("127.0.0.1", master.port)
        wait_until(lambda: replica.info("replication")["master_link_status"] == "up", timeout=60)
        watch = Watch(store, "test")
        watch.check_persistence()
        watch.check_restart()
        master.restart()  # SIGTERM: it saves its snapshot, and loads it
        store.client.connection_pool.disconnect()
        with caplog.at_level(logging.WARNING, logger="kombu_delay.mover.watch"):
            watch.check_restart()
        assert "Redis restarted" in caplog.text and "what it keeps on disk" in caplog.text, caplog.text
        assert "a failover promoted a replica:" not in caplog.text
        assert store.counts() == {"q": 1}
        store.client.close()


def test_refs_that_name_no_bucket_are_dropped_by_the_walk_of_the_id_index(
    r: redis.Redis, prefix: str
) -> None:
    # A compressed bucket keeps no task-id list: when it was lost (expired after its grace,
    # evicted), its refs stayed in the id index for as long as anything was published, and
    # find and cancel left them there.
    store = Store(r, prefix)
    far, near = 30 * 86_400_000, 600_000
    now = store.time_ms()
    cold = Settings()  # due a month ahead: stored compressed
    for i in range(5):
        store.schedule(Due(now + far, task_id=f"lost{i}"), f"{prefix}q", kombu_payload(f"lost{i}"), cold)
    store.schedule(Due(now + near, task_id="kept"), f"{prefix}q", kombu_payload("kept"), cold)
    store.schedule(Due(now + far, task_id="kept"), f"{prefix}q", kombu_payload("kept-retry"), cold)
    ids = keys.ids(prefix)
    assert r.hlen(ids) == 6 and len(r.hget(ids, "kept").split()) == 2
    lost_start = (now + far) - (now + far) % 60_000
    lost_keys = [k for k in r.keys(f"{keys.ns(prefix)}c*{lost_start}*")]
    assert lost_keys and r.delete(*lost_keys)  # the month-ahead bucket is gone, its meta hash too
    r.hset(ids, "junk", "no-ref-at-all")

    dropped = Watch(store, "m").forget_stale_refs()

    assert dropped == 5 + 1 + 1  # the lost messages' refs, the retry's, and the junk
    assert sorted(r.hkeys(ids)) == [b"kept"]
    (found,) = store.find("kept")
    assert found.message.startswith(b"{") and store.cancel("kept") == 1


def test_one_mover_walks_the_id_index_in_an_hour_however_many_run(r: redis.Redis, prefix: str) -> None:
    # Each walk costs Redis about 4 s per million task ids: with every mover walking at its
    # start and every hour, ten movers of ten million ids spent ten minutes of Redis an hour.
    store = Store(r, prefix)
    now = store.time_ms()
    for i in range(600):
        store.schedule(Due(now + 600_000, task_id=f"t{i}"), f"{prefix}q", kombu_payload(f"t{i}"), Settings())
    walk = keys.walk(prefix)
    every_ms = int(watch_module.FORGET_EVERY_S * 1000)

    assert Watch(store, "first").forget_stale_refs() == 0

    assert r.hget(walk, "by") == b"first" and r.hexists(walk, "done")
    assert 0 < r.pttl(walk) <= every_ms  # gone when the next walk is due
    left = store.forget_stale_refs(0, 250, "second", every_ms)  # nothing read
    assert isinstance(left, float) and 0 < left <= every_ms / 1000
    # The second mover looks again just after the claim ends: from its own clock an hour on,
    # it found the claim still there each time, and the index was walked every two hours.
    r.pexpire(walk, 5000)
    second = Watch(store, "second")
    assert second.forget_stale_refs() == 0 and 1 < second.next_walk_s <= 6
    r.delete(walk)  # as its expiry would, an hour on
    page = store.forget_stale_refs(0, 250, "second", every_ms)
    assert isinstance(page, tuple)
    cursor, dropped, *_ = page
    assert dropped == 0 and r.hget(walk, "by") == b"second"
    assert cursor != 0 and not r.hexists(walk, "done")  # 600 ids: more than one page
    while cursor:
        page = store.forget_stale_refs(cursor, 250, "second", every_ms)
        assert isinstance(page, tuple)
        cursor = page[0]
    assert r.hexists(walk, "done") and r.hlen(keys.ids(prefix)) == 600
    r.persist(walk)  # a claim with no expiry (its PEXPIREAT refused by an ACL) stopped every walk
    third = Watch(store, "third")
    assert third.forget_stale_refs() == 0 and third.next_walk_s == watch_module.FORGET_EVERY_S
    assert r.hget(walk, "by") == b"third" and 0 < r.pttl(walk) <= every_ms  # taken over
    r.delete(walk)
    r.set(walk, "by hand")  # a key of another type: every mover walks, as before it was shared
    assert store.forget_stale_refs(0, 1000, "third", every_ms) == (0, 0, 0, 0)
    assert r.get(walk) == b"by hand"


def test_a_walk_left_part_way_by_a_mover_that_is_gone_is_taken_over(r: redis.Redis, prefix: str) -> None:
    # A mover killed (or stopped) during its walk of the id index held the claim for the rest
    # of the hour: no stale ref dropped, and no lost bucket put back for a user who may not
    # SCAN, until then.
    store = Store(r, prefix)
    now = store.time_ms()
    for i in range(600):
        store.schedule(Due(now + 600_000, task_id=f"t{i}"), f"{prefix}q", kombu_payload(f"t{i}"), Settings())
    walk, movers = keys.walk(prefix), keys.movers(prefix)
    every_ms = int(watch_module.FORGET_EVERY_S * 1000)
    store.heartbeat("gone", now_ms=now)
    page = store.forget_stale_refs(0, 250, "gone", every_ms, now_ms=now)  # its first page of several
    assert isinstance(page, tuple) and page[0] != 0 and not r.hexists(walk, "done")
    fresh = now + FRESH_HEARTBEAT_MS  # its heartbeat as old as a live mover's may be
    assert isinstance(store.forget_stale_refs(0, 250, "other", every_ms, now_ms=fresh), float)
    later = fresh + 1  # older than that: killed
    page = store.forget_stale_refs(0, 250, "other", every_ms, now_ms=later)
    assert isinstance(page, tuple) and r.hget(walk, "by") == b"other"
    store.heartbeat("other", now_ms=later)
    r.zrem(movers, "other")  # stopped cleanly, part way: its heartbeat removed
    page = store.forget_stale_refs(0, 250, "third", every_ms, now_ms=later)
    assert isinstance(page, tuple) and r.hget(walk, "by") == b"third"
    cursor = page[0]
    while cursor:
        page = store.forget_stale_refs(cursor, 250, "third", every_ms, now_ms=later)
        assert isinstance(page, tuple)
        cursor = page[0]
    # A walk done holds its claim until the next is due, whether its mover runs or not.
    assert r.hexists(walk, "done") and not r.zscore(movers, "third")
    assert isinstance(store.forget_stale_refs(0, 250, "fourth", every_ms, now_ms=later), float)
    # A mover that found the claim looks again within a minute, not when it ends an hour on:
    # only so is a walk left part way taken over in time.
    fourth = Watch(store, "fourth")
    assert fourth.forget_stale_refs() == 0 and fourth.next_walk_s == watch_module.CLAIM_LOOK_S


def test_a_walk_cut_short_by_a_redis_restart_begins_again_in_the_restarted_redis() -> None:
    # A Redis restarted with its data kept the mover's own claim, and its walk went on from its
    # HSCAN cursor, which means nothing in another process (the hash is laid out anew): a
    # quarter of the index was never read, and the walk was marked done.
    with RedisServer(persistence=True, appendfsync="always") as server:
        store = Store(server.client())
        now = store.time_ms()
        for i in range(3000):
            store.schedule(Due(now + 600_000, task_id=f"t{i}"), "q", kombu_payload(f"t{i}"), Settings())
        for pattern in ("m:*", "cm:*"):  # either space's meta hashes
            for key in store.client.scan_iter(match=keys.ns("") + pattern):
                store.client.delete(key)  # every ref now names no bucket
        watch = Watch(store, "walker")
        watch._stop.set()  # one page, then stop: a walk cut short
        assert watch.forget_stale_refs() > 0 and watch._walk_cursor != 0
        server.restart(kill=True)
        store.client.connection_pool.disconnect()
        wait_until(lambda: not int(store.client.info("persistence")["loading"]), timeout=DEADLINE_S)
        watch._stop.clear()
        watch.forget_stale_refs()
        assert store.client.hlen(keys.ids("")) == 0
        assert store.client.hget(keys.walk(""), "by") == b"walker" and store.client.hexists(
            keys.walk(""), "done"
        )


def test_stranded_prefixes_are_looked_at_again_on_one_connection(
    r: redis.Redis, redis_server: RedisServer, prefix: str
) -> None:
    # The look read on a second connection while it held the first, watching: a mover held
    # one more than the four of its pool that the docs gave, and with max_connections 4 the
    # walk of the id index found the pool full.
    other = f"{prefix}other:"
    Store(r, other).schedule(Due(Store(r).time_ms() + 600_000, task_id="x"), f"{other}q", "{}", Settings())
    one = redis.Redis(port=redis_server.port, max_connections=1)
    assert Store(one, prefix).renew_stranded([other], 30_000, 60_000, lambda found: "told") == {other: 1}
    assert r.hget(keys.stranded(prefix), other) == b"1"
    one.close()


def test_stranded_prefixes_are_looked_at_again_on_one_connection_without_watch(
    r: redis.Redis, redis_server: RedisServer
) -> None:
    # An ACL user without WATCH (security.md allows it): the refused WATCH kept the pipeline's
    # connection, and the reads took a second one.
    Store(r, "other:").schedule(Due(Store(r).time_ms() + 600_000, task_id="x"), "other:q", "{}", Settings())
    r.acl_setuser(
        "nowatch", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"], commands=["+@all", "-watch"]
    )
    one = redis.Redis(port=redis_server.port, username="nowatch", password="pw", max_connections=1)
    r.acl_log_reset()
    try:
        store = Store(one, "")
        for _ in range(3):
            assert store.renew_stranded(["other:"], 30_000, 60_000, lambda found: "told") == {"other:": 1}
        # Asked once: each refusal is an entry of the ACL LOG (merged only within 60 s), and a
        # mover asked every 15 s, pushing out the entries worth reading.
        assert [int(e["count"]) for e in r.acl_log() if e["object"] == "watch"] == [1]
    finally:
        one.close()
        r.acl_deluser("nowatch")


def test_a_walk_that_failed_part_way_goes_on_from_there_when_retried(
    r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its retry, a minute later, began again from the first page, found the claim its own
    # first page had taken, and walked nothing for the hour the claim lasts.
    store = Store(r, prefix)
    ids = keys.ids(prefix)
    r.hset(ids, mapping={f"junk{i}": "no-ref-at-all" for i in range(1000)})
    watch, pages = Watch(store, "m"), store.forget_stale_refs

    def cut_after_the_first_page(cursor: int, *args: Any) -> Any:
        if cursor:
            raise RedisUnavailable("Redis is unavailable: the connection was cut")
        return pages(cursor, *args)

    monkeypatch.setattr(store, "forget_stale_refs", cut_after_the_first_page)
    with pytest.raises(RedisUnavailable):
        watch.forget_stale_refs()
    left = r.hlen(ids)
    assert 0 < left < 1000 and r.hexists(keys.walk(prefix), "at")
    monkeypatch.setattr(store, "forget_stale_refs", pages)
    assert watch.forget_stale_refs() == left and r.hlen(ids) == 0
    # Cut again, and then its claim gone (a Redis restarted, its hour over): a cursor means
    # nothing there, and the retry walks the whole index again, under a claim of its own.
    r.delete(keys.walk(prefix))
    r.hset(ids, mapping={f"junk{i}": "no-ref-at-all" for i in range(1000)})
    monkeypatch.setattr(store, "forget_stale_refs", cut_after_the_first_page)
    with pytest.raises(RedisUnavailable):
        watch.forget_stale_refs()
    r.delete(keys.walk(prefix))
    r.hset(ids, mapping={f"more{i}": "no-ref-at-all" for i in range(1000)})
    monkeypatch.setattr(store, "forget_stale_refs", pages)
    watch.forget_stale_refs()
    assert r.hlen(ids) == 0 and r.hget(keys.walk(prefix), "by") == b"m"


def test_a_walk_of_the_id_index_the_acl_refuses_is_said(r: redis.Redis, caplog) -> None:
    # An ACL line from before the walk lacks HSCAN: the walk must say so, not fail in silence.
    caplog.set_level(logging.INFO, logger="kombu_delay.mover.watch")
    port = r.connection_pool.connection_kwargs["port"]
    r.execute_command("ACL", "SETUSER", "nohscan", "on", ">pw", "~*", "&*", "+@all", "-hscan")
    try:
        user = redis.Redis(port=port, username="nohscan", password="pw")
        watch = Watch(Store(user, "nohscan:"), "acl")
        assert watch.forget_stale_refs() == 0
        assert [level for level, text in said(caplog) if "grant HSCAN" in text] == [logging.WARNING]
        # Refused before it wrote: the next walk is left to a mover that may read the index.
        assert not r.exists(keys.walk("nohscan:"))
        user.close()
    finally:
        r.execute_command("ACL", "DELUSER", "nohscan")


def test_another_apps_keys_the_acl_refuses_leave_the_index_check_on(caplog):
    """Apps with a user each, limited to their own prefix, on one Redis: the look at stranded
    prefixes read another app's counts, was refused, and the mover took that for a refused SCAN,
    said "this user may not SCAN" and put no lost bucket back for the rest of its life. The
    other app's keys are its own movers' business; the lost bucket is put back."""
    with RedisServer() as server:
        admin = server.client()
        for app in ("app1", "app2"):
            rules = ["on", f">{app}", "resetkeys", "resetchannels", f"~{app}:*", f"&{app}:*", "+@all"]
            admin.execute_command("ACL", "SETUSER", app, *rules)
        Store(admin, "app2:").schedule(
            Due(600_000, relative=True, task_id="b-1"), "app2:celery", kombu_payload("b-1"), Settings()
        )
        app1 = redis.Redis(port=server.port, username="app1", password="app1")
        Store(app1, "app1:").schedule(
            Due(600_000, relative=True, task_id="a-1"), "app1:celery", kombu_payload("a-1"), Settings()
        )
        indexes = (keys.index("app1:"), keys.cold_index("app1:"))
        assert sum(map(admin.zcard, indexes)) == 1
        admin.delete(*indexes)  # evicted, or deleted by hand
        with caplog.at_level(logging.INFO, logger="kombu_delay.mover.watch"):
            Watch(Store(app1, "app1:"), "test").check_prefixes()
        assert "may not SCAN" not in caplog.text, caplog.text
        assert sum(map(admin.zcard, indexes)) == 1  # put back
        app1.close()


def test_a_user_who_may_not_scan_has_lost_buckets_put_back_by_the_walk(caplog):
    """The index of buckets, evicted or deleted by hand, is put back by a SCAN of the meta
    hashes, which the ACL line of the security docs leaves out: its buckets stayed out, and
    nothing moved what they held. The walk of the id index, which reads the refs that name
    every bucket, puts them back too."""
    with RedisServer() as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "noscan", "on", ">pw", "~*", "&*", "+@all", "-scan")
        user = redis.Redis(port=server.port, username="noscan", password="pw")
        store = Store(user)
        now = store.time_ms()
        for n, ahead in enumerate((20_000, 3_600_000)):  # an ordinary bucket and a compressed one
            store.schedule(Due(now + ahead, task_id=f"t-{n}"), "q", kombu_payload(f"t-{n}"), Settings())
        indexes = (keys.index(""), keys.cold_index(""))
        assert [admin.zcard(index) for index in indexes] == [1, 1]
        admin.delete(*indexes)  # evicted, or deleted by hand
        watch = Watch(store, "noscan")
        with caplog.at_level(logging.WARNING, logger="kombu_delay.mover.watch"):
            watch.check_prefixes()  # refused SCAN: said, and nothing put back
            assert "may not SCAN" in caplog.text
            assert [admin.zcard(index) for index in indexes] == [0, 0]
            watch.forget_stale_refs()
        assert [admin.zcard(index) for index in indexes] == [1, 1]
        assert "2 buckets holding 2 messages had left the bucket index" in caplog.text
        assert admin.hget(keys.totals(""), "reindexed") == b"2"
        user.close()


def test_a_second_database_stranded_is_told_at_once_beside_the_first(caplog):
    # Keyed by every database found, the WARNING came again naming the first alone at the scan
    # that first found the second (told only from its second scan on), and then, its key being
    # the same, not at all for 10 minutes.
    with RedisServer() as server:
        due = Due(600_000, relative=True, task_id="t")
        for db in (2, 4):
            Store(redis.Redis(port=server.port, db=db)).schedule(
                due, "q", kombu_payload(f"t{db}"), Settings()
            )
        store = Store(server.client())
        watch = Watch(store, "test")
        with caplog.at_level(logging.INFO, logger=watch_module.__name__):
            redis.Redis(port=server.port, db=4).delete(keys.counts(""))  # not there at first
            watch.check_prefixes()
            watch.check_prefixes()  # database 2 told
            Store(redis.Redis(port=server.port, db=4)).schedule(due, "q", kombu_payload("u4"), Settings())
            watch.check_prefixes()
            watch.check_prefixes()  # database 4 told, beside 2
        warned = [text for level, text in said(caplog) if level == logging.WARNING]
        assert len(warned) == 2 and "database 2 (1) of" in warned[0]
        assert "database 2 (1), 4 (1) of" in warned[1], warned
