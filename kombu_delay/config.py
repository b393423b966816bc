"""Settings: one frozen dataclass, built from transport options, the environment and flags.

Every option is a ``broker_transport_options`` key, an environment variable
(upper case, ``KOMBU_DELAY_`` instead of ``delay_``), or a CLI flag, in
rising precedence. User-facing durations are seconds (a fraction down to 1 ms);
fields are milliseconds. Counts (messages, messages per second) are whole numbers.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from kombu_delay.errors import ConfigError
from kombu_delay.ops.checks import FRESH_HEARTBEAT_MS

logger = logging.getLogger(__name__)

DAY_MS = 86_400_000
#: The ``KOMBU_DELAY_*`` variables told as likely misspellings of a setting's (once a process).
_misspelt_told: set[str] = set()
#: The shortest ``delay_grace`` accepted, ms. The grace is how long scheduled messages survive
#: with no mover running (a live mover renews the expiry of everything it holds), so it must
#: outlast a restart or a deploy with room to spare.
MIN_GRACE_MS = 3_600_000
#: The longest ``delay_look_ahead`` accepted, ms: a worker holds what it fetched ahead (in its
#: memory, and in kombu's unacked set, restored after ``visibility_timeout``), so the window
#: stays a small fraction of the default hour.
MAX_LOOK_AHEAD_MS = 60_000
#: The longest ``delay_heartbeat_interval`` accepted, ms: ``health``, ``stats`` and publishers
#: count a mover as running while its heartbeat is younger than ``FRESH_HEARTBEAT_MS`` (30 s),
#: so a mover beats at least three times in that span, and one late beat is no outage.
MAX_HEARTBEAT_INTERVAL_MS = FRESH_HEARTBEAT_MS // 3
#: The longest duration accepted, ms: the span of every due time there can be (to the year-2109
#: ceiling, ``store.keys.MAX_DUE_MS``, spelled again as the store imports this module), which no
#: option needs more than. It keeps every expiry a publish sets (a due time, plus the bucket width
#: and the grace, plus a day) far below 2**53 ms, where a Lua number stops being a whole
#: millisecond Redis takes, so no script is refused after its first writes.
MAX_DURATION_MS = 2**42 - 1
_TOO_LONG = f"must be at most {MAX_DURATION_MS // 1000} s (the span of every due time there can be, to 2109)"


@dataclass(frozen=True)
class Settings:
    """All kombu-delay options, validated."""

    #: Width of one time bucket, ms. Option ``delay_bucket_width`` (s). Default 60 s.
    #: Publisher only: movers find buckets through the index, whatever their width.
    bucket_width_ms: int = 60_000
    #: How long scheduled messages survive with no mover running, ms. Option ``delay_grace``
    #: (s). Default 7 days, at least 1 hour: a mover outage shorter than this loses nothing.
    #: While a mover runs, nothing it holds expires, however long it is held.
    grace_ms: int = 7 * DAY_MS
    #: Refuse ETAs further out than this at publish, ms; 0 = no limit (the default).
    #: Option ``delay_max_delay`` (s).
    max_delay_ms: int = 0
    #: Most messages one move call moves. Option ``delay_batch_size``. Default 500.
    batch_size: int = 500
    #: Longest a mover sleeps without looking, ms. Option ``delay_max_sleep`` (s). Default 1 s.
    max_sleep_ms: int = 1000
    #: Cap on moves per second per mover; 0 = none. Option ``delay_max_rate``. Default 0.
    max_rate: int = 0
    #: Hold messages while their destination list has this many items; 0 = never.
    #: Option ``delay_max_queue_length``. Default 0.
    max_queue_length: int = 0
    #: How often a mover records its heartbeat, ms. Option ``delay_heartbeat_interval`` (s).
    #: Default 2 s.
    heartbeat_interval_ms: int = 2000
    #: Store a message due further ahead than this compressed, in the cold space, ms;
    #: 0 = never. Option ``delay_compress_after`` (s). Default 60 s. Publisher only. A
    #: message due within ``delay_thaw_ahead`` is never stored compressed, whatever this says.
    compress_after_ms: int = 60_000
    #: How long before their due time movers restore (thaw) compressed messages into the
    #: buckets they move from, ms. Option ``delay_thaw_ahead`` (s). Default 30 s. A
    #: publisher refuses to store a message compressed closer to its due time than this.
    thaw_ahead_ms: int = 30_000
    #: Move messages onto their lists this long before they are due, ms; 0 = at due (the
    #: default). Option ``delay_look_ahead`` (s), at most 60 s. Mover only. A message keeps its
    #: ETA, so Celery's timer still starts it at its ETA, never before (one held by an
    #: ``x-delay`` alone carries none: it is moved at its due time); the worker fetches what
    #: falls due in the window into its memory (as stock Celery does, for that window only) and
    #: a herd finishes sooner. Keep it well below the workers' ``visibility_timeout``: a worker
    #: holds a message up to this long plus its backlog before it runs and acks it.
    look_ahead_ms: int = 0
    #: Run a mover thread inside each Celery worker. Option ``delay_embedded_mover``.
    #: Default off: the sidecar is the recommended deployment.
    embedded_mover: bool = False

    def __post_init__(self) -> None:
        # Built by hand (Settings is public), a field skips the conversions of the options:
        # 1.5 messages, NaN ms and the text "false" must not pass as values.
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "embedded_mover":
                if not isinstance(value, bool):
                    raise ConfigError(f"embedded_mover is True or False, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int):
                unit = " of ms" if f.name.endswith("_ms") else ""
                raise ConfigError(f"{f.name} must be a whole number{unit}, got {value!r}")
        positive = ("bucket_width_ms", "batch_size", "max_sleep_ms", "heartbeat_interval_ms", "thaw_ahead_ms")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_option(name)} must be positive, got {_shown(self, name)}")
        if self.grace_ms < MIN_GRACE_MS:
            raise ConfigError(
                f"delay_grace must be at least {MIN_GRACE_MS // 1000} s (1 hour), got "
                f"{_shown(self, 'grace_ms')}: scheduled messages expire when no mover runs for that long"
            )
        for name in ("max_delay_ms", "max_rate", "max_queue_length", "compress_after_ms", "look_ahead_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{_option(name)} must not be negative, got {_shown(self, name)}")
        if self.look_ahead_ms > MAX_LOOK_AHEAD_MS:
            raise ConfigError(
                f"delay_look_ahead must be at most {MAX_LOOK_AHEAD_MS // 1000} s, got "
                f"{_shown(self, 'look_ahead_ms')}: workers hold what it hands them early"
            )
        if self.heartbeat_interval_ms > MAX_HEARTBEAT_INTERVAL_MS:
            raise ConfigError(
                f"delay_heartbeat_interval must be at most {MAX_HEARTBEAT_INTERVAL_MS // 1000} s, got "
                f"{_shown(self, 'heartbeat_interval_ms')}: health, stats and publishers take a mover "
                f"silent for {FRESH_HEARTBEAT_MS // 1000} s for a stopped one"
            )
        if self.batch_size > 5000:
            raise ConfigError(f"delay_batch_size must be at most 5000, got {self.batch_size}")
        for name in (f.name for f in fields(self) if f.name.endswith("_ms")):
            if getattr(self, name) > MAX_DURATION_MS:
                raise ConfigError(f"{_option(name)} {_TOO_LONG}, got {_shown(self, name)}")

    @classmethod
    def from_options(
        cls, options: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> Settings:
        """Build settings from transport options, overridden by ``KOMBU_DELAY_*`` variables.

        Each source is checked whole before the next applies: a bad option is refused even
        where a variable overrides it, as a bad variable is under a flag."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        known = {_option(f.name): f.name for f in fields(cls)}
        for key, raw in (options or {}).items():
            if key.startswith("delay_"):
                if key not in known:
                    near = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
                    meant = f" ({near[0]}?)" if near else ""
                    raise ConfigError(f"unknown transport option {key!r}{meant}; known: {sorted(known)}")
                values[known[key]] = raw
            elif key not in _misspelt_told and (hint := _option_hint(key, known)):  # -o max_rate=5: unsaid
                _misspelt_told.add(key)
                logger.warning("kombu-delay: transport option %r is not read: %s", key, hint)
        settings = cls().with_values(**values)
        overrides = {}
        variables = {"KOMBU_DELAY_" + option[len("delay_") :].upper(): name for option, name in known.items()}
        for var, name in variables.items():
            if env.get(var, "") != "":
                overrides[name] = env[var]
        _tell_misspelt(env, variables)
        return settings.with_values(**overrides)

    def with_values(self, **values: Any) -> Settings:
        """Return a copy with user-facing values (seconds for ``*_ms`` fields) applied.

        Names are field names or option names without ``delay_`` (``max_sleep`` for
        ``max_sleep_ms``), as the CLI flags give them.
        """
        names = {f.name for f in fields(self)}
        converted = {}
        for name, raw in values.items():
            field_name = name if name in names or f"{name}_ms" not in names else f"{name}_ms"
            if raw is not None:
                converted[field_name] = _convert(field_name, raw)
        return replace(self, **converted)


def _tell_misspelt(env: Mapping[str, str], variables: Mapping[str, str]) -> None:
    """Warn of a ``KOMBU_DELAY_*`` variable that is no setting's but looks meant for one: read
    by nothing, it would change nothing, unsaid. Others of the prefix (``KOMBU_DELAY_BROKER``,
    say) are left alone."""
    for var in env:
        if var.upper().startswith("KOMBU_DELAY_") and var not in variables and var not in _misspelt_told:
            near = _meant(var.upper(), variables)
            if near:
                _misspelt_told.add(var)
                logger.warning("kombu-delay: %s is no setting's variable, and is ignored: %s?", var, near)


#: The transport options kombu reads beside its Redis channel's (``from_transport_options``).
_KOMBU_OPTIONS = ("max_retries", "interval_start", "interval_step", "interval_max", "polling_interval")


def _option_hint(key: str, known: Iterable[str]) -> str | None:
    """What a transport option that is not kombu-delay's was likely meant as, where it is read
    by no one: one of kombu-delay's without its ``delay_``, a TLS option (kombu reads those from
    Celery's ``broker_use_ssl`` or the URL's query, never from here), or a close misspelling of
    one of kombu's (``socket_timout``); ``None`` for none (kombu takes any name)."""
    from kombu.transport import redis as kombu_redis

    lowered = key.lower()
    if f"delay_{lowered}" in known or lowered in known:  # (-o DELAY_MAX_RATE=5: the case differs)
        return f"{lowered if lowered in known else 'delay_' + lowered}?"
    near = difflib.get_close_matches(f"delay_{lowered.removeprefix('delay_')}", known, n=1, cutoff=0.85)
    if near:  # -o max_rat=3, -o Delay_max_rat=3
        return f"{near[0]}?"
    if key.startswith("ssl_"):
        return f"TLS options go in Celery's broker_use_ssl, or the broker URL's query (?{key}=...)"
    kombus = {*kombu_redis.SentinelChannel.from_transport_options, *_KOMBU_OPTIONS}
    if lowered in kombus and key not in kombus:  # -o VISIBILITY_TIMEOUT=60: kombu reads none
        return f"{lowered}?"
    near = difflib.get_close_matches(key, kombus, n=1, cutoff=0.85) if key not in kombus else []
    return f"{near[0]}?" if near else None


def _meant(var: str, variables: Iterable[str]) -> str | None:
    """The setting's variable ``var`` (upper case) looks meant for: the same in another case,
    one whose words hold all of its words or all of whose words it holds (``..._EMBEDDED``,
    ``..._RATE``, ``..._MAX_RATE_LIMIT``; where several do, all of them: ``..._MAX`` may mean
    any of three), else one spelled nearly as it is (``..._MAXRATE``); ``None`` for none."""
    words = set(var.removeprefix("KOMBU_DELAY_").split("_")) - {""}
    by_words = sorted(
        v for v in variables if words and (words <= set(v.split("_")[2:]) or set(v.split("_")[2:]) <= words)
    )
    if len(by_words) > 1:
        return f"one of {', '.join(by_words[:-1])} or {by_words[-1]}"
    near = difflib.get_close_matches(var, by_words or list(variables), n=1, cutoff=0.0 if by_words else 0.9)
    return near[0] if near else None


def _option(name: str) -> str:
    base = name[: -len("_ms")] if name.endswith("_ms") else name
    return "delay_" + base


def _shown(settings: Settings, name: str) -> str:
    value = getattr(settings, name)
    return seconds_shown(value) if name.endswith("_ms") else str(value)


def seconds_shown(ms: int) -> str:
    """A duration of ``ms`` as an error tells it: "2,592,000 s", "0.25 s" (not "2.592e+06 s")."""
    return f"{ms / 1000:,.3f}".rstrip("0").rstrip(".") + " s"


def _convert(name: str, raw: Any) -> Any:
    option = _option(name)
    if name == "embedded_mover":
        try:
            return _flag(raw)
        except ValueError as exc:
            raise ConfigError(f"{option} is on or off ({', '.join(_FLAG_WORDS)}), got {raw!r}") from exc
    try:
        number = _finite(raw)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"{option} must be a number, got {raw!r}") from exc
    if not name.endswith("_ms"):
        if type(raw) is int or (isinstance(raw, str) and raw.strip().lstrip("+-").isdecimal()):
            return int(raw)  # whole, as given: through a float, past 2**53 it is another number
        # A count (messages, messages/s): int() would turn 0.5 into 0, which means "no limit".
        if not number.is_integer():
            raise ConfigError(f"{option} must be a whole number, got {raw!r}")
        return int(number)
    if abs(number) > MAX_DURATION_MS / 1000:
        # Checked before * 1000, which overflows a float near 1e305 s.
        if number < 0:
            raise ConfigError(f"{option} must not be negative, got {raw!r}")
        raise ConfigError(f"{option} {_TOO_LONG}, got {raw!r}")
    ms = round(number * 1000)
    if ms == 0 and number > 0:
        # Rounding must not turn a positive duration into 0, which means "no limit" for some.
        raise ConfigError(f"{option} must be at least 0.001 s (1 ms), got {raw!r}")
    return ms


#: The words an on/off option accepts (any case), and those that mean on.
_FLAG_WORDS = ("1", "0", "true", "false", "yes", "no", "on", "off")
_TRUE_WORDS = ("1", "true", "yes", "on")


def _flag(raw: Any) -> bool:
    """An on/off value: a bool, the int 0 or 1, or one of :data:`_FLAG_WORDS` as text;
    ``ValueError`` for anything else (``b"false"``, ``-1``, ``NaN`` and ``[0]`` are true by
    their truth, and turned an embedded mover on)."""
    if isinstance(raw, bool):
        return raw
    if type(raw) is int and raw in (0, 1):
        return bool(raw)
    if not isinstance(raw, str) or raw.lower() not in _FLAG_WORDS:
        raise ValueError(raw)
    return raw.lower() in _TRUE_WORDS


def _finite(raw: Any) -> float:
    """A finite number from a number or its text; ``ValueError`` for a bool, NaN or infinity."""
    if isinstance(raw, bool):
        raise ValueError(raw)
    number = float(raw)
    if not math.isfinite(number):
        raise ValueError(raw)
    return number
