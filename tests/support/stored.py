"""What Redis holds, read as a test checks it (every stored message, its bucket and destination),
test payloads in kombu's layout, LPUSHes watched by the Redis clock, and clocks a test drives."""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due, index_id
from kombu_delay.store import Store, cold, keys

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

#: The ordinary layout, for tests that look into it (test_cold.py covers the cold space).
ORDINARY = Settings(compress_after_ms=0)


@dataclass(frozen=True)
class Envelope:
    """What is known of one stored message: its id-index key, its list key and itself."""

    task_id: str
    dest: str
    payload: bytes


@dataclass(frozen=True)
class Stored:
    """One member of one bucket."""

    start_ms: int
    score: float
    envelope: Envelope
    #: Stored compressed, in the cold space (``envelope.payload`` is then the restored message).
    cold: bool = False

    @property
    def due_ms(self) -> int:
        return int(self.score)

    @property
    def message(self) -> dict[str, Any]:
        decoded: dict[str, Any] = json.loads(self.envelope.payload)
        return decoded


def dests_of(client: redis.Redis, prefix: str, start_ms: int, space: str = "") -> list[str]:
    """The destinations a bucket's meta hash counts (each has its own sorted set)."""
    meta = client.hgetall(keys.meta(prefix, start_ms, space))
    return sorted(k.decode()[2:] for k, v in meta.items() if k.startswith(b"q:") and int(v) > 0)


def stored(client: redis.Redis, prefix: str = "") -> list[Stored]:
    """Every message in every indexed bucket, the compressed ones (restored) included, in due order."""
    found: list[Stored] = []
    for space, index in (("", keys.index(prefix)), (keys.COLD, keys.cold_index(prefix))):
        for start in client.zrange(index, 0, -1):
            start_ms = int(start)
            for dest in dests_of(client, prefix, start_ms, space):
                key = keys.queue_set(prefix, start_ms, dest, space)
                for member, score in client.zrange(key, 0, -1, withscores=True):
                    payload = cold.unpack(member)[1] if space else bytes(member)
                    envelope = Envelope(index_id(payload), dest, payload)
                    found.append(Stored(start_ms, float(score), envelope, bool(space)))
    return sorted(found, key=lambda s: s.score)


def eta_us(text: str) -> int:
    """An ISO-8601 ETA as exact integer epoch microseconds (naive means UTC)."""
    when = datetime.fromisoformat(text)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return (when - EPOCH) // _US


_US = datetime(1970, 1, 1, 0, 0, 0, 1, tzinfo=UTC) - EPOCH


def kombu_payload(tag: str, queue: str = "celery", body: str = "e30=") -> str:
    """A small message in kombu's stored JSON layout, with ``tag`` as its delivery tag."""
    return json.dumps(
        {
            "body": body,
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {},
            "properties": {
                "body_encoding": "base64",
                "delivery_info": {"exchange": "", "routing_key": queue},
                "delivery_mode": 2,
                "delivery_tag": tag,
                "priority": 0,
            },
        }
    )


def schedule_herd(
    store: Store, dest: str, due_ms: int, tags: list[str], settings: Settings = ORDINARY
) -> None:
    """Schedule one test payload per tag for ``dest``, all due at ``due_ms`` (task id = tag)."""
    store.schedule_many([(Due(due_ms, task_id=tag), dest, kombu_payload(tag)) for tag in tags], settings)


def tags_in(client: redis.Redis, key: str) -> list[str]:
    """Delivery tags of every message in a list, oldest first (the order BRPOP takes)."""
    items = client.lrange(key, 0, -1)
    return [json.loads(item)["properties"]["delivery_tag"] for item in reversed(items)]


def sweep_all(store: Store) -> tuple[int, int, int]:
    """One whole sweep cycle; return (renewed, lost, rebuilt)."""
    renewed = lost = rebuilt = 0
    cursor = ""
    while True:
        page = store.sweep(cursor, 3)  # small pages: the cursor is crossed many times
        renewed, lost, rebuilt = renewed + page.renewed, lost + page.lost, rebuilt + page.rebuilt
        cursor = page.cursor
        if not cursor:
            return renewed, lost, rebuilt


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class LpushMonitor:
    """Collect every ``LPUSH`` a Lua script runs, with its Redis-clock time in µs.

    Uses ``MONITOR``, whose timestamps come from the server clock when the command
    runs inside the script: an independent record of when each message reached a list.
    ``other`` is a second connection: its ``ECHO`` of a marker shows the reader where the
    stream ends, however far behind the reader is.
    """

    client: redis.Redis
    other: redis.Redis
    pushes: list[tuple[int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._marker = f"lpush-monitor-{uuid.uuid4()}"
        self._seen_start = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LpushMonitor:
        self._thread.start()
        # Echoed until MONITOR shows it: from then on every command is recorded.
        deadline = time.monotonic() + 30
        while not self._seen_start.wait(0.05):
            assert time.monotonic() < deadline, "MONITOR did not start"
            self.other.echo(f"{self._marker}-start")
        return self

    def _run(self) -> None:
        with self.client.monitor() as monitor:
            while True:
                try:
                    line = monitor.next_command()
                except redis.ConnectionError:
                    return
                command = line["command"]
                if self._marker in command:
                    if command.endswith("-end"):
                        return
                    self._seen_start.set()
                elif line.get("client_type") == "lua" and command.startswith("LPUSH "):
                    self.pushes.append((round(float(line["time"]) * 1_000_000), command))

    def __exit__(self, *exc: object) -> None:
        self.other.echo(f"{self._marker}-end")  # the last line the reader needs
        self._thread.join(60)
        self.client.close()

    def first_push_us(self, needle: str) -> list[int]:
        """Times of the LPUSHes whose command text contains ``needle``."""
        return [at for at, command in self.pushes if needle in command]


class FakeClock:
    """A clock for :class:`~kombu_delay.store.Store` (epoch ms) that moves only when told to.

    It starts at Redis's own clock and only ever runs ahead of it, so the expiries the scripts
    set from it never fall due during a test: a test drives time through it instead of waiting.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.ms = redis_ms(client)

    def __call__(self) -> int:
        return self.ms

    def advance(self, ms: int) -> int:
        self.ms += ms
        return self.ms


def behind(client: redis.Redis, ms: int = 60_000) -> FakeClock:
    """A clock ``ms`` behind Redis's (far less than the shortest grace, an hour), for a store
    that publishes: what it stores as due soon is overdue by Redis's clock already, as a mover
    outage leaves it. A mover process (which judges by Redis's clock) finds it due at once, so
    a test neither waits for a due time nor races one; it never tells whether a move is early."""
    clock = FakeClock(client)
    clock.ms -= ms
    return clock


def calls(client: redis.Redis, command: str, succeeded: bool = False) -> int:
    """How many times the server has run ``command`` (``INFO commandstats``: a script's
    commands included) since it started or its CONFIG RESETSTAT; with ``succeeded``, without
    those that failed (Redis 7 counts them: an ``EVALSHA`` of a script not loaded yet, say)."""
    stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    return int(stats.get("calls", 0)) - (int(stats.get("failed_calls", 0)) if succeeded else 0)


def redis_ms(client: redis.Redis) -> int:
    """Redis's clock, epoch ms."""
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


def expires_at(client: redis.Redis, key: str) -> int | None:
    """When Redis will delete ``key``, epoch ms by its clock (``None``: no expiry, or no key).

    A PTTL, then TIME: never earlier than the real expiry, later by at most the round trip (a
    transaction would be exact, but Redis refuses to queue one over maxmemory)."""
    ttl = client.pttl(key)
    if ttl < 0:
        return None
    return redis_ms(client) + ttl


def fill_to_maxmemory(client: redis.Redis, room: int, value_bytes: int = 4096) -> int:
    """Set ``maxmemory`` ``room`` bytes above what Redis uses now, and fill it with filler
    strings of ``value_bytes`` until Redis refuses one (``noeviction``); return the limit."""
    limit = int(client.info("memory")["used_memory"]) + room
    client.config_set("maxmemory", limit)
    try:
        for i in range(10 * room // value_bytes + 1000):
            client.set(f"filler:{i}", b"x" * value_bytes)
    except redis.exceptions.OutOfMemoryError:
        return limit
    raise AssertionError(f"Redis took {room} bytes and more under maxmemory: is its policy noeviction?")
