"""A mover stays alive and says so: its backoff survives any outage length, and it keeps
beating while it drains a long backlog, so a liveness probe never kills it mid catch-up."""

from __future__ import annotations

import time

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.mover.loop import Backoff, Mover
from kombu_delay.store import Store, keys
from kombu_delay.store.replies import Scheduled
from tests.support.cli import health
from tests.support.procs import wait_until
from tests.support.stored import behind, kombu_payload

#: Backlog size and rate cap: the drain takes BACKLOG / RATE s (60 s), far past MAX_AGE_S.
BACKLOG, RATE = 12_000, 200
#: The probe's heartbeat threshold, s; the mover beats every 0.5 s here.
MAX_AGE_S = 20


def test_backoff_stays_within_its_cap_after_any_number_of_failures():
    """Thousands of failures (hours of outage) neither overflow nor pass the cap."""
    backoff = Backoff(base=0.1, cap=5.0)
    delays = [backoff.next() for _ in range(5000)]
    assert all(0 < d <= 5.0 for d in delays)
    assert all(d >= 2.5 for d in delays[1100:])  # jitter keeps the upper half of the cap
    backoff.reset()
    assert backoff.next() <= 0.1


def test_health_sees_the_mover_alive_while_it_drains_a_backlog(r, redis_server, start_mover):
    """A mover started with a rate-capped backlog waiting beats from the start and all
    through the drain; every probe taken while the list still grows says OK.

    The backlog is overdue at once (stored through a clock behind Redis's), and the rate cap
    makes its drain last a minute at least, however slow the machine: the probes run until one
    has started more than a staleness window into the drain, and the mover is stopped mid-drain.
    """
    clock = behind(r)  # stored however slow this is; overdue for the mover
    store = Store(r, clock=clock)
    due = clock() + 1000
    items = [(Due(due, task_id=f"t{i}"), "celery", kombu_payload(f"m{i}")) for i in range(BACKLOG)]
    assert {res.outcome for res in store.schedule_many(items, Settings())} == {Scheduled.STORED}

    mover = start_mover("--max-rate", str(RATE), env={"KOMBU_DELAY_HEARTBEAT_INTERVAL": "0.5"})
    wait_until(lambda: r.llen("celery") > 0, timeout=90)
    started = time.monotonic()
    probes: list[tuple[float, int, str]] = []  # (s into the drain, exit status, line)
    while not any(at > MAX_AGE_S + 1 for at, _, _ in probes):
        at = time.monotonic() - started
        seen = health(redis_server, "", "--max-heartbeat-age", str(MAX_AGE_S), "--max-overdue", "0")
        assert r.llen("celery") < BACKLOG, "the drain ended: make it longer"
        probes.append((at, seen.returncode, seen.stdout.strip()))
        assert seen.returncode == 0, (probes, mover.output()[-2000:])
    assert r.zcard(keys.movers("")) == 1
    assert probes[0][0] < MAX_AGE_S, probes  # the first probe came early in the drain
    assert mover.stop() == 0, mover.output()[-2000:]  # mid-drain
    listed = r.llen("celery")
    assert 0 < listed < BACKLOG and sum(store.counts().values()) == BACKLOG - listed


def test_a_heartbeat_interval_shorter_than_the_longest_sleep_is_kept(r, prefix):
    """An idle mover sleeps up to ``max_sleep`` between looks, or less for its thaw, sweep and
    staging: it wakes for a heartbeat of a shorter interval too, as the option says (it beat
    once a look: every second, for an interval of 0.3 s)."""
    waits: list[float] = []

    class Recorded(Mover):
        def _wait(self, wake, seconds):  # the loop's one sleep: recorded, and the loop stops
            waits.append(seconds)
            self.stop()

    settings = Settings(max_sleep_ms=20_000, heartbeat_interval_ms=300)
    Recorded(Store(r, prefix=prefix), settings, watch=False).run()
    assert len(waits) == 1 and 0 < waits[0] <= 0.3, waits
    # Counted from the last move call, where the wait counts from, not from now: counted from
    # now, a heartbeat due at the next look (2 s, a look every second) woke the mover a call's
    # time before that look, and the look came a moment later: half as many calls again idle.
    idle = Mover(Store(r, prefix=prefix), Settings(), watch=False)
    idle._last_beat, idle._called_at = 100.0, 101.0
    assert idle._beat_in() == 1.0  # the next look, 1 s on, is when the beat is due: one wake
