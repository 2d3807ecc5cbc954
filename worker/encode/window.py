"""How far ahead a worker reads: what it can start within the latency target, no more.

A worker reads rows into its own queues so it can sort them by length (`sort_window`, in
rows; an entry brings its request's rows of one bucket), but every row it holds is one no
peer can take. A worker that reads a full window while it computes one batch at a time
holds rows it will start only several batches later,
while a peer that read second runs short batches or none: under a backlog the load spreads
unevenly and the fleet serves less than its sum. So the window is also bounded by the
worker's measured rate: what it can start within `latency_slo_s`, and never less than one
full batch per compute stream (the next batch of each must be there when it comes free).
What the worker does not hold stays on the stream for whichever peer has room, and counts
as lag for an autoscaler. Plain arithmetic over numbers the loop feeds it: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import deque


class ComputeRate:
    """Rows per second of compute on one stream, over the last `window` batches.

    None until `min_batches` are seen: before that the window is `sort_window` as before.
    Short batches under light load understate what the worker could do; that only makes the
    window its floor (a full batch per stream) while nothing is waiting anyway.
    """

    def __init__(self, window: int = 32, min_batches: int = 4) -> None:
        self._seen: deque[tuple[int, float]] = deque(maxlen=window)
        self._min = min_batches
        self._rows = 0
        self._seconds = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        if not (rows > 0 and seconds > 0 and math.isfinite(seconds)):
            return
        if len(self._seen) == self._seen.maxlen:
            old_rows, old_seconds = self._seen[0]
            self._rows -= old_rows
            self._seconds -= old_seconds
        self._seen.append((rows, seconds))
        self._rows += rows
        self._seconds += seconds

    def per_second(self) -> float | None:
        if len(self._seen) < self._min:
            return None
        return self._rows / max(self._seconds, 1e-9)


def read_window(
    *,
    sort_window: int,
    max_batch_size: int,
    streams: int,
    rows_per_s: float | None,
    horizon_s: float,
) -> int:
    """Rows a worker may hold read and not started.

    `rows_per_s` is one compute stream's measured rate (None: not measured yet), so the
    worker starts `rows_per_s x streams x horizon_s` rows within the horizon.
    """
    ceiling = max(max_batch_size, sort_window)
    if rows_per_s is None:
        return ceiling
    floor = max_batch_size * streams
    soon = math.ceil(rows_per_s * streams * horizon_s)
    return min(ceiling, max(floor, soon))
