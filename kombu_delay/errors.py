"""The exception tree of kombu-delay, and where redis-py's failures become it
(:func:`translated_errors`, around every call of the store)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import redis


class KombuDelayError(Exception):
    """Base class of every error kombu-delay raises."""

    def __repr__(self) -> str:
        # With its words: redis-py 8 gives its errors, and so those of ours that are also its
        # own (RedisUnavailable, WrongTypeKey, ...), a repr of their kind alone ("server:...").
        return f"{type(self).__name__}({str(self)!r})"


class ConfigError(KombuDelayError, ValueError):
    """An option has a bad value; the message names the option."""


class BadETA(KombuDelayError, ValueError):
    """A message's ETA or ``x-delay`` cannot be used; it is delivered at once."""


class DelayTooLong(KombuDelayError, ValueError):
    """The ETA is further out than ``max_delay`` (or the year-2109 ceiling) allows."""


class RedisUnavailable(KombuDelayError, redis.ConnectionError):
    """Redis could not be reached. Also a ``redis.ConnectionError``, so kombu's
    and Celery's connection-retry policies treat it as a connection error."""


class RedisAuthError(KombuDelayError, redis.AuthenticationError):
    """Redis refused the credentials: a wrong password or user name, a missing password, or
    a disabled user. Retrying cannot help, so the mover stops with this error. Also a
    ``redis.AuthenticationError``, so kombu and Celery treat it as they treat the same
    refusal of plain kombu's own connection."""


class RedisPermissionError(KombuDelayError, redis.exceptions.NoPermissionError):
    """Redis's ACL does not let this user run a command or touch a key that kombu-delay
    needs (``NOPERM``; the README's ACL line lists them). Retrying cannot help, so the mover
    stops with this error. Also a ``redis.exceptions.NoPermissionError``, as redis-py
    raises for the same refusal outside a script."""


class RedisRefused(KombuDelayError, redis.ResponseError):
    """Redis refused a write (``maxmemory`` reached under ``noeviction``, a read-only
    replica, a failed background save). Also a ``redis.ResponseError``, so it is one of
    kombu's ``channel_errors``, as the same refusal of plain kombu's ``LPUSH`` would be."""


class OverMaxmemory(RedisRefused, redis.exceptions.OutOfMemoryError):
    """Redis refused a write because ``maxmemory`` is reached (under ``noeviction``). Also a
    ``redis.exceptions.OutOfMemoryError``, as the same refusal of plain kombu's ``LPUSH``."""


class ReadOnlyRefused(RedisRefused, redis.exceptions.ReadOnlyError):
    """Redis refused a write because it is a read-only replica. Also a
    ``redis.exceptions.ReadOnlyError``, as the same refusal of plain kombu's ``LPUSH``."""


class WrongTypeKey(KombuDelayError, redis.ResponseError):
    """A key holds a value of another type than the command expects (``WRONGTYPE``): one of
    kombu-delay's keys written over by hand, or a destination that is not a list. Also a
    ``redis.ResponseError``, as redis-py raises it."""


#: What each optional extra installs (setup.cfg's ``extras_require``), for a message that needs
#: one: kombu-delay is installed from a checkout or a git URL as often as from an index, so
#: ``pip install 'kombu-delay[web]'`` is no command every user can run, and the packages are.
EXTRAS = {
    "metrics": ("prometheus-client>=0.17",),
    "web": ("flask>=3.0", "waitress>=3.0"),
    "plot": ("matplotlib>=3.7",),
}


def needs_extra(what: str, extra: str) -> str:
    """``<what> needs the <extra> extra: pip install '<package>' ...``."""
    return f"{what} needs the {extra} extra: pip install " + " ".join(f"'{p}'" for p in EXTRAS[extra])


def is_wrong_type(error: redis.ResponseError) -> bool:
    """True for Redis's ``WRONGTYPE`` refusal, raw (also in a script's error text) or translated."""
    return isinstance(error, WrongTypeKey) or "WRONGTYPE" in str(error)


class PayloadTooLarge(KombuDelayError, ValueError):
    """The message is larger than Redis accepts for one string (512 MB)."""


class CorruptMember(KombuDelayError, ValueError):
    """A stored compressed message cannot be restored (altered or truncated in Redis). The
    mover keeps it on the dead-letter list, counted, and never pushes it."""


class EditConflict(KombuDelayError, RuntimeError):
    """A cancel or reschedule found a task's messages moved by other edits each time it looked
    (other threads or processes rescheduling the same task id over and over): some are still
    scheduled, not as asked. Nothing was lost; try again."""


class StorageFormatError(KombuDelayError, RuntimeError):
    """The data under this key prefix is in a storage format this version cannot read (the
    ``format`` field of the totals hash, see :data:`kombu_delay.store.keys.FORMAT`). Nothing
    was read or written; waiting cannot help, so the mover stops with this error."""


#: redis-py's refusals of the credentials. ``AuthenticationError`` is a ``ConnectionError``,
#: but unlike one it does not go away by waiting.
AUTH_ERRORS = (redis.AuthenticationError, redis.exceptions.AuthenticationWrongNumberOfArgsError)

#: What a mover cannot wait out: refused credentials, an ACL that denies it a command or a key
#: (raw or translated), and data in a storage format it cannot read.
FATAL_ERRORS = (*AUTH_ERRORS, redis.exceptions.NoPermissionError, StorageFormatError)

#: How an ACL refusal reads when Redis 7 reports it from inside a script, where redis-py
#: sees a plain error (Redis 6 keeps the ``NOPERM`` code in the text).
_SCRIPT_NOPERM = ("NOPERM", "The user executing the script can't")
#: Where a script's error was raised, as Redis words it around the error's own text: Redis 6's
#: "Error running script (call to f_<sha>): @user_script:136: user_script:136: " before it,
#: Redis 7's " script: <sha>, on @user_script:136." after it. Left out of an ACL refusal's text,
#: which it would otherwise bury.
_SCRIPT_PLACE = re.compile(
    r"^Error running script \(call to \w+\): (?:@?\w+: ?\d+: )+|^(?:@?user_script: ?\d+: )+"
    r"| script: \w+, on @?\w+:\d+\.?$"
)


#: Refusals that waiting may end (and that write nothing), besides a read-only replica's (its
#: own class, ReadOnlyRefused): a failed background save, too few replicas
#: (min-replicas-to-write), a replica cut off from its master, a script running too long.
_WAIT_REFUSALS = ("MISCONF", "NOREPLICAS", "MASTERDOWN", "BUSY ")


def waits_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a refusal that waiting may end (see ``_WAIT_REFUSALS``)."""
    return isinstance(exc, RedisRefused) and any(m in str(exc) for m in _WAIT_REFUSALS)


#: A redis-py client as its ``str`` shows it (every setting of its connection, about 1,000
#: characters), as a Sentinel failure names each sentinel it asked.
_CLIENT_REPR = re.compile(
    r"<redis\.client\.Redis\(<redis\.connection\.\w+\(<redis\.connection\.\w+\((.*?)\)>\)>\)>"
)
_ADDRESS = re.compile(r"(?:^|,)host=([^,]*),port=(\d+)|(?:^|,)path=([^,]*)")


def unavailable_text(exc: BaseException) -> str:
    """``exc``'s text, each redis-py client it names shown by its address only: "No master found
    for 'mymaster' : <redis.client.Redis(...)> - ..." told 1,500 characters of settings."""

    def address(match: re.Match[str]) -> str:
        found = _ADDRESS.search(match[1])
        if found is None:
            return "<a Redis client>"
        return found[3] if found[3] is not None else f"{found[1]}:{found[2]}"

    # (redis-py ends a sentence with a full stop: "... Connection refused.", read inside ours)
    return _CLIENT_REPR.sub(address, str(exc)).removesuffix(".")


def coded_text(exc: redis.ResponseError) -> str:
    """``exc``'s text with the error code redis-py strips into its class put back, where a
    refusal that waiting may end is told by it."""
    return f"MASTERDOWN {exc}" if isinstance(exc, redis.exceptions.MasterDownError) else str(exc)


def write_waits_out(exc: redis.ResponseError) -> bool:
    """Whether ``exc`` is Redis refusing a write for now: a failover's ``NOREPLICAS``,
    ``MASTERDOWN`` or ``READONLY`` (a master demoted), a failing disk's ``MISCONF``, a script
    running past its time (``BUSY``). (In a pipeline, redis-py words it "Command # 1 (...) of
    pipeline caused error: NOREPLICAS ...", or "Transaction discarded because of: BUSY ...";
    Redis 6 words one inside a script "Error running script (call to f_...): @user_script:2:
    ... -NOREPLICAS ...", a read-only replica's "-READONLY ...".)"""
    text = _bare(coded_text(exc))
    return isinstance(exc, redis.exceptions.ReadOnlyError) or any(
        text.startswith(m) or f"caused error: {m}" in text or f"because of: {m}" in text
        for m in (*_WAIT_REFUSALS, "READONLY ")
    )


def over_maxmemory(exc: redis.ResponseError) -> bool:
    """Whether ``exc`` is Redis refusing a write at its ``maxmemory`` (redis-py strips the "OOM"
    into the class; Redis 6 wraps a script's refusal in a plain error that keeps it in the text)."""
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or "OOM command" in str(exc)


def _bare(text: str) -> str:
    """A refusal's text without where in a script it was raised, nor the "-" before its code
    that Redis 6 leaves there ("... @user_script: 329: -NOREPLICAS ...")."""
    return _SCRIPT_PLACE.sub("", text).removeprefix("-")


def refusal_text(text: str) -> str:
    """An ACL refusal's text without where in a script it was raised; one from inside a script,
    which names neither the command nor its key, says so and where to look."""
    text = _bare(text)
    if _SCRIPT_NOPERM[1] not in text:
        return text
    return (
        f"{text.rstrip('.')} (a command of one of kombu-delay's scripts: Redis does not say which, "
        f"nor on which key; the docs' Security page lists what each user needs)"
    )


@contextmanager
def translated_errors() -> Iterator[None]:
    """Turn redis-py's connection failures and refusals into kombu-delay errors."""
    try:
        yield
    except AUTH_ERRORS as exc:
        # Before the connection errors: redis-py's AuthenticationError is one of them, but
        # retrying with the same credentials cannot help.
        if isinstance(exc, RedisAuthError):
            raise
        raise RedisAuthError(f"Redis authentication failed: {exc}") from exc
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        if isinstance(exc, RedisUnavailable):
            raise
        raise RedisUnavailable(f"Redis is unavailable: {unavailable_text(exc)}") from exc
    except redis.ResponseError as exc:
        if isinstance(exc, RedisRefused | RedisPermissionError):
            raise
        text = coded_text(exc)
        if isinstance(exc, redis.exceptions.NoPermissionError) or any(m in text for m in _SCRIPT_NOPERM):
            raise RedisPermissionError(f"Redis's ACL refused this user: {refusal_text(text)}") from exc
        # redis-py strips the "READONLY" prefix into the class; Redis 6 wraps a script's refusal
        # in a plain error that keeps it in the text.
        if over_maxmemory(exc):
            raise OverMaxmemory(
                f"Redis refused the write: maxmemory is reached ({text}); nothing was written"
            ) from exc
        if isinstance(exc, redis.exceptions.ReadOnlyError) or "READONLY" in text:
            raise ReadOnlyRefused(f"Redis refused the write: {text}") from exc
        if any(m in text for m in _WAIT_REFUSALS):
            raise RedisRefused(f"Redis refused the write: {text}") from exc
        if is_wrong_type(exc):
            raise WrongTypeKey(text) from exc
        if "unknown command" in text:  # (the checks that can do without one have caught it)
            raise RedisRefused(
                f"Redis does not know a command kombu-delay needs (renamed or disabled by "
                f"rename-command?): {text}"
            ) from exc
        if isinstance(exc, redis.exceptions.NoScriptError):  # lost again at each of its tries
            raise RedisRefused(
                f"Redis lost kombu-delay's script as it was called, at each try (SCRIPT FLUSH in a "
                f"loop?): {text}; nothing was run"
            ) from exc
        if "invalid bulk length" in text:  # and Redis closed the connection
            raise RedisRefused(
                f"Redis refused an argument over its limit for one string (proto-max-bulk-len): {text}"
            ) from exc
        raise


def translated(exc: BaseException) -> BaseException:
    """The kombu-delay error :func:`translated_errors` makes of ``exc``: ``exc`` itself where it
    makes none (one of kombu-delay's own already, say)."""
    try:
        with translated_errors():
            raise exc
    except BaseException as made:  # (returned, whatever it is)
        return made
