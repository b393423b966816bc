"""A loopback TCP proxy in front of a test's own redis-server that can lose one exchange:
the request (it never reaches Redis) or the reply (Redis ran the command, the client never
hears of it, as when Redis dies between the two). Either way the client's connection is closed.
Or it refuses one request itself, as a read-only replica would, and the connection goes on.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Literal

Lose = Literal["request", "reply", "refuse"]
#: The reply a refused request gets (``arm(marker, "refuse")``): nothing reaches Redis.
REFUSAL = b"-READONLY You can't write against a read only replica.\r\n"


class LossyProxy:
    """Forwards every connection to ``127.0.0.1:<target>``, until :meth:`arm` names a marker:
    then the first request whose bytes carry it loses what ``lose`` says (once), and
    :attr:`lost` is set. ``on_lost`` runs once a reply is lost, before the client's connection
    is closed: what it does comes before the client can try again."""

    def __init__(self, target: int, on_lost: Callable[[], None] | None = None) -> None:
        self.target = target
        self.on_lost = on_lost
        self.lost = threading.Event()
        self._lock = threading.Lock()
        self._armed: tuple[bytes, Lose] | None = None
        self._skip = 0
        self._arms = 0  # how many times armed: bytes seen before the latest arming don't count
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, marker: bytes, lose: Lose, skip: int = 0) -> None:
        """Lose (or refuse) the exchange of the first request that carries ``marker``, after
        ``skip`` such requests passed."""
        with self._lock:
            self._armed = (marker, lose)
            self._skip = skip
            self._arms += 1

    def _take(self, seen: bytes, arms: int) -> Lose | None:
        with self._lock:
            if self._armed is None or arms != self._arms or self._armed[0] not in seen:
                return None
            if self._skip:
                self._skip -= 1
                return None
            lose = self._armed[1]
            self._armed = None
            return lose

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self._sockets += [client, server]
            losing = threading.Event()  # set: the reply now on its way is not forwarded
            threading.Thread(target=self._requests, args=(client, server, losing), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client, losing), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket, losing: threading.Event) -> None:
        seen, arms = b"", 0
        while data := _recv(client):
            if arms != self._arms:  # only what was sent since the latest arming
                seen, arms = b"", self._arms
            seen = seen[-4096:] + data  # a marker cut in two by the network is still found
            lose = self._take(seen, arms)
            if lose == "refuse":  # (a request whose bytes came in one read: a test's are small)
                self.lost.set()
                try:
                    client.sendall(REFUSAL)
                except OSError:
                    break
                continue
            if lose == "request":
                self.lost.set()
                break
            if lose == "reply":
                losing.set()
            try:
                server.sendall(data)
            except OSError:
                break
        _close(client, server)

    def _replies(self, server: socket.socket, client: socket.socket, losing: threading.Event) -> None:
        while data := _recv(server):
            if losing.is_set():
                if self.on_lost is not None:
                    self.on_lost()
                self.lost.set()
                break
            try:
                client.sendall(data)
            except OSError:
                break
        _close(client, server)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            _close(*self._sockets)

    def __enter__(self) -> LossyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
