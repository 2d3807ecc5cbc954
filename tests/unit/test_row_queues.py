"""The worker's row queues: batches take rows by key, and rows taken back wait where they did."""

from __future__ import annotations

import numpy as np

from common.protocol import RequestEntry, pack_rows
from worker.encode.assembly import Assembly
from worker.encode.row_queues import RowQueues
from worker.held import Held


def _assembly(name: str, lengths: list[int], arrived_s: float, deliveries: int = 1) -> Assembly:
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
    return Assembly.of(Held(entry, "s", name, arrived_s, 128, deliveries=deliveries))


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
