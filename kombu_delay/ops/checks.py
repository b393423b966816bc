"""What makes a deployment unsafe that no single move shows, said the same way everywhere.

The mover logs these, ``stats`` shows them, ``health`` fails on them and the metrics expose
them; each place reads the facts from Redis and words them here, so they never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping

#: A mover heartbeat younger than this means a mover serves its namespace, ms. ``health``
#: uses 30 s by default too, and a mover beats every 2 s.
FRESH_HEARTBEAT_MS = 30_000

#: The only ``maxmemory-policy`` under which Redis never deletes a scheduled message.
SAFE_POLICY = "noeviction"


def eviction_problem(policy: str | None) -> str | None:
    """Return why ``policy`` endangers scheduled messages, or ``None`` when it does not (or is
    unknown: ``None``)."""
    if policy is None or policy == SAFE_POLICY:
        return None
    return (
        f"Redis's maxmemory-policy is {policy}: under memory pressure Redis deletes scheduled "
        f"messages without a trace; set maxmemory-policy {SAFE_POLICY} (CONFIG SET and redis.conf)"
    )


def stranded_problem(stranded: Mapping[str, int]) -> str | None:
    """Return what to do about other key prefixes whose messages no mover serves (prefix ->
    messages), or ``None`` when there are none."""
    if not stranded:
        return None
    parts = ", ".join(f"{prefix!r} ({n:,})" for prefix, n in sorted(stranded.items()))
    first = sorted(stranded)[0]
    return (
        f"messages are stranded under key prefix {parts}, which no mover serves: run a mover with "
        f"that global_keyprefix (kombu-delay --prefix {first!r} mover), or give the publishers "
        "this mover's"
    )
