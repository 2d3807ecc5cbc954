"""Admission: a pure decision on whether a request may be queued, from plain numbers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueueState:
    depth: int  # entries waiting or in progress for the model, as last measured
    live_workers: int


@dataclass(frozen=True, slots=True)
class Admitted:
    pass


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str  # the `rejected_total{reason}` label
    message: str
    retry_after_s: float


def admit(state: QueueState, n_inputs: int, max_queue_depth: int) -> Admitted | Rejected:
    """Refuse fast, with a retry hint, rather than queue work that will only time out."""
    if state.live_workers == 0:
        return Rejected("no_workers", "no live worker serves this model right now", 1.0)
    if state.depth + n_inputs > max_queue_depth:
        message = (
            f"queue for this model holds {state.depth} entries; adding {n_inputs} would exceed "
            f"max_queue_depth {max_queue_depth}"
        )
        return Rejected("queue_full", message, 1.0)
    return Admitted()
