"""Pure parts of `microbatch tune`: the sweep grid and the choice under a p99 target."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import product


def grid(waits_ms: Sequence[float], sizes: Sequence[int]) -> list[dict[str, str]]:
    """Every (max_wait_ms, max_batch_size) pair as live batching overrides."""
    return [
        {"max_wait_ms": f"{w:g}", "max_batch_size": str(s)} for w, s in product(waits_ms, sizes)
    ]


def best_under(rows: Sequence[dict], p99_target_ms: float) -> dict | None:
    """The highest-throughput row whose p99 meets the target and that had no errors."""
    eligible = [
        r
        for r in rows
        if r["p99_ms"] is not None and r["p99_ms"] <= p99_target_ms and not r["errors_by_status"]
    ]
    return max(eligible, key=lambda r: r["requests_per_s"], default=None)
