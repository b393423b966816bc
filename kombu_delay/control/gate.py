"""How calls of one :class:`~kombu_delay.DelayControl` share its connection: no more run at once
than its pool holds, which refuses one more ("Too many connections") rather than wait, and its
store is opened once, for every thread (:class:`Once`)."""

from __future__ import annotations

import copy
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import redis

from kombu_delay.errors import WrongTypeKey

#: kombu's pool size where the transport options give no ``max_connections``.
KOMBU_POOL = 10

Call = TypeVar("Call", bound=Callable[..., Any])
T = TypeVar("T")


def pool_size(transport_options: dict[str, Any]) -> int:
    """The connections kombu's pool holds under these transport options. One that is no number
    is kombu's default here: the connection refuses it, naming it, when it is made."""
    try:
        return max(1, int(transport_options.get("max_connections") or KOMBU_POOL))
    except (TypeError, ValueError):
        return KOMBU_POOL


#: The gate of each connection: the controls made on one kombu Connection share its pool.
_GATES: weakref.WeakKeyDictionary[Any, Gate] = weakref.WeakKeyDictionary()
_GATES_LOCK = threading.Lock()


def gate_of(conn: Any) -> Gate:
    """The :class:`Gate` of kombu Connection ``conn``, shared by every control made on it."""
    with _GATES_LOCK:
        gate = _GATES.get(conn)
        if gate is None:
            gate = _GATES[conn] = Gate(pool_size(conn.transport_options))
        return gate


class Gate:
    """At most ``size`` calls at once; the others wait for one to end. A call made inside
    another, by the same thread, goes on: it uses the connection its caller waited for."""

    def __init__(self, size: int) -> None:
        self._slots = threading.BoundedSemaphore(size)
        self._inside = threading.local()

    @contextmanager
    def passed(self) -> Iterator[None]:
        depth = getattr(self._inside, "depth", 0)
        if depth:
            self._inside.depth = depth + 1
            try:
                yield
            finally:
                self._inside.depth = depth
            return
        with self._slots:
            self._inside.depth = 1
            try:
                yield
            finally:
                self._inside.depth = 0


class Once(Generic[T]):
    """What ``make`` returns (given to :meth:`get`), made on first use, once for every thread.
    Where making it fails, the threads that waited for that attempt get its failure, not an
    attempt each in turn: against a Redis that accepts connections and never answers, six
    requests of a dashboard would otherwise end 10, 20, ... 60 s later (a socket timeout
    each). A call that comes after the failure tries again.

    ``make`` is not kept: a control's own method would make a reference cycle, and a control
    left to the garbage collector would hold its connections until the collector runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.made: T | None = None
        self._failed = 0  # attempts failed so far
        self._failure: Exception | None = None  # the last one's, until one succeeds

    def get(self, make: Callable[[], T]) -> T:
        made = self.made
        if made is not None:
            return made
        failed = self._failed
        with self._lock:
            if self.made is None:
                shared = self._failure if self._failed != failed else None
                if shared is not None:
                    raise _fresh(shared) or shared
                try:
                    self.made = make()
                except Exception as exc:
                    self._failure, self._failed = _fresh(exc), self._failed + 1
                    raise
                self._failure = None
            return self.made


def _fresh(failure: Exception) -> Exception | None:
    """A copy of ``failure``, its text and type, with no traceback and no cause (whose traceback
    holds the frames below): kept, the exception its caller raises would hold every frame it
    passes through (a dashboard request's, with its credentials), and raised by each thread
    that waited, it would gather all their frames. ``None`` where it cannot be copied: the
    threads that waited then try again each."""
    try:
        fresh = copy.copy(failure)
    except Exception:  # an exception that cannot be made again from its arguments
        return None
    fresh.__cause__, fresh.__suppress_context__ = None, True
    return fresh


def gated(method: Call) -> Call:
    """Run ``method`` of an object with a ``_gate`` (:class:`Gate`) through it. Where it could
    not reach Redis, the idle connections of the object's store (``_opened``, a :class:`Once`,
    once opened) are closed: at Redis's ``maxclients`` the next call's connect may need the
    place one of them holds (see :meth:`~kombu_delay.store.Store.close_idle`). Redis's
    ``WRONGTYPE``, which names no key, is told with the shared keys of another type named."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._gate.passed():
            try:
                return method(self, *args, **kwargs)
            except redis.ConnectionError:
                if self._opened.made is not None:
                    self._opened.made.close_idle()
                raise
            except WrongTypeKey as exc:  # the keys of another type named, for the dashboard too
                named = exc if self._opened.made is None else self._opened.made.keys_named(exc)
                if named is exc:
                    raise
                raise named from exc

    return run  # type: ignore[return-value]
