"""Is kombu-delay healthy: what the probe reads from Redis, and the reasons to call it unhealthy.

It answers two questions with the Redis clock only: is some mover alive (a heartbeat
recorded recently enough), and are due messages being moved (the oldest overdue message
is young enough)? Plus what endangers scheduled messages whatever the movers do, and what
does but is often chosen knowingly (a Redis that keeps nothing on disk, in tests or a cache):
that is printed as a warning, never a verdict. The ``health`` command
(:mod:`kombu_delay.cli.health`) prints the verdict and exits with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kombu_delay.errors import WrongTypeKey
from kombu_delay.mover.watch import ALERT_KEEP_MS
from kombu_delay.ops.checks import (
    evicted_beats,
    eviction_problem,
    memory_problem,
    movers_heard,
    movers_told,
    persistence_problem,
    unread_policy,
)
from kombu_delay.store import Store, keys, spaces


@dataclass(frozen=True)
class Health:
    """What the probe saw, ages in ms by the Redis clock."""

    #: Movers with a heartbeat in the last :data:`~kombu_delay.ops.checks.FRESH_HEARTBEAT_MS`
    #: (a mover writes one every ``delay_heartbeat_interval``, 2 s by default).
    movers: int
    #: Age of the freshest mover heartbeat; ``None`` when no mover has one.
    heartbeat_age_ms: int | None
    #: How long the oldest due message has been waiting; 0 when none is due, ``None`` when
    #: not read (a liveness probe: its cost grows with the queues of the earliest bucket).
    overdue_ms: int | None
    #: What endangers scheduled messages whatever the movers do (an evicting
    #: ``maxmemory-policy``, Redis at its ``maxmemory``, messages stranded under another key
    #: prefix).
    warnings: tuple[str, ...] = ()
    #: What endangers scheduled messages but is no reason to call this unhealthy, as many run
    #: it knowingly: a Redis that keeps nothing on disk. Printed as warnings.
    notes: tuple[str, ...] = ()
    #: Movers whose last heartbeat is older than that and still kept (for a day): stopped, or
    #: killed, or cut off from Redis.
    silent: int = 0
    #: Why Redis refuses every write now (a read-only replica, too few replicas in time), among
    #: the warnings too: no mover can write its heartbeat meanwhile.
    refusal: str | None = None

    def problems(
        self, max_heartbeat_age_ms: int, max_overdue_ms: int, redis_checks: bool = True
    ) -> list[str]:
        """Return the reasons to call this unhealthy (a threshold of 0 skips its check;
        ``redis_checks`` false skips the warnings, which a mover restart cannot fix)."""
        found = list(self.warnings) if redis_checks else []
        if max_heartbeat_age_ms:
            if self.heartbeat_age_ms is None:
                found.append("no mover heartbeat" + evicted_beats(self.warnings))
            elif self.heartbeat_age_ms > max_heartbeat_age_ms:
                found.append(
                    f"no mover heartbeat within {max_heartbeat_age_ms / 1000:g} s "
                    f"(freshest {self.heartbeat_age_ms / 1000:.1f} s ago)"
                )
        if max_overdue_ms and self.overdue_ms is not None and self.overdue_ms > max_overdue_ms:
            found.append(
                f"oldest overdue message waits {self.overdue_ms / 1000:.1f} s "
                f"(limit {max_overdue_ms / 1000:g} s)"
            )
        return found

    def summary(self) -> str:
        beat = "none" if self.heartbeat_age_ms is None else f"{self.heartbeat_age_ms / 1000:.1f} s ago"
        return f"movers {movers_told(self.movers, self.silent)}, freshest heartbeat {beat}" + (
            "" if self.overdue_ms is None else f", oldest overdue {self.overdue_ms / 1000:.1f} s"
        )


def check(store: Store, host: str | None = None, notes: bool = True, overdue: bool = True) -> Health:
    """Read heartbeats and, with ``overdue``, the earliest due time; judge ages by the Redis clock.

    With ``host``, only movers on that host count (mover ids are
    ``[embedded:]host:pid:random``), so a probe can watch its own pod's mover. Without
    ``notes``, what would only be printed (:func:`cautions`) is not read. A shared key of
    another type (:meth:`Store.misshapen`; Redis's own error, from a script, names none) is a
    warning, or, where it is one this reads (the heartbeats, an index), a
    :class:`WrongTypeKey` that names it. Data in a storage format this version does not read
    is a :class:`StorageFormatError`, as for a mover, which stops on it.
    """
    store.check_format()
    misshapen = store.misshapen()
    read = {
        keys.movers(store.prefix),
        keys.alerts(store.prefix),
        *(space.index(store.prefix) for space in spaces.ALL),
    }
    if misshapen.keys() & read:
        # What the probe reads: an error from Redis, as its WRONGTYPE would be, naming the key.
        raise WrongTypeKey("WRONGTYPE " + "; ".join(misshapen.values()))
    policy, memory = store.memory_state()
    replication, refuses = store.write_refusal()
    warnings = (*misshapen.values(), *threats(store, policy, memory, replication))
    told = cautions(store, policy) if notes else ()
    earliest = store.earliest_due_ms() if overdue else None
    now = store.time_ms()
    # A heartbeat is written by Redis's clock: one ahead of it (``inf``, by hand) is no sign of life.
    beats = {
        name: ms
        for name, ms in store.heartbeats().items()
        if ms <= now + keys.FUTURE_BEAT_MS and (host is None or host in name.split(":")[:2])
    }
    freshest = max(beats.values()) if beats else None
    alive, silent = movers_heard(beats.values(), now)
    return Health(
        movers=alive,
        silent=silent,
        heartbeat_age_ms=None if freshest is None else max(0, now - freshest),
        overdue_ms=None if not overdue else 0 if earliest is None else max(0, now - earliest),
        warnings=warnings,
        notes=told,
        refusal=replication if refuses else None,
    )


def dangers(store: Store) -> tuple[str, ...]:
    """What endangers the scheduled messages of ``store`` now, whatever the movers do, as
    ``stats`` shows it: the shared keys of another type (:meth:`Store.misshapen`), then
    :func:`threats` and :func:`cautions`. One sentence each, saying what to do."""
    policy, memory = store.memory_state()
    replication, _ = store.write_refusal()
    return (
        *store.misshapen().values(),
        *threats(store, policy, memory, replication),
        *cautions(store, policy),
    )


def threats(
    store: Store, policy: str | None, memory: tuple[int, int] | None, refusal: str | None
) -> tuple[str, ...]:
    """What ``health`` fails on: where Redis's writes go (``refusal``: a replica, too few
    replicas in time, see :meth:`Store.write_refusal`), its eviction policy ``policy``
    (``None``: unread), Redis at its ``maxmemory`` (``memory``, see :meth:`Store.memory_state`),
    and what movers recorded in the alerts hash (stranded key prefixes)."""
    found = (
        refusal,
        eviction_problem(policy),
        memory_problem(policy, memory),
        *store.alerts(ALERT_KEEP_MS).values(),
    )
    return tuple(text for text in found if text)


def cautions(store: Store, policy: str | None) -> tuple[str, ...]:
    """What endangers scheduled messages but ``health`` only prints: a Redis that keeps nothing
    on disk (read here; not judged when ``INFO`` or ``CONFIG GET save`` is refused), and an
    eviction policy that could not be read (``policy`` ``None``), so is not judged either."""
    found = (unread_policy(policy), persistence_problem(*store.persistence()))
    return tuple(text for text in found if text)
