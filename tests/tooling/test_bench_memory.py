"""The memory scenario's split of the uncompressed sorted sets (no Redis: the figures given)."""

from __future__ import annotations

from kombu_delay.tooling.bench.memory import rounding_split
from kombu_delay.tooling.bench.report import evaluate


def test_the_allocator_rounding_is_computed_only_for_jemalloc_and_said_so() -> None:
    # It always read 257 (jemalloc's size class of a 1,023-byte member, whatever the allocator),
    # and the sorted-set entry, the measured bytes minus that class, read -153 on libc malloc.
    figures, note = rounding_split("libc", 1023, 1127.0)
    assert figures == {}
    assert "Redis's allocator is libc, not jemalloc" in note
    figures, note = rounding_split("jemalloc-5.3.0", 1023, 1368.0)
    assert figures == {
        "uncompressed_allocator_rounding_bytes": 257,
        "uncompressed_sorted_set_structure_bytes": 88,
    }
    assert note == ""
    figures, note = rounding_split("jemalloc-5.3.0", 1023, 1127.0)  # less than the class: no split
    assert figures == {} and "not split" in note


def test_the_table_labels_the_computed_figures_and_shows_the_measured_one() -> None:
    measured = {"uncompressed_buckets_beyond_member_per_msg": 345.0}
    rows = {row["metric"] for row in evaluate({"memory": measured})}
    assert rows == {"uncompressed: of which sorted sets (beyond the member)"}
    computed = rounding_split("jemalloc-5.3.0", 1023, 1368.0)[0]
    rows = {row["metric"] for row in evaluate({"memory": {**measured, **computed}})}
    assert {row for row in rows if "rounding" in row or "entry" in row} == {
        "uncompressed: sorted sets, of which jemalloc rounding (computed)",
        "uncompressed: sorted sets, of which entry (computed: the rest)",
    }
