"""``kombu-delay find|cancel|dead``: by task id, and the dead letters by digest.

Exit codes as :mod:`~kombu_delay.cli.inspect`: 0 found or done, 1 not found, 2 usage error,
3 Redis unavailable or another kombu-delay error.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import replace

import click
import redis
from click.core import ParameterSource

from kombu_delay.cli.common import global_options, shown
from kombu_delay.cli.inspect import (
    NOT_FOUND,
    clipped,
    control,
    message_json,
    message_table,
    table,
)
from kombu_delay.control import DeadLetter, DelayControl
from kombu_delay.errors import KombuDelayError

#: Bytes of a dead letter shown in its row of the text listing.
PREVIEW_BYTES = 60


@global_options
@click.command()
@click.argument("task_ids", nargs=-1, required=True, metavar="TASK_ID...")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: {task_id: [messages]}.")
@click.pass_context
def find(ctx: click.Context, task_ids: tuple[str, ...], as_json: bool) -> None:
    """Show the pending messages of each TASK_ID: queue, ETA (UTC), time left, size.

    Exits 0 when every id has a pending message, 1 when some have none (never
    scheduled, already moved to its queue, cancelled, or dead-lettered: where
    there are dead letters, it says how many). A compressed message damaged in
    Redis is shown with no task name, and said so on stderr: a mover will
    dead-letter it, and cancel removes it.

    \b
    Examples:
      kombu-delay find 1b0e7c34-5bd2-4c3e-9f7e-2a8f3d9a6c01
      kombu-delay find ID1 ID2 --json
    """
    with control(ctx) as ctl:
        found = {i: [replace(m, task_id=i) for m in ctl.find(i, unreadable=True)] for i in task_ids}
        now = ctl.time_ms()
        dead = 0
        if not as_json and not all(found.values()):
            with suppress(redis.RedisError):  # a hint: where it cannot be read (an ACL), none
                dead = ctl.store.dead_count()
    if as_json:
        click.echo(json.dumps({i: [message_json(m, now) for m in ms] for i, ms in found.items()}, indent=2))
    else:
        listed = [message for messages in found.values() for message in messages]
        if listed:
            for line in message_table(listed, now):
                click.echo(line)
    for task_id, messages in found.items():
        damaged = sum(not m.message for m in messages)
        if damaged:
            click.echo(
                f"{named(task_id)}: {damaged} message{'s' if damaged != 1 else ''} damaged in Redis, "
                "unreadable: a mover will dead-letter it; cancel removes it",
                err=True,
            )
    missing = [task_id for task_id, messages in found.items() if not messages]
    for task_id in missing:
        click.echo(f"{named(task_id)}: not scheduled", err=True)
    if missing and dead:  # (where a compressed message that could not be restored went)
        kept = f"{dead:,} dead letter{'s' if dead != 1 else ''}"
        click.echo(f"{kept} kept: `kombu-delay dead` lists them", err=True)
    if missing:
        ctx.exit(NOT_FOUND)


@global_options
@click.command()
@click.argument("task_ids", nargs=-1, required=True, metavar="TASK_ID...")
@click.pass_context
def cancel(ctx: click.Context, task_ids: tuple[str, ...]) -> None:
    """Unschedule every pending message of each TASK_ID (retries share their task's id).

    Exits 0 when every id had something to cancel, 1 when some did not (never
    scheduled, already moved to its queue, or already cancelled).

    \b
    Examples:
      kombu-delay cancel 1b0e7c34-5bd2-4c3e-9f7e-2a8f3d9a6c01
      kombu-delay cancel ID1 ID2 ID3
      kombu-delay ls --queue emails --limit 10000 --json |
        jq -j '.items[].task_id + "\\u0000"' | xargs -0 -r kombu-delay cancel --
    """
    each(ctx, task_ids, lambda ctl, i: ctl.cancel(i), "cancelled {n} message{s}", "not scheduled")


def each(
    ctx: click.Context, names: Iterable[str], act: Callable[[DelayControl, str], int], done: str, absent: str
) -> None:
    """``act`` on each of ``names``: say ``done`` (``{n}`` its count, ``{s}`` a plural's s) of each it
    acted on, ``absent`` on stderr of each it did not, and exit 1 when one was absent."""
    missing = 0
    with control(ctx) as ctl:
        for name in names:
            n = act(ctl, name)
            if n:
                click.echo(f"{named(name)}: {done.format(n=n, s='s' if n != 1 else '')}")
            else:
                missing += 1
                click.echo(f"{named(name)}: {absent}", err=True)
    if missing:
        ctx.exit(NOT_FOUND)


def named(task_id: str) -> str:
    """A task id as a line about it starts: :func:`shown`, and an empty one as ``''``."""
    return shown(task_id) or "''"


def _letter_json(letter: DeadLetter) -> dict[str, object]:
    return {
        "index": letter.index,
        "digest": letter.digest,
        "task_id": letter.task_id,
        "size": len(letter.member),
        "member_base64": base64.b64encode(letter.member).decode("ascii"),
    }


@global_options
@click.command()
@click.option(
    "--offset", type=click.IntRange(0), default=0, show_default=True, help="Skip this many (newest first)."
)
@click.option(
    "--limit", "-n", type=click.IntRange(1, 10_000), default=50, show_default=True, help="Dead letters shown."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON: {total, items}, each member in base64.")
@click.option(
    "--remove",
    "digests",
    multiple=True,
    metavar="DIGEST",
    help="Remove the dead letter of this digest (repeatable).",
)
@click.pass_context
def dead(ctx: click.Context, offset: int, limit: int, as_json: bool, digests: tuple[str, ...]) -> None:
    """List the dead letters, newest first, or remove some by their digest.

    A dead letter is a compressed message a mover could not restore (damaged in
    Redis): it was never delivered, and is kept byte for byte. Each row shows its
    position, the sha256 digest that names it, the task id it carries in the
    clear, its size and the start of its bytes; --json gives the member whole.
    With --remove nothing is listed: each digest's letter is removed, and the
    command exits 1 when one was not there.

    \b
    Examples:
      kombu-delay dead
      kombu-delay dead --json > dead-letters.json
      kombu-delay dead --remove 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
    """
    if digests:
        listing = ("as_json", "offset", "limit")
        if any(ctx.get_parameter_source(name) is not ParameterSource.DEFAULT for name in listing):
            raise click.UsageError("--remove lists nothing: give it without --json, --offset and --limit")
        _remove(ctx, tuple(_digest(d) for d in digests))
        return
    with control(ctx) as ctl:
        try:
            total, letters = ctl.dead_letters(offset, limit)
        except ValueError as exc:  # a page past any list position
            if isinstance(exc, KombuDelayError):  # a broker URL or option it cannot use
                raise
            raise click.BadParameter(str(exc), param_hint="--offset") from exc
    if as_json:
        click.echo(json.dumps({"total": total, "items": [_letter_json(x) for x in letters]}, indent=2))
        return
    click.echo(f"{total} dead letter{'s' if total != 1 else ''}")
    rows = [
        [
            str(x.index),
            x.digest,
            clipped(shown(x.task_id)) or "-",
            str(len(x.member)),
            x.preview(PREVIEW_BYTES),
        ]
        for x in letters
    ]
    if rows:
        for line in table(["POS", "DIGEST", "TASK ID", "SIZE", "BYTES"], rows):
            click.echo(line)
    if offset + len(letters) < total:
        click.echo(f"more: --offset {offset + len(letters)}")


def _digest(text: str) -> str:
    """A digest as given (spaces around it, any case), or a usage error."""
    digest = text.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise click.BadParameter(
            f"{shown(text)} is not a digest: 64 hex digits, as dead lists them", param_hint="--remove"
        )
    return digest


def _remove(ctx: click.Context, digests: tuple[str, ...]) -> None:
    each(ctx, digests, lambda ctl, d: ctl.remove_dead_letter(d), "removed", "no such dead letter")


#: The commands, for ``add_command`` on ``kombu-delay`` and ``celery ... delay``.
COMMANDS = (find, cancel, dead)
