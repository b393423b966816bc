"""``python -m kombu_delay demo``: watch a stock Celery worker run delayed tasks on time.

It starts a private Redis, a mover and a stock ``celery worker`` on plain
``redis://``, schedules a handful of tasks with countdowns through
``delayredis://``, shows each one firing with its lateness (due -> task start),
then a summary. Every process it starts is stopped by its PID, also on Ctrl-C or
an error. It exits 0 only if every task ran exactly once and none reached the
worker before it was due.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import click
import redis
from kombu.exceptions import OperationalError

from kombu_delay.cli.common import forget_celery_servers, without_celery_servers
from kombu_delay.connect import Target
from kombu_delay.errors import KombuDelayError
from kombu_delay.store import Store
from kombu_delay.tooling.redis_server import RedisServer, dying_with_us, stop_process
from kombu_delay.tooling.stopping import terminated_as_interrupted

#: Countdowns of the demo's tasks, seconds.
COUNTDOWNS = (1.0, 2.0, 3.0, 4.0, 5.5, 7.0, 8.5, 10.0)
#: A task is shown as on time when it started at most this long after its ETA, ms.
ON_TIME_MS = 100
#: How long to wait for Redis, the mover and the worker to come up, and for stragglers, s.
STARTUP_TIMEOUT_S = 120.0
STRAGGLER_TIMEOUT_S = 60.0
#: After the last task: how long to keep watching for a second run of any task, s.
DUPLICATE_WATCH_S = 1.5
REFRESH_S = 0.1


class DemoFailed(Exception):
    """The demo could not run (a process died, or something never came up)."""


class Child:
    """A process of the demo, in its own session (Ctrl-C reaches only the demo), stopped by PID,
    and by Linux if the demo dies without stopping it."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.log = name, log
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(  # stopped too if the demo is killed (SIGKILL)
                dying_with_us(args),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=without_celery_servers({**os.environ, **(env or {})}),
                start_new_session=True,
            )

    def check(self) -> None:
        if self.popen.poll() is not None:
            raise DemoFailed(f"the {self.name} exited with {self.popen.returncode}:\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join("    " + line for line in text)

    def stop(self, timeout: float = 15.0) -> None:
        stop_process(self.popen, timeout)


@dataclass
class Task:
    number: int
    countdown: float
    id: str = ""
    due_ms: int = 0  #: the ETA its message carries (approximate until it is received)
    received_ms: list[int] = field(default_factory=list)
    started_ms: list[int] = field(default_factory=list)

    @property
    def lateness_ms(self) -> int | None:
        return self.started_ms[0] - self.due_ms if self.started_ms else None

    @property
    def early(self) -> bool:
        return any(t < self.due_ms for t in self.received_ms + self.started_ms)


def clock(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000).strftime("%H:%M:%S.%f")[:-3]


class View:
    """The terminal output: a live table on a TTY, one line per event otherwise."""

    def __init__(self, live: bool) -> None:
        self.live = live
        self._drawn = 0

    def say(self, text: str = "") -> None:
        click.echo(text)

    def fired(self, task: Task) -> None:
        if not self.live:
            late = task.lateness_ms
            self.say(
                f"fired task {task.number}  countdown {task.countdown:4.1f} s  due {clock(task.due_ms)}  "
                f"started {clock(task.started_ms[0])}  late {late} ms"
            )

    def draw(self, tasks: list[Task], held: int, elapsed: float) -> None:
        if not self.live:
            return
        now_ms = int(time.time() * 1000)
        lines = [click.style("  task  countdown  due at        status", bold=True)]
        for task in tasks:
            if task.started_ms:
                ran = f"ran at {clock(task.started_ms[0])}  +{task.lateness_ms} ms"
                status = click.style(ran, fg="green")
            elif now_ms < task.due_ms:
                left = (task.due_ms - now_ms) / 1000
                status = click.style(f"held in Redis, due in {left:4.1f} s", fg="cyan")
            else:
                status = click.style("due, on its way to the worker", fg="yellow")
            lines.append(f"  #{task.number:<4} {task.countdown:6.1f} s   {clock(task.due_ms)}  {status}")
        done = sum(1 for t in tasks if t.started_ms)
        bar = "#" * (20 * done // len(tasks))
        lines.append(f"  [{bar:<20}] ran {done}/{len(tasks)}   held in Redis: {held}   {elapsed:4.1f} s")
        out = sys.stdout
        if self._drawn:
            out.write(f"\x1b[{self._drawn}A")
        for line in lines:
            out.write("\r\x1b[2K" + line + "\n")
        out.flush()
        self._drawn = len(lines)


def wait_for(what: str, predicate: Any, children: list[Child], timeout: float = STARTUP_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        for child in children:
            child.check()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise DemoFailed(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(REFRESH_S)


def run(view: View, workdir: Path) -> bool:
    """Run the demo; return True when every task ran once and none early."""
    from celery import Celery

    from kombu_delay.tooling.demo import app as demo_app

    children: list[Child] = []
    # Persistent, as a deployment runs it; stopped by Linux too if the demo is killed (SIGKILL).
    # In a session of its own, as the mover and the worker are: a SIGINT to the demo's process
    # group reaches the demo only, which stops the others (where SIGINT is ignored, as in a
    # background job of a script, the demo goes on, and so does its Redis).
    server = RedisServer(directory=str(workdir), persistence=True, dies_with_parent=True, own_session=True)
    producer: Celery | None = None
    try:
        server.start()
        client = server.client()
        store = Store(client)
        view.say(f"Redis      {server.binary} on 127.0.0.1:{server.port} (pid {server.process.pid})")  # type: ignore[union-attr]
        start_children(view, server, workdir, children)
        producer = Celery("kombu_delay_demo_producer", broker=server.delay_url)
        runs = demo_app.Runs(client)
        view.say("waiting for the mover and the worker to start...")
        wait_for("the mover's first heartbeat", store.heartbeats, children)
        warmup = producer.send_task(demo_app.TASK_NAME, args=(0,))
        wait_for("the worker's first task", lambda: warmup.id in runs.started_ids(), children)
        tasks = schedule(view, producer, server.delay_url)
        watch(view, tasks, runs, store, children)
        return summary(view, tasks, sum(store.counts().values()))
    finally:
        if producer is not None:
            producer.close()
        for child in reversed(children):
            child.stop()
        server.stop()


def start_children(view: View, server: RedisServer, workdir: Path, children: list[Child]) -> None:
    """Start the mover (on ``delayredis://``) and a stock worker (on plain ``redis://``), each
    added to ``children`` as soon as it runs, so that the caller stops it whatever follows."""
    from kombu_delay.tooling.demo import app as demo_app

    mover = Child(
        "mover",
        [sys.executable, "-m", "kombu_delay", "--broker", server.delay_url, "mover"],
        workdir / "mover.log",
    )
    children.append(mover)
    view.say(f"mover      kombu-delay --broker {server.delay_url} mover (pid {mover.popen.pid})")
    worker_args = [sys.executable, "-m", "celery", "-A", "kombu_delay.tooling.demo.app", "worker"]
    worker_args += ["--pool", "solo", "--without-gossip", "--without-mingle", "--without-heartbeat"]
    worker_args += ["--loglevel", "INFO", "--hostname", "demo@%h"]
    worker = Child("worker", worker_args, workdir / "worker.log", {demo_app.BROKER_ENV: server.url})
    children.append(worker)
    view.say(f"worker     celery worker on plain {server.url} (pid {worker.popen.pid})")


def schedule(view: View, producer: Any, delay_url: str) -> list[Task]:
    """Send the demo's tasks with their countdowns; return them with their ids and ETAs."""
    from kombu_delay.tooling.demo import app as demo_app

    tasks = [Task(n, c) for n, c in enumerate(COUNTDOWNS, 1)]
    for task in tasks:
        sent_ms = int(time.time() * 1000)
        task.id = producer.send_task(demo_app.TASK_NAME, args=(task.number,), countdown=task.countdown).id
        task.due_ms = sent_ms + int(task.countdown * 1000)
    view.say(
        f"\nScheduled {len(tasks)} tasks with countdowns {COUNTDOWNS[0]:g} s to {COUNTDOWNS[-1]:g} s "
        f"through {delay_url}.\nThey wait in Redis sorted sets, not in the worker; "
        "the mover puts each\non the plain Celery queue when it is due.\n"
    )
    return tasks


def watch(view: View, tasks: list[Task], runs: Any, store: Store, children: list[Child]) -> None:
    """Show each task as it fires, until all ran and no second run followed (or a deadline)."""
    by_id = {task.id: task for task in tasks}
    start = time.monotonic()
    deadline = start + COUNTDOWNS[-1] + STRAGGLER_TIMEOUT_S
    watch_until: float | None = None
    while True:
        for record in runs.new():
            record_run(view, by_id.get(record["id"]), record)
        for child in children:
            child.check()
        view.draw(tasks, sum(store.counts().values()), time.monotonic() - start)
        now = time.monotonic()
        if watch_until is None and all(t.started_ms for t in tasks):
            watch_until = now + DUPLICATE_WATCH_S
        if (watch_until is not None and now >= watch_until) or now >= deadline:
            return
        time.sleep(REFRESH_S)


def record_run(view: View, task: Task | None, record: dict[str, Any]) -> None:
    """Note one event the worker recorded (received or started) on its task."""
    if task is None:
        return  # the warm-up task
    if record["eta_ms"] is not None:
        task.due_ms = int(record["eta_ms"])
    if record["event"] == "received":
        task.received_ms.append(record["at_ms"])
        return
    task.started_ms.append(record["at_ms"])
    if len(task.started_ms) == 1:
        view.fired(task)


def summary(view: View, tasks: list[Task], held: int) -> bool:
    ran = [t for t in tasks if t.started_ms]
    once = [t for t in ran if len(t.started_ms) == 1]
    early = [t for t in tasks if t.early]
    late = sorted(t.lateness_ms for t in ran if t.lateness_ms is not None)
    on_time = [x for x in late if 0 <= x <= ON_TIME_MS]
    view.say("")
    view.say(f"fired {len(ran)}/{len(tasks)}, exactly once {len(once)}/{len(tasks)}, {len(early)} early")
    if late:
        view.say(
            f"lateness (ETA -> task start): median {statistics.median(late):.0f} ms, max {late[-1]} ms; "
            f"on time (within {ON_TIME_MS} ms): {len(on_time)}/{len(tasks)}"
        )
    if held:
        view.say(f"still held in Redis: {held}")
    ok = len(once) == len(tasks) and not early
    view.say(click.style("OK" if ok else "FAILED", fg="green" if ok else "red", bold=True))
    return ok


@click.command()
@click.option(
    "--live/--no-live",
    default=None,
    help="Redraw a live table (default: when stdout is a terminal).",
)
def demo(live: bool | None) -> None:
    """Run a private Redis, a mover and a stock Celery worker; watch delayed tasks fire.

    Everything runs on the demo's own Redis, with the default settings: --broker, --prefix
    and -o are ignored, and so are CELERY_BROKER_URL, Celery's other server variables and the
    KOMBU_DELAY_* variables.

    \b
    Examples:
      python -m kombu_delay demo
      python -m kombu_delay demo --no-live > demo.log
    """
    given = click.get_current_context().find_object(Target)  # kombu-delay's own --broker, --prefix, -o
    ignored = ["--broker"] if given is not None and given.source == "--broker" else []
    if given is not None and given.transport_options:
        options = set(given.transport_options)
        ignored += ["--prefix"] * ("global_keyprefix" in options) + ["-o"] * bool(
            options - {"global_keyprefix"}
        )
    ignored += forget_celery_servers()
    ignored += [name for name in sorted(os.environ) if name.startswith("KOMBU_DELAY_")]
    for name in ignored:
        os.environ.pop(name, None)
    if ignored:
        click.echo(f"demo: ignoring {', '.join(ignored)}: it runs on a private Redis of its own", err=True)
    if live is None:
        live = sys.stdout.isatty() and os.environ.get("TERM", "") != "dumb"
    view = View(live)
    if live:
        sys.stdout.write("\x1b[?25l")  # hide the cursor while redrawing
    try:
        # A closed terminal (SIGHUP) stops the demo as Ctrl-C does: its processes and its directory go.
        with terminated_as_interrupted(), tempfile.TemporaryDirectory(prefix="kombu-delay-demo-") as workdir:
            ok = run(view, Path(workdir))
    except KeyboardInterrupt:
        view.say("\ninterrupted: every process the demo started is stopped")
        sys.exit(130)
    except DemoFailed as exc:
        view.say(click.style(f"\ndemo failed: {exc}", fg="red"))
        sys.exit(1)
    except (RuntimeError, KombuDelayError) as exc:  # no redis-server binary, or it would not start
        view.say(click.style(f"\ndemo failed: {exc}", fg="red"))
        sys.exit(1)
    except (redis.RedisError, OperationalError) as exc:  # its Redis went away (killed, say)
        view.say(click.style(f"\ndemo failed: its Redis went away ({exc})", fg="red"))
        sys.exit(1)
    finally:
        if live:
            sys.stdout.write("\x1b[?25h")
            sys.stdout.flush()
    sys.exit(0 if ok else 1)
