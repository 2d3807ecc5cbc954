"""Fair shares between tenants' lanes where a worker reads: the room split by weight, a lane
far ahead sits out, no credit for idle time, and a lane alone is never held back."""

from __future__ import annotations

import pytest

from common.protocol import GenerateEntry, RequestEntry
from worker.lane_shares import SLACK_TOKENS, LaneShares, cost_of

pytestmark = pytest.mark.unit


def _shares(**weights: float) -> LaneShares:
    shares = LaneShares()
    shares.set_weights(weights)
    return shares


def test_the_room_is_split_by_weight_one_entry_at_least() -> None:
    shares = _shares(a=3, b=1, c=1)
    assert shares.counts(50) == {"a": 30, "b": 10, "c": 10}
    assert shares.counts(2) == {"a": 1, "b": 1, "c": 1}  # every lane is polled


def test_a_lane_far_ahead_sits_out_until_the_others_catch_up() -> None:
    shares = _shares(a=1, b=1)
    shares.read({"a", "b"}, {"a": int(SLACK_TOKENS) + 100, "b": 10})
    assert shares.counts(10) == {"b": 10}  # a read more tokens: b's turn
    shares.read({"b"}, {"b": int(SLACK_TOKENS)})
    assert shares.counts(10) == {"a": 5, "b": 5}  # level again


def test_weights_scale_what_a_token_counts() -> None:
    shares = _shares(a=4, b=1)
    # a reads 4x b's tokens, which at weight 4 is the same virtual count
    shares.read({"a", "b"}, {"a": 4 * int(SLACK_TOKENS), "b": int(SLACK_TOKENS)})
    assert set(shares.counts(10)) == {"a", "b"}


def test_a_lane_back_from_idle_gets_no_credit_for_its_idle_time() -> None:
    shares = _shares(a=1, b=1)
    for _ in range(10):  # a alone, backlogged, b idle
        shares.read({"a", "b"}, {"a": 1000})
    assert set(shares.counts(10)) == {"a", "b"}  # alone, a is never held back
    shares.read({"a", "b"}, {"a": 1000, "b": 10})  # b comes back: level with a, not 10k behind
    shares.read({"a", "b"}, {"a": 1000, "b": 1000})
    assert set(shares.counts(10)) == {"a", "b"}


def test_no_backlogged_lane_means_every_lane_is_read() -> None:
    shares = _shares(a=1, b=1)
    shares.read({"a", "b"}, {"a": 10 * int(SLACK_TOKENS)})
    shares.read({"a", "b"}, {})  # both idle now
    assert set(shares.counts(4)) == {"a", "b"}


def test_an_entry_costs_its_tokens_and_a_generation_its_most_new_ones() -> None:
    tokens = (7).to_bytes(4, "little") * 12
    rows = RequestEntry(
        id="e", request_id="r", model="m", tokens=tokens, lengths=(12).to_bytes(4, "little"),
        deadline_ms=1, priority=1, reply_to="s", enqueued_ms=0,
    )  # fmt: skip
    assert cost_of(rows) == 12
    prompt = GenerateEntry(
        id="g", request_id="r", model="m", tokens=tokens[:20], max_tokens=30, n=2,
        deadline_ms=1, priority=1, reply_to="s", enqueued_ms=0, temperature=0.0, top_p=1.0,
        seed=None, stop=[], stream=False,
    )  # fmt: skip
    assert cost_of(prompt) == 5 + 60


def test_held_rows_of_a_light_lane_take_their_place_among_a_heavy_backlog() -> None:
    from worker.encode.assembly import Assembly
    from worker.encode.batching import Batch, Limits, next_batch
    from worker.encode.row_queues import RowQueues
    from worker.held import Held

    def held(lane: str, i: int) -> Assembly:
        entry = RequestEntry(
            id=f"{lane}{i}", request_id="r", model="m", tokens=b"\\0" * 16,
            lengths=(4).to_bytes(4, "little"), deadline_ms=1, priority=1, reply_to="s",
            enqueued_ms=0,
        )  # fmt: skip
        return Assembly(Held(entry, "s", f"{i}-0", float(i), 128, lane=lane), [[1, 2, 3, 4]])

    rows = RowQueues([128])
    for i in range(20):  # the heavy backlog, held first
        rows.add(128, held("heavy", i))
    for i in range(2):
        rows.add(128, held("light", 100 + i))
    limits = Limits(max_batch_size=4, max_batch_tokens=4096, max_wait_s=0.0)
    batch = next_batch(rows.in_order(), 1000.0, limits, ordered=True)
    assert isinstance(batch, Batch) and len(batch.keys) == 4
    taken = rows.take(128, batch.keys)
    # by share: the light lane's first row is in the first batch, not after 20 heavy rows
    assert [a.held.lane for a, _ in taken].count("light") >= 1
