"""Length buckets: the one rule both roles share for which stream an input belongs to."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


def bucket_for(n_tokens: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `n_tokens`, or None when it is longer than all."""
    i = bisect_left(buckets, n_tokens)
    return buckets[i] if i < len(buckets) else None


def parts(lengths: Sequence[int], buckets: Sequence[int], max_rows: int) -> list[list[int]]:
    """A request's rows grouped for queueing: the row indices of each entry, one bucket per
    entry, at most `max_rows` rows each and a bucket's rows split evenly, in input order.
    Rows past the largest bucket share it (the gateway refuses them before they get here)."""
    by_bucket: dict[int, list[int]] = {}
    for index, n in enumerate(lengths):
        by_bucket.setdefault(bucket_for(n, buckets) or buckets[-1], []).append(index)
    out: list[list[int]] = []
    for _, rows in sorted(by_bucket.items()):
        n, count = len(rows), -(-len(rows) // max_rows)
        out.extend(rows[i * n // count : (i + 1) * n // count] for i in range(count))
    return out
