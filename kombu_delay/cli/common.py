"""What every CLI command shares: the global options, where the broker came from, logging, redaction.

``--broker/-b``, ``--prefix``, ``--transport-option/-o`` and ``--log-level`` are accepted
before the sub-command and after it (the sub-command's value wins) on ``kombu-delay``; under
``celery -A proj delay``, only ``--log-level`` before it. Every message the CLI prints or logs goes through a
:class:`~kombu_delay.redact.Redactor` of the broker's passwords.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import os
import signal
import sys
import traceback
from collections.abc import Mapping, MutableMapping
from typing import Any, TypeVar

import click
import wcwidth

from kombu_delay.connect import Target
from kombu_delay.message import is_text
from kombu_delay.redact import RedactingFilter, Redactor

BROKER_ENV = "KOMBU_DELAY_BROKER"
CELERY_ENV = "CELERY_BROKER_URL"
DEFAULT_BROKER = "delayredis://localhost:6379/0"
LOG_LEVELS = ("debug", "info", "warning", "error")

#: ``-o`` words that stand for Python constants (any case), as in Celery's and kombu's config.
OPTION_WORDS: dict[str, Any] = {"true": True, "false": False, "none": None}

#: kombu and redis-py options whose values are names, kept as typed: ``-o
#: global_keyprefix=0123`` is the prefix ``0123``, not the number 123.
STRING_OPTIONS = frozenset(
    {"global_keyprefix", "master_name", "sep", "client_name", "username", "password", "queue_order_strategy"}
)

#: The environment variables through which Celery names a server, or a configuration that may
#: name one: its settings read them before an app's own ``broker=`` (``app.conf.broker_url``
#: is ``CELERY_BROKER_URL`` first), and the ``celery`` command reads them as its options.
CELERY_SERVER_ENV = (
    "CELERY_BROKER_URL",
    "CELERY_BROKER_READ_URL",
    "CELERY_BROKER_WRITE_URL",
    "CELERY_RESULT_BACKEND",
    "CELERY_CONFIG_MODULE",
    "CELERY_LOADER",
    # The celery command's own options (click: envvar=..., and auto_envvar_prefix CELERY).
    "BROKER_URL",
    "CELERY_BROKER",
    "RESULT_BACKEND",
    "LOADER",
    "CONFIG_MODULE",
    "CELERY_CONFIG",
)

#: Scrubs every log line of the CLI's process; its redactor follows the broker in use.
LOG_FILTER = RedactingFilter()
_HANDLER_NAME = "kombu-delay"


def option_value(text: str) -> Any:
    """Type one ``-o`` value: ``true``/``false``/``none`` (any case), an integer or a finite
    decimal number become that Python value; anything else stays a string.

    redis-py and kombu want ``socket_timeout=5`` as a number and ``max_connections=20`` as
    an int, as they would get them from ``broker_transport_options``.
    """
    if text.lower() in OPTION_WORDS:
        return OPTION_WORDS[text.lower()]
    for kind in (int, float):
        try:
            number = kind(text)
        except ValueError:
            continue
        if math.isfinite(number):
            return number
    return text


def _steps(text: str) -> list[int]:
    """kombu's ``priority_steps`` from ``-o priority_steps=0,3,6,9``: ascending whole numbers,
    none negative, as a publisher takes them (kombu's ``Channel.priority`` reads a first
    step above 0 as well: 3,6,9 sends priority 0 to the list of 9)."""
    try:
        steps = [int(part) for part in text.split(",")]
    except ValueError:
        steps = []
    if not steps or steps[0] < 0 or steps != sorted(set(steps)):
        raise click.BadParameter(
            f"priority_steps={text!r}: expected ascending whole numbers, none negative, such as 0,3,6,9",
            param_hint="--transport-option",
        )
    return steps


def parse_option(values: tuple[str, ...]) -> dict[str, Any]:
    """Turn ``-o KEY=VALUE`` flags into transport options (see :func:`option_value`)."""
    options: dict[str, Any] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep:  # the text is not echoed: it may be a password typed with the wrong separator
            raise click.BadParameter("expected KEY=VALUE, found no '='", param_hint="--transport-option")
        key = key.strip()
        if not key:
            raise click.BadParameter(
                "expected KEY=VALUE, found no KEY before '='", param_hint="--transport-option"
            )
        if key == "priority_steps":
            options[key] = _steps(value)
        else:
            options[key] = value if key in STRING_OPTIONS else option_value(value)
    return options


def setup_logging(level: str) -> None:
    """Log to stderr at ``level`` (once per process; a later call changes the level), every
    handler scrubbed by :data:`LOG_FILTER`."""
    root = logging.getLogger()
    if not root.handlers:
        ours = logging.StreamHandler(sys.stderr)
        ours.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        ours.set_name(_HANDLER_NAME)
        root.addHandler(ours)
    if any(handler.get_name() == _HANDLER_NAME for handler in root.handlers):
        root.setLevel(getattr(logging, level.upper()))
    for handler in root.handlers:  # also handlers someone else set up: they print our errors too
        if LOG_FILTER not in handler.filters:
            handler.addFilter(LOG_FILTER)


def without_celery_servers(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` without :data:`CELERY_SERVER_ENV`: the environment of a child that
    must use only the servers it is given."""
    return {name: value for name, value in env.items() if name not in CELERY_SERVER_ENV}


def forget_celery_servers(env: MutableMapping[str, str] = os.environ) -> list[str]:
    """Remove :data:`CELERY_SERVER_ENV` from ``env`` (this process's environment); return the
    names removed. The demo and the benchmark call it first: they run their own Redis, and a
    Celery app would otherwise publish to the one the environment names."""
    return [name for name in CELERY_SERVER_ENV if env.pop(name, None) is not None]


def resolve_broker(flag: str | None) -> tuple[str, str]:
    """Return the broker URL and where it came from: the flag, an environment variable, or
    the default."""
    if flag is not None:
        return flag, "--broker"
    for name in (BROKER_ENV, CELERY_ENV):
        if os.environ.get(name):
            return os.environ[name], name
    return DEFAULT_BROKER, f"default; give --broker or {BROKER_ENV}"


def target(ctx: click.Context) -> Target:
    """The command's :class:`Target` (set by ``kombu-delay`` or by ``celery ... delay``)."""
    found = ctx.find_object(Target)
    if found is None:  # pragma: no cover - both entry points set it
        raise click.UsageError("no broker given")
    return found


def announce(ctx: click.Context) -> None:
    """Say on stderr which broker and key prefix the command reads, and where they came from
    (stdout stays clean for ``--json``)."""
    click.echo(f"kombu-delay: {target(ctx).describe()}", err=True)


def merge_options(
    ctx: click.Context,
    broker: str | None,
    prefix: str | None,
    transport_options: tuple[str, ...],
    log_level: str | None,
) -> None:
    """Apply global options given at this level: the first level builds the :class:`Target`,
    a later one (after the sub-command) changes it, so its values win."""
    if log_level is not None:
        setup_logging(log_level)
    found = ctx.find_object(Target)
    if found is None:
        url, source = resolve_broker(broker)
        found = ctx.obj = Target(url, source=source)
    elif broker is not None:
        found.url, found.source = broker, "--broker"
    found.transport_options.update(parse_option(transport_options))
    if prefix is not None:
        found.transport_options["global_keyprefix"] = prefix
    LOG_FILTER.redactor = Redactor.for_url(found.url, found.transport_options)


def utf8_text(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback: ``value`` (a key prefix, a queue name) as given, unless it holds bytes
    that are not UTF-8 (read by the shell as lone surrogates), which no Redis key is named by."""
    if value is not None and not is_text(value):
        raise click.BadParameter(f"{value!r} is not UTF-8 text")
    return value


class BrokerOption(click.Option):
    """``--broker``, whose help names the fallback of the group it runs under: a group that
    reads the broker elsewhere (``celery -A proj delay``: the app's) says so in its
    ``broker_fallback`` attribute."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        fallback = f"else env {BROKER_ENV}, then {CELERY_ENV}, then {DEFAULT_BROKER}"
        at: click.Context | None = ctx
        while at is not None:
            fallback = getattr(at.command, "broker_fallback", None) or fallback
            at = at.parent
        self.help = (
            f"Broker URL ({fallback}). redis://, rediss://, sentinel:// and redis+socket:// are accepted too."
        )
        return super().get_help_record(ctx)


def _options() -> list[click.Parameter]:
    """Fresh instances of the global options (each command owns its parameters)."""
    return [
        BrokerOption(["--broker", "-b"], default=None),
        click.Option(
            ["--prefix"],
            default=None,
            callback=utf8_text,
            help="kombu's global_keyprefix, as the publisher sets it.",
        ),
        click.Option(
            ["--transport-option", "-o", "transport_options"],
            multiple=True,
            metavar="KEY=VALUE",
            help="A broker_transport_options entry (repeatable), e.g. -o master_name=mymaster "
            "-o socket_timeout=5. Integers and decimals become numbers, true/false/none (any case) "
            "become True/False/None, priority_steps=0,3,6,9 a list; any other VALUE is a string.",
        ),
        click.Option(
            ["--log-level"],
            default=None,
            type=click.Choice(LOG_LEVELS, case_sensitive=False),
            help="Log level (default info).",
        ),
    ]


C = TypeVar("C", bound=click.Command)


def global_options(command: C) -> C:
    """Give a click command (or group) the global options, applied before its body runs; on a
    sub-command they change what the group set, so the sub-command's values win. An option the
    command defines itself keeps the command's meaning (``bench --broker`` is a Redis to flush)."""
    callback = command.callback
    own = {param.name for param in command.params}
    added = [option for option in _options() if option.name not in own]
    names = [str(option.name) for option in added]

    @functools.wraps(callback or (lambda: None))
    def merged(*args: Any, **kwargs: Any) -> Any:
        given = {name: kwargs.pop(name) for name in names}
        merge_options(
            click.get_current_context(),
            given.get("broker"),
            given.get("prefix"),
            given.get("transport_options") or (),
            given.get("log_level"),
        )
        return callback(*args, **kwargs) if callback is not None else None

    command.params.extend(added)
    command.callback = merged
    return command


class RedactingGroup(click.Group):
    """A click group whose errors are scrubbed of the broker's passwords before click prints
    them, including a traceback nobody translated.

    ``lazy`` names commands by ``"module:attribute"``: the module is imported only when the
    command runs (or help lists it), so ``mover`` and ``health`` never load the tooling.
    """

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            module, _, attr = self.lazy[cmd_name].partition(":")
            command = getattr(importlib.import_module(module), attr)
            self.add_command(global_options(command), cmd_name)
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except BrokenPipeError:
            # The reader went away (`kombu-delay ls | head`): exit as a command that SIGPIPE ends
            # does (141), not with click's 1, which means "not found" here. stdout is pointed at
            # /dev/null first, so the interpreter's last flush does not fail on it again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(128 + signal.SIGPIPE)
        except click.ClickException as exc:
            # click marks ``message`` final for type checkers; it is a plain attribute, printed later.
            setattr(exc, "message", LOG_FILTER.redactor(exc.message))  # noqa: B010
            raise
        except Exception:
            if not LOG_FILTER.redactor:
                raise
            click.echo(LOG_FILTER.redactor(traceback.format_exc()).rstrip(), err=True)
            ctx.exit(1)


def cells(text: str) -> int:
    """The terminal columns ``text`` (made printable, as ``shown`` in inspect.py does) takes, as
    wcwidth measures them: two for a wide character (CJK, an emoji), none for a mark drawn over
    the one before (an accent, a Thai vowel, a variation selector, a skin tone); its length where
    wcwidth finds a control character in it."""
    width = int(wcwidth.wcswidth(text))
    return width if width >= 0 else len(text)


def padded(text: str, width: int) -> str:
    """``text`` and the spaces that make it ``width`` terminal columns wide."""
    return text + " " * (width - cells(text))


#: What the escapes :func:`shown` writes start with after their backslash (``\\x1b``, ``\\\\``).
_ESCAPE_STARTS = frozenset("\\nrtxuU")
#: Printable characters that show as nothing, or as a cut name's end: Unicode's default-ignorable
#: ones that Python calls printable (variation selectors, the combining grapheme joiner, Hangul
#: fillers), and the ellipsis :func:`~kombu_delay.cli.inspect.clipped` ends a cut name with.
_UNSEEN = frozenset(
    "\u034f\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180f\u3164\uffa0\u2026"
    + "".join(map(chr, [*range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)]))
)


def shown(text: str, keep: str = "") -> str:
    """``text`` for a terminal: every character that is not printable (a newline, an escape
    sequence's ESC, an RTL override), or shows as nothing (:data:`_UNSEEN`), as its Python
    escape, and a space at either end as ``\\x20``, so a task or queue name cannot forge rows,
    pass for another or steer the terminal; but those in ``keep``. A backslash of the text that
    would read as the start of such an escape is doubled: the id ``a\\u202e``, written with a
    backslash, shows as ``a\\\\u202e``, not as the RTL override's escape."""
    if text.isprintable() and "\\" not in text and _UNSEEN.isdisjoint(text) and text.strip(" ") == text:
        return text
    parts = [
        char if (char.isprintable() and char not in _UNSEEN) or char in keep else _escaped(char)
        for char in text
    ]
    for end in {0, len(parts) - 1} if parts else ():
        if parts[end] == " ":
            parts[end] = "\\x20"
    for i, part in enumerate(parts[:-1]):
        if part == "\\" and parts[i + 1][0] in _ESCAPE_STARTS:
            parts[i] = "\\\\"
    return "".join(parts)


def _escaped(char: str) -> str:
    # (repr leaves a printable character as it is, an unseen one included)
    return repr(char)[1:-1] if not char.isprintable() else char.encode("unicode_escape").decode("ascii")
