"""What makes a deployment unsafe that no single move shows, said the same way everywhere.

The mover logs these, ``stats`` shows them, ``health`` fails on them (on a Redis that keeps
nothing on disk it only prints a warning) and the metrics expose them; each place reads the
facts from Redis and words them here, so they never disagree.
"""

from __future__ import annotations

import math
import re
import threading
import time
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

#: A mover heartbeat younger than this means a mover serves its namespace, ms. ``health``
#: uses 30 s by default too, and a mover beats every 2 s.
FRESH_HEARTBEAT_MS = 30_000
#: How far ahead of Redis's clock a heartbeat may be and still count, ms: a mover writes its own
#: by that clock, so only one written by hand, or a clock set back, is ahead of it.
FUTURE_BEAT_MS = 60_000


def shell_word(text: str) -> str | None:
    """``text`` as one word of a command an operator may paste into any POSIX shell (sh, dash,
    bash, zsh): in single quotes. ``None`` where it holds what no terminal shows, or shows as
    nothing or a blank (a tab, a control or a direction mark; a combining mark, a variation
    selector, a filler, a space other than ASCII's), which a command read off the screen would
    lose: a key prefix is read from key names in Redis, and a form only some shells read
    (bash's ``$'...'``) runs what follows a quote in the others."""
    if not all(_shown(c) for c in text):
        return None
    return "'" + text.replace("'", "'\\''") + "'"


#: Printable characters that show as nothing or a blank: Hangul fillers, the blank Braille pattern.
_BLANKS = frozenset("\u115f\u1160\u3164\uffa0\u2800")


def _shown(char: str) -> bool:
    """Whether ``char`` shows as itself in a terminal (:func:`shell_word`)."""
    if char == " ":
        return True
    return char.isprintable() and char not in _BLANKS and unicodedata.category(char) not in ("Mn", "Me", "Zs")


def mover_command(prefix: str) -> str:
    """The command an operator is told to run for a mover of key prefix ``prefix``: where the
    prefix cannot be typed (:func:`shell_word`), through the Celery app that publishes there."""
    typed = shell_word(prefix)
    if typed is None:
        return "celery -A <the app that publishes there> delay mover: its prefix cannot be typed"
    return f"kombu-delay --broker <broker URL> --prefix {typed} mover"


def ways_to_start(prefix: str) -> str:
    """How a publisher tells its operator to start a mover of key prefix ``prefix``: through the
    Celery app, or where the prefix can be typed (:func:`shell_word`), with the CLI too."""
    app = "`celery -A <your app> delay mover`"
    if shell_word(prefix) is None:
        return f"{app} (its key prefix cannot be typed in a shell)"
    return f"{app} or `{mover_command(prefix)}`"


#: How long after a publish found no mover serving its namespace the next asks again, s.
ASK_AGAIN_S = 60.0


class MoverAsks:
    """Whether a publisher's delayed publish asks if a mover serves its namespace (its ``where``:
    process, broker, key prefix; a forked child asks again): the first does, and where that
    found none, one a minute, until one finds a mover. The first may come right after a Redis
    restart, before the mover's next heartbeat: its warning was never taken back."""

    def __init__(self) -> None:
        self._at: dict[tuple[int, str, str], float] = {}  # the next ask, monotonic s (inf: none)
        self._lock = threading.Lock()

    def due(self, where: tuple[int, str, str]) -> bool:
        return time.monotonic() >= self._at.get(where, 0.0)

    def answered(self, where: tuple[int, str, str], movers: int | None) -> str | None:
        """Note an ask's answer (``movers``: the movers found, ``None`` unknown): "none" where
        none serves and none was told, "now" where one serves after none did, else ``None``
        (another thread asked meanwhile, or nothing changed)."""
        with self._lock:
            if not self.due(where):
                return None
            before, none = self._at.get(where), movers == 0
            self._at[where] = time.monotonic() + ASK_AGAIN_S if none else math.inf
        if none:
            return None if before is not None else "none"
        return "now" if before is not None else None


def glob_escaped(text: str) -> str:
    """``text`` as a literal part of a Redis glob (``SCAN MATCH``, ``--pattern``, an ACL key or
    channel pattern): each of ``*?[]\\`` and ``^`` behind a backslash."""
    return re.sub(r"([*?\[\]\\^])", r"\\\1", text)


def heard(age_ms: int) -> bool:
    """Whether a mover whose last heartbeat is ``age_ms`` old was heard from in time: within
    :data:`FRESH_HEARTBEAT_MS` (a heartbeat is kept a day), and no further ahead of the clock
    than :data:`FUTURE_BEAT_MS` (one written so, by hand, is no sign of life)."""
    return -FUTURE_BEAT_MS <= age_ms <= FRESH_HEARTBEAT_MS


def movers_heard(beats: Iterable[int], now_ms: int) -> tuple[int, int]:
    """Of the movers whose last heartbeats (epoch ms) are ``beats``: how many were heard from
    in time (:func:`heard`), and how many not."""
    ages = [now_ms - beat for beat in beats]
    alive = sum(1 for age in ages if heard(age))
    return alive, len(ages) - alive


def movers_told(alive: int, silent: int) -> str:
    """The movers as ``stats`` and ``health`` say them: ``1 (1 more silent for over 30 s)``."""
    over = f" ({silent} more silent for over {FRESH_HEARTBEAT_MS // 1000} s)" if silent else ""
    return f"{alive}{over}"


#: The only ``maxmemory-policy`` under which Redis never deletes a scheduled message.
SAFE_POLICY = "noeviction"


def eviction_problem(policy: str | None) -> str | None:
    """Return why ``policy`` endangers scheduled messages, or ``None`` when it does not (or is
    unknown: ``None``)."""
    if policy is None or policy == SAFE_POLICY:
        return None
    return (
        f"{_POLICY_TOLD}{policy}: under memory pressure Redis deletes scheduled "
        f"messages without a trace; set maxmemory-policy {SAFE_POLICY} (CONFIG SET and redis.conf)"
    )


_POLICY_TOLD = "Redis's maxmemory-policy is "
#: What "no mover heartbeat" adds beside an evicting policy (among ``warnings``): movers may be
#: running, their heartbeats deleted by Redis as they are written.
EVICTED_BEATS = " (or deleted: the maxmemory-policy above evicts the movers' heartbeats too)"


def evicted_beats(warnings: Iterable[str]) -> str:
    """:data:`EVICTED_BEATS` where ``warnings`` tell an evicting policy, else nothing."""
    return EVICTED_BEATS if any(w.startswith(_POLICY_TOLD) for w in warnings) else ""


#: Bytes short of its ``maxmemory`` within which Redis is taken to be at it. Redis judges a
#: write with the write's own arguments read into memory already, so a Redis filled by publishes
#: stops short of the limit as ``INFO`` counts it (448 bytes short, in a test run, refusing every
#: publish of 1 KB), and refuses any write larger than what is left.
AT_MAXMEMORY_BYTES = 64 * 1024


def memory_problem(
    policy: str | None, usage: tuple[int, int] | None, margin: int = AT_MAXMEMORY_BYTES
) -> str | None:
    """Return what it means that Redis is at its ``maxmemory``: less than ``margin`` bytes left
    (``usage``: what it uses and the limit, bytes; ``None``: no limit, or unread), under
    ``policy``. Only under ``noeviction``, which refuses writes then; an evicting policy deletes
    keys instead (:func:`eviction_problem`)."""
    if usage is None or policy != SAFE_POLICY or usage[1] - usage[0] >= margin:
        return None
    used, limit = usage
    left = "none left" if used >= limit else f"{(limit - used) / 1024:,.1f} KB left"
    return (
        f"Redis is at its maxmemory ({used / 2**20:,.1f} MB used of {limit / 2**20:,.1f} MB, "
        f"{left}): it refuses every write larger than what is left, publishes among them, and "
        "workers on delayredis:// deliver what they fetch unrecorded (on redis:// they fail as they "
        "fetch: kombu records what they fetch, a write); movers go on moving; free memory or raise maxmemory"
    )


def unread_policy(policy: str | None) -> str | None:
    """Return what it means that Redis's ``maxmemory-policy`` could not be read (``None``:
    ``INFO`` refused by the ACL, as ``-@dangerous`` does, or renamed), or ``None`` when it was."""
    if policy is not None:
        return None
    return (
        "cannot read Redis's maxmemory-policy (INFO refused by this user's ACL, or renamed): an "
        "evicting policy, which deletes scheduled messages, goes unnoticed, and so does Redis at "
        "its maxmemory; grant the user +info"
    )


def persistence_problem(aof_enabled: bool | None, save_rules: str | None) -> str | None:
    """Return why a Redis that keeps nothing on disk endangers scheduled messages, or ``None``
    when it keeps them (the AOF on, or RDB save rules) or when that is unknown (``None``: INFO or
    ``CONFIG GET save`` refused or renamed)."""
    if aof_enabled is None or aof_enabled or save_rules is None or save_rules.strip():
        return None
    return (
        "Redis keeps nothing on disk (appendonly no, no save rules): a Redis restart loses every "
        "scheduled message without a trace; set appendonly yes (CONFIG SET and redis.conf)"
    )


def snapshot_note(aof_enabled: bool | None, save_rules: str | None) -> str | None:
    """Return what a Redis that persists by RDB snapshots only loses on a crash, or ``None``
    with the AOF on, with nothing on disk at all (:func:`persistence_problem`) or unknown."""
    rules = (save_rules or "").strip()
    if aof_enabled is None or aof_enabled or not rules:
        return None
    return (
        f"Redis persists by RDB snapshots only (save {rules}): a crash loses the messages "
        "scheduled since the last snapshot and moves again those moved since (a worker that "
        "took one runs it twice); appendonly yes keeps them"
    )


def _to_type(stranded: Mapping[str, int]) -> str:
    """The prefix whose mover command the stranded warning gives: of those that can be typed,
    the one that strands the most messages (one written by hand to come first sorted does not
    take it), else the first."""
    ranked = sorted(stranded, key=lambda prefix: (-stranded[prefix], prefix))
    return next((prefix for prefix in ranked if shell_word(prefix) is not None), ranked[0])


def stranded_problem(stranded: Mapping[str, int]) -> str | None:
    """Return what to do about other key prefixes whose messages no mover serves (prefix ->
    messages), or ``None`` when there are none."""
    if not stranded:
        return None
    parts = ", ".join(f"{prefix!r} ({n:,})" for prefix, n in sorted(stranded.items()))
    return (
        f"messages are stranded under key prefix {parts}, which no mover serves: run a mover with "
        f"that global_keyprefix ({mover_command(_to_type(stranded))}; the same database number), or "
        "give the publishers the global_keyprefix of the movers that run"
    )


def databases_problem(found: Mapping[int, int], prefix: str, before: Iterable[int]) -> str | None:
    """Return what to do about other databases holding messages under ``prefix`` that no mover
    serves (database -> messages) at this look and at the one ``before`` (movers of several
    databases started together find each other's messages before their heartbeats), or
    ``None`` when there are none."""
    seen = set(before)
    stranded = {db: n for db, n in found.items() if db in seen}
    if not stranded:
        return None
    parts = ", ".join(f"{db} ({n:,})" for db, n in sorted(stranded.items()))
    return (
        f"messages are stranded in database {parts} of this Redis, under this mover's key prefix "
        f"{prefix!r}, and no mover serves them: run a mover with that database number in its broker "
        "URL, or give the publishers this mover's"
    )


@dataclass
class Findings:
    """What the last checks found."""

    #: The server's ``maxmemory-policy``, when it could be read, and where it has a
    #: ``maxmemory``, what it uses and the limit, bytes (:meth:`Store.memory_state`).
    policy: str | None = None
    memory: tuple[int, int] | None = None
    #: Other key prefixes holding messages no mover serves: prefix -> messages.
    stranded: dict[str, int] = field(default_factory=dict)
    #: Whether Redis's AOF is on, and its RDB save rules (read only while the AOF is off),
    #: when they could be read.
    aof_enabled: bool | None = None
    save_rules: str | None = None

    @property
    def evicting(self) -> bool:
        return eviction_problem(self.policy) is not None

    @property
    def memory_problem(self) -> str | None:
        return memory_problem(self.policy, self.memory)

    @property
    def volatile(self) -> bool:
        """Redis keeps nothing on disk: a restart loses every scheduled message."""
        return persistence_problem(self.aof_enabled, self.save_rules) is not None


#: What is logged when a problem is gone.
RESOLVED = {
    "policy": "Redis's maxmemory-policy no longer lets it delete scheduled messages",
    "memory": "Redis is no longer at its maxmemory: it accepts publishes",
    "stranded": "no messages are stranded under other key prefixes any more",
    "databases": "no messages are stranded in other databases any more",
    "persistence": "Redis keeps scheduled messages on disk now (appendonly or save rules)",
    "forget": "the id index is walked again",
    "record": "the record of stranded prefixes is kept again",
}


#: What is logged where what Redis keeps on disk cannot be read.
UNREAD_PERSISTENCE = (
    "cannot read what Redis keeps on disk (INFO persistence or CONFIG GET save refused, or Redis "
    "still loading its data); persistence not checked until it can be read"
)
#: What a server that took over by a failover holds, as a mover tells it.
REPLICATED = (
    "what was replicated to it (what the former server took after its last replicated write is "
    "not: a publish made there is lost, a move made there is made again)"
)
