"""Load the Lua scripts shipped in ``kombu_delay/store/lua`` (one script per file).

Redis runs each script as one chunk, so a helper has to travel inside each script's text. A
script names the helpers it uses, one line each, after its header::

    --- @include clock

which stands for ``lua/_clock.lua`` (a helper file may include others). Each helper goes in
once, where it is first named, its own includes before it, so every function is defined
before the code that calls it.

A script that needs a constant of :mod:`kombu_delay.store.keys` names it the same way::

    --- @const FORMAT MAX_DUE_MS

which stands for ``local FORMAT, MAX_DUE_MS = 1, 4398046511103``: one definition, in Python,
and no argument to pass in every call.

The scripts of :data:`FUNCTIONS` run once per message. On Redis 7 and later they also make up
one function library (:func:`library`), loaded on first use and run by ``FCALL``: the same
text, but a script's helpers (its includes and constants) are made once, when the library
loads, instead of anew (a closure each) on every call, a good part of what a call costs
Redis, and a helper may keep what it made for the next call (a memo, see :data:`MEMO`).
Where the server has no functions (Redis 6), lost them (``FUNCTION FLUSH``, a restart
without persistence), or the ACL refuses them, the script runs as it is, by ``EVALSHA``: same
arguments, same reply.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from importlib import resources
from typing import Any

import redis
from redis.commands.core import Script

from kombu_delay.store import keys

#: An include line: ``--- @include <helper>``.
INCLUDE = re.compile(r"^--- @include ([a-z_]+)[ \t]*$")
#: A constants line: ``--- @const <NAME> [<NAME>...]``, names of integers in :mod:`keys`.
CONST = re.compile(r"^--- @const((?: [A-Z][A-Z0-9_]*)+)[ \t]*$")
#: A helper's memo, ``local <name>_memo = false``: off in a script, whose helpers are made on
#: every call; a function's library turns it on (an empty table), as its helpers outlive a call.
MEMO = re.compile(r"^local ([a-z_]+_memo)\b.* = false\b", re.M)
#: The scripts that also run as functions (see the module's docstring): those called once per
#: message. The others run once per batch, where a call's own cost is shared.
FUNCTIONS = ("schedule",)

logger = logging.getLogger(__name__)


def _path(name: str) -> str:
    return f"lua/{name}.lua"


def _read_all() -> dict[str, str]:
    folder = resources.files(__package__).joinpath("lua")
    return {
        f.name.removesuffix(".lua"): f.read_text("utf-8") for f in folder.iterdir() if f.name.endswith(".lua")
    }


#: Every script's text, read once, when this module is imported: a process runs the Lua it
#: started with, never a newer file an upgrade in place wrote under it later (with arguments
#: its Python does not send: a mover that loaded its thaw then would fail every thaw).
_TEXTS = _read_all()


def _read(name: str) -> str:
    try:
        return _TEXTS[name]
    except KeyError:
        raise FileNotFoundError(f"no script {_path(name)}") from None


def _constants(names: list[str]) -> str:
    values = [getattr(keys, name) for name in names]
    if not all(type(value) is int for value in values):
        raise TypeError(f"not integers of kombu_delay.store.keys: {names}")
    return f"local {', '.join(names)} = {', '.join(str(v) for v in values)}\n"


def _lines(name: str, included: set[str]) -> Iterator[tuple[bool, list[str]]]:
    """The lines of ``lua/<name>.lua`` in order, each as ``(resolved, text)``: an include or a
    constants line resolved (True; an include already made in ``included`` gives nothing),
    any other line as it is (False)."""
    for line in _read(name).splitlines(keepends=True):
        if match := CONST.match(line):
            yield True, [_constants(match[1].split())]
        elif (match := INCLUDE.match(line)) is None:
            yield False, [line]
        elif (helper := f"_{match[1]}") not in included:
            included.add(helper)
            yield True, _expand(helper, included)


def _expand(name: str, included: set[str]) -> list[str]:
    return [text for _, part in _lines(name, included) for text in part]


@cache
def source(name: str) -> str:
    """Return the text Redis runs for ``lua/<name>.lua``: the script with its includes resolved."""
    return "".join(_expand(name, set()))


def _split(name: str) -> tuple[str, str]:
    """Return ``lua/<name>.lua`` in two parts: its helpers and constants (its include and const
    lines resolved), and its own text (the rest, in order)."""
    helpers: list[str] = []
    own: list[str] = []
    for resolved, part in _lines(name, set()):
        (helpers if resolved else own).extend(part)
    text = "".join(helpers)
    if re.search(r"\b(KEYS|ARGV)\[", text):
        raise ValueError(f"a helper of {name}.lua reads KEYS or ARGV: a function's helpers run at load")
    return text, "".join(own)


def function_name(library_name: str, name: str) -> str:
    """The name of script ``name``'s function in library ``library_name``."""
    return f"{library_name}_{name}"


@cache
def library() -> tuple[str, str]:
    """Return ``(name, text)`` of the function library of :data:`FUNCTIONS`. The name carries
    a hash of the text: each version has its own library, and publishers of different
    versions can share a server."""

    def blocks(library_name: str) -> str:
        # One block per script, so that each one's helpers are local to it.
        parts = []
        for name in FUNCTIONS:
            helpers, own = _split(name)
            helpers += "".join(f"{memo} = {{}}\n" for memo in MEMO.findall(helpers))
            register = (
                f"redis.register_function('{function_name(library_name, name)}', function(KEYS, ARGV)\n"
            )
            parts.append(f"do\n{helpers}{register}{own}end)\nend\n")
        return "".join(parts)

    digest = hashlib.sha1(blocks("").encode(), usedforsecurity=False).hexdigest()[:16]
    name = f"kombu_delay_{digest}"
    return name, f"#!lua name={name}\n{blocks(name)}"


def names() -> list[str]:
    """Return the names of the scripts shipped (helpers, whose names start with ``_``, left out)."""
    found = resources.files(__package__).joinpath("lua").iterdir()
    return sorted(f.name[:-4] for f in found if f.name.endswith(".lua") and not f.name.startswith("_"))


#: Seconds a client runs its scripts by ``EVALSHA`` before it tries the library again, where
#: loading it was refused for a while (a full, loading or replica server, too few replicas, a
#: failed save) or a library of its name lacks its function: each try sends the whole library
#: (tens of KB), which a try at every publish would send with every message.
LOAD_RETRY_S = 60.0


class Library:
    """The function library (:func:`library`) on one client: loaded on first use, loaded
    again when the server has lost it, given up for this client where the server has no
    functions or the ACL refuses them, and for :data:`LOAD_RETRY_S` where a load is refused
    for a while."""

    def __init__(self, client: redis.Redis, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.name = library()[0]
        self.monotonic = monotonic
        #: None: not loaded by this client yet (or lost since); False, until _retry_at if set.
        self._usable: bool | None = None
        self._retry_at: float | None = None
        #: Whether the load found a library of its name there already (another client's, or
        #: one that is not this library at all, loaded under its name by hand).
        self._found = False
        #: Whether its function was then not found: the next load tells a library deleted
        #: since (it loads) from one there again, whose next call tells (``confirming``).
        self._suspect = False
        #: Set by a load that found a library of its name there again after its function was
        #: not found, until an ``FCALL`` runs: another such answer tells a library under its
        #: name that lacks it (another client may have loaded this one again meanwhile, which
        #: its ``FCALL`` runs, or it was flushed again meanwhile). Cleared by each call that runs.
        self.confirming = False
        #: Times in a row a library of its name was found so: told at the second, a
        #: LOAD_RETRY_S apart (a flush loop can make the first).
        self._strikes = 0
        #: The state changes are made under it: publishing threads share a client.
        self._lock = threading.Lock()

    def ready(self) -> bool:
        """Whether to run a function now: loads the library first when it is not known to be
        there ("already exists" is a success: its name is its text's hash)."""
        usable, retry_at = self._usable, self._retry_at
        if usable is not None and retry_at is None:  # loaded, or given up for good
            return usable
        with self._lock:
            return self._ready()

    def ran(self) -> None:
        """Told by each ``FCALL`` that ran."""
        if self.confirming or self._strikes:
            self.confirming, self._strikes = False, 0

    def _ready(self) -> bool:
        if self._retry_at is not None and self.monotonic() >= self._retry_at:
            self._usable, self._retry_at = None, None
        if self._usable is None:
            try:
                self.client.function_load(library()[1])
                self._usable, self._found, self._suspect, self.confirming = True, False, False, False
            except redis.exceptions.BusyLoadingError:  # (one of redis-py's connection errors)
                self._for_now("Redis is loading its data")
            except redis.ResponseError as error:
                text = str(error)
                if "already exists" in text:
                    self._usable, self._found = True, True
                    self.confirming, self._suspect = self._suspect, False
                elif "unknown command" in text or isinstance(error, redis.exceptions.NoPermissionError):
                    logger.debug(
                        "scripts run by EVALSHA here: FUNCTION LOAD failed: %s", _first_clause(error)
                    )
                    self._usable = False
                else:  # for now (a full, loading or replica server, a refused write): the script runs
                    self._for_now(f"FUNCTION LOAD failed: {_first_clause(error)}")
        return bool(self._usable)

    def _foreign(self) -> None:
        """A library of its name is there, and lacked its function after a load again: tried
        again after LOAD_RETRY_S, and told (once per process) where that was so twice in a row."""
        self.confirming, self._strikes = False, self._strikes + 1
        if self._strikes >= 2 and self.name not in _told_foreign:
            _told_foreign.add(self.name)
            logger.warning(
                "kombu-delay: the function library %s was found twice, %.0f s apart, without its "
                "function (another library under its name, or one flushed or deleted again and "
                "again): publishes run their script by EVALSHA, and load the library again every "
                "%.0f s; where FUNCTION LIST LIBRARYNAME %s shows no function %s, delete it",
                *(self.name, LOAD_RETRY_S, LOAD_RETRY_S, self.name, function_name(self.name, FUNCTIONS[0])),
            )
        self._for_now("its library lacks the function")

    def _for_now(self, why: str) -> None:
        logger.debug("scripts run by EVALSHA here for %.0f s: %s", LOAD_RETRY_S, why)
        self._usable, self._retry_at = False, self.monotonic() + LOAD_RETRY_S

    def lost(self, error: redis.ResponseError) -> bool:
        """Whether ``error``, from ``FCALL``, means that the function did not run because it
        is not there to run (the script is run instead): lost by the server (loaded again on
        the next call, which tells a library of its name that lacks it: see ``confirming``), or
        not available to this client (never asked for again)."""
        text = str(error)
        if "Function not found" in text:
            with self._lock:
                if self.confirming:
                    self._foreign()
                else:
                    self._usable, self._suspect = None, self._found
            return True
        if "unknown command" in text or (
            isinstance(error, redis.exceptions.NoPermissionError) and "'fcall'" in text
        ):
            logger.debug("scripts run by EVALSHA here: %s", _first_clause(error))
            with self._lock:
                self._usable, self._retry_at = False, None
            return True
        return False


#: The libraries found lacking their function, told once per process.
_told_foreign: set[str] = set()


def _first_clause(error: Exception) -> str:
    """An error's text up to its first comma (Redis quotes a refused command's arguments,
    here a whole library, after it)."""
    return str(error).split(",", 1)[0]


#: Tries of a script call that Redis answers NOSCRIPT. redis-py's :class:`Script` loads the
#: script again after one, once; a ``SCRIPT FLUSH`` between that load and its ``EVALSHA`` (an
#: operator's, in a loop) raised it, and the publish or the move failed. A NOSCRIPT call ran
#: nothing, so it is safe to make again.
NOSCRIPT_TRIES = 3


class Reloading:
    """A redis-py :class:`Script`, called again where Redis lost it meanwhile (see
    :data:`NOSCRIPT_TRIES`). In a pipeline the call is queued, and the pipeline loads it."""

    def __init__(self, script: Script) -> None:
        self._script = script

    def __call__(
        self, keys: Sequence[Any] | None = None, args: Sequence[Any] | None = None, client: Any = None
    ) -> Any:
        for _ in range(NOSCRIPT_TRIES - 1):
            try:
                return self._script(keys, args, client)
            except redis.exceptions.NoScriptError:
                logger.debug("a script was flushed from Redis as it was called; calling it again")
        return self._script(keys, args, client)


class Function:
    """A script of :data:`FUNCTIONS`, called as redis-py's :class:`Script` is: by ``FCALL`` when
    the library is there, else (and in a pipeline) as the script, by ``EVALSHA``."""

    def __init__(self, library: Library, name: str, script: Reloading) -> None:
        self._library = library
        self._function = function_name(library.name, name)
        self._script = script

    def __call__(
        self, keys: Sequence[Any] | None = None, args: Sequence[Any] | None = None, client: Any = None
    ) -> Any:
        keys, args = keys or [], args or []
        if client is None and self._library.ready():
            try:
                ran = self._library.client.fcall(self._function, len(keys), *keys, *args)
                self._library.ran()
                return ran
            except redis.ResponseError as error:
                if not self._library.lost(error):
                    raise
        return self._script(keys, args, client)


class Scripts:
    """The scripts registered on one client. redis-py's :class:`Script` reloads a
    script after NOSCRIPT (a restart or failover), so SHAs are never cached here."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._loaded: dict[str, Reloading | Function] = {}
        self._library: Library | None = None

    def __getitem__(self, name: str) -> Reloading | Function:
        script = self._loaded.get(name)
        if script is None:
            script = Reloading(self._client.register_script(source(name)))
            if name in FUNCTIONS:
                if self._library is None:
                    self._library = Library(self._client)
                script = Function(self._library, name, script)
            self._loaded[name] = script
        return script
