"""Load the Lua scripts shipped in ``kombu_delay/store/lua`` (one script per file)."""

from __future__ import annotations

from functools import cache
from importlib import resources

import redis
from redis.commands.core import Script

#: Helpers put in front of every script (``lua/_common.lua``): Redis runs each script as
#: one chunk, so a shared Lua function has to travel inside each script's text.
COMMON = "_common"


@cache
def _read(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text("utf-8")


def source(name: str) -> str:
    """Return the text Redis runs for ``lua/<name>.lua``: the common helpers, then the script."""
    return _read(COMMON) + _read(name)


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
