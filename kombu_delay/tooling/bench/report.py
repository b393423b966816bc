"""The benchmark's output: the results table with its targets, terminal charts, and a PNG.

The charts are always drawn in the terminal; the PNG needs matplotlib (the
``plot`` extra).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: (scenario, metric label, path into the results, format, target text, check).
Row = tuple[str, str, tuple[str, ...], str, str, Callable[[float], bool] | None]


def _herd_rows(case: str, label: str) -> list[Row]:
    """The rows of one case of the herd scenario."""
    rows: list[tuple[str, str, str, str, Callable[[float], bool] | None]] = [
        ("messages", "messages", "{:,.0f}", "", None),
        ("payload bytes", "payload_bytes_mean", "{:.0f}", "", None),
        ("thaw began, ms before due", "thaw_started_ms_before_due", "{:,.0f}", "", None),
        ("thaw done, ms before due", "thaw_done_ms_before_due", "{:,.0f}", "> 0", lambda v: v > 0),
        ("thawed/s", "thawed_per_s", "{:,.0f}", "", None),
        ("peak used memory, MB", "peak_used_memory_mb", "{:,.0f}", "", None),
        ("all on list, s after due", "all_on_list_s_after_due", "{:.2f}", "<= 2", lambda v: v <= 2),
        ("moved/s (due -> last on list)", "moved_per_s", "{:,.0f}", "", None),
        ("floor: bare Lua move/s, same run", "floor_move_per_s", "{:,.0f}", "", None),
        ("early", "early", "{:.0f}", "= 0", lambda v: v == 0),
        ("lost", "lost", "{:.0f}", "= 0", lambda v: v == 0),
        ("doubled", "doubled", "{:.0f}", "= 0", lambda v: v == 0),
    ]
    return [("herd", f"{label}: {name}", ("herd", case, key), fmt, t, c) for name, key, fmt, t, c in rows]


ROWS: list[Row] = [
    ("publish", "plain redis:// publishes/s", ("publish", "plain_per_s"), "{:,.0f}", "", None),
    ("publish", "delayed publishes/s", ("publish", "delayed_per_s"), "{:,.0f}", "", None),
    ("publish", "delayed / plain", ("publish", "ratio"), "{:.2f}", ">= 0.9", lambda v: v >= 0.9),
    ("publish", "Redis CPU µs, plain publish", ("publish", "plain_redis_cpu_us"), "{:.1f}", "", None),
    ("publish", "Redis CPU µs, delayed publish", ("publish", "delayed_redis_cpu_us"), "{:.1f}", "", None),
    ("precision", "lateness p50, ms", ("precision", "p50_ms"), "{:.2f}", "", None),
    ("precision", "lateness p99, ms", ("precision", "p99_ms"), "{:.2f}", "<= 5", lambda v: v <= 5),
    ("precision", "lateness max, ms", ("precision", "max_ms"), "{:.2f}", "", None),
    ("precision", "early arrivals", ("precision", "early"), "{:.0f}", "= 0", lambda v: v == 0),
    ("burst", "due -> all on list, s", ("burst", "drain_s"), "{:.3f}", "", None),
    (
        "burst",
        "moved/s, one mover",
        ("burst", "moved_per_s"),
        "{:,.0f}",
        ">= 200,000",
        lambda v: v >= 200_000,
    ),
    ("burst", "pipelined LPUSH ceiling/s", ("burst", "lpush_ceiling_per_s"), "{:,.0f}", "", None),
    ("burst", "moved / ceiling", ("burst", "ratio_to_ceiling"), "{:.2f}", ">= 0.5", lambda v: v >= 0.5),
    ("burst", "largest script call, ms", ("burst", "largest_script_call_ms"), "{:.1f}", "", None),
    ("burst", "Redis µs per moved msg", ("burst", "script_server_us_per_msg"), "{:.1f}", "", None),
    ("burst", "Redis CPU µs per moved msg", ("burst", "redis_cpu_us_per_msg"), "{:.1f}", "", None),
    ("burst", "floor: bare Lua move/s", ("burst", "floor_per_s"), "{:,.0f}", "", None),
    ("burst", "floor: Redis CPU µs per msg", ("burst", "floor_redis_cpu_us_per_msg"), "{:.1f}", "", None),
    (
        "memory",
        "bytes per msg beyond payload",
        ("memory", "overhead_per_msg"),
        "{:.0f}",
        "<= 150",
        lambda v: v <= 150,
    ),
    ("memory", "payload bytes", ("memory", "payload_bytes"), "{:.0f}", "", None),
    ("memory", "compressed member, mean bytes", ("memory", "compressed_member_bytes"), "{:.0f}", "", None),
    ("memory", "used memory per msg", ("memory", "used_memory_per_msg"), "{:.0f}", "", None),
    ("memory", "of which compressed sorted sets", ("memory", "compressed_sets_per_msg"), "{:.0f}", "", None),
    ("memory", "of which id index", ("memory", "ids_index_per_msg"), "{:.0f}", "", None),
    ("memory", "of which other", ("memory", "other_per_msg"), "{:.0f}", "", None),
    (
        "memory",
        "uncompressed layout (delay_compress_after=0), B/msg",
        ("memory", "uncompressed_overhead_per_msg"),
        "{:.0f}",
        "",
        None,
    ),
    (
        "memory",
        "uncompressed: of which id index",
        ("memory", "uncompressed_ids_index_per_msg"),
        "{:.0f}",
        "",
        None,
    ),
    (
        "memory",
        "uncompressed: of which task-id lists",
        ("memory", "uncompressed_task_id_lists_per_msg"),
        "{:.0f}",
        "",
        None,
    ),
    (
        "memory",
        "uncompressed: of which allocator rounding",
        ("memory", "uncompressed_allocator_rounding_bytes"),
        "{:.0f}",
        "",
        None,
    ),
    (
        "memory",
        "uncompressed: of which sorted-set entry",
        ("memory", "uncompressed_sorted_set_structure_bytes"),
        "{:.0f}",
        "",
        None,
    ),
    ("memory", "uncompressed: of which other", ("memory", "uncompressed_other_per_msg"), "{:.0f}", "", None),
    (
        "memory",
        "plain kombu list, beyond payload",
        ("memory", "plain_list_overhead_per_msg"),
        "{:.0f}",
        "",
        None,
    ),
    (
        "memory",
        "floor: bare sorted set, beyond payload",
        ("memory", "bare_sorted_set_overhead_per_msg"),
        "{:.0f}",
        "",
        None,
    ),
    (
        "memory",
        "floor: sorted set of task ids, per entry",
        ("memory", "task_id_sorted_set_per_msg"),
        "{:.0f}",
        "",
        None,
    ),
    ("thaw", "stored compressed", ("thaw", "stored_cold"), "{:,.0f}", "", None),
    ("thaw", "thaw began, ms before due", ("thaw", "thaw_started_ms_before_due"), "{:,.0f}", "", None),
    ("thaw", "thaw took, s", ("thaw", "thaw_s"), "{:.3f}", "", None),
    ("thaw", "thawed/s, one mover", ("thaw", "thawed_per_s"), "{:,.0f}", "", None),
    (
        "thaw",
        "thaw done, ms before due",
        ("thaw", "thaw_done_ms_before_due"),
        "{:,.0f}",
        "> 0",
        lambda v: v > 0,
    ),
    ("thaw", "largest script call, ms", ("thaw", "largest_thaw_script_call_ms"), "{:.1f}", "", None),
    ("thaw", "Redis CPU µs per thawed msg", ("thaw", "thaw_redis_cpu_us_per_msg"), "{:.1f}", "", None),
    ("thaw", "due -> all on list, s", ("thaw", "drain_s"), "{:.3f}", "", None),
    ("thaw", "moved/s, one mover", ("thaw", "moved_per_s"), "{:,.0f}", "", None),
    ("thaw", "early arrivals", ("thaw", "early"), "{:.0f}", "= 0", lambda v: v == 0),
    ("thaw", "lost", ("thaw", "lost"), "{:.0f}", "= 0", lambda v: v == 0),
    ("cpu", "plain publish, Redis CPU µs", ("cpu", "plain_redis_cpu_us"), "{:.1f}", "", None),
    ("cpu", "schedule, Redis CPU µs", ("cpu", "schedule_redis_cpu_us"), "{:.1f}", "", None),
    ("cpu", "move, Redis CPU µs", ("cpu", "move_redis_cpu_us"), "{:.1f}", "", None),
    (
        "cpu",
        "delayed (schedule + move) / plain",
        ("cpu", "delayed_ratio"),
        "{:.2f}",
        "<= 2",
        lambda v: v <= 2,
    ),
    (
        "cpu",
        "compressed schedule, Redis CPU µs",
        ("cpu", "schedule_compressed_redis_cpu_us"),
        "{:.1f}",
        "",
        None,
    ),
    ("cpu", "thaw, Redis CPU µs", ("cpu", "thaw_redis_cpu_us"), "{:.1f}", "", None),
    ("cpu", "move after thaw, Redis CPU µs", ("cpu", "move_after_thaw_redis_cpu_us"), "{:.1f}", "", None),
    (
        "cpu",
        "compressed (schedule + thaw + move) / plain",
        ("cpu", "compressed_ratio"),
        "{:.2f}",
        "<= 2",
        lambda v: v <= 2,
    ),
    ("cpu", "floor: bare Lua move, Redis CPU µs", ("cpu", "floor_move_redis_cpu_us"), "{:.1f}", "", None),
    *_herd_rows("default", "default settings"),
    *_herd_rows("short_ahead", "short thaw-ahead"),
    ("scale", "publish, Redis CPU µs, small", ("scale", "small", "publish_redis_cpu_us"), "{:.1f}", "", None),
    ("scale", "publish, Redis CPU µs, large", ("scale", "large", "publish_redis_cpu_us"), "{:.1f}", "", None),
    (
        "scale",
        "publish cost large / small",
        ("scale", "publish_ratio"),
        "{:.2f}",
        "<= 1.2",
        lambda v: v <= 1.2,
    ),
    (
        "scale",
        "move, Redis CPU µs/msg, small",
        ("scale", "small", "move_redis_cpu_us_per_msg"),
        "{:.1f}",
        "",
        None,
    ),
    (
        "scale",
        "move, Redis CPU µs/msg, large",
        ("scale", "large", "move_redis_cpu_us_per_msg"),
        "{:.1f}",
        "",
        None,
    ),
    ("scale", "move cost large / small", ("scale", "move_ratio"), "{:.2f}", "<= 1.2", lambda v: v <= 1.2),
    ("scale", "same, Redis wall µs: publish ratio", ("scale", "publish_server_ratio"), "{:.2f}", "", None),
    ("scale", "same, Redis wall µs: move ratio", ("scale", "move_server_ratio"), "{:.2f}", "", None),
    ("scale", "scheduled, large", ("scale", "large", "scheduled"), "{:,.0f}", "", None),
    ("scale", "fill time, large, s", ("scale", "large", "fill_s"), "{:,.0f}", "", None),
    ("scale", "Redis used_memory, large, MB", ("scale", "large", "used_memory_mb"), "{:,.0f}", "", None),
    ("scale", "Redis RSS, large, MB", ("scale", "large", "redis_rss_mb"), "{:,.0f}", "", None),
    ("scale", "used_memory per msg, large", ("scale", "large", "used_memory_per_msg"), "{:.0f}", "", None),
    (
        "scale",
        "memory per msg, large / middle",
        ("scale", "memory_per_msg_ratio"),
        "{:.2f}",
        "<= 1.05",
        lambda v: v <= 1.05,
    ),
    (
        "scale",
        "kombu publish, Redis CPU µs, large",
        ("scale", "large", "publish_kombu_redis_cpu_us"),
        "{:.1f}",
        "",
        None,
    ),
    (
        "scale",
        "stats ms, large / small",
        ("scale", "inspection_ratio", "stats"),
        "{:.2f}",
        "<= 2",
        lambda v: v <= 2,
    ),
    (
        "scale",
        "ls_first_page ms, large / small",
        ("scale", "inspection_ratio", "ls_first_page"),
        "{:.2f}",
        "<= 2",
        lambda v: v <= 2,
    ),
    (
        "scale",
        "find ms, large / small",
        ("scale", "inspection_ratio", "find"),
        "{:.2f}",
        "<= 2",
        lambda v: v <= 2,
    ),
    (
        "scale",
        "cancel ms, large / small",
        ("scale", "inspection_ratio", "cancel"),
        "{:.2f}",
        "<= 2",
        lambda v: v <= 2,
    ),
    (
        "scale",
        "health ms, large / small",
        ("scale", "inspection_ratio", "health"),
        "{:.2f}",
        "<= 2",
        lambda v: v <= 2,
    ),
    ("scale", "mover RSS at large, MB", ("scale", "large", "mover_rss_mb"), "{:.1f}", "", None),
    (
        "backpressure",
        "max-rate: peak moved/s",
        ("backpressure", "max_rate", "peak_per_s"),
        "{:,.0f}",
        "",
        None,
    ),
    (
        "backpressure",
        "max-rate: lost",
        ("backpressure", "max_rate", "lost"),
        "{:.0f}",
        "= 0",
        lambda v: v == 0,
    ),
    (
        "backpressure",
        "max-queue-length: longest list",
        ("backpressure", "max_queue_length", "longest_list"),
        "{:,.0f}",
        "",
        None,
    ),
    (
        "backpressure",
        "max-queue-length: lost",
        ("backpressure", "max_queue_length", "lost"),
        "{:.0f}",
        "= 0",
        lambda v: v == 0,
    ),
    ("e2e", "due -> task start p99, ms", ("e2e", "lateness", "p99_ms"), "{:.1f}", "", None),
    ("e2e", "early task starts", ("e2e", "lateness", "early"), "{:.0f}", "= 0", lambda v: v == 0),
    (
        "e2e",
        "worker RSS growth, delay, MB",
        ("e2e", "delay_rss_growth_mb"),
        "{:.1f}",
        "<= 5",
        lambda v: v <= 5,
    ),
    ("e2e", "worker RSS growth, stock, MB", ("e2e", "stock_rss_growth_mb"), "{:.1f}", "", None),
]


def lookup(results: dict[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = results
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return float(node) if isinstance(node, int | float) and not isinstance(node, bool) else None


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Return one row per metric present: value, target and whether it is met."""
    rows = []
    for scenario, label, path, fmt, target, check in ROWS:
        value = lookup(results, path)
        if value is None:
            continue
        met = None if check is None or math.isnan(value) else bool(check(value))
        rows.append(_row(scenario, label, value, fmt, target, met))
    for size, row in sorted(
        ((results.get("inspect") or {}).get("sizes") or {}).items(), key=lambda item: int(item[0])
    ):
        for op in ("cancel", "find", "reschedule", "stats"):
            if isinstance(row.get(op), dict) and "median_ms" in row[op]:
                value = float(row[op]["median_ms"])
                rows.append(_row("inspect", f"{op} median ms at {int(size):,}", value, "{:.2f}", "", None))
    return rows


def _row(scenario: str, label: str, value: float, fmt: str, target: str, met: bool | None) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "metric": label,
        "value": value,
        "shown": fmt.format(value),
        "target": target,
        "met": met,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """A plain-text (and Markdown) table of the evaluated rows."""
    lines = ["| scenario | metric | value | target | met |", "|---|---|---:|---|---|"]
    for row in rows:
        met = "" if row["met"] is None else ("yes" if row["met"] else "**no**")
        lines.append(f"| {row['scenario']} | {row['metric']} | {row['shown']} | {row['target']} | {met} |")
    return "\n".join(lines)


def _bars(pairs: list[tuple[str, float]], width: int = 50, unit: str = "") -> list[str]:
    top = max((v for _, v in pairs), default=0) or 1
    return [f"{label:>12} | {'#' * round(width * v / top):<{width}} {v:,.0f}{unit}" for label, v in pairs]


def terminal_charts(results: dict[str, Any]) -> str:
    """Lateness histogram, burst drain and backpressure ramps as text bars."""
    out: list[str] = []
    late = (results.get("precision") or {}).get("lateness_ms") or []
    if late:
        edges = [0.5, 1, 2, 3, 5, 10, 20, 50, float("inf")]
        counts, low = [], float("-inf")
        for edge in edges:
            counts.append(
                (f"<= {edge:g} ms" if edge != float("inf") else "> 50 ms", sum(low < x <= edge for x in late))
            )
            low = edge
        out += ["precision: lateness due -> on list (messages)", *_bars(counts)]
    series = (results.get("burst") or {}).get("series") or []
    if series:
        end = series[-1][0] or 1
        marks = [end * i / 10 for i in range(1, 11)]
        picked = [
            (f"{m:,.0f} ms", float(next((n for t, n in series if t >= m), series[-1][1]))) for m in marks
        ]
        out += ["", "burst: messages on the list after the due time", *_bars(picked)]
    for name in ("max_rate", "max_queue_length"):
        ramp = ((results.get("backpressure") or {}).get(name) or {}).get("moved_per_s_by_half_second") or []
        if ramp:
            pairs = [(f"{0.5 * (i + 1):.1f} s", float(v)) for i, v in enumerate(ramp[:40])]
            out += [
                "",
                f"backpressure ({name.replace('_', '-')}): moved/s per 0.5 s",
                *_bars(pairs, unit="/s"),
            ]
    return "\n".join(out)


def plot(results: dict[str, Any], path: Path) -> bool:
    """Write a PNG of the same charts; return False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    late = (results.get("precision") or {}).get("lateness_ms") or []
    axes[0].hist(late, bins=40)
    axes[0].set(title="precision: due -> on list", xlabel="lateness, ms", ylabel="messages")
    series = (results.get("burst") or {}).get("series") or []
    if series:
        axes[1].plot([t for t, _ in series], [n for _, n in series])
    axes[1].set(title="burst: on the list after due", xlabel="ms after due", ylabel="messages")
    for name in ("max_rate", "max_queue_length"):
        ramp = ((results.get("backpressure") or {}).get(name) or {}).get("moved_per_s_by_half_second") or []
        axes[2].step([0.5 * (i + 1) for i in range(len(ramp))], ramp, label=name.replace("_", "-"))
    axes[2].set(title="backpressure: moved/s per 0.5 s", xlabel="s after due", ylabel="messages/s")
    axes[2].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
