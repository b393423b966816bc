"""The rows of the benchmark's scenarios whose rows are built per case (herd, backpressure, e2e):
one per reported figure, with its target where it has one (see targets.py)."""

from __future__ import annotations

from collections.abc import Callable

#: (scenario, metric label, path into the results, format, target text, check).
Row = tuple[str, str, tuple[str, ...], str, str, Callable[[float], bool] | None]


def zero(v: float) -> bool:
    """The check of a count that must be none."""
    return v == 0


def herd_rows(case: str, label: str) -> list[Row]:
    """The rows of one case of the herd scenario."""
    rows: list[tuple[str, str, str, str, Callable[[float], bool] | None]] = [
        ("messages", "messages", "{:,.0f}", "", None),
        ("payload bytes", "payload_bytes_mean", "{:.0f}", "", None),
        ("thaw began, ms before due", "thaw_started_ms_before_due", "{:,.0f}", "", None),
        ("thaw done, ms before due", "thaw_done_ms_before_due", "{:,.0f}", "> 0", lambda v: v > 0),
        ("thawed/s", "thawed_per_s", "{:,.0f}", "", None),
        ("copy for the handover began, ms before due", "staging_began_ms_before_due", "{:,.0f}", "", None),
        ("copy whole, ms before due", "staged_ms_before_due", "{:,.0f}", "", None),
        ("handed over whole: RENAME calls", "renames", "{:.0f}", "", None),
        ("peak used memory, MB", "peak_used_memory_mb", "{:,.0f}", "", None),
        ("all on list, s after due", "all_on_list_s_after_due", "{:.2f}", "<= 2", lambda v: v <= 2),
        ("moved/s (first -> last move, Redis clock)", "moved_per_s", "{:,.0f}", "", None),
        ("move span, ms (resolution: the sample gap)", "move_span_ms", "{:.1f}", "", None),
        ("largest sample gap in it, ms", "move_sample_gap_ms", "{:.1f}", "", None),
        ("floor: the whole herd by a bare Lua move, s", "floor_move_s", "{:.2f}", "", None),
        ("floor: bare Lua move/s, same run", "floor_move_per_s", "{:,.0f}", "", None),
        ("floor: Redis CPU µs per msg", "floor_move_redis_cpu_us", "{:.1f}", "", None),
        ("early (seen on the list before due)", "early", "{:.0f}", "= 0", lambda v: v == 0),
        (BLIND, "early_blind_ms", "{:.2f}", "", None),
        ("lost", "lost", "{:.0f}", "= 0", lambda v: v == 0),
        ("doubled", "doubled", "{:.0f}", "= 0", lambda v: v == 0),
    ]
    return [("herd", f"{label}: {name}", ("herd", case, key), fmt, t, c) for name, key, fmt, t, c in rows]


#: The row beside each sampled "early": the longest a due time came after the last sample before
#: it (a push within that gap before its due time is not seen; precision times each push).
BLIND = "early: unsampled ms before a due time"


def at_most(most: float) -> Callable[[float], bool]:
    return lambda v: v <= most


def backpressure_rows() -> list[Row]:
    """The rows of the backpressure scenario, each ramp's deliveries counted by task id."""
    rows: list[Row] = []
    for ramp, label in (("max_rate", "max-rate"), ("max_queue_length", "max-queue-length")):
        figure = "peak_per_s" if ramp == "max_rate" else "longest_list"
        shown = "peak moved/s" if ramp == "max_rate" else "longest list"
        rows.append(
            ("backpressure", f"{label}: {shown}", ("backpressure", ramp, figure), "{:,.0f}", "", None)
        )
        # The cap itself: the rate after the first second (the limiter starts with a second's
        # allowance), the list's length as sampled before each take by the consumer.
        held, most = ("rate_over_cap", 1.1) if ramp == "max_rate" else ("longest_over_cap", 1.0)
        told = "moved/s after the first second / cap" if ramp == "max_rate" else "longest list / cap"
        rows.append(
            (
                "backpressure",
                f"{label}: {told}",
                ("backpressure", ramp, held),
                "{:.2f}",
                f"<= {most:g}",
                at_most(most),
            )
        )
        for name, key in (
            ("lost", "lost"),
            ("doubled", "doubled"),
            ("delivered - published", "delivered_minus_messages"),
        ):
            path = ("backpressure", ramp, key)
            rows.append(("backpressure", f"{label}: {name}", path, "{:.0f}", "= 0", lambda v: v == 0))
    return rows


def e2e_rows() -> list[Row]:
    """The rows of the end-to-end scenario."""

    rows: list[tuple[str, tuple[str, ...], str, str, Callable[[float], bool] | None]] = [
        ("tasks not started", ("lateness", "not_started"), "{:.0f}", "= 0", zero),
        ("due -> task start p99, ms", ("lateness", "p99_ms"), "{:.1f}", "", None),
        ("early task starts", ("lateness", "early"), "{:.0f}", "= 0", zero),
        ("worker RSS growth, delay, MB", ("delay_rss_growth_mb",), "{:.1f}", "<= 5", lambda v: v <= 5),
        ("worker RSS growth, stock, MB", ("stock_rss_growth_mb",), "{:.1f}", "", None),
        ("pending, delay: not held in Redis", ("delay_not_held_in_redis",), "{:.0f}", "= 0", zero),
        ("pending, delay: unacked by the worker", ("delay_unacked_by_worker",), "{:.0f}", "= 0", zero),
        ("pending, stock: unacked by the worker", ("stock_unacked_by_worker",), "{:.0f}", "", None),
    ]
    return [("e2e", name, ("e2e", *path), fmt, t, c) for name, path, fmt, t, c in rows]
