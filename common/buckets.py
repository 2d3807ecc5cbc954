"""Length buckets: the one rule both roles share for which stream an input belongs to."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


def bucket_for(n_tokens: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `n_tokens`, or None when it is longer than all."""
    i = bisect_left(buckets, n_tokens)
    return buckets[i] if i < len(buckets) else None
