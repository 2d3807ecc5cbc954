"""`wall_ms`: the wall clock in epoch milliseconds, as deadlines and enqueue times travel.

Deadlines cross processes and hosts, so they are wall time; durations inside one process are
taken on `time.monotonic` instead.
"""

from __future__ import annotations

import time


def wall_ms() -> int:
    return int(time.time() * 1000)
