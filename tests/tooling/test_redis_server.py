"""The suite's redis-server launcher: a server it starts is its own, on a port no one else holds."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kombu_delay.tooling.redis_server import QUIET_PORTS, RedisServer, free_port


def test_a_port_taken_before_the_first_start_is_replaced_never_shared(redis_server: RedisServer) -> None:
    server = RedisServer()
    server.port = redis_server.port  # as if another process took the free port it was handed
    with server:
        assert server.port != redis_server.port
        with server.client() as client:
            assert int(client.info("server")["process_id"]) == server.process.pid  # type: ignore[union-attr]
        port = server.port
        server.restart()
        assert server.port == port  # a restart keeps its port
        with server.client() as client:
            assert int(client.info("server")["process_id"]) == server.process.pid  # type: ignore[union-attr]


def test_a_given_port_another_server_holds_is_an_error(redis_server: RedisServer) -> None:
    server = RedisServer(port=redis_server.port)
    try:
        with pytest.raises(RuntimeError):
            server.start()
        assert server.process is not None and server.process.poll() is not None  # not left running
    finally:
        server.cleanup()
    with redis_server.client() as client:
        assert client.ping()  # the other server is untouched


def test_a_free_port_is_one_no_outgoing_connection_takes_meanwhile() -> None:
    # It was one the system picked, in its ephemeral range, which it hands to outgoing
    # connections too: a dashboard a test started found its port taken ("Address already in
    # use") by one of them, between the port's pick and the bind.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    port = free_port()
    assert port in QUIET_PORTS and port < low
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free indeed
