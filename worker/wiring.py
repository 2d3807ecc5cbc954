"""`Wiring`: what a loop is connected to, handed over by the composition root.

A loop talks outward through these three and nothing else: it waits on its `inbox` (and
reads the cancel set and live settings posted there), hands outcomes to the `publisher`,
and reports a batch that died of a bug to the `supervisor`. None of them can call back
into the loop. Traced, it also has `spans`, where its batches and entries' events go.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.entry_spans import EntrySpans
from worker.inbox import Inbox
from worker.publisher import Publisher
from worker.supervisor import Supervisor


@dataclass(frozen=True, slots=True)
class Wiring:
    name: str  # this worker's consumer name, on its replies and batch ids
    model: str  # the served model name, on its metrics
    inbox: Inbox
    publisher: Publisher
    supervisor: Supervisor
    spans: EntrySpans | None = None  # None: tracing is off
