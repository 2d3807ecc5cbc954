"""`Held`: an entry a worker has read and not yet answered, as its loop keeps it.

Plain data, apart from the intake that makes them, so the bookkeeping built on it (an
entry's assembly, the row queues) stays pure: no Redis, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.triage import Entry


@dataclass(slots=True)
class Held:
    entry: Entry
    stream: str
    entry_id: str
    arrived_s: float  # monotonic time the worker read it
    bucket: int
