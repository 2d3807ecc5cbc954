"""Admission refuses fast, with a retry hint."""

from __future__ import annotations

from gateway.admission import Admitted, QueueState, Rejected, admit


def test_room_in_the_queue_admits() -> None:
    assert admit(QueueState(depth=10, live_workers=1), 5, 100) == Admitted()


def test_a_full_queue_rejects_with_retry_after() -> None:
    decision = admit(QueueState(depth=98, live_workers=2), 5, 100)
    assert isinstance(decision, Rejected)
    assert decision.reason == "queue_full"
    assert decision.retry_after_s > 0
    assert "max_queue_depth 100" in decision.message


def test_no_live_worker_rejects() -> None:
    decision = admit(QueueState(depth=0, live_workers=0), 1, 100)
    assert isinstance(decision, Rejected)
    assert decision.reason == "no_workers"
