"""The memory scenario: Redis memory per scheduled message, compressed and not, against floors."""

from __future__ import annotations

import math
import random
import statistics
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import click

from kombu_delay.store import cold
from kombu_delay.tooling.bench.ctx import Ctx
from kombu_delay.tooling.bench.env import QUEUE, fill, now_ms


def memory(ctx: Ctx) -> dict[str, Any]:
    """Redis used_memory per scheduled message, beyond its payload, ids index included:
    stored compressed (the default for messages due this far ahead), then uncompressed."""
    ctx.fresh()
    n = ctx.sizes.memory
    start = int(now_ms()) + 600_000
    messages = []
    for _ in range(n):
        due_ms = start + random.randrange(3_600_000)
        messages.append((due_ms, *ctx.payloads.make(due_ms)))
    payloads = [payload for _, _, payload in messages]
    payload = statistics.fmean(len(p.encode()) for p in payloads)
    ns = ctx.store.ns

    # The default settings: due 10-70 min ahead, every message is stored compressed.
    before = ctx.probe.used_memory()
    count, fill_s = fill(ctx.store, ctx.settings, iter(messages))
    per = (ctx.probe.used_memory() - before) / count
    ctx.fill_rate = count / max(fill_s, 1e-6)
    ids_bytes = ctx.probe.sizes_of(f"{ns}ids")
    cold_bytes = ctx.probe.sizes_of(f"{ns}cz:*")
    member = statistics.fmean(len(cold.pack(p, task_id) or b"") for _, task_id, p in messages)
    result: dict[str, Any] = {
        "messages": count,
        "payload_bytes": payload,
        "stored_compressed": _members_of(ctx, f"{ns}cz:*"),
        "used_memory_per_msg": per,
        "overhead_per_msg": per - payload,
        "beyond_member_per_msg": per - member,
        "compressed_member_bytes": member,
        "compressed_sets_per_msg": cold_bytes / count,
        "ids_index_per_msg": ids_bytes / count,
        "other_per_msg": per - (ids_bytes + cold_bytes) / count,
    }

    # The same messages with compression off: the layout movers move from, and the one a
    # message due sooner than delay_compress_after is stored in.
    ctx.probe.flush()
    before = ctx.probe.used_memory()
    count, _ = fill(ctx.store, replace(ctx.settings, compress_after_ms=0), iter(messages))
    per = (ctx.probe.used_memory() - before) / count
    ids_bytes = ctx.probe.sizes_of(f"{ns}ids")
    bucket_bytes = ctx.probe.sizes_of(f"{ns}z:*")
    task_list_bytes = ctx.probe.sizes_of(f"{ns}t:*")
    plain_member = payload  # the member is the payload itself
    result.update(
        {
            "uncompressed_stored": _members_of(ctx, f"{ns}z:*"),
            "uncompressed_used_memory_per_msg": per,
            "uncompressed_overhead_per_msg": per - payload,
            "uncompressed_ids_index_per_msg": ids_bytes / count,
            "uncompressed_buckets_per_msg": bucket_bytes / count,
            "uncompressed_buckets_beyond_member_per_msg": bucket_bytes / count - plain_member,
            "uncompressed_task_id_lists_per_msg": task_list_bytes / count,
            "uncompressed_other_per_msg": per - (ids_bytes + bucket_bytes + task_list_bytes) / count,
        }
    )
    allocator = str(ctx.probe.info("memory").get("mem_allocator", "unknown"))
    split, note = rounding_split(allocator, plain_member, bucket_bytes / count)
    result.update({"allocator": allocator, **split})
    if note:
        result["allocator_note"] = note
        click.echo(f"memory: {note}")
    # For scale, the same payloads in the structures a layout can be made of: the list plain
    # kombu pushes them onto; a bare sorted set of them (the floor of any layout that keeps
    # the message itself as a sorted-set member); and a sorted set of task ids alone (the
    # floor of the index of a layout that would keep the payloads elsewhere).
    ctx.probe.flush()
    plain = _grown(ctx, lambda: ctx.probe.lpush_ceiling(payloads))
    ctx.probe.flush()
    bare = _grown(ctx, lambda: ctx.probe.zadd_all(QUEUE, payloads))
    ctx.probe.flush()
    ids = [str(uuid.uuid4()) for _ in range(count)]
    id_set = _grown(ctx, lambda: ctx.probe.zadd_all(QUEUE, ids))
    ctx.probe.flush()
    result["plain_list_overhead_per_msg"] = plain / count - payload
    result["bare_sorted_set_overhead_per_msg"] = bare / count - payload
    result["task_id_sorted_set_per_msg"] = id_set / count
    return result


def _members_of(ctx: Ctx, pattern: str) -> int:
    """How many members the sorted sets matching ``pattern`` hold together."""
    client = ctx.probe.client
    return sum(int(client.zcard(key)) for key in client.scan_iter(match=pattern, count=1000))


def _grown(ctx: Ctx, fill: Callable[[], object]) -> int:
    """Redis ``used_memory`` growth, in bytes, while ``fill`` runs."""
    before = ctx.probe.used_memory()
    fill()
    return ctx.probe.used_memory() - before


def rounding_split(allocator: str, member: float, buckets_per_msg: float) -> tuple[dict[str, float], str]:
    """Split the uncompressed buckets' bytes per message (measured) into the allocator's
    rounding of the member and the sorted-set entry: computed, from jemalloc's size classes,
    so only where Redis uses jemalloc (``INFO memory``'s ``mem_allocator``), and only where
    the rest is not below zero. Returns the figures, and else a note that says why none."""
    if not allocator.startswith("jemalloc"):
        return {}, (
            f"Redis's allocator is {allocator}, not jemalloc: the uncompressed sorted sets are not "
            "split into allocator rounding and sorted-set entry (that split is computed from "
            "jemalloc's size classes)"
        )
    # jemalloc hands out size classes: a member of this length is stored in the next one.
    # (Compressed members vary in length, so one class says nothing about them.)
    size_class = _size_class(member + 6)
    entry = buckets_per_msg - size_class
    if entry < 0:
        return {}, (
            f"the uncompressed sorted sets hold {buckets_per_msg:.0f} bytes per message, less than "
            f"jemalloc's size class of the member ({size_class}): not split"
        )
    return {
        "uncompressed_allocator_rounding_bytes": size_class - member,
        "uncompressed_sorted_set_structure_bytes": entry,
    }, ""


def _size_class(size: float) -> int:
    """jemalloc's size class for an allocation of ``size`` bytes (four classes per doubling)."""
    n = math.ceil(size)
    if n <= 16:
        return max(8, 8 * math.ceil(n / 8))
    if n <= 128:
        return 16 * math.ceil(n / 16)
    spacing: int = 1 << (math.ceil(math.log2(n)) - 3)
    return spacing * math.ceil(n / spacing)
