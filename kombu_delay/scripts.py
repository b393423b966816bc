"""Load the Lua scripts shipped in ``kombu_delay/lua`` (one script per file)."""

from __future__ import annotations

from functools import cache
from importlib import resources

import redis
from redis.commands.core import Script


@cache
def source(name: str) -> str:
    """Return the text of ``lua/<name>.lua``."""
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text("utf-8")


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
