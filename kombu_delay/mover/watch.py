"""A mover's background checks: Redis's eviction policy, memory and persistence, other key
prefixes' stranded messages, buckets that left their index (evicted or deleted), which are put back,
and id-index refs that name no bucket, which are dropped (every :data:`FORGET_EVERY_S`).
They run in a thread of their own, so a scan of a large database never delays a move: at the
mover's start (the scans :data:`FIRST_SCAN_AFTER_S` later), then the policy, memory and
persistence every :data:`POLICY_CHECK_EVERY_S`, the scans every :data:`PREFIX_CHECK_EVERY_S`,
and the prefixes a scan found stranded every :data:`STRANDED_RECHECK_S`. What they find is
logged (again every :data:`LOG_REPEAT_S` while it lasts), handed to the metrics, and recorded
in the namespace's alerts hash, which ``stats`` and ``health`` read.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

import redis

from kombu_delay.errors import RedisPermissionError, WrongTypeKey
from kombu_delay.mover.threads import start_daemon
from kombu_delay.ops.checks import (
    AT_MAXMEMORY_BYTES,
    FRESH_HEARTBEAT_MS,
    REPLICATED,
    RESOLVED,
    UNREAD_PERSISTENCE,
    Findings,
    databases_problem,
    eviction_problem,
    memory_problem,
    persistence_problem,
    snapshot_note,
    stranded_problem,
    unread_policy,
)
from kombu_delay.store import Store

logger = logging.getLogger(__name__)

#: How often the eviction policy, memory and persistence are read, seconds (``INFO memory``, ``INFO
#: persistence``, and ``CONFIG GET save`` while the AOF is off).
POLICY_CHECK_EVERY_S = 60.0
#: How often the database is scanned for other key prefixes, seconds (a full ``SCAN``).
PREFIX_CHECK_EVERY_S = 300.0
#: How long after its start a mover scans first, seconds: movers of several key prefixes (or
#: databases) started together found each other's messages before their first heartbeats, and
#: ``health`` reported them stranded until the next look.
FIRST_SCAN_AFTER_S = 15.0
#: How soon a scan that failed is made again, seconds: not at once, since it fails after its
#: whole SCAN where the record it writes is refused (over maxmemory, say), every time.
PREFIX_RETRY_S = 60.0
#: How often the id index is walked for refs that name no bucket, seconds, in pages of
#: :data:`FORGET_PAGE` task ids: a ref of a message lost with its bucket, or of a compressed one
#: (compressed buckets keep no task-id list to drop refs with), would otherwise stay while
#: anything is published. About 4 s of Redis's time per million task ids, so one mover walks
#: in that time, however many run (the key ``<ns>walk``, see ``forget.lua``).
FORGET_EVERY_S = 3600.0
#: The commands the walk runs (Redis 7.0 names none in a script's ACL refusal: the hint names all).
WALK_COMMANDS = ("HSCAN", "TYPE", "PTTL", "HMGET", "ZSCORE", "EXISTS", "TIME", "HSET", "HDEL", "PEXPIREAT")
#: Seconds before a walk that failed (Redis away, a connection refused by a full pool) is
#: tried again: not an hour, the refs it drops would wait that long.
FORGET_RETRY_S = 60.0
#: Seconds between looks at another mover's walk in hand (one script call that reads nothing
#: of the index): a walk its mover left part way, killed or stopped, is taken over at the next.
CLAIM_LOOK_S = 60.0
#: Task ids a page of the walk reads: about 2 ms of Redis's time, which a due move may wait.
FORGET_PAGE = 250
#: After each page the walk waits this many times as long as the page took: it takes at most
#: a sixth of Redis's time, however large the index (ten million task ids: minutes; 588 s
#: on a busy machine).
FORGET_PAUSE = 5.0
#: How often a problem that lasts is logged again, seconds.
LOG_REPEAT_S = 600.0
#: How often the prefixes found stranded (by any mover of this prefix) are looked at again, seconds
#: (two reads each, no ``SCAN``): one whose mover starts later leaves the alert then, not minutes
#: later at the next scan; and a mover's log and metrics tell what another's scan recorded.
STRANDED_RECHECK_S = 15.0
#: How long an alert recorded for ``stats`` and ``health`` stays valid without a new check, ms.
ALERT_KEEP_MS = int(3 * PREFIX_CHECK_EVERY_S * 1000)


class Watch:
    """Runs the checks for one mover's store until :meth:`stop`."""

    def __init__(
        self,
        store: Store,
        name: str,
        on_findings: Callable[[Findings], None] | None = None,
        logged: dict[str, tuple[str, float]] | None = None,
    ) -> None:
        self.store = store
        self.name = name
        self.findings = Findings()
        self._on_findings = on_findings
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        #: Seconds from the last walk's first page to the next look at the id index: an hour,
        #: or what is left of another mover's claim on it.
        self.next_walk_s = FORGET_EVERY_S
        #: Where a walk that failed stopped: its retry goes on from there, under the claim its
        #: first page took (from the start, it found its own claim and walked nothing).
        self._walk_cursor = 0
        #: The run id of the Redis that cursor is of (None: unread, or INFO refused).
        self._walk_run_id: str | None = None
        #: What was told, and when (monotonic s); given, it outlives this Watch (an embedded
        #: mover's tries: each told the same problems again).
        self._logged = {} if logged is None else logged
        self._scan_allowed = True
        self._config_allowed = True
        #: Redis's run id at the last look, and when (monotonic s; None: not read yet, or INFO refused).
        self._run_id: tuple[str, float] | None = None
        self._stranded_dbs: set[int] = set()  # (told when found twice: movers start together)

    def start(self) -> None:
        # The walk of the id index on a thread of its own: paced, it takes minutes at ten
        # million task ids, and the other checks must not wait for it.
        self._threads = [
            start_daemon(self.run, "kombu-delay-watch"),
            start_daemon(self.walks, "kombu-delay-walk"),
        ]

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the checks, waiting ``timeout`` s at most for the ones in hand: each long walk
        looks at the stop between its calls, so only a call that Redis does not answer takes
        longer, and waiting would only add to the socket timeout the mover waited already."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def walks(self) -> None:
        """Walk the id index now and whenever :attr:`next_walk_s` says, until stopped."""
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.forget_stale_refs()
            except Exception as exc:
                self._failed("the walk of the id index", exc)
                self.next_walk_s = FORGET_RETRY_S
            else:
                self._tell("the walk of the id index", None, logging.WARNING)
            self._stop.wait(max(0.0, began + self.next_walk_s - time.monotonic()))

    def run(self) -> None:
        next_policy = 0.0
        next_prefixes = next_recheck = time.monotonic() + FIRST_SCAN_AFTER_S  # (the look after a scan)
        while not self._stop.is_set():
            now, step = time.monotonic(), ""
            try:
                if now >= next_policy:
                    next_policy, step = now + 5.0, "the check of Redis's policy, memory and persistence"
                    self.check_policy()
                    self.check_persistence()
                    self.check_restart()
                    next_policy = now + POLICY_CHECK_EVERY_S
                    self._tell(step, None, logging.WARNING)  # (its end, where its failure was told)
                if now >= next_prefixes:
                    next_prefixes, step = now + PREFIX_RETRY_S, "the scan for stranded messages"
                    self.check_prefixes()
                    next_prefixes = now + PREFIX_CHECK_EVERY_S
                    next_recheck = now + STRANDED_RECHECK_S
                    self._tell(step, None, logging.WARNING)
                elif now >= next_recheck:  # whatever this mover's scan found: another's too
                    next_recheck = now + STRANDED_RECHECK_S  # a failure waits as long: no SCAN
                    step = "the look again at stranded prefixes"
                    self.recheck_stranded()
                    self._tell(step, None, logging.WARNING)
            except Exception as exc:  # the top of this loop
                self._failed(step, exc)
            due = [next_policy, next_prefixes, next_recheck]
            self._stop.wait(max(0.05, min(due) - time.monotonic()))

    def check_policy(self) -> None:
        """Read the eviction policy and memory; log an ERROR while the policy lets Redis delete
        messages, a WARNING while Redis is at its maxmemory (it refuses publishes): told again
        every LOG_REPEAT_S, whatever its figures, and over only with twice the margin left."""
        self.findings.policy, self.findings.memory = self.store.memory_state()
        if self.findings.policy is None and "unknown" not in self._logged:
            logger.warning("mover %s: %s", self.name, unread_policy(None))
            self._logged["unknown"] = ("", time.monotonic())
        self._tell("policy", eviction_problem(self.findings.policy), logging.ERROR)
        margin = AT_MAXMEMORY_BYTES * (2 if "memory" in self._logged else 1)
        problem = memory_problem(self.findings.policy, self.findings.memory, margin)
        self._tell("memory", problem, logging.WARNING, gist="at maxmemory")
        self._report()

    def check_persistence(self) -> None:
        """Read what Redis keeps on disk; log a WARNING while it keeps nothing (a restart loses
        every scheduled message), and once, at INFO, that it keeps only RDB snapshots."""
        aof, rules = self.store.persistence(read_rules=self._config_allowed)
        if aof is False and rules is None:  # CONFIG GET refused or renamed: not asked again
            self._config_allowed = False
        if aof is None or (aof is False and rules is None):
            # Unknown: what was last found stands (a refusal is no sign it was fixed).
            if "persistence unknown" not in self._logged:
                logger.info("mover %s: %s", self.name, UNREAD_PERSISTENCE)
                self._logged["persistence unknown"] = ("", time.monotonic())
            return
        self.findings.aof_enabled, self.findings.save_rules = aof, rules
        note = snapshot_note(aof, rules)
        if note is not None and "snapshots" not in self._logged:
            logger.info("mover %s: %s", self.name, note)
            self._logged["snapshots"] = (note, time.monotonic())
        self._tell("persistence", persistence_problem(aof, rules), logging.WARNING)
        self._report()

    def check_restart(self) -> None:
        """Log a WARNING when Redis's run id changed since the last look: a Redis up no longer
        than that restarted, and holds what it keeps on disk, where it keeps nothing, nothing
        scheduled before, lost and counted nowhere (but a snapshot saved by hand, which Redis 7
        counts as it loads it); one up longer is another server (a failover), holding what was
        replicated to it, as is a replica promoted (a second replication id) onto a Redis that
        keeps nothing on disk, however recently it started.
        (Redis counts its uptime by its wall clock, this by a monotonic one: a clock stepped
        between them can mistake one for the other.)"""
        found = self.store.run_id()
        now = time.monotonic()
        if found is None:
            return
        run_id, uptime_s, promoted, loaded = found
        if self._run_id is not None and run_id != self._run_id[0]:
            restarted = uptime_s <= now - self._run_id[1] + 5
            keeps_nothing = persistence_problem(self.findings.aof_enabled, self.findings.save_rules)
            # A second replication id: a replica promoted, or (Redis 7) a Redis that reloaded its
            # snapshot, which a Redis that keeps nothing on disk has none of.
            if promoted and (not restarted or keeps_nothing):
                what = "a failover promoted a replica"
                kept = REPLICATED
            elif restarted and keeps_nothing:
                what = "Redis restarted"
                kept = "nothing from before (it keeps nothing on disk): all scheduled lost"
                if loaded is None:  # (before Redis 7, which does not say what it loaded)
                    kept += ", unless it loaded a snapshot saved by hand"
                elif loaded:
                    kept = f"the {loaded:,} keys of a snapshot saved by hand (it keeps nothing on disk else)"
                    kept += ": what was scheduled after that snapshot lost"
            elif restarted:
                what = "Redis restarted (or a failover promoted a replica started since)"
                kept = "what it keeps on disk, or what was replicated to it"
            else:
                what = "another Redis server answers (a failover, or a new address)"
                kept = REPLICATED
            logger.warning(
                "mover %s: %s: run id %s (on %s), was %s, up %d s; it holds %s",
                *(self.name, what, run_id, self.store.address(), self._run_id[0], uptime_s, kept),
            )
        self._run_id = (run_id, now)

    def check_prefixes(self) -> None:
        """Scan for other key prefixes whose messages no mover serves; log and record them.
        Then put back into their index the buckets that count messages but left it, and log the
        other databases holding messages under this prefix that no mover serves."""
        if not self._scan_allowed:
            return
        try:
            stranded = self.store.stranded(FRESH_HEARTBEAT_MS, stopping=self._stop.is_set)
            if self._stop.is_set():  # (a scan cut short: what it found says nothing)
                return
            self.check_index()
            self._record_stranded(stranded)
            found, seen = self.store.stranded_databases(FRESH_HEARTBEAT_MS), self._stranded_dbs
            self._stranded_dbs = set(found)
            told = databases_problem(found, self.store.prefix, seen)  # new with a database, not a count
            self._tell("databases", told, logging.WARNING, gist=repr(sorted(set(found) & seen)))
        except RedisPermissionError:
            self._scan_allowed = False
            logger.warning(
                "mover %s: this user may not SCAN: messages stranded under other key prefixes are not "
                "looked for, and buckets that left the bucket index (evicted, or deleted by hand) are "
                "put back only by the hourly walk of the id index; grant +scan (see the security docs)",
                self.name,
            )

    def recheck_stranded(self) -> None:
        """Look again at the prefixes found stranded, by this mover or another of its prefix: one
        whose mover has started since, or whose messages are gone, leaves the alert."""
        self._record_stranded({})

    def _record_stranded(self, found: dict[str, int]) -> None:
        # One record for every mover of the prefix (<ns>stranded): each looks again at what it
        # found and at what is recorded (a scan's finding is minutes old, a reindex later), and
        # writes what is stranded still, with the alert, watching the record meanwhile.
        try:
            self.findings.stranded = self.store.renew_stranded(
                found, FRESH_HEARTBEAT_MS, ALERT_KEEP_MS, stranded_problem
            )
        except WrongTypeKey as exc:  # the record (or alerts) written by hand as another type
            told = f"the stranded check cannot keep its record: {exc}{self.store.misshapen_told()}"
            self._tell("record", told, logging.ERROR)
            return
        self._tell("record", None, logging.ERROR)
        # New when another prefix is, not when a count moves (every 15 s while one publishes)
        gist = repr(sorted(self.findings.stranded))
        self._tell("stranded", stranded_problem(self.findings.stranded), logging.WARNING, gist=gist)
        self._report()

    def check_index(self) -> None:
        """Put back into their index the buckets whose meta hash counts messages but that are
        in no index (an index evicted, or deleted by hand, strands every bucket it named:
        movers reach buckets only through it); log an ERROR when there were any."""
        self._told_put_back(*self.store.reindex(stopping=self._stop.is_set))

    def _told_put_back(self, buckets: int, messages: int) -> None:
        if buckets:
            logger.error(
                "mover %s: %d buckets holding %d messages had left the bucket index, or stood in it "
                "at another time than their own (evicted, deleted or changed by hand): put back, and "
                "moved from now on",
                *(self.name, buckets, messages),
            )

    def forget_stale_refs(self) -> int:
        """Walk the whole id index, a page at a time, dropping the refs that name no bucket;
        return how many (logged when any). Sets :attr:`next_walk_s`."""
        if self._walk_cursor and (
            self.store.walk_by() != self.name or self._walk_run_id != self._run_id_now()
        ):
            # Its claim is gone (a Redis restart, a failover, its hour over) or another's, or
            # Redis is another process than the one it walked (restarted with its data, the
            # claim too, or failed over): an HSCAN cursor means nothing in another process,
            # which lays the hash out anew, and the walk begins again (forget.lua lets a
            # mover begin its own walk again).
            self._walk_cursor = 0
        cursor, dropped, every_ms = self._walk_cursor, 0, int(FORGET_EVERY_S * 1000)
        if not cursor:
            self._walk_run_id = self._run_id_now()
        self.next_walk_s = FORGET_EVERY_S
        while True:
            began = time.monotonic()
            try:
                page = self.store.forget_stale_refs(cursor, FORGET_PAGE, self.name, every_ms)
            except RedisPermissionError as exc:  # an ACL line from before it (HSCAN), say
                named = re.search(r"'([a-z|]+)' command", str(exc))  # Redis 7 names the command
                needed = ", ".join(WALK_COMMANDS)
                hint = "" if named and named[1].upper() not in WALK_COMMANDS else f": grant {needed}"
                self._tell("forget", f"the id index cannot be walked ({exc}){hint}", logging.WARNING)
                self._walk_cursor = 0
                return dropped
            if isinstance(page, float):  # another mover's walk began within FORGET_EVERY_S
                logger.debug("mover %s: the id index was walked lately; not walked again", self.name)
                # Just after its claim ends, not an hour after; sooner, to take over a walk its
                # mover left part way.
                self.next_walk_s = min(page + 1.0, CLAIM_LOOK_S)
                break
            cursor, n, buckets, messages = page
            self._walk_cursor = cursor
            dropped += n
            self._told_put_back(buckets, messages)
            if cursor == 0 or self._stop.wait(FORGET_PAUSE * (time.monotonic() - began)):
                break
        self._tell("forget", None, logging.WARNING)
        if dropped:
            logger.info(
                "mover %s: dropped %d id-index refs that named no bucket (messages lost with it)",
                self.name,
                dropped,
            )
        return dropped

    def _run_id_now(self) -> str | None:
        found = self.store.run_id()
        return None if found is None else found[0]

    def _tell(self, what: str, problem: str | None, level: int, gist: str = "") -> None:
        """Log ``problem`` when it is new, or once per LOG_REPEAT_S while it lasts (``gist``: what
        makes it new, where not its whole text, whose figures change from look to look)."""
        if problem is None:
            if self._logged.pop(what, None) is not None:
                logger.info("mover %s: %s", self.name, RESOLVED.get(what, f"{what} works again"))
            return
        said, at = self._logged.get(what, ("", float("-inf")))
        now = time.monotonic()
        if said != (gist or problem) or now - at >= LOG_REPEAT_S:
            logger.log(level, "mover %s: %s", self.name, problem)
            self._logged[what] = (gist or problem, now)

    def _failed(self, what: str, exc: Exception) -> None:
        """Log a failed check: Redis away at debug level (the mover's own loop reports it), any
        other error (a refusal, a key of another type) as a WARNING, at most once per
        LOG_REPEAT_S while it lasts."""
        if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
            logger.debug("mover %s: %s failed; retrying", self.name, what, exc_info=True)
        else:
            self._tell(what, f"{what} failed ({exc}); retrying", logging.WARNING)

    def _report(self) -> None:
        if self._on_findings is not None:
            self._on_findings(self.findings)
