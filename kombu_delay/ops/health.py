"""``health``: one probe for liveness, readiness and watchdogs, from heartbeats and overdue age.

It answers two questions with the Redis clock only: is some mover alive (a
heartbeat recorded within ``--max-heartbeat-age``), and are due messages being
moved (the oldest overdue message is younger than ``--max-overdue``)? It prints
one line and exits 0 (healthy), 1 (unhealthy) or 2 (Redis unreachable or bad
configuration), so it fits a Kubernetes ``exec`` probe, a systemd timer or any
cron-style check.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import click

from kombu_delay.cli.common import announce, global_options, target
from kombu_delay.errors import KombuDelayError
from kombu_delay.mover.watch import ALERT_KEEP_MS
from kombu_delay.ops.checks import eviction_problem
from kombu_delay.store import Store

#: Exit statuses.
HEALTHY, UNHEALTHY, UNREACHABLE = 0, 1, 2


@dataclass(frozen=True)
class Health:
    """What the probe saw, ages in ms by the Redis clock."""

    movers: int
    #: Age of the freshest mover heartbeat; ``None`` when no mover has one.
    heartbeat_age_ms: int | None
    #: How long the oldest due message has been waiting; 0 when none is due.
    overdue_ms: int
    #: What endangers scheduled messages whatever the movers do (an evicting
    #: ``maxmemory-policy``, messages stranded under another key prefix).
    warnings: tuple[str, ...] = ()

    def problems(
        self, max_heartbeat_age_ms: int, max_overdue_ms: int, redis_checks: bool = True
    ) -> list[str]:
        """Return the reasons to call this unhealthy (a threshold of 0 skips its check;
        ``redis_checks`` false skips the warnings, which a mover restart cannot fix)."""
        found = list(self.warnings) if redis_checks else []
        if max_heartbeat_age_ms:
            if self.heartbeat_age_ms is None:
                found.append("no mover heartbeat")
            elif self.heartbeat_age_ms > max_heartbeat_age_ms:
                found.append(
                    f"no mover heartbeat within {max_heartbeat_age_ms / 1000:g} s "
                    f"(freshest {self.heartbeat_age_ms / 1000:.1f} s ago)"
                )
        if max_overdue_ms and self.overdue_ms > max_overdue_ms:
            found.append(
                f"oldest overdue message waits {self.overdue_ms / 1000:.1f} s "
                f"(limit {max_overdue_ms / 1000:g} s)"
            )
        return found

    def summary(self) -> str:
        beat = "none" if self.heartbeat_age_ms is None else f"{self.heartbeat_age_ms / 1000:.1f} s ago"
        return (
            f"movers {self.movers}, freshest heartbeat {beat}, oldest overdue {self.overdue_ms / 1000:.1f} s"
        )


def check(store: Store, host: str | None = None) -> Health:
    """Read heartbeats and the earliest due time; judge ages by the Redis clock.

    With ``host``, only movers on that host count (mover ids are
    ``[embedded:]host:pid:random``), so a probe can watch its own pod's mover.
    """
    warnings = (eviction_problem(store.eviction_policy()), *store.alerts(ALERT_KEEP_MS).values())
    beats = store.heartbeats()
    if host is not None:
        beats = {name: ms for name, ms in beats.items() if host in name.split(":")[:2]}
    earliest = store.earliest_due_ms()
    now = store.time_ms()
    freshest = max(beats.values()) if beats else None
    return Health(
        movers=len(beats),
        heartbeat_age_ms=None if freshest is None else max(0, now - freshest),
        overdue_ms=0 if earliest is None else max(0, now - earliest),
        warnings=tuple(text for text in warnings if text),
    )


@global_options
@click.command()
@click.option(
    "--max-heartbeat-age",
    type=float,
    default=30.0,
    show_default=True,
    help="Unhealthy when no mover heartbeat is younger than this, s (0 = don't check).",
)
@click.option(
    "--max-overdue",
    type=float,
    default=60.0,
    show_default=True,
    help="Unhealthy when a due message has waited longer than this, s (0 = don't check).",
)
@click.option(
    "--this-host",
    is_flag=True,
    help="Count only movers on this host (a liveness probe next to its own mover).",
)
@click.option(
    "--liveness",
    is_flag=True,
    help="A liveness probe next to its own mover: the same as --this-host --max-overdue 0, and the "
    "Redis checks (eviction policy, stranded key prefixes) are skipped, as a restart cannot fix them.",
)
@click.option("--quiet", "-q", is_flag=True, help="Print nothing when healthy.")
@click.pass_context
def health(
    ctx: click.Context,
    max_heartbeat_age: float,
    max_overdue: float,
    this_host: bool,
    liveness: bool,
    quiet: bool,
) -> None:
    """Exit 0 when a mover is alive, due messages move and Redis keeps them safe; 1 when not;
    2 when Redis is unreachable.

    Unhealthy as well: a maxmemory-policy that lets Redis delete scheduled messages, and
    messages stranded under another key prefix that no mover serves (found by the movers).
    Prints one line: "OK: ..." or "UNHEALTHY: <reason>; ...", and on stderr which broker
    it read (not with --quiet when healthy).

    \b
    Examples:
      kombu-delay -b delayredis://redis:6379/0 health
      kombu-delay -b delayredis://redis:6379/0 health --max-heartbeat-age 10 --max-overdue 30
      kombu-delay health --liveness --quiet      # liveness of the mover in this pod
      kombu-delay health -b delayredis://redis:6379/0 --this-host --max-overdue 120
      celery -A proj delay health --max-overdue 120
    """
    tgt = target(ctx)
    if liveness:
        this_host, max_overdue = True, 0.0
    try:
        with tgt.open() as store:
            seen = check(store, socket.gethostname() if this_host else None)
    except KombuDelayError as exc:
        announce(ctx)
        click.echo(f"UNREACHABLE: {tgt.redact(str(exc))}")
        ctx.exit(UNREACHABLE)
    problems = seen.problems(round(max_heartbeat_age * 1000), round(max_overdue * 1000), not liveness)
    if problems or not quiet:
        announce(ctx)
    if problems:
        click.echo(f"UNHEALTHY: {'; '.join(problems)} ({seen.summary()})")
        ctx.exit(UNHEALTHY)
    if not quiet:
        click.echo(f"OK: {seen.summary()}")
