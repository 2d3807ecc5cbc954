"""Fair shares between tenants' lanes where a worker reads: the room to the least served
lane by weight and cost, idle lanes probed, no credit for idle time, a lane alone never
held back; and the fair order held rows are batched in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.protocol import GenerateEntry, RequestEntry
from worker.lane_shares import LaneShares, ahead, cost_of, fill, water_level

pytestmark = pytest.mark.unit


def _shares(**weights: float) -> LaneShares:
    shares = LaneShares()
    shares.set_weights(weights)
    return shares


def _backlog(shares: LaneShares, *lanes: str) -> None:
    """A read that found one 1-token entry in each of `lanes` (and nothing elsewhere)."""
    shares.read(shares.lanes, dict.fromkeys(lanes, 1), dict.fromkeys(lanes, 1))


def test_with_nothing_backlogged_each_lane_gets_an_equal_part() -> None:
    counts = _shares(a=3, b=1).counts(8)
    assert counts == {"a": 4, "b": 4}
    assert all(type(n) is int for n in counts.values())  # XREADGROUP's COUNT
    assert _shares(a=1, b=1, c=1).counts(2) == {"a": 1, "b": 1, "c": 1}  # each polled


def test_the_room_goes_to_backlogged_lanes_by_weight_even_one_entry_at_a_time() -> None:
    shares = _shares(a=3, b=1)
    got = {"a": 0, "b": 0}
    for _ in range(400):  # one entry of room per read; both lanes always hold more
        counts = shares.counts(1)
        for lane, n in counts.items():
            got[lane] += n
        shares.read(counts, counts, counts)
    assert got["a"] / sum(got.values()) == pytest.approx(0.75, abs=0.01)


def test_a_lane_whose_entries_cost_more_is_given_fewer_of_them() -> None:
    shares = _shares(a=1, b=1)
    for _ in range(50):  # a's entries are 10 tokens, b's 1: tokens, not entries, are shared
        shares.read({"a", "b"}, {"a": 10, "b": 1}, {"a": 1, "b": 1})
    counts = shares.counts(22)
    assert counts["b"] >= 20 and counts.get("a", 0) <= 2


def test_an_idle_lane_is_probed_for_one_and_comes_back_without_credit() -> None:
    shares = _shares(a=1, b=1)
    for _ in range(100):  # a alone, backlogged; b idle
        _backlog(shares, "a")
    # a alone takes the room; b is probed for the part it would have (an over-read it
    # returns only if it has entries)
    assert shares.counts(8) == {"a": 8, "b": 4}
    _backlog(shares, "a", "b")  # b comes back: level with a, not 100 behind
    counts = shares.counts(10)
    assert abs(counts["a"] - counts["b"]) <= 1


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


def test_a_lane_back_while_every_queue_was_empty_a_moment_starts_at_the_level() -> None:
    shares = _shares(a=1, b=1)
    for _ in range(100):  # a alone, backlogged
        _backlog(shares, "a")
    shares.read({"a", "b"}, {}, {})  # every lane empty a moment (an open-loop tenant)
    _backlog(shares, "b")  # b back: at the level a was at, not 100 behind it
    _backlog(shares, "a", "b")
    counts = shares.counts(10)
    assert abs(counts["a"] - counts["b"]) <= 1


def _one_at_a_time(served: dict[str, float], steps: dict[str, float], room: int) -> dict[str, int]:
    """What `fill` stands for: each entry to the least counted lane, the first on a tie."""
    taken, projected = dict.fromkeys(served, 0), dict(served)
    for _ in range(room):
        lane = min(projected, key=projected.__getitem__)
        taken[lane] += 1
        projected[lane] += steps[lane]
    return taken


# counts in sixteenths and steps of a cost over a power-of-two weight: exact in floating
# point whichever way they are summed, so a tie is a tie in the bulk and the loop alike
LANES = st.lists(
    st.tuples(st.integers(0, 4000), st.integers(1, 64), st.sampled_from([1, 2, 4, 8])),
    min_size=1,
    max_size=12,
)


def _lanes(lanes: list[tuple[int, int, int]]) -> tuple[dict[str, float], dict[str, float]]:
    served = {f"t{i}": start / 16 for i, (start, _, _) in enumerate(lanes)}
    steps = {f"t{i}": cost / weight for i, (_, cost, weight) in enumerate(lanes)}
    return served, steps


# every property of the bulk step, over the same lanes and rooms
over_lanes = given(lanes=LANES, room=st.integers(1, 300))


@settings(max_examples=400, deadline=None)
@over_lanes
def test_the_room_taken_in_bulk_is_what_one_entry_at_a_time_gives(
    lanes: list[tuple[int, int, int]], room: int
) -> None:
    served, steps = _lanes(lanes)
    assert fill(served, steps, room) == _one_at_a_time(served, steps, room)


@settings(max_examples=400, deadline=None)
@over_lanes
def test_what_is_taken_at_once_is_the_loop_s_first_entries_and_nearly_all_of_them(
    lanes: list[tuple[int, int, int]], room: int
) -> None:
    served, steps = _lanes(lanes)
    at_once, one_by_one = ahead(served, steps, room), _one_at_a_time(served, steps, room)
    assert all(at_once[lane] <= one_by_one[lane] for lane in served)
    left = room - sum(at_once.values())
    assert left <= sum(max(steps.values()) / step for step in steps.values())


def test_the_water_level_shares_the_room_as_a_fluid() -> None:
    # a and b are under it: L / 1 + (L - 2) / 0.5 = 10; c, at 50, is over it
    served, steps = {"a": 0.0, "b": 2.0, "c": 50.0}, {"a": 1.0, "b": 0.5, "c": 1.0}
    assert water_level(served, steps, 10) == pytest.approx(14 / 3)
    assert water_level({"a": 3.0}, {"a": 0.5}, 8) == pytest.approx(7.0)
    assert water_level({"a": 1.0, "b": 9.0}, {"a": 2.0, "b": 1.0}, 4) == pytest.approx(9.0)


def test_the_room_taken_in_bulk_keeps_weights_whatever_the_counts() -> None:
    served = {"a": 0.1, "b": 1 / 3, "c": 7.25}
    steps = {"a": 1 / 3, "b": 1 / 7, "c": 0.9}
    taken = fill(served, steps, 250)
    assert sum(taken.values()) == 250
    reached = {lane: served[lane] + taken[lane] * steps[lane] for lane in served}
    # each lane ends within one of its steps of the others: the level is shared
    assert max(reached.values()) - min(reached.values()) <= max(steps.values()) + 1e-9
