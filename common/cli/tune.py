"""Pure parts of `microbatch tune`: the sweep grid and the choice under a p99 target."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import product
from typing import Any


def grid(waits_ms: Sequence[float], sizes: Sequence[int]) -> list[dict[str, str]]:
    """Every (max_wait_ms, max_batch_size) pair as live batching overrides."""
    return [
        {"max_wait_ms": f"{w:g}", "max_batch_size": str(s)} for w, s in product(waits_ms, sizes)
    ]


def best_under(
    rows: Sequence[dict[str, Any]], p99_target_ms: float, tie_share: float = 0.02
) -> dict[str, Any] | None:
    """The highest-throughput row whose p99 meets the target and that had no errors.

    Throughputs within `tie_share` of the best count as equal (a shared machine is noisy,
    and below saturation every setting carries the offered load); among those the lowest
    p99 wins.
    """
    eligible = [
        r
        for r in rows
        if r["p99_ms"] is not None and r["p99_ms"] <= p99_target_ms and not r["errors_by_status"]
    ]
    if not eligible:
        return None
    top = max(r["requests_per_s"] for r in eligible)
    tied = [r for r in eligible if r["requests_per_s"] >= top * (1 - tie_share)]
    return min(tied, key=lambda r: r["p99_ms"])
