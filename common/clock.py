"""`wall_ms`: the wall clock in epoch milliseconds, as deadlines and enqueue times travel.

Deadlines cross processes and hosts, so they are wall time; durations inside one process are
taken on `time.monotonic` instead.
"""

from __future__ import annotations

import os
import time

_IMPORTED_S = time.monotonic()


def wall_ms() -> int:
    return int(time.time() * 1000)


def process_age_s() -> float:
    """Seconds since this process started, interpreter and imports included (Linux's
    /proc); elsewhere, since this module was imported."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command's name
            started_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
            return max(0.0, float(uptime.read().split()[0]) - started_s)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_S
