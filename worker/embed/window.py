"""How far ahead a worker reads: what it can start within the latency target, no more.

A worker reads entries into its own queues so it can sort them by length (`sort_window`),
but every entry it holds is one no peer can take. A worker that reads a full window while
it computes one batch at a time holds entries it will start only several batches later,
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


class ServiceRate:
    """Entries per second of compute on one stream, over the last `window` batches.

    None until `min_batches` are seen: before that the window is `sort_window` as before.
    Short batches under light load understate what the worker could do; that only makes the
    window its floor (a full batch per stream) while nothing is waiting anyway.
    """

    def __init__(self, window: int = 32, min_batches: int = 4) -> None:
        self._seen: deque[tuple[int, float]] = deque(maxlen=window)
        self._min = min_batches
        self._entries = 0
        self._seconds = 0.0

    def observe(self, entries: int, seconds: float) -> None:
        if not (entries > 0 and seconds > 0 and math.isfinite(seconds)):
            return
        if len(self._seen) == self._seen.maxlen:
            old_entries, old_seconds = self._seen[0]
            self._entries -= old_entries
            self._seconds -= old_seconds
        self._seen.append((entries, seconds))
        self._entries += entries
        self._seconds += seconds

    def per_second(self) -> float | None:
        if len(self._seen) < self._min:
            return None
        return self._entries / max(self._seconds, 1e-9)


def read_window(
    *,
    sort_window: int,
    max_batch_size: int,
    streams: int,
    entries_per_s: float | None,
    horizon_s: float,
) -> int:
    """Entries a worker may hold read and not started.

    `entries_per_s` is one compute stream's measured rate (None: not measured yet), so the
    worker starts `entries_per_s x streams x horizon_s` entries within the horizon.
    """
    ceiling = max(max_batch_size, sort_window)
    if entries_per_s is None:
        return ceiling
    floor = max_batch_size * streams
    soon = math.ceil(entries_per_s * streams * horizon_s)
    return min(ceiling, max(floor, soon))
