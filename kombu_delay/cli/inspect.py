"""``kombu-delay stats|ls|reschedule|purge``: the CLI over :class:`~kombu_delay.control.DelayControl`.

Exit codes: 0 found or done, 1 not found (nothing scheduled under that id or for
that queue), 2 usage error, 3 Redis unavailable or another kombu-delay error.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime

import click
import redis

from kombu_delay.cli.common import announce, cells, global_options, padded, shown, target, utf8_text
from kombu_delay.connect import with_socket_timeouts
from kombu_delay.control import DelayControl, ScheduledMessage, Stats, histogram_slots
from kombu_delay.errors import KombuDelayError
from kombu_delay.ops.checks import evicted_beats, movers_heard, movers_told
from kombu_delay.store.listing import Cursor

NOT_FOUND = 1
FAILED = 3
BAR_WIDTH = 40
#: One day, ms: a histogram spanning more labels its rows with their dates.
DAY_MS = 86_400_000
#: The task id column of a message damaged in Redis (it has no id to cancel it by).
UNREADABLE = "(unreadable)"


class InspectError(click.ClickException):
    """A kombu-delay error shown to the user, exit code 3."""

    exit_code = FAILED


@contextmanager
def control(ctx: click.Context) -> Iterator[DelayControl]:
    """Yield a :class:`DelayControl` for the command's broker (named first, on stderr), errors
    turned into exit 3, with the mover's socket timeouts unless the options set their own."""
    tgt = with_socket_timeouts(target(ctx))
    announce(ctx)
    try:
        with DelayControl(tgt.url, tgt.transport_options, ssl=tgt.ssl) as ctl:
            yield ctl  # (each call names the keys of another type behind a WRONGTYPE: gated)
    except (KombuDelayError, redis.RedisError) as exc:  # (an error kombu-delay names none for: a
        # command renamed away, say)
        raise InspectError(tgt.redact(str(exc))) from exc


#: The widest a name or task id is shown in a table, characters: past it, one long queue or
#: task name, or task id, would push every row's figures off the screen (``--json`` gives
#: them whole).
NAME_COLUMN = 60
#: The most characters a name is shown with: marks drawn over the character before take no
#: column, so a name of an accent repeated 30,000 times fits :data:`NAME_COLUMN` whole.
NAME_CHARS = 4 * NAME_COLUMN


def clipped(text: str) -> str:
    """``text`` (already :func:`shown`) cut to :data:`NAME_COLUMN` terminal columns and
    :data:`NAME_CHARS` characters, marked ``…``. Measured on at most that many characters, a
    dozen times (a cut measured a longer start at each character: a name of 60,000 took
    seconds, and a listing of them as many times that)."""
    if len(text) <= NAME_CHARS and cells(text) <= NAME_COLUMN:
        return text
    text = text[: NAME_CHARS - 1]
    fits, over = 0, len(text) + 1  # the longest start that fits beside the mark lies in [fits, over)
    while over - fits > 1:  # (a mark stays with its character: a start's width never falls)
        middle = (fits + over) // 2
        fits, over = (middle, over) if cells(text[:middle]) <= NAME_COLUMN - 1 else (fits, middle)
    return text[:fits] + "…"


def when(ms: int) -> str:
    """Epoch ms as a UTC time with milliseconds."""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def span(ms: int) -> str:
    """A duration for people: ``950ms``, ``12.3s``, ``4m05s``, ``3h12m``, ``2d04h``."""
    sign, ms = ("-" if ms < 0 else ""), abs(ms)
    if ms < 1000:
        return f"{sign}{ms}ms"
    if ms < 60_000:
        return f"{sign}{ms / 1000:.1f}s"
    minutes, seconds = divmod(ms // 1000, 60)
    if minutes < 60:
        return f"{sign}{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{sign}{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{sign}{days}d{hours:02d}h"


def bar(count: int, peak: int) -> str:
    """A terminal bar of ``count`` against ``peak`` (at least one block when non-zero)."""
    if not count or not peak:
        return ""
    return "\u2588" * max(1, round(BAR_WIDTH * count / peak))


def render_stats(stats: Stats) -> str:
    now = stats.now_ms
    lines = [f"WARNING    {shown(text)}" for text in stats.warnings]  # (an alert, say, written by hand)
    earliest = "nothing scheduled"
    if stats.earliest_due_ms is not None:
        left = stats.earliest_due_ms - now
        rel = f"in {span(left)}" if left >= 0 else f"{span(-left)} ago"
        earliest = f"earliest due {when(stats.earliest_due_ms)} UTC ({rel})"
    lines.append(f"scheduled  {stats.scheduled:,}   {earliest}")
    lag = f"   oldest is {span(stats.oldest_overdue_ms)} late" if stats.overdue else ""
    more = "+" if stats.truncated else ""
    lines.append(f"overdue    {stats.overdue:,}{more}{lag}")
    if stats.truncated:
        lines.append(
            "NOTE       counts cut short by the census's limits: overdue and the due times are "
            "lower bounds (+), and 'not counted' is what is due later or in buckets not examined"
        )
    if stats.vanished:
        lines.append(
            f"vanished   {stats.vanished:,} counted messages are gone from Redis (expired or evicted, or "
            "their sorted set written over by hand: ls names it); a mover settles them as expired"
        )
    if stats.dead_letters:
        kept = f"{stats.dead_letters:,} compressed message{'s' if stats.dead_letters != 1 else ''}"
        lines.append(f"dead       {kept} could not be restored: `kombu-delay dead` lists them")
    if stats.movers:
        beat = stats.last_heartbeat_ms  # (None: only one ahead of Redis's clock, written by hand)
        told = movers_told(*movers_heard(stats.movers.values(), now))
        last = "none heard" if beat is None else f"{span(now - beat)} ago"
        lines.append(f"movers     {told}, last heartbeat {last}")
    else:
        why = evicted_beats(stats.warnings)
        lines.append(f"movers     none running (no heartbeat kept; is `kombu-delay mover` running?){why}")
    if stats.by_queue:
        lines.append("queues")
        names = {name: clipped(shown(name)) for name in stats.by_queue}
        width = max(cells(q) for q in names.values())
        for name, n in sorted(stats.by_queue.items()):
            lines.append(f"  {padded(names[name], width)}  {n:,}")
    if stats.histogram:
        lines.extend(_histogram_rows(stats))
    if stats.totals:
        lines.append("lifetime   " + "  ".join(f"{k}={v:,}" for k, v in sorted(stats.totals.items())))
    return "\n".join(lines)


def _histogram_rows(stats: Stats) -> list[str]:
    """The due-time histogram: a header, a row per slot (its start, with the date when the rows
    span more than a day), and what is due after it, or, cut short, not counted."""
    first, last = stats.histogram[0], stats.histogram[-1]
    slot_ms = first.end_ms - first.start_ms
    dated = last.end_ms - first.start_ms > DAY_MS
    stamp = "%Y-%m-%d %H:%M:%S" if dated else "%H:%M:%S"
    cut = -3 if slot_ms % 1000 else None  # (milliseconds where rows are finer than seconds)
    more = "+" if stats.truncated else ""
    rest = "not counted" if stats.truncated else "later"
    labels = [
        datetime.fromtimestamp(slot.start_ms / 1000, UTC).strftime(stamp + (".%f" if cut else ""))[:cut]
        for slot in stats.histogram
    ]
    width = max(len(rest), *(len(label) for label in labels))
    peak = max([s.count for s in stats.histogram] + [stats.later])
    lines = [f"due times (UTC, one row per {span(slot_ms)}, row = start of slot)"]
    for label, slot in zip(labels, stats.histogram, strict=True):
        lines.append(f"  {label:<{width}}  {bar(slot.count, peak)} {slot.count:,}{more}")
    lines.append(f"  {rest:<{width}}  {bar(stats.later, peak)} {stats.later:,}")
    return lines


@global_options
@click.command()
@click.option("--hours", type=float, default=12, show_default=True, help="Histogram horizon, hours.")
@click.option("--slot", type=float, default=60, show_default=True, help="Histogram row width, minutes.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_context
def stats(ctx: click.Context, hours: float, slot: float, as_json: bool) -> None:
    """Show what is scheduled: per queue, overdue (mover lag), a due-time histogram, movers.

    It reads counters and bucket sizes, never the messages, in short script calls (each at most
    about 10,000 sorted sets): its cost grows with the buckets of the window and their queues.

    \b
    Examples:
      kombu-delay -b delayredis://localhost:6379/0 stats
      kombu-delay stats --hours 2 --slot 10
      kombu-delay stats --json | jq .overdue
      celery -A proj delay stats
    """
    if not (math.isfinite(hours) and math.isfinite(slot)) or hours <= 0 or slot <= 0:
        raise click.BadParameter("--hours and --slot must be finite and positive")
    # Checked before connecting, so that only this, and no error from Redis or the transport
    # options, reads as a bad --hours/--slot.
    try:
        histogram_slots(hours, slot)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--hours/--slot") from exc
    with control(ctx) as ctl:
        snapshot = ctl.stats(hours=hours, slot_minutes=slot)
    click.echo(json.dumps(snapshot.to_dict(), indent=2) if as_json else render_stats(snapshot))


def table(heads: list[str], rows: list[list[str]]) -> list[str]:
    """``rows`` under ``heads``, each column as wide as its widest cell."""
    widths = [max(cells(row[i]) for row in [heads, *rows]) for i in range(len(heads))]
    return [
        "  ".join(padded(c, w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [heads, *rows]
    ]


def message_table(items: Sequence[ScheduledMessage], now: int) -> list[str]:
    """Scheduled messages as the lines of a table, for a terminal."""
    rows = [
        [
            clipped(shown(item.task_id)) if item.task_id else UNREADABLE,
            clipped(shown(item.task)) if item.task else "-",
            clipped(shown(item.queue)),
            when(item.due_ms),
            span(item.due_ms - now),
            str(item.size),
        ]
        for item in items
    ]
    return table(["TASK ID", "TASK", "QUEUE", "ETA (UTC)", "LEFT", "SIZE"], rows)


def message_json(item: ScheduledMessage, now: int) -> dict[str, object]:
    """A scheduled message as ``--json`` prints it."""
    return {
        "task_id": item.task_id,
        "task": item.task,
        "queue": item.queue,
        "eta": item.eta.isoformat(),
        "due_ms": item.due_ms,
        "left_ms": item.due_ms - now,
        "size": item.size,
    }


@global_options
@click.command(name="ls")
@click.option("--queue", "-Q", default=None, callback=utf8_text, help="Only messages bound for this queue.")
@click.option(
    "--limit", "-n", type=click.IntRange(1, 10_000), default=50, show_default=True, help="Messages per page."
)
@click.option("--cursor", "-c", default=None, help="Continue after a previous page (its printed cursor).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: {items, cursor}.")
@click.pass_context
def ls(ctx: click.Context, queue: str | None, limit: int, cursor: str | None, as_json: bool) -> None:
    """List scheduled messages, earliest first, one page at a time.

    Shows task id, task name, queue, ETA (UTC), time left and payload size, then
    the cursor of the next page. The cursor is a position in time, so paging is
    stable while movers deliver messages. A message damaged in Redis is listed as
    (unreadable), with no task id.

    \b
    Examples:
      kombu-delay ls
      kombu-delay ls --queue emails --limit 20
      kombu-delay ls -c 1796281560000:1796281574917:0:1796281574917.0:1796281560000:8f008930511d4321:celery
      kombu-delay ls --json | jq -r '.items[].task_id'
      celery -A proj delay ls -Q celery
    """
    if cursor:
        try:
            Cursor.parse(cursor)
        except ValueError as exc:
            raise click.BadParameter(
                f"{cursor!r} is not a cursor printed by ls", param_hint="--cursor"
            ) from exc
    with control(ctx) as ctl:
        page = ctl.scheduled(queue=queue, limit=limit, cursor=cursor)
        now = ctl.time_ms()
        if queue is not None and not cursor:
            _warn_look_alikes(ctl, queue, "not listed")
    rows = [message_json(item, now) for item in page.items]
    if as_json:
        click.echo(json.dumps({"items": rows, "cursor": page.cursor}, indent=2))
        return
    for line in message_table(page.items, now):
        click.echo(line)
    if page.cursor:
        click.echo(f"next page: --cursor {shlex.quote(page.cursor)}")  # pasted into a shell
    else:
        click.echo("end of listing")


@global_options
@click.command()
@click.argument("task_id")
@click.option("--eta", default=None, help="New due time, ISO-8601 with an offset, e.g. 2030-01-01T09:00Z.")
@click.option("--countdown", type=float, default=None, help="New due time, seconds from now.")
@click.pass_context
def reschedule(ctx: click.Context, task_id: str, eta: str | None, countdown: float | None) -> None:
    """Move TASK_ID's pending messages to a new due time (the ETA inside is rewritten too).

    A due time already past sends the message to its queue now. Exits 1 when
    nothing is scheduled under TASK_ID.

    \b
    Examples:
      kombu-delay reschedule 1b0e7c34-5bd2-4c3e-9f7e-2a8f3d9a6c01 --countdown 300
      kombu-delay reschedule ID --eta 2030-01-01T09:00:00+00:00
      kombu-delay reschedule ID --countdown 0      # run it now
    """
    if (eta is None) == (countdown is None):
        raise click.UsageError("give exactly one of --eta or --countdown")
    if countdown is not None and not math.isfinite(countdown):
        raise click.BadParameter(f"{countdown} is not a finite number of seconds", param_hint="--countdown")
    new_eta = None
    if eta is not None:
        try:
            new_eta = datetime.fromisoformat(eta)
        except ValueError as exc:
            raise click.BadParameter(f"{eta!r} is not ISO-8601", param_hint="--eta") from exc
        if new_eta.tzinfo is None:
            raise click.BadParameter(f"{eta!r} has no offset; add Z or +00:00", param_hint="--eta")
    with control(ctx) as ctl:
        n = ctl.reschedule(task_id, eta=new_eta, countdown=countdown)
        found = ctl.find(task_id)
    if not n:
        click.echo(f"{shown(task_id)}: not scheduled", err=True)
        ctx.exit(NOT_FOUND)
    due = f"due {when(found[0].due_ms)} UTC" if found else "sent to its queue now"
    click.echo(f"{shown(task_id)}: rescheduled {n} message{'s' if n != 1 else ''}, {due}")


def _warn_look_alikes(ctl: DelayControl, queue: str, what: str) -> None:
    """Name on stderr the destinations that look like ``queue``'s priority lists under
    another separator (:meth:`DelayControl.look_alikes`), and say what to pass."""
    found = ctl.look_alikes(queue)
    if not found:
        return
    names = ", ".join(f"{shown(ctl.queue_of(dest))} ({n:,})" for dest, n in sorted(found.items()))
    steps = ",".join(str(step) for step in ctl.store.steps)
    click.echo(
        f"kombu-delay: {names} look like priority lists of {queue!r}, but are not its lists under "
        f"this command's separator {ctl.store.sep!r} and priority steps {steps}, and were {what}. "
        "If they are queues of their own, nothing is wrong. If the app sets another `sep` or "
        "`priority_steps` in its broker_transport_options, pass the app's own here (-o sep=... "
        "-o priority_steps=...) or run `celery -A <app> delay`",
        err=True,
    )


@global_options
@click.command()
@click.option(
    "--queue", "-Q", required=True, callback=utf8_text, help="Queue whose scheduled messages are removed."
)
@click.option("--yes", is_flag=True, help="Confirm: required, this cannot be undone.")
@click.pass_context
def purge(ctx: click.Context, queue: str, yes: bool) -> None:
    """Remove every message held for a queue (all priorities) that no mover has moved yet.

    Messages already on the queue's list are not touched (`celery purge` removes
    those, and with kombu-delay's transport these too). Exits 1 when the queue
    had nothing scheduled.

    \b
    Examples:
      kombu-delay purge --queue emails --yes
      celery -A proj delay purge -Q celery --yes
    """
    if not yes:
        raise click.UsageError(f"purge removes every scheduled message of {queue!r}; add --yes to confirm")
    with control(ctx) as ctl:
        n = ctl.purge(queue)
        _warn_look_alikes(ctl, queue, "not purged")
    click.echo(f"{shown(queue)}: purged {n} scheduled message{'s' if n != 1 else ''}")
    if not n:
        ctx.exit(NOT_FOUND)


#: The commands, for ``add_command`` on ``kombu-delay`` and ``celery ... delay``.
COMMANDS = (stats, ls, reschedule, purge)
