"""The benchmark's output: the results table with its targets, terminal charts, and a PNG.

The charts are always drawn in the terminal; the PNG needs matplotlib (the
``plot`` extra).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kombu_delay.tooling.bench.targets import ROWS


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
        # A figure with a target that could not be measured (NaN: a herd never all on its list)
        # misses it: it is no "met" left blank.
        met = None if check is None else not math.isnan(value) and bool(check(value))
        rows.append(_row(scenario, label, value, fmt, target, met))
    return rows + _inspect_rows(results) + _web_rows(results) + _drain_rows(results)


#: The inspect scenario's operations, as its rows name them.
INSPECT_OPS = {
    "cancel": "cancel",
    "find": "find",
    "reschedule": "reschedule",
    "stats": "stats",
    "ls_page_100": "ls (a page of 100)",
    "ls_queue_page_100": "ls --queue (a page of 100)",
}


def _inspect_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The median latency of each inspection at each size."""
    rows = []
    sizes = ((results.get("inspect") or {}).get("sizes") or {}).items()
    for size, row in sorted(sizes, key=lambda item: int(item[0])):
        for op, label in INSPECT_OPS.items():
            if isinstance(row.get(op), dict) and "median_ms" in row[op]:
                value = float(row[op]["median_ms"])
                rows.append(_row("inspect", f"{label} median ms at {int(size):,}", value, "{:.2f}", "", None))
    return rows


def _web_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The dashboard's server time of each page: median and p99."""
    web = results.get("web") or {}
    rows = []
    for page, figures in (web.get("pages") or {}).items():
        at = f"{int(web.get('scheduled') or 0):,} scheduled"
        for key, name in (("median_ms", "median"), ("p99_ms", "p99")):
            if isinstance(figures, dict) and key in figures:
                label = f"{page}: {name} server ms, {at}"
                rows.append(_row("web", label, float(figures[key]), "{:.2f}", "", None))
    return rows


def _drain_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each drain variant's tasks that ran exactly once (target: all of them) and its early
    starts (target: none)."""
    rows = []
    for name, variant in ((results.get("drain") or {}).get("variants") or {}).items():
        n = int(variant["tasks"])
        once = float(variant["ran_once"])
        rows.append(_row("drain", f"{name}: tasks that ran once", once, "{:,.0f}", f"all {n:,}", once == n))
        early = float(variant["early"])
        rows.append(_row("drain", f"{name}: early starts", early, "{:.0f}", "= 0", early == 0))
    return rows


def _row(scenario: str, label: str, value: float, fmt: str, target: str, met: bool | None) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "metric": label,
        "value": value,
        "shown": "not measured" if math.isnan(value) else fmt.format(value),
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
