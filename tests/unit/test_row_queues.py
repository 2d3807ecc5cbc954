"""The worker's row queues: batches take rows by key, and rows taken back wait where they did."""

from __future__ import annotations

import numpy as np

from common.protocol import RequestEntry, pack_rows
from worker.encode.assembly import Assembly
from worker.encode.row_queues import RowQueues
from worker.held import Held


def _assembly(
    name: str, lengths: list[int], arrived_s: float, deliveries: int = 1, lane: str = ""
) -> Assembly:
    tokens, packed = pack_rows([np.ones(n, dtype=np.uint32) for n in lengths])
    entry = RequestEntry(
        id=name,
        request_id=name,
        model="noop",
        tokens=tokens,
        lengths=packed,
        deadline_ms=0,
        priority=1,
        reply_to="r",
        enqueued_ms=0,
    )
    held = Held(entry, "s", name, arrived_s, 128, deliveries=deliveries, lane=lane)
    return Assembly.of(held)


def test_rows_wait_by_length_then_arrival_and_a_take_leaves_the_rest_in_order() -> None:
    rows = RowQueues([128])
    a, b = _assembly("a", [5, 2, 9], 1.0), _assembly("b", [2, 7], 2.0)
    rows.add(128, a)
    rows.add(128, b)
    view = rows.in_order()[128]
    assert [(w.n_tokens, w.arrived_s) for w in view] == [
        (2, 1.0),
        (2, 2.0),
        (5, 1.0),
        (7, 2.0),
        (9, 1.0),
    ]
    taken = rows.take(128, [view[0].key, view[2].key])
    assert [(x.entry.id, i) for x, i in taken] == [("a", 1), ("a", 0)]
    assert [w.n_tokens for w in rows.in_order()[128]] == [2, 7, 9]
    assert rows.held == 3


def test_rows_put_back_wait_where_they_did_and_a_dropped_entry_leaves_entirely() -> None:
    rows = RowQueues([128])
    a, b = _assembly("a", [5, 2], 1.0), _assembly("b", [3], 2.0)
    rows.add(128, a)
    rows.add(128, b)
    keys = [w.key for w in rows.in_order()[128]]
    taken = rows.take(128, keys[:2])  # a's 2-token row and b's 3-token row
    rows.put_back(128, zip(keys[:2], taken, strict=True))
    assert [(w.key, w.n_tokens) for w in rows.in_order()[128]] == [
        (keys[0], 2),
        (keys[1], 3),
        (keys[2], 5),
    ]
    assert rows.drop(a) == 2
    assert [w.n_tokens for w in rows.in_order()[128]] == [3]
    assert rows.held == 1


def test_a_redelivered_entry_s_rows_wait_apart_and_run_one_at_a_time() -> None:
    rows = RowQueues([128])
    fresh, again = _assembly("fresh", [3, 4], 1.0), _assembly("again", [6, 2], 2.0, deliveries=2)
    rows.add(128, fresh)
    rows.add(128, again)
    assert [w.n_tokens for w in rows.in_order()[128]] == [3, 4]  # no batch grows into them
    assert rows.held == 4
    first = rows.lone()
    assert first is not None and first.keys == (2,) and first.trigger == "alone"
    assert first.padded_tokens == 6 and first.bucket == 128
    assert rows.take(128, first.keys) == [(again, 0)]
    second = rows.lone()
    assert second is not None and second.keys == (3,)
    rows.drop(again)  # cancelled: its rows leave the lone queue too
    assert rows.lone() is None and rows.held == 2


def test_a_light_tenants_row_goes_before_a_batch_queued_behind_the_running_one() -> None:
    """Fair order's virtual time is the batch in service's, not the one queued behind it:
    a row of an idle tenant that arrives while a batch runs and another waits behind it is
    placed before the waiting one's rows (so the loop revokes it and the row joins the next
    batch). Moved by the queued batch, the time put that row after it, a whole batch later:
    B's p50 beside a saturating A was 1.76x alone, 1.15x since (benchmarks/tenant_fairness.py)."""
    rows = RowQueues([128])
    heavy = _assembly("a", [4] * 8, 1.0, lane="A")
    rows.add(128, heavy)
    keys = [w.key for w in rows.in_order()[128]]
    rows.take(128, keys[:4])  # the running batch
    rows.take(128, keys[4:], started=False)  # the batch queued behind it
    light = _assembly("b", [4], 2.0, lane="B")
    rows.add(128, light)
    assert rows.ahead_of(light) < rows.latest(keys[4:])
    rows.started(keys[4:])  # the queued batch starts: the time moves past it
    later = _assembly("c", [4], 3.0, lane="C")
    rows.add(128, later)
    assert rows.ahead_of(later) > rows.latest(keys[4:])
