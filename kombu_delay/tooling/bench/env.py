"""The benchmark's environment: its Redis, Celery-shaped payloads, mover processes, probes.

``kombu-delay bench`` measures kombu-delay from the outside, as an operator
would: it publishes through Celery and the ``delayredis://`` transport, runs
real ``kombu-delay mover`` processes, and watches the queue lists the way a
worker does. The instrumentation it needs (``INFO``, ``SLOWLOG``, ``LLEN``,
``BRPOP``, the pipelined ``LPUSH`` ceiling) is not kombu-delay data access, so
it lives here, in :class:`Probe`, rather than in the store.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from kombu_delay.cli.common import without_celery_servers
from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import Store, scripts
from kombu_delay.store.replies import Scheduled
from kombu_delay.tooling.redis_server import dying_with_us, stop_process

#: The queue every scenario publishes to (kombu's list key for priority 0).
QUEUE = "bench"
#: Task name of the benchmark's messages (the e2e worker registers it).
TASK = "kombu_delay.tooling.bench.e2e.record"
#: A Celery message's task id (its ``id`` header), for counting each on a list once (headers
#: precede nothing that could hold the same text: the body is base64).
TASK_ID = re.compile(rb'"id": "([^"]+)"')
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def eta_of(ms: int) -> datetime:
    """Return epoch ``ms`` as an exact UTC datetime (no float rounding)."""
    return _EPOCH + timedelta(milliseconds=ms)


def now_ms() -> float:
    """The benchmark's clock: ``time.time()`` in ms; the same clock Redis ``TIME`` reads
    when both run on one machine."""
    return time.time() * 1000


def rss_mb(pid: int) -> float:
    """Resident set size of a process, MB (Linux ``/proc``; 0 where unavailable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def celery_app(url: str, name: str = "kombu_delay_bench") -> Celery:
    """A Celery app that publishes to ``url`` (no result backend)."""
    app = Celery(name, broker=url)
    app.conf.update(task_default_queue=QUEUE, broker_connection_retry_on_startup=True)
    return app


class Payloads:
    """Celery messages exactly as ``apply_async`` builds them, about ``size`` bytes each.

    One real message is captured from a real ``send_task`` (through plain
    ``redis://``, so it lands on a list as is); copies get a fresh task id and
    their own ETA, which is what ``apply_async`` would have produced for them.
    """

    def __init__(self, probe: Probe, url: str, size: int) -> None:
        app = celery_app(url)
        capture = "kombu_delay_bench_capture"
        base = self._capture(app, probe, capture, 0)
        step = len(self._capture(app, probe, capture, 30)) - len(base)
        pad = max(0, round((size - len(base)) * 30 / max(step, 1)))
        self.pad = "x" * pad
        self.template = self._capture(app, probe, capture, pad)
        message = json.loads(self.template)
        self._id = message["headers"]["id"]
        self._tag = message["properties"]["delivery_tag"]
        self._eta = message["headers"]["eta"]
        self.size = len(self.template)
        app.close()

    @staticmethod
    def _capture(app: Celery, probe: Probe, queue: str, pad: int) -> str:
        app.send_task(TASK, kwargs={"pad": "x" * pad}, countdown=60, queue=queue)
        raw = probe.client.rpop(queue)
        assert raw is not None, "the captured message did not arrive"
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def make(self, due_ms: int) -> tuple[str, str]:
        """Return ``(task_id, payload)`` of a message due at ``due_ms``."""
        task_id = str(uuid.uuid4())
        eta = eta_of(due_ms).isoformat(timespec="microseconds")
        text = self.template.replace(self._id, task_id).replace(self._tag, str(uuid.uuid4()))
        return task_id, text.replace(self._eta, eta)


def fill(
    store: Store,
    settings: Settings,
    messages: Iterator[tuple[int, str, str]],
    dest: str = QUEUE,
    chunk: int = 2000,
) -> tuple[int, float]:
    """Schedule ``(due_ms, task_id, payload)`` messages, pipelined; return (stored, seconds).

    Raises ``RuntimeError`` if any message was already due (the fill overran its target time).
    """
    stored, started = 0, time.perf_counter()
    batch: list[tuple[Due, str, str]] = []

    def flush() -> int:
        results = store.schedule_many(batch, settings, chunk=chunk)
        batch.clear()
        bad = [r for r in results if r.outcome is not Scheduled.STORED]
        if bad:
            raise RuntimeError(f"{len(bad)} messages were not stored ({bad[0].outcome.name}): fill too slow")
        return len(results)

    for due_ms, task_id, payload in messages:
        batch.append((Due(due_ms, task_id=task_id), dest, payload))
        if len(batch) >= chunk * 5:
            stored += flush()
    if batch:
        stored += flush()
    return stored, time.perf_counter() - started


#: The sorted set a bare-move floor is timed from.
FLOOR_SET = "kombu_delay_bench:floor"
#: The function library a bare scripted publish is timed by, where Redis has functions.
FLOOR_LIBRARY = "kombu_delay_bench_floor"


#: The probe's socket timeout, s: a synchronous FLUSHDB of millions of messages, or a command
#: while a flush of them is freed, can take longer than redis-py's own default (5 s from 8.0).
PROBE_TIMEOUT_S = 300


class Probe:
    """Direct Redis access for measuring: memory, slow log, command stats, list lengths."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=PROBE_TIMEOUT_S, socket_connect_timeout=10)

    def flush(self) -> None:
        self.client.flushdb()

    def slowlog_settings(self) -> dict[str, str]:
        """The server's ``slowlog-*`` settings, which :meth:`reset_stats` changes, for every database."""
        return {str(k): str(v) for k, v in self.client.config_get("slowlog-*").items()}

    def set_settings(self, settings: dict[str, str]) -> None:
        """Put back ``settings`` (``CONFIG SET``, one by one: Redis 6 takes one a call)."""
        for name, value in settings.items():
            self.client.config_set(name, value)

    def info(self, section: str) -> dict[str, Any]:
        return dict(self.client.info(section))

    def used_memory(self) -> int:
        return int(self.info("memory")["used_memory"])

    def redis_version(self) -> str:
        return str(self.info("server")["redis_version"])

    def reset_stats(self, slower_than_us: int = 1000) -> None:
        self.client.config_resetstat()
        self.client.config_set("slowlog-log-slower-than", slower_than_us)
        self.client.config_set("slowlog-max-len", 10000)
        self.client.slowlog_reset()

    def calls(self, command: str) -> int:
        """Calls of ``command`` (lower case) since the server started or its stats were reset."""
        return int(self.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))

    def evalsha_stats(self) -> dict[str, float]:
        """Calls and server µs of ``EVALSHA`` since :meth:`reset_stats`."""
        stat = self.info("commandstats").get("cmdstat_evalsha", {})
        return {"calls": int(stat.get("calls", 0)), "usec": float(stat.get("usec", 0))}

    def command_usec_per_call(self, name: str) -> float:
        return float(self.info("commandstats").get(f"cmdstat_{name}", {}).get("usec_per_call", 0.0))

    def slowest_script_ms(self) -> float:
        """The longest ``EVALSHA`` in the slow log since :meth:`reset_stats`, ms."""
        entries = self.client.slowlog_get(10000)
        durations = [
            int(e["duration"]) for e in entries if str(_text(e["command"])).upper().startswith("EVALSHA")
        ]
        return max(durations, default=0) / 1000

    def llen(self, key: str = QUEUE) -> int:
        return int(self.client.llen(key))

    def lpush_ceiling(self, payloads: list[str], key: str = QUEUE, chunk: int = 1000) -> float:
        """Push ``payloads`` with pipelined single-value LPUSH (as kombu does); return seconds."""
        started = time.perf_counter()
        for begin in range(0, len(payloads), chunk):
            pipe = self.client.pipeline(transaction=False)
            for payload in payloads[begin : begin + chunk]:
                pipe.lpush(key, payload)
            pipe.execute()
        return time.perf_counter() - started

    def redis_cpu_s(self) -> float:
        """CPU seconds used by Redis's main thread so far (less noisy than wall time when
        the machine is shared)."""
        return sum(self.redis_cpu_split_s())

    def redis_process_cpu_s(self) -> float:
        """CPU seconds used by the whole Redis process so far: its main thread and its
        background threads (which free what ``UNLINK`` dropped)."""
        cpu = self.info("cpu")
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])

    def redis_cpu_split_s(self) -> tuple[float, float]:
        """CPU seconds used by Redis's main thread so far: (in user space, in the kernel)."""
        cpu = self.info("cpu")
        return float(cpu["used_cpu_user_main_thread"]), float(cpu["used_cpu_sys_main_thread"])

    def zadd_all(self, key: str, payloads: list[str]) -> None:
        """Add ``payloads`` to the sorted set ``key`` as they are (score 0), in chunks."""
        for begin in range(0, len(payloads), 5000):
            self.client.zadd(key, dict.fromkeys(payloads[begin : begin + 5000], 0))

    def floor_move(self, payloads: list[str], limit: int, key: str = QUEUE) -> tuple[float, float]:
        """Time ``bench_floor.lua`` moving ``payloads`` from a sorted set to ``key``.

        Returns (wall seconds, Redis CPU seconds).
        """
        self.zadd_all(FLOOR_SET, payloads)
        return self._time_floor(limit, key)

    def floor_publish(self, payloads: list[str], rounds: int = 5) -> dict[str, float]:
        """Redis main-thread CPU seconds of sending ``payloads`` one per round trip, as a
        publish sends its message, in three ways: ``lpush``, a bare ``LPUSH`` (a plain publish's
        own command); ``zadd``, a bare ``ZADD``; and ``script``, a script call that makes that
        ``ZADD`` and nothing else (``bench_floor_publish.lua``, by ``FCALL`` where Redis has
        functions, as a delayed publish is, else by ``EVALSHA``): the floor of any publish that
        stores its message by a script. The three alternate in ``rounds`` rounds, so a
        machine whose speed drifts weighs on each alike."""
        keys = {way: f"{FLOOR_SET}:{way}" for way in ("lpush", "zadd", "script")}
        call = self._floor_script(keys["script"])
        ways: dict[str, Callable[[int, str], object]] = {
            "lpush": lambda i, payload: self.client.lpush(keys["lpush"], payload),
            "zadd": lambda i, payload: self.client.zadd(keys["zadd"], {payload: i}),
            "script": call,
        }
        spent = dict.fromkeys(ways, 0.0)
        size = -(-len(payloads) // rounds)
        try:
            for begin in range(0, len(payloads), size):
                for way, send in ways.items():
                    before = self.redis_cpu_s()
                    for i, payload in enumerate(payloads[begin : begin + size], begin):
                        send(i, payload)
                    spent[way] += self.redis_cpu_s() - before
        finally:
            self.client.delete(*keys.values())
            with contextlib.suppress(redis.ResponseError):
                self.client.function_delete(FLOOR_LIBRARY)
        return spent

    def _floor_script(self, key: str) -> Callable[[int, str], object]:
        """A call of ``bench_floor_publish.lua`` adding a member to ``key``: a function where
        Redis has them (loaded here, deleted by :meth:`floor_publish`), else a script."""
        source = scripts.source("bench_floor_publish")
        try:
            self.client.function_load(
                f"#!lua name={FLOOR_LIBRARY}\n"
                f"redis.register_function('{FLOOR_LIBRARY}_zadd', function(KEYS, ARGV)\n{source}\nend)\n",
                replace=True,
            )
        except redis.ResponseError:  # no functions (Redis 6)
            sha = self.client.script_load(source)
            return lambda i, payload: self.client.evalsha(sha, 1, key, i, payload)
        return lambda i, payload: self.client.fcall(f"{FLOOR_LIBRARY}_zadd", 1, key, i, payload)

    def floor_move_list(self, limit: int, key: str = QUEUE, chunk: int = 20_000) -> tuple[int, float, float]:
        """Time ``bench_floor.lua`` moving everything on the list ``key`` again, from a sorted
        set of all of it (read in chunks: a herd does not fit a client's memory at once).
        A herd is slower to move than a small sample, member for member: its sorted set is
        larger than the CPU caches, and its order is not the order its members were written.

        Returns (messages, wall seconds, Redis CPU seconds).
        """
        length = self.llen(key)
        for begin in range(0, length, chunk):
            members: list[bytes] = self.client.lrange(key, begin, begin + chunk - 1)  # type: ignore[assignment]
            self.client.zadd(FLOOR_SET, dict.fromkeys(members, 0))
        self.client.delete(key)
        return length, *self._time_floor(limit, key)

    def _time_floor(self, limit: int, key: str) -> tuple[float, float]:
        script = self.client.register_script(scripts.source("bench_floor"))
        cpu, started = self.redis_cpu_s(), time.perf_counter()
        while int(script(keys=[FLOOR_SET, key], args=[limit])):
            pass
        return time.perf_counter() - started, self.redis_cpu_s() - cpu

    def sizes_of(self, pattern: str) -> int:
        """Exact memory of every key matching ``pattern`` (``MEMORY USAGE ... SAMPLES 0``)."""
        return sum(
            int(self.client.memory_usage(key, samples=0) or 0)
            for key in self.client.scan_iter(match=pattern, count=1000)
        )

    def pop_many(self, count: int, key: str = QUEUE) -> int:
        """Take up to ``count`` messages off a list, as a worker would; return how many."""
        got = self.client.rpop(key, count)
        return len(got) if got else 0

    def consumer(self, key: str = QUEUE) -> redis.Redis:
        """A separate connection for a blocking consumer."""
        return redis.Redis.from_url(self.url)

    def close(self) -> None:
        self.client.close()


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list | tuple):
        return " ".join(_text(v) for v in value)
    return str(value)


@dataclass
class Movers:
    """``kombu-delay mover`` processes of one benchmark, stopped by PID."""

    delay_url: str
    batch_size: int
    log_dir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, *extra: str) -> subprocess.Popen[bytes]:
        args = [sys.executable, "-m", "kombu_delay", "--broker", self.delay_url, "--log-level", "warning"]
        args += ["mover", "--batch-size", str(self.batch_size), *extra]
        log = open(self.log_dir / f"mover-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(  # stopped too if the bench is killed (SIGKILL)
            dying_with_us(args), stdout=log, stderr=subprocess.STDOUT, env=without_celery_servers(os.environ)
        )
        log.close()
        self.procs.append(proc)
        time.sleep(0.5)  # let it subscribe to the wake channel before anything is published
        if proc.poll() is not None:
            raise RuntimeError(f"the mover exited at start: {self.output(proc)}")
        return proc

    def output(self, proc: subprocess.Popen[bytes]) -> str:
        path = self.log_dir / f"mover-{self.procs.index(proc)}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        stop_process(proc)

    def stop_all(self) -> None:
        for proc in self.procs:
            self.stop(proc)
