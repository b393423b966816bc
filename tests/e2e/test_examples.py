"""The runnable examples under examples/, against the suite's own Redis."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

from celery import Celery

from kombu_delay import DelayControl
from kombu_delay.store import Store, keys
from tests.support.procs import ROOT, wait_until

EXAMPLES = ROOT / "examples"
PROJECT = EXAMPLES / "celery_project"


def test_kombu_xdelay_example_delivers_every_message_after_its_delay(r, redis_server, start_mover):
    start_mover()
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "kombu_xdelay.py"), redis_server.delay_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all 4 messages arrived, 0 early" in done.stdout
    waits = re.findall(r"received message \d+ after (\d+) ms \(x-delay (\d+) ms\)", done.stdout)
    assert len(waits) == 4
    assert all(int(waited) >= int(delay) for waited, delay in waits)


def test_kombu_xdelay_example_reads_the_broker_from_the_environment(r, redis_server, start_mover):
    start_mover()
    env = {**os.environ, "KOMBU_DELAY_BROKER": redis_server.delay_url}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "kombu_xdelay.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 early" in done.stdout


def test_celery_project_example_runs_tasks_after_their_countdown(r, redis_server, spawn):
    env = {"CELERY_BROKER_URL": redis_server.delay_url, "PYTHONPATH": str(PROJECT)}
    celery = [sys.executable, "-m", "celery", "-A", "proj"]
    quiet = ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    worker = spawn(
        [*celery, "worker", "--pool", "solo", *quiet, "--loglevel", "INFO"], env=env, name="worker"
    )
    mover = spawn([*celery, "delay", "mover"], env=env, name="mover")
    done = subprocess.run(
        [sys.executable, "-m", "proj.schedule", "2"],
        cwd=PROJECT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("scheduled reminder") == 2

    def reminded() -> list[str]:
        return re.findall(r"'user (\d+) reminded (-?\d+) ms after its ETA'", worker.output())

    wait_until(lambda: len(reminded()) >= 2, timeout=120)
    assert sorted(user for user, _ in reminded()) == ["1", "2"], worker.output()
    assert all(int(late) >= 0 for _, late in reminded())
    assert mover.popen.poll() is None, mover.output()


# -- examples/deploy follow the README's probe advice -------------------------------------

DEPLOY = EXAMPLES / "deploy"
MANIFEST = DEPLOY / "kubernetes-mover-sidecar.yaml"
#: A kombu-delay health call in a shell line (systemd, supervisor): up to the shell's next word.
SHELL_HEALTH = re.compile(r"kombu-delay(?: --broker \S+)? health[^;&|'\n]*")


def manifest_probes() -> dict[str, list[str]]:
    """The exec command of each probe of the Kubernetes example, by probe name, read without a
    YAML library: the manifest writes each command as a flow sequence of double-quoted
    strings, which is JSON."""
    probes: dict[str, list[str]] = {}
    current = None
    for line in MANIFEST.read_text().splitlines():
        text = line.strip()
        if text.endswith("Probe:"):
            current = text[: -len(":")]
        elif current and text.startswith("command:"):
            probes[current] = json.loads(text.partition(":")[2])
            current = None
    return probes


def shell_health_calls() -> dict[str, list[list[str]]]:
    """Every kombu-delay health call in the systemd and supervisor examples (comments aside),
    as argv from "health"."""
    calls = {}
    for path in sorted(DEPLOY.iterdir()):
        if path != MANIFEST:
            lines = [line for line in path.read_text().splitlines() if not line.startswith(("#", ";"))]
            found = [shlex.split(m.group(0)) for line in lines for m in SHELL_HEALTH.finditer(line)]
            calls[path.name] = [argv[argv.index("health") :] for argv in found]
    return calls


def restarts_only_a_dead_mover(argv: list[str]) -> bool:
    """README: a probe that restarts the mover counts only this host's movers and leaves lag and
    Redis's configuration out: ``--liveness``."""
    return "--liveness" in argv and "--max-overdue" not in argv


def test_every_deploy_example_probes_as_the_readme_advises():
    probes = manifest_probes()
    assert set(probes) == {"livenessProbe", "readinessProbe"}
    assert probes["livenessProbe"][:2] == ["kombu-delay", "health"]
    assert restarts_only_a_dead_mover(probes["livenessProbe"]), probes["livenessProbe"]
    ready = probes["readinessProbe"]
    assert "--this-host" in ready and float(ready[ready.index("--max-overdue") + 1]) > 0, ready
    calls = shell_health_calls()
    # Every example has a check (the timer's unit runs the health service's).
    assert set(calls) == {p.name for p in DEPLOY.iterdir()} - {MANIFEST.name}
    assert all(calls[name] for name in calls if not name.endswith(".timer")), calls
    for name, argvs in calls.items():  # each of these restarts (or refuses to start) the mover
        assert all(restarts_only_a_dead_mover(argv) for argv in argvs), (name, argvs)


def test_the_examples_liveness_probes_pass_a_mover_held_by_backpressure(r, redis_server, start_mover):
    """The manifest's liveness command, run as written (its broker from the environment, as
    the container sets it), against a real mover whose due messages its --max-queue-length
    holds: exit 0, so Kubernetes does not restart it in a loop; the readiness command reports
    the overdue. The systemd and supervisor checks agree with the liveness probe."""
    probes = manifest_probes()
    r.lpush("celery", "filler")  # the list is at the mover's limit: due messages stay put
    mover = start_mover("--max-queue-length", "1")
    app = Celery("pub", broker=redis_server.delay_url)
    for _ in range(2):
        app.send_task("examples.noop", countdown=0.5)
    app.close()
    wait_until(lambda: r.zcard(keys.movers("")) == 1)
    with DelayControl(redis_server.url) as control:
        wait_until(lambda: control.stats().oldest_overdue_ms >= 3000)
    env = {**os.environ, "KOMBU_DELAY_BROKER": redis_server.delay_url}

    def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        assert argv[0] in ("kombu-delay", "health"), argv
        args = argv[1:] if argv[0] == "kombu-delay" else argv
        assert not {"-b", "--broker"} & set(args), args  # the suite's broker, from the environment
        return subprocess.run(
            [sys.executable, "-m", "kombu_delay", *args], cwd=ROOT, env=env, capture_output=True, text=True
        )

    alive = run(probes["livenessProbe"])
    assert alive.returncode == 0 and alive.stdout == "", alive.stdout + alive.stderr
    for name, argvs in shell_health_calls().items():
        for argv in argvs:
            done = run(argv)
            assert done.returncode == 0, (name, argv, done.stdout + done.stderr)
    # The manifest's 120 s would take two minutes to reach: the same command with 2 s.
    ready = probes["readinessProbe"]
    ready = [*ready[: ready.index("--max-overdue") + 1], "2", *ready[ready.index("--max-overdue") + 2 :]]
    lagging = run(ready)
    assert lagging.returncode == 1, lagging.stdout + lagging.stderr
    assert lagging.stdout.startswith("UNHEALTHY: oldest overdue message waits"), lagging.stdout
    assert r.llen("celery") == 1 and Store(r).counts() == {"celery": 2}  # held, not moved
    # An evicting maxmemory-policy fails the readiness probe, not the liveness one: a restart
    # cannot fix it.
    r.config_set("maxmemory-policy", "volatile-ttl")
    try:
        assert run(probes["livenessProbe"]).returncode == 0
        unsafe = run(probes["readinessProbe"])
        assert unsafe.returncode == 1 and "maxmemory-policy is volatile-ttl" in unsafe.stdout, unsafe.stdout
    finally:
        r.config_set("maxmemory-policy", "noeviction")
    # A mover that stopped beating still fails the liveness probe.
    assert mover.stop() == 0, mover.output()
    dead = run(probes["livenessProbe"])
    assert dead.returncode == 1 and "no mover heartbeat" in dead.stdout, dead.stdout + dead.stderr
