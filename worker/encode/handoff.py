"""A batch on its way to a compute thread and back: its rows grouped by entry, its work timed
on the thread that runs it, and, on one stream, a batch queued behind the running one while
it can still be revoked. Plain data and functions; the loop does the scheduling.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from common.clock import wall_ms
from worker.encode.assembly import Assembly
from worker.encode.batching import Batch
from worker.encode.row_queues import Row

Part = tuple[Assembly, list[int], list[int]]  # an entry, its rows' indices, their places


def profile_facts(
    batch: Batch, members: list[Row], start_ms: int, threads: int
) -> dict[str, object]:
    """What a profiled batch's trace says about it: its padding and its rows' queueing."""
    waits_ms = [max(0, start_ms - a.entry.enqueued_ms) for a, _ in members]
    return {
        "bucket": batch.bucket,
        "rows": len(members),
        "longest": batch.padded_tokens // len(members),
        "real_tokens": batch.real_tokens,
        "padded_tokens": batch.padded_tokens,
        "padding_ratio": round(1 - batch.real_tokens / batch.padded_tokens, 4),
        "trigger": batch.trigger,
        "threads": threads,
        "queue_wait_ms_max": max(waits_ms),
        "queue_wait_ms_mean": round(sum(waits_ms) / len(waits_ms), 1),
    }


@dataclass(frozen=True, slots=True)
class Behind:
    """A batch queued behind the running one: its submission, while it can be revoked."""

    future: Future
    batch: Batch
    members: list[Row]
    entries: list[Part]


def timed(work: Callable[[], list]) -> tuple[list, int, float]:
    """`work()`'s results, when it started (epoch ms) and its seconds, timed on the compute
    thread: a batch queued behind another (the loop's `_queue_behind`) must not count its wait as
    compute, or the cost model would learn the wait."""
    start_ms, t0 = wall_ms(), time.perf_counter()
    results = work()
    return results, start_ms, time.perf_counter() - t0


def by_entry(members: list[Row]) -> list[Part]:
    """A batch's members grouped by entry: each entry's row indices and where those rows sit
    in the batch, so a batch's results are handed over an entry at a time."""
    parts: dict[int, Part] = {}
    for place, (assembly, index) in enumerate(members):
        part = parts.get(id(assembly))
        if part is None:
            part = parts[id(assembly)] = (assembly, [], [])
        part[1].append(index)
        part[2].append(place)
    return list(parts.values())
