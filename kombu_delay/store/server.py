"""What kind of Redis server the store is on: its eviction policy, its run id, what it keeps
on disk and how much memory it has left. Nothing here reads or writes a message."""

from __future__ import annotations

from typing import Any

import redis

from kombu_delay.errors import translated_errors
from kombu_delay.store import keys
from kombu_delay.store.base import StoreBase, as_text


class ServerFacts(StoreBase):
    """The server's facts that the mover's checks, ``health`` and staging read."""

    #: ``INFO replication`` was refused (by the ACL): :meth:`replica_of` asks no more.
    _replication_refused = False

    def memory_state(self) -> tuple[str | None, tuple[int, int] | None]:
        """Return the server's ``maxmemory-policy`` (``None`` when it cannot be read: ``INFO
        memory`` carries it and is allowed where ``CONFIG`` is not, for managed Redis and ACL
        users; a policy other than ``noeviction`` lets Redis delete scheduled messages) and,
        where Redis has a ``maxmemory``, what it uses and the limit, bytes (else ``None``): what
        it counts against the limit, its replication and AOF buffers left out, as Redis does
        before it refuses a write that may grow it, a publish among them. One ``INFO memory``."""
        with translated_errors():
            try:
                info: dict[str, Any] = self.client.info("memory")
            except redis.ResponseError:  # INFO refused by an ACL: nothing to judge by
                return None, None
        policy, limit = info.get("maxmemory_policy"), int(info.get("maxmemory", 0))
        used = int(info.get("used_memory", 0)) - int(info.get("mem_not_counted_for_evict", 0))
        return None if policy is None else as_text(policy), (used, limit) if limit > 0 else None

    def replica_of(self) -> str | None:
        """Where Redis here is a replica, what it says of it (``INFO replication``): of which
        master, and its link to it; ``None`` where it is a master, or cannot tell (``INFO``
        refused by an ACL). A mover refuses to move on a replica, whether or not it takes
        writes: what a replica takes stays apart from its master's data. Refused once, asked no
        more (a mover asks at each heartbeat: each refusal would fill the ACL log)."""
        if self._replication_refused:
            return None
        with translated_errors():
            try:
                info: dict[str, Any] = self.client.info("replication")
            except redis.ResponseError as exc:  # (BUSY too: asked again at the next)
                self._replication_refused = isinstance(exc, redis.exceptions.NoPermissionError)
                return None
        if as_text(info.get("role", "")) != "slave":
            return None
        master = f"{as_text(info.get('master_host', '?'))}:{info.get('master_port', '?')}"
        return f"Redis here is a replica (of {master}, link {as_text(info.get('master_link_status', '?'))})"

    def write_refusal(self) -> tuple[str | None, bool]:
        """What is wrong with where Redis's writes go, read without writing one (``INFO
        replication``), and whether no mover can move there: a replica (one that refuses every
        write, or, where its ``replica-read-only`` is off, one that takes them apart from its
        master's data, where movers refuse to move), or a master under ``min-replicas-to-write``
        fewer of whose replicas are in time than that asks for (Redis shows their count only
        under that setting; where ``CONFIG`` is refused, judged as if it asked for one);
        ``(None, False)`` where it takes writes, or cannot tell (``INFO`` refused by an ACL)."""
        replica = self.replica_of()
        if replica is not None:
            fix = "give kombu-delay the master's address (or Sentinel's: delaysentinel://)"
            taking = self._config("replica-read-only")
            if taking == "no":
                said = (
                    "it takes writes (replica-read-only no), but they stay apart from its master's "
                    "data: movers refuse to move here (a message moved here stays scheduled on the "
                    "master, and runs twice where anything takes from this replica, or once it is "
                    "promoted), and publishes made here are not its master's"
                )
            else:
                said = "it refuses every write, so movers move nothing, and publishes and workers fail"
                if taking is None:  # (CONFIG refused: the default, read-only, is the likely case)
                    said += " (unless its replica-read-only is off: then movers refuse to move here)"
            return f"{replica}: {said}; {fix}", True
        with translated_errors():
            try:
                info: dict[str, Any] = self.client.info("replication")
            except redis.ResponseError:
                return None, False
            if "min_slaves_good_slaves" not in info:
                return None, False
            good, wanted = int(info["min_slaves_good_slaves"]), self._config("min-replicas-to-write")
            asked = int(wanted) if wanted is not None and wanted.isdigit() else 1
            if good >= asked:
                return None, False
        in_time = "none of its replicas has" if good == 0 else f"only {good} of its replicas have"
        return (
            f"Redis refuses every write (NOREPLICAS): {in_time} acknowledged it within min-replicas-max-lag, "
            f"and its min-replicas-to-write asks for {asked} (a failover under way, a replica down), so "
            "movers move nothing, and publishes and workers fail, until enough have"
        ), True

    def _config(self, name: str) -> str | None:
        """The server's setting ``name`` (``CONFIG GET``); ``None`` where ``CONFIG`` is refused or
        renamed, or the setting unknown."""
        try:
            found: dict[Any, Any] = self.client.config_get(name)
        except redis.ResponseError:
            return None
        return next((as_text(value) for value in found.values()), None)

    def in_cluster(self) -> bool | None:
        """Whether the server is a node of a Redis Cluster (``INFO cluster``), ``None`` where it
        cannot say (``INFO`` refused by an ACL)."""
        with translated_errors():
            try:
                info: dict[str, Any] = self.client.info("cluster")
            except redis.ResponseError:
                return None
        return bool(info.get("cluster_enabled"))

    def run_id(self) -> tuple[str, int, bool, int | None] | None:
        """Return the server's run id (new at each start), its uptime, s, whether it has a second
        replication id (a replica promoted; on Redis 7 also a reloaded snapshot), and how many keys
        it loaded from disk as it started (``None`` before Redis 7, which does not say), or ``None``."""
        with translated_errors():
            try:
                info: dict[str, Any] = {
                    **self.client.info("server"),
                    **self.client.info("replication"),
                    **self.client.info("persistence"),
                }
            except redis.ResponseError:
                return None
        found, uptime = info.get("run_id"), info.get("uptime_in_seconds")
        promoted = info.get("master_replid2", 0) not in (0, "0")  # (its 40 zeros read as 0: none)
        loaded = info.get("rdb_last_load_keys_loaded")
        loaded = None if loaded is None else int(loaded)
        return None if found is None or uptime is None else (as_text(found), int(uptime), promoted, loaded)

    def persistence(self, read_rules: bool = True) -> tuple[bool | None, str | None]:
        """Return whether the AOF is on and the RDB save rules (``""``: none), each ``None`` when
        it cannot be read: what Redis keeps on disk, so what a Redis restart keeps.

        ``INFO persistence`` says whether the AOF is on. Only when it is off are the save rules
        read, with ``CONFIG GET save``, which managed Redis renames and ACL users are often
        refused (``CONFIG`` is ``@dangerous``): then they are ``None``, as they are without
        ``read_rules``. Both are ``None`` while Redis loads what it kept (``loading``): it turns
        its AOF off until it has read it, and reads ``aof_enabled:0`` meanwhile.
        """
        with translated_errors():
            try:
                info: dict[str, Any] = self.client.info("persistence")
            except redis.ResponseError:  # INFO refused by an ACL: nothing to judge by
                return None, None
            aof = info.get("aof_enabled")
            if aof is None or int(info.get("loading", 0)) or int(info.get("async_loading", 0)):
                return None, None
            if int(aof) or not read_rules:
                return bool(int(aof)), None
            try:
                rules: dict[Any, Any] = self.client.config_get("save")
            except redis.ResponseError:  # refused (NOPERM) or renamed away (unknown command)
                return False, None
        found = next((value for name, value in rules.items() if as_text(name) == "save"), None)
        return False, None if found is None else as_text(found)

    def memory_free(self, share: float) -> int | None:
        """Bytes Redis may still grow by before ``share`` of its ``maxmemory``; ``None`` when
        it has no ``maxmemory``, 0 when the ACL refuses ``INFO`` (it cannot be told)."""
        try:
            with translated_errors():
                info = self.client.info("memory")
        except redis.exceptions.NoPermissionError:
            return 0
        limit = int(info.get("maxmemory", 0))
        if not limit:
            return None
        return max(0, int(limit * share) - int(info.get("used_memory", 0)))

    def set_memory(self, start_ms: int, dest: str) -> int | None:
        """Bytes of bucket ``start_ms``'s sorted set for ``dest`` (``MEMORY USAGE``, sampled);
        ``None`` when it is gone or the ACL refuses the command."""
        try:
            with translated_errors():
                size = self.client.memory_usage(keys.queue_set(self.prefix, start_ms, dest), samples=5)
        except redis.exceptions.NoPermissionError:
            return None
        return None if size is None else int(size)
