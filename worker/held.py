"""`Held`: an entry a worker has read and not yet answered, as its loop keeps it.

Plain data, apart from the intake that makes them, so the bookkeeping built on it (an
entry's assembly, the row queues) stays pure: no Redis, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.triage import Entry


@dataclass(slots=True)
class Held:
    entry: Entry
    stream: str
    entry_id: str
    arrived_s: float  # monotonic time the worker read it
    bucket: int
    # deliveries so far; past the first, a worker may have died computing it (a poison input
    # that crashes or OOMs the process), so it runs alone: no batch-mate dies with it again
    deliveries: int = 1
    span: Any = None  # its `process entry` span, when tracing is on (worker.entry_spans)
    lane: str = ""  # the tenant whose lane it came from ("": a bucket stream)
    weight: float = 1.0  # that tenant's weight: its share of the batches

    @property
    def alone(self) -> bool:
        return self.deliveries > 1
