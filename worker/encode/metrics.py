"""`BatchMetrics`: a model's batch metrics, each bucket's series looked up once.

A label lookup costs a few microseconds and a batch observes five series: at thousands of
batches a second that was a measurable share of a worker's event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from prometheus_client import Histogram

from common import metrics


class Series(NamedTuple):
    batch_size: Histogram
    batch_tokens: Histogram
    padding_ratio: Histogram
    compute_seconds: Histogram
    queue_wait: Histogram


_METRICS = (
    metrics.batch_size,
    metrics.batch_tokens,
    metrics.padding_ratio,
    metrics.compute_seconds,
    metrics.queue_wait_seconds,
)


class BatchMetrics:
    def __init__(self, model: str) -> None:
        self._model = model
        self._by_bucket: dict[int, Series] = {}

    def of(self, bucket: int) -> Series:
        series = self._by_bucket.get(bucket)
        if series is None:
            labels = (self._model, str(bucket))
            series = self._by_bucket[bucket] = Series(*(m.labels(*labels) for m in _METRICS))
        return series


def computed_tokens(padded_tokens: int, size: int, width: Callable[[int], int] | None) -> int:
    """Padded tokens as the runner computed them: the longest row rounded up to its grid
    (bfloat16 on a CPU; `width`, where the runner has one), which the policy, choosing
    among lengths, leaves out."""
    longest = padded_tokens // size
    return (width(longest) if width is not None else longest) * size
