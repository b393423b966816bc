"""A small Sentinel setup on loopback for tests: one master, one replica, three sentinels.

Every process is a ``redis-server`` of our own (``--replicaof`` for the replica,
``--sentinel`` with a generated config for the sentinels) on free ports, and is
stopped by its PID. Timings are short (``down-after-milliseconds`` 1000) so a
failover completes in seconds, and every wait is generous.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import TracebackType

import redis

from kombu_delay.tooling.redis_server import RedisServer

MASTER_NAME = "mymaster"


class SentinelServer(RedisServer):
    """``redis-server <conf> --sentinel`` monitoring one master."""

    def __init__(self, master_port: int, down_after_ms: int = 1000, failover_timeout_ms: int = 5000) -> None:
        super().__init__()
        self.conf = self.dir / "sentinel.conf"
        self._settings = (master_port, down_after_ms, failover_timeout_ms)
        self._conf_port: int | None = None

    def args(self) -> list[str]:
        # Written when the port is new only (start() may take another): a sentinel rewrites its
        # own file with what it learns, and a restart must keep that.
        if self._conf_port != self.port:
            self._write_conf()
            self._conf_port = self.port
        return [self.binary, str(self.conf), "--sentinel"]

    def _write_conf(self) -> None:
        master_port, down_after_ms, failover_timeout_ms = self._settings
        self.conf.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    "bind 127.0.0.1",
                    "daemonize no",
                    f'dir "{self.dir}"',
                    f'logfile "{self.dir / "redis.log"}"',
                    f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2",
                    f"sentinel down-after-milliseconds {MASTER_NAME} {down_after_ms}",
                    f"sentinel failover-timeout {MASTER_NAME} {failover_timeout_ms}",
                    f"sentinel parallel-syncs {MASTER_NAME} 1",
                    "",
                ]
            )
        )

    def master_port(self) -> int | None:
        with self.client(socket_timeout=5) as client:
            try:
                addr = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
            except redis.RedisError:
                return None
        return int(addr[1]) if addr else None

    def log(self) -> str:
        path = self.dir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""


class SentinelCluster:
    """Master, replica and three sentinels; ``url`` is the ``delaysentinel://`` broker URL."""

    def __init__(self, data_args: list[str] | None = None) -> None:
        #: Extra ``redis-server`` arguments for both data nodes (e.g. ``min-replicas-to-write``).
        self.data_args = list(data_args or [])
        self.master = RedisServer(extra_args=self.data_args)
        self.replica: RedisServer | None = None
        self.sentinels: list[SentinelServer] = []

    @property
    def data_nodes(self) -> list[RedisServer]:
        return [node for node in (self.master, self.replica) if node is not None]

    @property
    def url(self) -> str:
        return ";".join(f"delaysentinel://127.0.0.1:{s.port}/0" for s in self.sentinels)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", s.port) for s in self.sentinels]

    def start(self, timeout: float = 120.0) -> SentinelCluster:
        self.master.start()
        self.replica = RedisServer(
            extra_args=[*self.data_args, "--replicaof", "127.0.0.1", str(self.master.port)]
        ).start()
        self.sentinels = [SentinelServer(self.master.port).start() for _ in range(3)]
        self.wait_ready(self.master.port, timeout)
        return self

    def wait_ready(self, master_port: int, timeout: float = 120.0) -> None:
        """Wait until every sentinel names ``master_port``, knows a healthy replica and its peers."""
        deadline = time.monotonic() + timeout
        while not self._ready(master_port):
            if time.monotonic() > deadline:
                raise AssertionError("the sentinel setup did not settle:\n" + self.logs())
            time.sleep(0.2)

    def _ready(self, master_port: int) -> bool:
        for sentinel in self.sentinels:
            try:
                with sentinel.client(socket_timeout=5, decode_responses=True) as client:
                    master = client.execute_command("SENTINEL", "MASTER", MASTER_NAME)
                    replicas = client.execute_command("SENTINEL", "REPLICAS", MASTER_NAME)
                    peers = client.execute_command("SENTINEL", "SENTINELS", MASTER_NAME)
            except redis.RedisError:
                return False
            info = _pairs(master)
            if int(info.get("port", 0)) != master_port or "down" in info.get("flags", ""):
                return False
            healthy = [
                r
                for r in map(_pairs, replicas)
                if "down" not in r.get("flags", "") and r.get("master-link-status") == "ok"
            ]
            if not healthy or len(peers) < len(self.sentinels) - 1:
                return False
        return True

    def current_master(self) -> RedisServer:
        """The data node every sentinel currently names as master."""
        ports = {s.master_port() for s in self.sentinels}
        if len(ports) != 1:
            raise AssertionError(f"sentinels disagree on the master: {ports}")
        (port,) = ports
        for node in self.data_nodes:
            if node.port == port:
                return node
        raise AssertionError(f"unknown master port {port}")

    def logs(self) -> str:
        parts = []
        for node in [*self.data_nodes, *self.sentinels]:
            path = Path(node.dir) / "redis.log"
            text = path.read_text(errors="replace")[-3000:] if path.exists() else ""
            parts.append(f"--- {node.port}\n{text}")
        return "\n".join(parts)

    def cleanup(self) -> None:
        for node in [*self.sentinels, *self.data_nodes]:
            node.cleanup()

    def __enter__(self) -> SentinelCluster:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()


def _pairs(flat: list[str] | dict[str, str]) -> dict[str, str]:
    """SENTINEL replies are flat key/value lists (RESP2) or maps (RESP3)."""
    if isinstance(flat, dict):
        return {str(k): str(v) for k, v in flat.items()}
    return {str(flat[i]): str(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}
