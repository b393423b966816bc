"""Support for the fault and load suite: a ledger of every message, a consumer that
timestamps arrivals by the Redis clock, mover processes that can be killed, and an
invariant check of everything kombu-delay keeps in Redis.

Sizes: the CI size by default; ``KOMBU_DELAY_CHAOS=1`` (``tox -e chaos``) selects the
large one and enables the tests marked ``chaos``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from kombu_delay.message import index_id
from kombu_delay.store import cold, keys
from tests.support.procs import Proc

CHAOS = os.environ.get("KOMBU_DELAY_CHAOS", "") == "1"

#: Marks a test (or a parameter) as chaos-size: run by ``tox -e chaos``, skipped otherwise.
chaos_only = [
    pytest.mark.chaos,
    pytest.mark.skipif(not CHAOS, reason="chaos size: set KOMBU_DELAY_CHAOS=1 (tox -e chaos)"),
    pytest.mark.timeout(1800),
]

#: Pops up to ARGV[1] items from KEYS[1] and returns the Redis clock with them, in one
#: atomic step: every item was on the list at that instant, so it was pushed no later.
#: redis-py silently retries a command whose reply was lost to a disconnect, and a pop is
#: not idempotent, so each popped batch is kept (KEYS[2], numbered by KEYS[3]) until the
#: next call says (ARGV[2]) that the consumer has it; a repeated call returns it again.
POP_LUA = """
local t = redis.call('TIME')
local current = tonumber(redis.call('GET', KEYS[3]) or '0')
if current ~= tonumber(ARGV[2]) then
  local kept = redis.call('LRANGE', KEYS[2], 0, -1)
  return {t[1], t[2], current, unpack(kept)}
end
redis.call('DEL', KEYS[2])
local items = redis.call('RPOP', KEYS[1], ARGV[1])
if not items then return {t[1], t[2], current} end
redis.call('RPUSH', KEYS[2], unpack(items))
current = redis.call('INCR', KEYS[3])
return {t[1], t[2], current, unpack(items)}
"""


def figures(name: str, **values: Any) -> None:
    """Print one line of figures (``pytest -s`` shows it) and append it to the JSON-lines
    file named by ``KOMBU_DELAY_FIGURES``, if set."""
    line = json.dumps({"test": name, **values}, sort_keys=True)
    print(f"\nFIGURES {line}")
    target = os.environ.get("KOMBU_DELAY_FIGURES")
    if target:
        with open(target, "a", encoding="utf-8") as out:
            out.write(line + "\n")


def message(mid: str, due_iso: str = "", queue: str = "faults", body: str = "e30=") -> str:
    """A message in kombu's stored JSON layout: ``mid`` as its id, a fresh delivery tag."""
    headers: dict[str, Any] = {"id": mid, "task": "faults.noop"}
    if due_iso:
        headers["eta"] = due_iso
    return json.dumps(
        {
            "body": body,
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": {
                "body_encoding": "base64",
                "delivery_info": {"exchange": "", "routing_key": queue},
                "delivery_mode": 2,
                "delivery_tag": str(uuid.uuid4()),
                "priority": 0,
            },
        }
    )


@dataclass
class Ledger:
    """Every message published (id, due time, delivery tag) and every arrival."""

    due: dict[str, int] = field(default_factory=dict)
    #: Ids whose publish was retried after an error: the first attempt may have landed too.
    uncertain: set[str] = field(default_factory=set)
    #: id -> Redis-clock ms of each arrival.
    arrivals: dict[str, list[int]] = field(default_factory=dict)
    #: Delivery tag -> times seen (a tag is unique per publish attempt).
    tags: Counter[str] = field(default_factory=Counter)
    #: Arrivals with an id that was never published (or whose publish raised).
    foreign: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def published(self, mid: str, due_ms: int) -> None:
        with self.lock:
            self.due[mid] = due_ms

    def arrived(self, raw: bytes, at_ms: int) -> None:
        decoded = json.loads(raw)
        mid = str(decoded["headers"]["id"])
        with self.lock:
            self.tags[decoded["properties"]["delivery_tag"]] += 1
            self.arrivals.setdefault(mid, []).append(at_ms)

    def delivered(self) -> int:
        with self.lock:
            return sum(1 for mid in self.due if mid in self.arrivals)

    def complete(self) -> bool:
        return self.delivered() == len(self.due)

    def lost(self) -> list[str]:
        with self.lock:
            return [mid for mid in self.due if mid not in self.arrivals]

    def doubled(self) -> list[str]:
        with self.lock:
            return [mid for mid, seen in self.arrivals.items() if len(seen) > 1]

    def doubled_tags(self) -> list[str]:
        with self.lock:
            return [tag for tag, n in self.tags.items() if n > 1]

    def unknown(self) -> list[str]:
        with self.lock:
            return [mid for mid in self.arrivals if mid not in self.due]

    def early(self) -> list[tuple[str, int, int]]:
        """``(id, due_ms, arrival_ms)`` of every arrival seen before its due time."""
        with self.lock:
            return [
                (mid, self.due[mid], at)
                for mid, seen in self.arrivals.items()
                if mid in self.due
                for at in seen
                if at < self.due[mid]
            ]

    def lateness_ms(self) -> list[int]:
        """First arrival minus due, per delivered message (consumer polling included)."""
        with self.lock:
            return [min(seen) - self.due[mid] for mid, seen in self.arrivals.items() if mid in self.due]

    def summary(self) -> dict[str, Any]:
        late = sorted(self.lateness_ms())
        return {
            "published": len(self.due),
            "delivered": self.delivered(),
            "lost": len(self.lost()),
            "doubled": len(self.doubled()),
            "doubled_uncertain": len(set(self.doubled()) & self.uncertain),
            "early": len(self.early()),
            "unknown": len(self.unknown()),
            "max_lateness_ms": late[-1] if late else None,
            "p50_lateness_ms": late[len(late) // 2] if late else None,
            "p99_lateness_ms": late[int(len(late) * 0.99)] if late else None,
        }


class Consumer:
    """A thread popping a list in batches, stamping each arrival with the Redis clock.

    It keeps going through Redis restarts (reconnecting with a short pause), the loss of its
    script to one included. Any other error ends it, and :meth:`stop` raises it.
    """

    def __init__(self, client: redis.Redis, key: str, ledger: Ledger, batch: int = 1000) -> None:
        self.client, self.key, self.ledger, self.batch = client, key, ledger, batch
        self.errors = 0
        #: Polls that found the pop script missing (in ``errors`` too).
        self.noscript = 0
        #: What ended the thread, raised again by :meth:`stop`.
        self.failure: Exception | None = None
        self.done = 0  # number of the last batch recorded
        self._pop = client.register_script(POP_LUA)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="consumer", daemon=True)

    def __enter__(self) -> Consumer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def poll_once(self) -> int:
        keys_ = [self.key, f"{self.key}:consumer-batch", f"{self.key}:consumer-batch-no"]
        reply = self._pop(keys=keys_, args=[self.batch, self.done])
        at_ms = int(reply[0]) * 1000 + int(reply[1]) // 1000
        number, items = int(reply[2]), reply[3:]
        if number <= self.done:
            # Nothing new; or Redis went back in time (it lost its last writes in a crash):
            # the batch it kept is one already recorded.
            self.done = number
            return 0
        for raw in items:
            self.ledger.arrived(raw, at_ms)
        self.done = number
        return len(items)

    def _run(self) -> None:
        try:
            self._poll_until_stopped()
        except Exception as exc:  # kept for stop(), which raises it in the test's own thread
            self.failure = exc

    def _poll_until_stopped(self) -> None:
        while not self._stop.is_set():
            try:
                if self.poll_once() == 0:
                    self._stop.wait(0.002)
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                self.errors += 1
                self._stop.wait(0.05)
            except redis.exceptions.NoScriptError:
                # redis-py loads the script when EVALSHA answers NOSCRIPT and calls it again:
                # across a Redis restart the load can reach the old server and the call the new
                # one, which has no script. The script did not run (nothing was popped), so the
                # call is simply made again; its first NOSCRIPT makes redis-py load it anew.
                self.errors += 1
                self.noscript += 1
                self._stop.wait(0.05)

    def stop(self) -> None:
        """Stop the thread; raise what ended it early, if anything did."""
        self._stop.set()
        self._thread.join(30)
        if self.failure is not None:
            failure = self.failure
            raise RuntimeError(f"the consumer thread died: {type(failure).__name__}: {failure}") from failure


class Movers:
    """``kombu-delay mover`` processes on one broker URL, killed and restarted by PID."""

    def __init__(
        self, url: str, log_dir: Path, *args: str, prefix: str = "", env: dict[str, str] | None = None
    ) -> None:
        self.url, self.log_dir, self.args, self.prefix, self.env = url, log_dir, list(args), prefix, env
        #: The current mover in each slot.
        self.procs: list[Proc] = []
        #: Every mover ever started, killed ones included.
        self.history: list[Proc] = []

    def spawn(self) -> Proc:
        cmd = [sys.executable, "-m", "kombu_delay", "--broker", self.url, "--log-level", "info"]
        if self.prefix:
            cmd += ["--prefix", self.prefix]
        proc = Proc(
            [*cmd, "mover", *self.args], self.env, log=self.log_dir / f"mover-{len(self.history)}.log"
        )
        self.history.append(proc)
        return proc

    def start(self, count: int = 1) -> None:
        for _ in range(count):
            self.procs.append(self.spawn())

    def restart(self, slot: int) -> None:
        """SIGKILL the mover in ``slot`` (by PID) and start a fresh one in its place."""
        self.procs[slot].kill()
        self.procs[slot] = self.spawn()

    def stop(self) -> list[int]:
        """SIGTERM every current mover; return their exit codes (0 = clean)."""
        return [p.stop() for p in self.procs]

    def cleanup(self) -> None:
        for proc in self.history:
            proc.stop()

    def __enter__(self) -> Movers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def logs(self) -> str:
        return "\n".join(p.output() for p in self.history)


def started(proc: Proc) -> bool:
    """True once a mover process has logged that its loop runs."""
    return " started (prefix " in proc.output()


def rss_kb(pid: int) -> int:
    """Resident set size of a process, KiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def consistency(client: redis.Redis, prefix: str = "") -> dict[str, int]:
    """Check every invariant between kombu-delay's keys at rest; return the totals.

    - every per-destination sorted set belongs to an indexed bucket, and every indexed
      bucket's meta hash counts exactly the members of its sorted sets; ``counts`` is their sum;
    - every meta hash belongs to an indexed bucket or to one waiting in ``gc``;
    - every member has one id-index ref, a ref that names a member names one of its own task
      id, and each member's task id is in its bucket's task-id list (which drives the clean-up
      of refs); refs that name nothing (moved messages whose bucket is not cleaned up yet, or
      a bucket that vanished) are returned as ``stale_refs``;
    - ``scheduled - moved - expired - cancelled - purged`` equals the members still stored.

    Call it only while no mover runs (or after the movers saw every due bucket).
    """
    ns = keys.ns(prefix)
    index = {_text(m) for m in client.zrange(keys.index(prefix), 0, -1)}
    waiting = {_text(m) for m in client.zrange(keys.drained(prefix), 0, -1)}
    sets: dict[str, list[str]] = {}
    for key in client.scan_iter(match=ns + "z:*", count=1000):
        start, dest = _text(key)[len(ns + "z:") :].split(":", 1)
        sets.setdefault(start, []).append(dest)
    assert set(sets) <= index, f"sorted sets of unindexed buckets: {sorted(set(sets) - index)}"
    meta_keys = {_text(k)[len(ns + "m:") :] for k in client.scan_iter(match=ns + "m:*", count=1000)}
    assert meta_keys <= index | waiting, f"meta of no known bucket: {sorted(meta_keys - index - waiting)}"
    per_dest: Counter[str] = Counter()
    members: dict[tuple[str, float], str] = {}
    for start in index:
        in_bucket: Counter[str] = Counter()
        listed = {_text(t) for t in client.lrange(keys.task_ids(prefix, int(start)), 0, -1)}
        for dest in sets.get(start, []):
            for member, score in client.zrange(
                keys.queue_set(prefix, int(start), dest), 0, -1, withscores=True
            ):
                in_bucket[dest] += 1
                task_id = index_id(member)
                members[(start, float(score))] = task_id
                assert task_id in listed, f"bucket {start}: {task_id!r} missing from its task-id list"
        meta = {_text(k): int(v) for k, v in client.hgetall(keys.meta(prefix, int(start))).items()}
        meta_counts = {k[2:]: v for k, v in meta.items() if k.startswith("q:") and v}
        assert meta_counts == dict(in_bucket), f"bucket {start}: meta {meta_counts} != {dict(in_bucket)}"
        per_dest.update(in_bucket)
    # The cold space (compressed messages): the same checks, its members' ids read off them.
    cold_index = {_text(m) for m in client.zrange(keys.cold_index(prefix), 0, -1)}
    cold_sets: dict[str, list[str]] = {}
    for key in client.scan_iter(match=ns + "cz:*", count=1000):
        start, dest = _text(key)[len(ns + "cz:") :].split(":", 1)
        cold_sets.setdefault(start, []).append(dest)
    unindexed = sorted(set(cold_sets) - cold_index)
    assert not unindexed, f"cold sets of unindexed buckets: {unindexed}"
    for start in cold_index:
        in_bucket = Counter()
        for dest in cold_sets.get(start, []):
            key = keys.queue_set(prefix, int(start), dest, keys.COLD)
            for member, score in client.zrange(key, 0, -1, withscores=True):
                in_bucket[dest] += 1
                members[(keys.COLD + start, float(score))] = cold.unpack(member)[0]
        meta = {_text(k): int(v) for k, v in client.hgetall(keys.meta(prefix, int(start), keys.COLD)).items()}
        meta_counts = {k[2:]: v for k, v in meta.items() if k.startswith("q:") and v}
        assert meta_counts == dict(in_bucket), f"cold bucket {start}: meta {meta_counts} != {dict(in_bucket)}"
        per_dest.update(in_bucket)
    counts = {_text(k): int(v) for k, v in client.hgetall(keys.counts(prefix)).items() if int(v)}
    assert counts == dict(per_dest), f"counts {counts} != members {dict(per_dest)}"
    resolved: dict[tuple[str, float], str] = {}
    stale = 0
    for task_id, value in client.hgetall(keys.ids(prefix)).items():
        for ref in _text(value).split():
            start, offset, seq = ref.split(":")
            at = (start, int(start.removeprefix(keys.COLD)) + int(offset) + int(seq) / keys.SEQ_SLOTS)
            if at not in members:  # moved and not cleaned up yet, or its bucket vanished
                stale += 1
                continue
            assert at not in resolved, "two id-index refs name the same member"
            resolved[at] = _text(task_id)
    assert resolved == members, "the id index and the stored members disagree"
    totals = {_text(k): int(v) for k, v in client.hgetall(keys.totals(prefix)).items()}
    assert totals.pop(keys.FORMAT_FIELD, keys.FORMAT) == keys.FORMAT  # the storage format, no counter
    stored = len(members)
    settled = sum(totals.get(name, 0) for name in ("moved", "expired", "cancelled", "purged"))
    assert totals.get("scheduled", 0) - settled == stored, f"totals {totals} vs {stored} stored"
    return {"stored": stored, "stale_refs": stale, **totals}
