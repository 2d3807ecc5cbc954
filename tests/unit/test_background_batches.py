"""Background rows beside online traffic (issue 36), by the rules of `worker.encode.batching`:
they fill an online batch only while it stays worth it and at most a fifth slower, and a
batch of them alone is a slice while online traffic is live; and rows placed by the fair
order are taken in that order."""

from __future__ import annotations

import pytest

from common.protocol import PRIORITY_BACKGROUND, PRIORITY_BATCH
from worker.encode.batching import Batch, Limits, Load, Waiting, next_batch
from worker.encode.cost import Cost

ROOMY = Limits(max_batch_size=8, max_batch_tokens=8192, max_wait_s=0.0, starvation_s=10)
# 9 s a forward + 10 ms a token: round numbers of seconds, so ties are exact
SLOW = Load(Cost(9.0, 0.01))
LIVE = Load(online_idle_s=0.1)  # online traffic came within ONLINE_LIVE_S


def online(key: int, n: int) -> Waiting:
    return Waiting(key, n, 1.0, PRIORITY_BATCH)


def bg(key: int, n: int) -> Waiting:
    return Waiting(key, n, 0.0, PRIORITY_BACKGROUND)


def keys(queue: list[Waiting], limits: Limits = ROOMY, load: Load = SLOW) -> set[int]:
    decision = next_batch({128: queue}, 1.0, limits, load)
    assert isinstance(decision, Batch)
    return set(decision.keys)


# ---- filling an online batch -----------------------------------------------------------------


def test_a_background_row_fills_only_if_real_tokens_per_second_do_not_drop() -> None:
    """An online row of 100 tokens: 100 in 10 s. With a row of 10, 110 in 11 s: the same
    10 a second, so it joins; with a row of 5, 105 in 11 s: fewer, so it does not. Both
    stay within a fifth slower (12 s)."""
    assert keys([online(0, 100), bg(1, 10)]) == {0, 1}
    assert keys([online(0, 100), bg(1, 5)]) == {0}


def test_the_fill_weighs_the_online_batch_by_all_its_padded_tokens() -> None:
    """Two online rows of 100: 200 in 11 s (18.2 a second); with a row of 30, 230 in 12 s
    (19.2 a second), so it joins."""
    assert keys([online(0, 100), online(1, 100), bg(2, 30)]) == {0, 1, 2}


def test_a_background_row_may_make_an_online_batch_exactly_a_fifth_slower() -> None:
    """An online row of 100 takes 10 s; with a row of 150 the batch pads to 300 tokens:
    12 s, a fifth slower exactly, and it joins."""
    assert keys([online(0, 100), bg(1, 150)]) == {0, 1}


# ---- slicing a batch of background rows alone ------------------------------------------------


@pytest.mark.parametrize(("size", "slice_rows"), [(7, 1), (8, 2), (16, 4)])
def test_a_slice_before_a_cost_model_is_a_quarter_of_the_batch_size_rounded_down(
    size: int, slice_rows: int
) -> None:
    limits = Limits(max_batch_size=size, max_batch_tokens=8192, max_wait_s=0.0)
    decision = next_batch({128: [bg(i, 20) for i in range(16)]}, 1.0, limits, LIVE)
    assert isinstance(decision, Batch) and len(decision.keys) == slice_rows
    assert decision.trigger == "size"


def test_a_slice_is_one_row_when_the_fixed_overhead_alone_outlasts_it() -> None:
    """A fifth of a 100 ms target is 20 ms, under a 50 ms forward: no token computes in the
    slice, so it holds one row, however short the rows."""
    limits = Limits(max_batch_size=8, max_batch_tokens=8192, max_wait_s=0.0, latency_slo_s=0.1)
    live = Load(Cost(0.050, 0.0001), online_idle_s=0.1)
    decision = next_batch({128: [bg(i, 1) for i in range(4)]}, 1.0, limits, live)
    assert isinstance(decision, Batch) and len(decision.keys) == 1


# ---- the fair order --------------------------------------------------------------------------


def test_rows_placed_by_the_fair_order_go_in_that_order_from_zero_up() -> None:
    """A place of 0 (a tenant's first row) or a fraction is a place like any other, not
    "unplaced": the row placed first anchors, whatever the arrivals."""
    limits = Limits(max_batch_size=1, max_batch_tokens=1024, max_wait_s=0.0, starvation_s=10)
    first = Waiting(1, 10, 5.0, PRIORITY_BATCH, order=0.0)
    second = Waiting(2, 10, 3.0, PRIORITY_BATCH, order=0.5)
    decision = next_batch({128: [second, first]}, 6.0, limits)
    assert isinstance(decision, Batch) and decision.keys == (1,)
    unplaced = Waiting(3, 10, 2.0, PRIORITY_BATCH)
    assert unplaced.order == 2.0  # unplaced: its arrival
