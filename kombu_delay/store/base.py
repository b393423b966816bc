"""What every part of the store shares: the client, the key prefix, the scripts and the clock."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import redis
from redis.exceptions import NoPermissionError

from kombu_delay.errors import ConfigError, StorageFormatError, WrongTypeKey, translated_errors
from kombu_delay.message import is_text
from kombu_delay.store import keys, spaces
from kombu_delay.store.clock import GiveUp, RedisClock
from kombu_delay.store.misshapen import BUCKET_KEY_TOLD, HINTS
from kombu_delay.store.scripts import Scripts

#: Redis's default limit for one string argument (``proto-max-bulk-len``), bytes.
MAX_PAYLOAD_BYTES = 512 * 2**20
#: The lowest ``proto-max-bulk-len`` Redis accepts, bytes: a string no longer than this is
#: taken by any server, so no limit is read for it.
MIN_BULK_BYTES = 2**20
#: Seconds a limit read from the server is kept (``CONFIG SET`` may change it).
BULK_LIMIT_TTL_S = 60.0


class StoreBase:
    """kombu-delay's data in one Redis database, under one ``global_keyprefix``."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str = "",
        sep: str = keys.KOMBU_PRIORITY_SEP,
        clock: Callable[[], int] | None = None,
        steps: Iterable[int] = keys.KOMBU_PRIORITY_STEPS,
    ) -> None:
        self.client = client
        #: Where "now" comes from, epoch ms: ``None`` (production) means the Redis clock, read
        #: inside each script. Tests pass a clock of their own to drive time instead of
        #: waiting for it; it must never run behind Redis's clock by more than ``delay_grace``,
        #: or the expiries it sets delete what they should keep. A method's ``now_ms`` argument
        #: overrides it for one call.
        self.clock = clock
        #: Redis's clock as estimated here, for a publish due well ahead (see
        #: :mod:`kombu_delay.store.clock`); unused with a clock of the store's own.
        self.redis_clock = RedisClock(client)
        #: How late a move call may run, by Redis's clock: its deadline.
        self.give_up = GiveUp(client)
        if not is_text(prefix):  # a lone surrogate (bytes a shell read that are not UTF-8)
            raise ConfigError(f"the key prefix {prefix!r} is not UTF-8 text: no Redis key is named by it")
        self.prefix = prefix
        #: kombu's ``sep`` transport option, between a queue name and its priority step.
        self.sep = sep
        #: kombu's ``priority_steps`` transport option: which ``<queue><sep><n>`` are ``queue``'s.
        self.steps = tuple(int(step) for step in steps)
        self.ns = keys.ns(prefix)
        #: The number of the client's database, which a wake-up names (:func:`keys.wakes`).
        self.db = _db_of(client)
        self._scripts = Scripts(client)
        #: The destinations this client's ACL was found to allow a delayed publish to (Redis 7:
        #: see :meth:`~kombu_delay.store.publish.Publishing.schedule`).
        self._publish_allowed: set[tuple[str, bool]] = set()
        #: The ordinary space's index: the scripts that take one index take this one (a script
        #: that works on either space is told which, see :mod:`kombu_delay.store.spaces`).
        self._index = spaces.ORDINARY.index(prefix)
        self._gc = keys.drained(prefix)
        self._purging_key = keys.purging(prefix)
        self._ids = keys.ids(prefix)
        self._counts = keys.counts(prefix)
        self._totals = keys.totals(prefix)
        #: True once this store saw the data in its own storage format (see :meth:`check_format`).
        self._format_checked = False
        #: True once a heartbeat tried the commands a mover needs (Redis 6: ``_mover_acl.lua``).
        self._acl_probed = False
        #: The server's ``proto-max-bulk-len`` as last read (0: it does not say, asked no more;
        #: None: it could not say then), and when (monotonic seconds).
        self._bulk_limit: tuple[int | None, float] | None = None
        #: Where the server does not say: the longest string found to fit, the shortest found
        #: over (0: none), and when.
        self._bulk_probed: tuple[int, int, float] = (0, 0, 0.0)

    def _now(self, now_ms: int | None = None) -> str:
        """The ``now_ms`` argument of a script: ``now_ms`` when given, else this store's
        clock, else '' (the Redis clock, read inside the script: the production path)."""
        if now_ms is not None:
            return str(int(now_ms))
        return "" if self.clock is None else str(int(self.clock()))

    def check_format(self) -> None:
        """Raise :class:`StorageFormatError` when the data under this prefix is in a storage
        format this version cannot read (one HGET). Data with no format recorded yet is taken
        for this version's: the first publish or heartbeat records it."""
        with self.types_named({}):  # Redis's WRONGTYPE names no key
            found = self.client.hget(self._totals, keys.FORMAT_FIELD)
        format_must_be(None if found is None else as_text(found), self.prefix)
        self._format_checked = True

    def _check_format_once(self) -> None:
        """:meth:`check_format`, on the first call of an inspection entry point only."""
        if not self._format_checked:
            self.check_format()

    def queue_of(self, dest: str) -> str:
        """Return the queue name of a destination list key."""
        return keys.queue_of(dest, self.prefix, self.sep, self.steps)

    def misshapen(self, also: dict[str, str] | None = None) -> dict[str, str]:
        """Each key this namespace shares (its indexes, id index, counts, totals, clean-up set, purge
        marks, heartbeats, alerts and dead letters) that holds a value of another type, written by
        hand, with a sentence that names it: every script that writes it fails on it. Also its
        hints (:data:`HINTS`), which the scripts do without on such a key, with what is then lost,
        and the keys ``also`` names, with their types (a bucket's). One pipelined ``TYPE`` each."""
        expected = {
            **(also or {}),
            spaces.ORDINARY.index(self.prefix): "zset",
            spaces.COLD.index(self.prefix): "zset",
            self._gc: "zset",
            self._purging_key: "hash",
            keys.movers(self.prefix): "zset",
            keys.alerts(self.prefix): "hash",
            keys.stranded(self.prefix): "hash",
            self._ids: "hash",
            self._counts: "hash",
            self._totals: "hash",
            keys.dead(self.prefix): "list",
        }
        hints = {name(self.prefix): (want, lost) for name, (want, lost) in HINTS.items()}
        with translated_errors():
            pipe = self.client.pipeline(transaction=False)
            for key in (*expected, *hints):
                pipe.type(key)
            found = [as_text(kind) for kind in pipe.execute()]
        told = {}
        fails = "the scripts that write it fail on it"
        for key, kind in zip((*expected, *hints), found, strict=True):
            want, effect = hints[key] if key in hints else (expected[key], fails)
            if kind not in ("none", want):
                told[key] = f"{key!r} holds a {kind}, not a {want} (written by hand?): " + (
                    f"{effect}; rename it out of the way (RENAME) and kombu-delay makes it anew"
                    if key not in (also or {})
                    else BUCKET_KEY_TOLD[
                        "cold" if want == "hash" and key.startswith(self.ns + keys.COLD) else want
                    ]
                )
        return told

    def misshapen_told(self, also: dict[str, str] | None = None) -> str:
        """``; <sentence>`` for each :meth:`misshapen` key (and of ``also``), to follow an error
        that names none (Redis's ``WRONGTYPE`` from a script); ``""`` where there is none, or
        where they cannot be read (the error at hand is then the one to tell)."""
        with suppress(Exception):
            return "".join(f"; {text}" for text in self.misshapen(also).values())
        return ""

    @contextmanager
    def types_named(self, also: dict[str, str]) -> Iterator[None]:
        """Run the block's reads; raise Redis's ``WRONGTYPE`` from them (which names no key) with
        the keys of ``also`` (key: the type it should be; a bucket's) and the shared keys of
        another type named (:meth:`misshapen_told`)."""
        try:
            with translated_errors():
                yield
        except WrongTypeKey as exc:
            raise WrongTypeKey(f"{exc}{self.misshapen_told(also)}") from exc

    def keys_named(self, exc: WrongTypeKey) -> WrongTypeKey:
        """``exc`` (Redis's ``WRONGTYPE``, from a script or a pipeline: it names no key) with
        the shared keys of another type named (:meth:`misshapen_told`), where it names none."""
        named = self.misshapen_told()
        if not named or named in str(exc):  # (named already: the format check's)
            return exc
        return WrongTypeKey(f"{exc}{named}")

    def over_bulk_limit(self, size: int) -> str | None:
        """Redis's limit for one string argument (``proto-max-bulk-len``), as text, when ``size``
        bytes are over it, else ``None``. Redis drops the connection on a longer argument, which
        a client takes for an outage and sends again. Asked only for a size over the lowest limit
        Redis accepts: read (``CONFIG GET``) at most once a minute; where the server does not
        say (``CONFIG`` renamed, or refused by the ACL: asked once), a request that declares an
        argument of that many bytes, without sending them, tells (:meth:`_bulk_fits`), and what
        it told is kept for a minute."""
        if size <= MIN_BULK_BYTES:
            return None
        now = time.monotonic()
        if self._bulk_limit is None or (
            self._bulk_limit[0] != 0 and now - self._bulk_limit[1] > BULK_LIMIT_TTL_S
        ):
            self._bulk_limit = (self._read_bulk_limit(), now)
        limit = self._bulk_limit[0]
        if limit:
            return f"{limit:,} bytes" if size > limit else None
        return None if self._bulk_fits(size, now) else f"{size:,} bytes refused"

    @contextmanager
    def sending(self, size: int) -> Iterator[None]:
        """Around a call that sends an argument of ``size`` bytes: where its connection breaks,
        what is known of Redis's limit for one string is forgotten if ``size`` is over the
        lowest limit, so the next :meth:`over_bulk_limit` asks again. Redis drops the
        connection on an argument over its limit, and one lowered since it was read (``CONFIG
        SET``) made every such call an outage for the minute it was kept: a publish raised
        :class:`~kombu_delay.errors.RedisUnavailable`, which kombu retries, and a thaw held every
        queue's moves back."""
        try:
            yield
        except (redis.ConnectionError, redis.ResponseError) as exc:
            # Redis answers "Protocol error: invalid bulk length" and closes, or the send breaks
            # first, as the bytes arrive.
            broken = isinstance(exc, redis.ConnectionError) or "invalid bulk length" in str(exc)
            if broken and size > MIN_BULK_BYTES:
                self._bulk_limit, self._bulk_probed = None, (0, 0, 0.0)
            raise

    def _read_bulk_limit(self) -> int | None:
        """The server's ``proto-max-bulk-len``; 0 where it does not say (``CONFIG`` refused by
        the ACL, renamed away), ``None`` where it could not say now (``BUSY``, say)."""
        with translated_errors():
            try:
                found: list[Any] = list(self.client.config_get("proto-max-bulk-len").values())
            except redis.ResponseError as exc:
                refused = isinstance(exc, NoPermissionError) or "unknown command" in str(exc).lower()
                return 0 if refused else None
        with suppress(ValueError, IndexError):
            return int(found[0])
        return 0

    def _bulk_fits(self, size: int, now: float) -> bool:
        """Whether Redis takes a string of ``size`` bytes, asked without sending one: a request
        that declares an argument of that length, which Redis refuses as soon as it reads it
        when it is over its limit ("invalid bulk length"), and otherwise waits for. Only that
        refusal says no; where no answer is sure (a broken connection, three times), yes, as
        Redis's default would, not kept: nothing is refused or dead-lettered for a fault of the
        connection."""
        fits_up_to, over_from, at = self._bulk_probed
        if now - at > BULK_LIMIT_TTL_S:
            fits_up_to, over_from = 0, 0
        if size <= fits_up_to or (over_from and size >= over_from):
            return size <= fits_up_to
        for _ in range(3):
            refused = self._refuses_length(size)
            if refused is not None:
                break
        if refused:
            over_from = min(over_from or size, size)
        elif refused is False:
            fits_up_to = max(fits_up_to, size)
        self._bulk_probed = (fits_up_to, over_from, now)
        return not refused

    def _refuses_length(self, size: int) -> bool | None:
        """Whether Redis refuses a request that declares an argument of ``size`` bytes, sent on
        a connection of its own, closed after (it waits for bytes it never gets); ``None`` where
        the answer is unsure. Two ``PING``s on another connection, sent after it, are answered
        only once Redis has read it (its event loop reads every ready connection before it
        waits again), and so after any refusal; a little more is waited for that to arrive."""
        pool = self.client.connection_pool
        conn: Any  # (redis-py leaves its connections' methods untyped)
        try:
            conn = pool.get_connection()
        except TypeError:  # redis-py before 5.3 names the command
            conn = pool.get_connection("PING")
        try:
            began = time.monotonic()
            conn.send_command("PING")
            conn.read_response()
            wait = min(2.0, max(0.05, 10 * (time.monotonic() - began)))
            conn.send_packed_command([b"*2\r\n$4\r\nPING\r\n$%d\r\n" % size])
            self.client.ping()
            self.client.ping()
            if not conn.can_read(timeout=wait):
                return False
            conn.read_response()
        except redis.ResponseError as exc:
            return True if "invalid bulk length" in str(exc) else None
        except redis.ConnectionError:
            return None
        finally:
            conn.disconnect()
            pool.release(conn)
        return None

    def scan_keys(
        self, match: str, page: int, stopping: Callable[[], bool] | None = None, type_: str | None = None
    ) -> Iterator[bytes | str]:
        """The keys ``SCAN`` finds for ``match`` (and of ``type_``), ``page`` keys per call;
        ends early once ``stopping()`` is true, checked between calls: a full ``SCAN`` of
        millions of keys takes seconds, and must not hold a mover's stop for them."""
        cursor = 0
        while True:
            cursor, found = self.client.scan(cursor, match=match, count=page, _type=type_)
            yield from found
            if cursor == 0 or (stopping is not None and stopping()):
                return

    def close_idle(self) -> None:
        """Close the connections the pool holds idle, after a call that could not connect.
        redis-py hands out the connection its pool got back last, and one whose connect Redis
        refused goes back on top: at Redis's ``maxclients``, every call took that one again
        and was refused, while an idle one below it, still connected, held the last place."""
        self.client.connection_pool.disconnect(inuse_connections=False)

    def address(self) -> str:
        """Where this store's calls go, as ``host:port`` (a socket's path): through Sentinel,
        the master it found last (no round trip; ``?`` before it found one)."""
        pool = self.client.connection_pool
        kwargs, proxy = pool.connection_kwargs, getattr(pool, "proxy", None)  # (a Sentinel pool's)
        if proxy is not None:
            found = getattr(proxy, "master_address", None)
            return "?" if not found else f"{found[0]}:{found[1]}"
        return (
            str(kwargs["path"])
            if "path" in kwargs
            else f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
        )

    def find_master_again(self) -> None:
        """Through Sentinel, ask it for the master: where it has changed, the idle connections
        close, and the next call goes to the new one (redis-py asks only as it connects)."""
        proxy = getattr(self.client.connection_pool, "proxy", None)
        if proxy is not None:
            with translated_errors():
                proxy.get_master_address()

    def time_ms(self, reader: Any = None) -> int:
        """Return the Redis clock in epoch ms (this store's own clock, when it has one), read
        through ``reader`` (a connection in hand, a pipeline watching keys) when given."""
        if self.clock is not None:
            return int(self.clock())
        with translated_errors():
            sec, usec = (reader or self.client).time()
        return int(sec) * 1000 + int(usec) // 1000


def format_must_be(found: str | None, prefix: str) -> None:
    """Raise :class:`StorageFormatError` unless ``found`` (the recorded storage format, ``None``
    when none is) is this version's."""
    if found is not None and found != str(keys.FORMAT):
        raise StorageFormatError(
            f"the kombu-delay data under key prefix {prefix!r} is in storage format {found!r}; "
            f"this version reads and writes format {keys.FORMAT} only (field {keys.FORMAT_FIELD!r} "
            f"of {keys.totals(prefix)!r})"
        )


def as_text(value: bytes | str) -> str:
    """A Redis reply as text."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def whole(value: bytes | str | None) -> int:
    """A count kept in a hash as a whole number; 0 where it is none (missing, or set by hand
    to text that is no whole number)."""
    if value is None:
        return 0
    try:
        return int(value)
    except ValueError:
        return 0


def _db_of(client: redis.Redis) -> int:
    """The number of ``client``'s database (0 where its pool does not say)."""
    kwargs = getattr(client.connection_pool, "connection_kwargs", None) or {}
    try:
        return int(kwargs.get("db") or 0)
    except (TypeError, ValueError):
        return 0


class OwnConnection:
    """What a wake-up subscription draws its connection from: the store's pool, except that
    the connection is a new one, never one the pool keeps, and is closed, not handed back,
    when the subscription ends.

    From the pool itself, a new subscription would take the idle connection of the mover's
    calls, which then need another. At Redis's ``maxclients`` that one is refused, and no
    round could move anything, for the sake of a subscription that only saves polling."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        # What the pool's own make_connection builds, without counting it among the pool's,
        # connected as the pool connects one: a Sentinel-managed connection finds its master
        # only in its own connect(), which a pub/sub's first command would not call.
        connection = self._pool.connection_class(**self._pool.connection_kwargs)
        try:
            connection.connect()
        except BaseException:
            connection.disconnect()
            raise
        return connection

    def release(self, connection: Any) -> None:
        connection.disconnect()
