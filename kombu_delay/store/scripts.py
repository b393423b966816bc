"""Load the Lua scripts shipped in ``kombu_delay/store/lua`` (one script per file).

Redis runs each script as one chunk, so a helper has to travel inside each script's text. A
script names the helpers it uses, one line each, after its header::

    --- @include clock

which stands for ``lua/_clock.lua`` (a helper file may include others). Each helper goes in
once, where it is first named, its own includes before it, so every function is defined
before the code that calls it.

A script that needs a constant of :mod:`kombu_delay.store.keys` names it the same way::

    --- @const FORMAT MAX_DUE_MS

which stands for ``local FORMAT, MAX_DUE_MS = 1, 4398046511104``: one definition, in Python,
and no argument to pass in every call.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

import redis
from redis.commands.core import Script

from kombu_delay.store import keys

#: An include line: ``--- @include <helper>``.
INCLUDE = re.compile(r"^--- @include ([a-z_]+)[ \t]*$")
#: A constants line: ``--- @const <NAME> [<NAME>...]``, names of integers in :mod:`keys`.
CONST = re.compile(r"^--- @const((?: [A-Z][A-Z0-9_]*)+)[ \t]*$")


def _path(name: str) -> str:
    return f"lua/{name}.lua"


@cache
def _read(name: str) -> str:
    return resources.files(__package__).joinpath(_path(name)).read_text("utf-8")


def _constants(names: list[str]) -> str:
    values = [getattr(keys, name) for name in names]
    if not all(type(value) is int for value in values):
        raise TypeError(f"not integers of kombu_delay.store.keys: {names}")
    return f"local {', '.join(names)} = {', '.join(str(v) for v in values)}\n"


def _expand(name: str, included: set[str]) -> list[str]:
    lines: list[str] = []
    for line in _read(name).splitlines(keepends=True):
        if match := CONST.match(line):
            lines.append(_constants(match[1].split()))
        elif (match := INCLUDE.match(line)) is None:
            lines.append(line)
        elif (helper := f"_{match[1]}") not in included:
            included.add(helper)
            lines += _expand(helper, included)
    return lines


@cache
def source(name: str) -> str:
    """Return the text Redis runs for ``lua/<name>.lua``: the script with its includes resolved."""
    return "".join(_expand(name, set()))


def names() -> list[str]:
    """Return the names of the scripts shipped (helpers, whose names start with ``_``, left out)."""
    found = resources.files(__package__).joinpath("lua").iterdir()
    return sorted(f.name[:-4] for f in found if f.name.endswith(".lua") and not f.name.startswith("_"))


class Scripts:
    """The scripts registered on one client. redis-py's :class:`Script` reloads a
    script after NOSCRIPT (a restart or failover), so SHAs are never cached here."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._loaded: dict[str, Script] = {}

    def __getitem__(self, name: str) -> Script:
        script = self._loaded.get(name)
        if script is None:
            script = self._loaded[name] = self._client.register_script(source(name))
        return script
