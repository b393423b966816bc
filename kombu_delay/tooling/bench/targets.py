"""The benchmark's targets: one row per reported figure, with its target where it has one."""

from __future__ import annotations

from collections.abc import Callable

#: (scenario, metric label, path into the results, format, target text, check).
Row = tuple[str, str, tuple[str, ...], str, str, Callable[[float], bool] | None]


def zero(v: float) -> bool:
    """The check of a count that must be none."""
    return v == 0


def _herd_rows(case: str, label: str) -> list[Row]:
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
        ("early", "early", "{:.0f}", "= 0", lambda v: v == 0),
        ("lost", "lost", "{:.0f}", "= 0", lambda v: v == 0),
        ("doubled", "doubled", "{:.0f}", "= 0", lambda v: v == 0),
    ]
    return [("herd", f"{label}: {name}", ("herd", case, key), fmt, t, c) for name, key, fmt, t, c in rows]


def _backpressure_rows() -> list[Row]:
    """The rows of the backpressure scenario, each ramp's deliveries counted by task id."""
    rows: list[Row] = []
    for ramp, label in (("max_rate", "max-rate"), ("max_queue_length", "max-queue-length")):
        figure = "peak_per_s" if ramp == "max_rate" else "longest_list"
        shown = "peak moved/s" if ramp == "max_rate" else "longest list"
        rows.append(
            ("backpressure", f"{label}: {shown}", ("backpressure", ramp, figure), "{:,.0f}", "", None)
        )
        for name, key in (
            ("lost", "lost"),
            ("doubled", "doubled"),
            ("delivered - published", "delivered_minus_messages"),
        ):
            path = ("backpressure", ramp, key)
            rows.append(("backpressure", f"{label}: {name}", path, "{:.0f}", "= 0", lambda v: v == 0))
    return rows


def _e2e_rows() -> list[Row]:
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


def _scale_rows() -> list[Row]:
    """The rows of the scale scenario: figures at the small and at the large size, and the
    ratios of the two that the targets read."""

    def both(label: str, key: str, fmt: str) -> list[Row]:
        return [
            ("scale", f"{label}, {size}", ("scale", size, key), fmt, "", None) for size in ("small", "large")
        ]

    def large(label: str, key: str, fmt: str) -> Row:
        return ("scale", label, ("scale", "large", key), fmt, "", None)

    def ratio(label: str, path: tuple[str, ...], limit: float | None) -> Row:
        if limit is None:
            return ("scale", label, ("scale", *path), "{:.2f}", "", None)
        return ("scale", label, ("scale", *path), "{:.2f}", f"<= {limit:g}", lambda v: v <= limit)

    inspection = ("stats", "ls_first_page", "find", "cancel", "health")
    return [
        *both("kombu publish, Redis CPU µs", "publish_kombu_redis_cpu_us", "{:.1f}"),
        ratio("kombu publish cost large / small", ("kombu_publish_ratio",), 1.2),
        *both("pipelined publish, Redis CPU µs", "publish_redis_cpu_us", "{:.1f}"),
        ratio("pipelined publish cost large / small", ("publish_ratio",), None),
        *both("messages already in each timed publish's set", "publish_bucket_members_mean", "{:.1f}"),
        *(
            (
                "scale",
                f"timed messages not moved, {size}",
                ("scale", size, "not_moved"),
                "{:,.0f}",
                "= 0",
                zero,
            )
            for size in ("small", "large")
        ),
        *both("move, Redis CPU µs/msg", "move_redis_cpu_us_per_msg", "{:.1f}"),
        ratio("move cost large / small", ("move_ratio",), 1.2),
        ratio("same, Redis wall µs: publish ratio", ("publish_server_ratio",), None),
        ratio("same, Redis wall µs: move ratio", ("move_server_ratio",), None),
        large("scheduled, large", "scheduled", "{:,.0f}"),
        large("fill time, large, s", "fill_s", "{:,.0f}"),
        large("the mover's walk of the id index, large, s", "walk_s", "{:,.0f}"),
        large("Redis used_memory, large, MB", "used_memory_mb", "{:,.0f}"),
        large("Redis RSS, large, MB", "redis_rss_mb", "{:,.0f}"),
        large("used_memory per msg, large", "used_memory_per_msg", "{:.0f}"),
        ratio("memory per msg, large / middle", ("memory_per_msg_ratio",), 1.05),
        *(ratio(f"{op} ms, large / small", ("inspection_ratio", op), 2) for op in inspection),
        large("mover RSS at large, MB", "mover_rss_mb", "{:.1f}"),
        *both("idle mover, Redis CPU ms/s", "mover_idle_redis_cpu_ms_per_s", "{:.2f}"),
    ]


ROWS: list[Row] = [
    ("publish", "plain redis:// publishes/s", ("publish", "plain_per_s"), "{:,.0f}", "", None),
    (
        "publish",
        "delayed publishes/s, 1 h ahead (compressed)",
        ("publish", "delayed_per_s"),
        "{:,.0f}",
        "",
        None,
    ),
    ("publish", "delayed / plain, 1 h ahead", ("publish", "ratio"), "{:.2f}", ">= 0.9", lambda v: v >= 0.9),
    ("publish", "delayed publishes/s, 30 s ahead", ("publish", "near_per_s"), "{:,.0f}", "", None),
    (
        "publish",
        "delayed / plain, 30 s ahead",
        ("publish", "near_ratio"),
        "{:.2f}",
        ">= 0.9",
        lambda v: v >= 0.9,
    ),
    ("publish", "Redis CPU µs, plain publish", ("publish", "plain_redis_cpu_us"), "{:.1f}", "", None),
    (
        "publish",
        "Redis CPU µs, delayed publish, 1 h ahead",
        ("publish", "delayed_redis_cpu_us"),
        "{:.1f}",
        "",
        None,
    ),
    (
        "publish",
        "Redis CPU µs, delayed publish, 30 s ahead",
        ("publish", "near_redis_cpu_us"),
        "{:.1f}",
        "",
        None,
    ),
    ("precision", "lateness p50, ms", ("precision", "p50_ms"), "{:.2f}", "", None),
    ("precision", "lateness p99, ms", ("precision", "p99_ms"), "{:.2f}", "<= 5", lambda v: v <= 5),
    ("precision", "lateness max, ms", ("precision", "max_ms"), "{:.2f}", "", None),
    ("precision", "early arrivals", ("precision", "early"), "{:.0f}", "= 0", lambda v: v == 0),
    ("precision", "lost", ("precision", "lost"), "{:.0f}", "= 0", lambda v: v == 0),
    ("precision", "doubled", ("precision", "doubled"), "{:.0f}", "= 0", lambda v: v == 0),
    ("burst", "due -> all on list, s", ("burst", "drain_s"), "{:.3f}", "", None),
    (
        "burst",
        "moved/s, one mover",
        ("burst", "moved_per_s"),
        "{:,.0f}",
        ">= 200,000",
        lambda v: v >= 200_000,
    ),
    ("burst", "early (on the list before due)", ("burst", "early"), "{:.0f}", "= 0", lambda v: v == 0),
    ("burst", "lost", ("burst", "lost"), "{:.0f}", "= 0", lambda v: v == 0),
    ("burst", "doubled", ("burst", "doubled"), "{:.0f}", "= 0", lambda v: v == 0),
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
        "uncompressed: of which sorted sets (beyond the member)",
        ("memory", "uncompressed_buckets_beyond_member_per_msg"),
        "{:.0f}",
        "",
        None,
    ),
    (
        "memory",
        "uncompressed: sorted sets, of which jemalloc rounding (computed)",
        ("memory", "uncompressed_allocator_rounding_bytes"),
        "{:.0f}",
        "",
        None,
    ),
    (
        "memory",
        "uncompressed: sorted sets, of which entry (computed: the rest)",
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
    ("thaw", "moved/s, first -> last move, Redis clock", ("thaw", "moved_per_s"), "{:,.0f}", "", None),
    ("thaw", "move span, ms", ("thaw", "move_span_ms"), "{:.1f}", "", None),
    ("thaw", "largest sample gap in it, ms", ("thaw", "move_sample_gap_ms"), "{:.1f}", "", None),
    ("thaw", "early arrivals", ("thaw", "early"), "{:.0f}", "= 0", lambda v: v == 0),
    ("thaw", "lost", ("thaw", "lost"), "{:.0f}", "= 0", lambda v: v == 0),
    ("thaw", "doubled", ("thaw", "doubled"), "{:.0f}", "= 0", lambda v: v == 0),
    (
        "cpu",
        "idle Redis CPU taken off each figure, ms/s",
        ("cpu", "idle_redis_cpu_ms_per_s"),
        "{:.2f}",
        "",
        None,
    ),
    (
        "cpu",
        "plain publish, Redis CPU µs (beside the schedule)",
        ("cpu", "plain_redis_cpu_us_beside_schedule"),
        "{:.1f}",
        "",
        None,
    ),
    ("cpu", "plain publish, of which user space, µs", ("cpu", "plain_redis_user_us"), "{:.1f}", "", None),
    (
        "cpu",
        "steady: plain publish's rounds, max / min",
        ("cpu", "plain_rounds_spread"),
        "{:.2f}",
        "<= 1.5",
        lambda v: v <= 1.5,
    ),
    (
        "cpu",
        "steady: plain publish's two halves differ, %",
        ("cpu", "plain_halves_differ_pct"),
        "{:.0f}",
        "<= 15",
        lambda v: v <= 15,
    ),
    ("cpu", "schedule, Redis CPU µs", ("cpu", "schedule_redis_cpu_us"), "{:.1f}", "", None),
    ("cpu", "schedule, of which user space, µs", ("cpu", "schedule_redis_user_us"), "{:.1f}", "", None),
    ("cpu", "move, Redis CPU µs", ("cpu", "move_redis_cpu_us"), "{:.1f}", "", None),
    (
        "cpu",
        "delayed (schedule + move) / plain",
        ("cpu", "delayed_ratio"),
        "{:.2f}",
        "<= 2",
        lambda v: v <= 2,
    ),
    ("cpu", "same, gross (idle CPU left in)", ("cpu", "delayed_ratio_gross"), "{:.2f}", "", None),
    ("cpu", "delayed - plain, Redis CPU µs", ("cpu", "delayed_minus_plain_us"), "{:.1f}", "", None),
    (
        "cpu",
        "plain publish, Redis CPU µs (beside the compressed schedule)",
        ("cpu", "plain_redis_cpu_us_beside_compressed"),
        "{:.1f}",
        "",
        None,
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
    ("cpu", "same, gross (idle CPU left in)", ("cpu", "compressed_ratio_gross"), "{:.2f}", "", None),
    ("cpu", "floor: bare Lua move, Redis CPU µs", ("cpu", "floor_move_redis_cpu_us"), "{:.1f}", "", None),
    ("cpu", "floor: bare LPUSH, Redis CPU µs", ("cpu", "floor_lpush_redis_cpu_us"), "{:.1f}", "", None),
    ("cpu", "floor: bare ZADD, Redis CPU µs", ("cpu", "floor_zadd_redis_cpu_us"), "{:.1f}", "", None),
    (
        "cpu",
        "floor: a script call of one ZADD, Redis CPU µs",
        ("cpu", "floor_script_zadd_redis_cpu_us"),
        "{:.1f}",
        "",
        None,
    ),
    (
        "cpu",
        "floor: delayed / plain, were the schedule that call",
        ("cpu", "floor_delayed_ratio"),
        "{:.2f}",
        "",
        None,
    ),
    *_herd_rows("default", "default settings"),
    *_herd_rows("short_ahead", "short thaw-ahead"),
    *_scale_rows(),
    *_backpressure_rows(),
    *_e2e_rows(),
]
