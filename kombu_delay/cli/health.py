"""``health``: one probe for liveness, readiness and watchdogs, from heartbeats and overdue age.

It prints one line and exits 0 (healthy), 1 (unhealthy) or 2 (Redis unreachable, or an
error: bad configuration, a refusal), so it fits a Kubernetes ``exec`` probe, a systemd timer
or any cron-style check. What it judges is :mod:`kombu_delay.ops.health`.
"""

from __future__ import annotations

import math
import socket

import click
import redis

from kombu_delay.cli.common import announce, global_options, shown, target
from kombu_delay.connect import with_socket_timeouts
from kombu_delay.errors import KombuDelayError, RedisUnavailable
from kombu_delay.ops.health import check
from kombu_delay.store.keys import MAX_DUE_MS

#: Exit statuses.
HEALTHY, UNHEALTHY, UNREACHABLE = 0, 1, 2
#: The longest threshold, s: the span of every due time there can be (to the year-2109 ceiling).
MAX_THRESHOLD_S = MAX_DUE_MS // 1000


def threshold(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """A threshold in seconds: finite, 0 (don't check) or from 0.001 (1 ms) to
    :data:`MAX_THRESHOLD_S`; a usage error (exit 2) otherwise, never a verdict on the movers."""
    if not (math.isfinite(value) and 0 <= value <= MAX_THRESHOLD_S):
        raise click.BadParameter(f"{value} is not a number of seconds from 0 to {MAX_THRESHOLD_S}")
    if 0 < value < 0.001:
        # In whole ms it would be 0, which turns the check off, as the settings refuse it too.
        raise click.BadParameter(
            f"{value} is under 0.001 s (1 ms), the shortest threshold; 0 turns the check off"
        )
    return value


@global_options
@click.command()
@click.option(
    "--max-heartbeat-age",
    type=float,
    callback=threshold,
    default=30.0,
    show_default=True,
    help="Unhealthy when no mover heartbeat is younger than this, s (0 = don't check).",
)
@click.option(
    "--max-overdue",
    type=float,
    callback=threshold,
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
    "Redis checks (eviction policy, stranded key prefixes, persistence) are skipped, as a restart "
    "cannot fix them.",
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
    2 when Redis is unreachable or answers with an error (a refusal, a key it reads of another
    type; another shared key of another type is a reason to be unhealthy).

    Unhealthy as well: a maxmemory-policy that lets Redis delete scheduled messages, and
    messages stranded under another key prefix that no mover serves (found by the movers).
    Prints one line: "OK: ..." or "UNHEALTHY: <reason>; ...", and on stderr which broker
    it read (not with --quiet when healthy). A Redis that keeps nothing on disk (no AOF, no
    save rules) adds a line "WARNING: ..." but changes no exit status: many run one knowingly.

    \b
    Examples:
      kombu-delay -b delayredis://redis:6379/0 health
      kombu-delay -b delayredis://redis:6379/0 health --max-heartbeat-age 10 --max-overdue 30
      kombu-delay health --liveness --quiet      # liveness of the mover in this pod
      kombu-delay health -b delayredis://redis:6379/0 --this-host --max-overdue 120
      celery -A proj delay health --max-overdue 120
    """
    tgt = with_socket_timeouts(target(ctx))
    if liveness:
        this_host, max_overdue = True, 0.0
    try:
        tgt.settings()  # its WARNING for an option it does not read, before a connect that fails
        with tgt.open() as store:
            host = socket.gethostname() if this_host else None
            seen = check(store, host, notes=not liveness, overdue=max_overdue > 0)
    except (KombuDelayError, redis.RedisError) as exc:
        # Exit 2 either way; the word says which: Redis did not answer, or it answered with a
        # refusal or an error (an ACL, a password, a key of another type) that is no verdict on
        # the movers either.
        announce(ctx)
        verdict = "UNREACHABLE" if isinstance(exc, RedisUnavailable) else "ERROR"
        click.echo(f"{verdict}: {tgt.redact(str(exc))}")
        ctx.exit(UNREACHABLE)
    problems = seen.problems(round(max_heartbeat_age * 1000), round(max_overdue * 1000), not liveness)
    if problems and liveness and seen.refusal:
        # No mover can write its heartbeat while Redis refuses writes: a restart cures nothing.
        announce(ctx)
        click.echo(f"ERROR: {shown(seen.refusal)} ({seen.summary()}; a mover restart cannot cure this)")
        ctx.exit(UNREACHABLE)
    if problems or not quiet:
        announce(ctx)
    if problems:
        click.echo(f"UNHEALTHY: {shown('; '.join(problems))} ({seen.summary()})")
        warn(seen.notes)
        ctx.exit(UNHEALTHY)
    if not quiet:
        # Movers are counted by a 30 s heartbeat: with none, say why that is OK.
        why = ""
        if seen.movers == 0:
            why = (
                f" (--max-heartbeat-age {max_heartbeat_age:g} s)"
                if max_heartbeat_age
                else " (heartbeats not checked)"
            )
        click.echo(f"OK: {seen.summary()}{why}")
        warn(seen.notes)


def warn(notes: tuple[str, ...]) -> None:
    """Print what endangers scheduled messages but is no verdict, one line each after it."""
    for note in notes:
        click.echo(f"WARNING: {shown(note)}")
