"""The batching policy's rules, one per test, plus invariants over random queues."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.buckets import bucket_for, parts
from common.protocol import PRIORITY_BACKGROUND, PRIORITY_BATCH, PRIORITY_INTERACTIVE
from worker.encode.batching import Batch, Limits, Load, Wait, Waiting, in_order, next_batch
from worker.encode.cost import Cost

BUCKETS = [128, 256, 512]
LIMITS = Limits(max_batch_size=4, max_batch_tokens=1024, max_wait_s=0.010, starvation_s=10.0)


def waiting(key: int, n: int, at: float = 0.0, priority: int = PRIORITY_BATCH) -> Waiting:
    return Waiting(key=key, n_tokens=n, arrived_s=at, priority=priority)


@pytest.mark.parametrize(
    ("n_tokens", "bucket"),
    [(1, 128), (127, 128), (128, 128), (129, 256), (256, 256), (257, 512), (512, 512), (513, None)],
)
def test_bucket_is_the_smallest_that_holds_the_input(n_tokens: int, bucket: int | None) -> None:
    assert bucket_for(n_tokens, BUCKETS) == bucket


def test_empty_queues_wait_for_arrivals() -> None:
    assert next_batch({128: [], 256: []}, 1.0, LIMITS) == Wait(None)


def test_partial_batch_waits_until_oldest_entry_reaches_max_wait() -> None:
    decision = next_batch({128: [waiting(1, 10, at=1.0), waiting(2, 10, at=1.004)]}, 1.005, LIMITS)
    assert decision == Wait(pytest.approx(1.010))


def test_wait_trigger_fires_at_max_wait_counted_from_the_oldest() -> None:
    decision = next_batch({128: [waiting(1, 10, at=1.0), waiting(2, 10, at=1.009)]}, 1.010, LIMITS)
    assert isinstance(decision, Batch)
    assert decision.trigger == "wait"
    assert decision.keys == (1, 2)


def test_size_trigger_fires_without_waiting() -> None:
    queue = [waiting(i, 10, at=1.0) for i in range(6)]
    decision = next_batch({128: queue}, 1.0, LIMITS)
    assert isinstance(decision, Batch)
    assert decision.trigger == "size"
    assert decision.keys == (0, 1, 2, 3)


def test_token_budget_stops_the_batch_and_fires_it() -> None:
    # 3 x 300 padded = 900 fits in 1024, a fourth would make 1200.
    queue = [waiting(i, 300, at=1.0) for i in range(4)]
    decision = next_batch({512: queue}, 1.0, LIMITS)
    assert isinstance(decision, Batch)
    assert decision.trigger == "tokens"
    assert decision.keys == (0, 1, 2)
    assert decision.padded_tokens == 900


def test_padding_is_to_the_longest_member_not_the_bucket_ceiling() -> None:
    queue = [waiting(1, 130, at=0.0), waiting(2, 150, at=0.0)]
    decision = next_batch({256: queue}, 1.0, LIMITS)
    assert isinstance(decision, Batch)
    assert decision.padded_tokens == 300
    assert decision.real_tokens == 280


def test_zero_max_wait_runs_whatever_is_queued_at_once() -> None:
    limits = Limits(max_batch_size=16, max_batch_tokens=16384, max_wait_s=0.0)
    decision = next_batch({128: [waiting(1, 5, at=2.0)]}, 2.0, limits)
    assert isinstance(decision, Batch)
    assert decision.keys == (1,)


def test_interactive_entry_skips_the_wait_and_goes_first() -> None:
    queue = [waiting(1, 10, at=1.0), waiting(2, 10, at=1.001, priority=PRIORITY_INTERACTIVE)]
    decision = next_batch({128: queue}, 1.002, LIMITS)
    assert isinstance(decision, Batch)
    assert decision.trigger == "priority"
    assert 2 in decision.keys


def test_interactive_bucket_is_chosen_before_an_older_ready_bucket() -> None:
    queues = {
        128: [waiting(1, 10, at=0.0)],
        256: [waiting(2, 200, at=0.5, priority=PRIORITY_INTERACTIVE)],
    }
    decision = next_batch(queues, 1.0, LIMITS)
    assert isinstance(decision, Batch)
    assert decision.bucket == 256


def test_among_ready_buckets_the_longest_waiting_goes_first() -> None:
    queues = {128: [waiting(1, 10, at=0.5)], 256: [waiting(2, 200, at=0.2)]}
    decision = next_batch(queues, 1.0, LIMITS)
    assert isinstance(decision, Batch)
    assert decision.bucket == 256


def test_a_lone_entry_longer_than_the_budget_still_runs() -> None:
    limits = Limits(max_batch_size=4, max_batch_tokens=512, max_wait_s=0.0)
    decision = next_batch({512: [waiting(1, 512, at=0.0), waiting(2, 512, at=0.0)]}, 0.0, limits)
    assert isinstance(decision, Batch)
    assert decision.keys == (1,)


queues_strategy = st.dictionaries(
    st.sampled_from(BUCKETS),
    st.lists(st.tuples(st.integers(1, 512), st.floats(0, 1), st.sampled_from([0, 1])), max_size=40),
)


@given(queues_strategy, st.floats(0, 2), st.integers(1, 32), st.integers(512, 20000))
def test_any_batch_respects_the_limits_and_stays_in_one_bucket(raw, now, size, budget) -> None:
    limits = Limits(max_batch_size=size, max_batch_tokens=budget, max_wait_s=0.01)
    key = iter(range(10**6))
    queues = {
        b: [Waiting(next(key), min(n, b), at, p) for n, at, p in entries]
        for b, entries in raw.items()
    }
    by_key = {w.key: (b, w) for b, q in queues.items() for w in q}
    decision = next_batch(queues, now, limits)
    if isinstance(decision, Wait):
        assert decision.until_s is None or decision.until_s > now - 1e-9
        return
    assert 1 <= len(decision.keys) <= size
    assert len(set(decision.keys)) == len(decision.keys)
    assert {by_key[k][0] for k in decision.keys} == {decision.bucket}
    longest = max(by_key[k][1].n_tokens for k in decision.keys)
    assert decision.padded_tokens == longest * len(decision.keys)
    assert len(decision.keys) == 1 or decision.padded_tokens <= budget


@given(queues_strategy, st.floats(0, 2), st.integers(1, 32), st.sampled_from([None, 0.01]))
def test_queues_kept_in_length_order_decide_as_unordered_ones(raw, now, size, wait) -> None:
    """A worker keeps its queues in length order so no decision sorts them: the decisions
    must be the very ones the policy makes from queues in arrival order."""
    limits = Limits(max_batch_size=size, max_batch_tokens=4096, max_wait_s=wait)
    key = iter(range(10**6))
    queues = {
        b: [Waiting(next(key), min(n, b), at, p) for n, at, p in entries]
        for b, entries in raw.items()
    }
    load = Load(Cost(0.004, 1e-5), {b: 300.0 for b in BUCKETS}, computing=1)
    ordered = {b: in_order(q) for b, q in queues.items()}
    assert next_batch(ordered, now, limits, load, ordered=True) == next_batch(
        queues, now, limits, load
    )


@given(st.lists(st.floats(0, 1), min_size=1, max_size=30))
def test_batch_traffic_is_served_fifo(arrivals) -> None:
    queue = [Waiting(i, 10, at, PRIORITY_BATCH) for i, at in enumerate(arrivals)]
    decision = next_batch({128: queue}, 5.0, LIMITS)
    assert isinstance(decision, Batch)
    expected = [w.key for w in sorted(queue, key=lambda w: w.arrived_s)][: LIMITS.max_batch_size]
    assert list(decision.keys) == expected


def test_live_overrides_replace_only_what_they_name() -> None:
    limits = LIMITS.with_overrides({"max_batch_size": "8", "max_wait_ms": "2.5"}, min_tokens=512)
    assert limits == Limits(8, 1024, 0.0025, starvation_s=10.0)
    assert LIMITS.with_overrides({"max_wait_ms": "auto"}, 512).max_wait_s is None


@pytest.mark.parametrize(
    "bad",
    [
        {"max_batch_size": "0"},
        {"max_batch_size": "x"},
        {"max_wait_ms": "-1"},
        {"max_batch_tokens": "100"},
        {"max_batchsize": "4"},
    ],
)
def test_bad_live_overrides_are_refused_by_name(bad: dict) -> None:
    with pytest.raises(ValueError):
        LIMITS.with_overrides(bad, min_tokens=512)


# ---- length-aware batches, starvation bound, split rule, adaptive wait -------------------

AUTO = Limits(max_batch_size=4, max_batch_tokens=4096, max_wait_s=None, latency_slo_s=0.1)


def test_a_batch_holds_similar_lengths_around_its_oldest_entry() -> None:
    lengths = [100, 12, 95, 10, 14, 105, 11, 98]
    queue = [waiting(i, n, at=i * 0.001) for i, n in enumerate(lengths)]
    decision = next_batch({128: queue}, 1.0, LIMITS)
    assert isinstance(decision, Batch)
    assert set(decision.keys) == {0, 2, 5, 7}  # the oldest is 100 tokens long: its kin join
    assert decision.padded_tokens == 4 * 105


def test_the_padding_rule_splits_a_batch_rather_than_pad_over_half_of_it() -> None:
    queue = [waiting(0, 120, at=0.0), waiting(1, 20, at=0.001), waiting(2, 25, at=0.002)]
    decision = next_batch({128: queue}, 0.0, LIMITS)
    assert isinstance(decision, Batch)
    # 120 + 25 pads 40% of 240 tokens; adding the 20 would pad 54% of 360: split there
    assert (decision.keys, decision.trigger) == ((0, 2), "split")
    assert decision.padded_tokens == 240
    after = next_batch({128: [queue[1]]}, 0.0, LIMITS)
    assert isinstance(after, Wait)  # the one left over waits for company as usual


def test_with_a_cost_model_a_join_must_not_lower_real_tokens_per_second() -> None:
    queue = [waiting(0, 40, at=0.0), waiting(1, 10, at=0.001)]  # 62% padding if together
    overhead_bound = Load(Cost(fixed_s=0.010, per_token_s=1e-5))
    token_bound = Load(Cost(fixed_s=1e-5, per_token_s=1e-3))
    together = next_batch({128: queue}, 1.0, LIMITS, overhead_bound)
    apart = next_batch({128: queue}, 1.0, LIMITS, token_bound)
    assert isinstance(together, Batch) and set(together.keys) == {0, 1}
    assert isinstance(apart, Batch) and apart.keys == (0,) and apart.trigger == "split"


def test_a_bucket_with_its_own_fitted_cost_is_batched_by_it_not_by_the_overall_fit() -> None:
    """Long batches cost more per token, so one line through all of them understates a short
    batch's overhead: the bucket's own fit decides its batches."""
    short = [waiting(0, 40, at=0.0), waiting(1, 10, at=0.001)]
    long = [waiting(2, 400, at=0.0), waiting(3, 300, at=0.001)]
    overall = Cost(fixed_s=1e-5, per_token_s=1e-3)  # fitted mostly on long batches
    load = Load(overall, bucket_costs={128: Cost(fixed_s=0.010, per_token_s=1e-5)})
    assert set(next_batch({128: short}, 1.0, LIMITS, load).keys) == {0, 1}  # type: ignore[union-attr]
    assert next_batch({512: long}, 1.0, LIMITS, load).keys == (2,)  # type: ignore[union-attr]
    assert next_batch({128: short}, 1.0, LIMITS, Load(overall)).keys == (0,)  # type: ignore[union-attr]


def test_batch_traffic_passed_over_too_long_goes_before_interactive() -> None:
    limits = Limits(max_batch_size=1, max_batch_tokens=1024, max_wait_s=0.01, starvation_s=0.5)
    queues = {
        128: [waiting(1, 10, at=0.0)],
        256: [waiting(2, 200, at=0.9, priority=PRIORITY_INTERACTIVE)],
    }
    assert next_batch(queues, 0.4, limits).bucket == 256  # type: ignore[union-attr]
    assert next_batch(queues, 1.0, limits).bucket == 128  # type: ignore[union-attr]


def test_auto_wait_runs_at_once_at_low_load() -> None:
    queue = [waiting(0, 10, at=1.0)]
    quiet = Load(Cost(0.004, 1e-5), {128: 5.0}, computing=1)  # next in 200 ms >> 4 ms
    assert isinstance(next_batch({128: queue}, 1.0, AUTO, quiet), Batch)
    assert isinstance(next_batch({128: queue}, 1.0, AUTO, Load()), Batch)  # nothing measured


def test_auto_wait_runs_at_once_while_nothing_else_computes() -> None:
    """A closed-loop client's next request waits on this answer: with every stream idle,
    however high the measured rate and the fitted overhead, waiting only adds latency."""
    queue = [waiting(0, 10, at=1.0)]
    idle = Load(Cost(0.050, 1e-5), {128: 40.0}, computing=0)  # 25 ms gaps < 50 ms overhead
    assert isinstance(next_batch({128: queue}, 1.0, AUTO, idle), Batch)
    busy = Load(Cost(0.050, 1e-5), {128: 40.0}, computing=1)
    assert isinstance(next_batch({128: queue}, 1.0, AUTO, busy), Wait)


def test_auto_wait_waits_for_an_arrival_due_within_the_fixed_overhead() -> None:
    queue = [waiting(0, 10, at=1.0)]
    busy = Load(Cost(0.004, 1e-5), {128: 1000.0}, computing=1)  # next in 1 ms < 4 ms
    decision = next_batch({128: queue}, 1.0, AUTO, busy)
    assert decision == Wait(pytest.approx(1.001))
    two = [waiting(0, 10, at=1.0), waiting(1, 10, at=1.0005)]  # 1 ms < 4/2 ms: still pays
    assert isinstance(next_batch({128: two}, 1.001, AUTO, busy), Wait)


def test_auto_wait_never_outlasts_a_quarter_of_the_latency_target() -> None:
    queue = [waiting(0, 10, at=1.0)]
    busy = Load(Cost(0.004, 1e-5), {128: 1000.0}, computing=1)
    assert isinstance(next_batch({128: queue}, 1.0 + 0.1 / 4, AUTO, busy), Batch)


@given(
    st.lists(st.tuples(st.integers(1, 128), st.floats(0, 1), st.sampled_from([0, 1])), min_size=1),
    st.floats(1, 3),
)
def test_the_most_urgent_oldest_entry_is_always_in_the_batch(entries, now) -> None:
    limits = Limits(max_batch_size=4, max_batch_tokens=512, max_wait_s=0.0, starvation_s=0.5)
    queue = [Waiting(i, n, at, p) for i, (n, at, p) in enumerate(entries)]
    decision = next_batch({128: queue}, now, limits)
    assert isinstance(decision, Batch)
    anchor = min(queue, key=lambda w: (w.arrived_s > now - 0.5 and w.priority == 1, w.arrived_s))
    assert anchor.key in decision.keys


@pytest.mark.parametrize(
    ("lengths", "max_rows", "expected"),
    [
        ([5], 128, [[0]]),
        ([5, 300, 6, 200], 128, [[0, 2], [3], [1]]),  # a part per bucket, smallest first
        ([5] * 5, 2, [[0], [1, 2], [3, 4]]),  # split evenly
        ([600, 3], 4, [[1], [0]]),  # past the largest bucket: it shares the largest
    ],
)
def test_a_request_travels_in_one_entry_per_bucket_and_max_rows(
    lengths: list[int], max_rows: int, expected: list[list[int]]
) -> None:
    assert parts(lengths, BUCKETS, max_rows) == expected


@given(st.lists(st.integers(1, 600), min_size=1, max_size=300), st.integers(1, 64))
def test_parts_hold_every_row_once_within_their_limits(lengths: list[int], max_rows: int) -> None:
    out = parts(lengths, BUCKETS, max_rows)
    assert sorted(i for part in out for i in part) == list(range(len(lengths)))
    for part in out:
        assert 0 < len(part) <= max_rows
        assert len({bucket_for(lengths[i], BUCKETS) or BUCKETS[-1] for i in part}) == 1


def test_live_overrides_at_their_bounds_and_each_refusal_says_what() -> None:
    from worker.encode.batching import raw_ms

    edge = LIMITS.with_overrides(
        {"max_batch_size": "1", "max_batch_tokens": "512", "max_wait_ms": "0"}, min_tokens=512
    )
    assert (edge.max_batch_size, edge.max_batch_tokens, edge.max_wait_s) == (1, 512, 0.0)
    with pytest.raises(ValueError, match="unknown live batching setting 'max_batchsize'"):
        LIMITS.with_overrides({"max_batchsize": "4"}, min_tokens=512)
    with pytest.raises(ValueError, match=r"max_batch_tokens 100 \(at least 512\), max_wait_ms 5"):
        LIMITS.with_overrides({"max_batch_tokens": "100", "max_wait_ms": "5"}, min_tokens=512)
    assert (raw_ms(None), raw_ms(0.012), raw_ms(0.0025)) == ("auto", "12", "2.5")


def test_an_entry_is_urgent_from_the_moment_it_has_starved() -> None:
    limits = Limits(max_batch_size=4, max_batch_tokens=1024, max_wait_s=10.0, starvation_s=0.5)
    decision = next_batch({128: [waiting(1, 10, at=1.0)]}, 1.5, limits)
    assert isinstance(decision, Batch) and decision.trigger == "priority"


def test_padding_exactly_at_the_limit_is_allowed_and_past_it_splits() -> None:
    limits = Limits(max_batch_size=2, max_batch_tokens=1024, max_wait_s=0.0, max_padding_ratio=0.25)
    exactly = next_batch({128: [waiting(1, 10), waiting(2, 20)]}, 1.0, limits)  # 30 of 40
    assert isinstance(exactly, Batch) and sorted(exactly.keys) == [1, 2]
    past = next_batch({128: [waiting(1, 10), waiting(2, 40)]}, 1.0, limits)  # 37.5% padding
    assert isinstance(past, Batch) and len(past.keys) == 1 and past.trigger == "split"


def test_a_batch_grows_to_its_padded_budget_exactly() -> None:
    limits = Limits(max_batch_size=8, max_batch_tokens=40, max_wait_s=0.0)
    queue = [waiting(i, 10) for i in range(6)]
    decision = next_batch({128: queue}, 1.0, limits)
    assert isinstance(decision, Batch) and len(decision.keys) == 4  # 4 x 10 = 40, no more
    assert decision.trigger == "tokens" and decision.padded_tokens == 40


def test_a_batch_cost_ignores_impossible_observations_and_takes_one_token() -> None:
    from worker.encode.cost import BatchCost

    cost = BatchCost(min_batches=2)
    for tokens, seconds in ((0, 0.1), (10, 0.0), (10, float("inf"))):
        cost.observe(tokens, seconds)
    assert cost.estimate() is None  # none of them counted
    cost.observe(1, 0.002)
    cost.observe(101, 0.003)
    fitted = cost.estimate()
    assert fitted is not None and fitted.per_token_s == pytest.approx(1e-5)


def bg(key: int, n: int, at: float = 0.0) -> Waiting:
    return waiting(key, n, at, PRIORITY_BACKGROUND)


def test_background_rows_never_anchor_while_an_online_row_waits() -> None:
    """A batch line queued long before an online request still goes after it: background
    rows never starve into urgency, and the online row anchors its bucket's batch."""
    limits = Limits(max_batch_size=1, max_batch_tokens=1024, max_wait_s=0.0, starvation_s=0.1)
    queue = [bg(1, 10, at=0.0), waiting(2, 10, at=5.0)]
    decision = next_batch({128: queue}, 9.0, limits)
    assert isinstance(decision, Batch) and decision.keys == (2,)


def test_a_bucket_of_online_rows_goes_before_an_older_background_bucket() -> None:
    # starvation far off: the online row wins by its lane, not by having starved
    limits = Limits(max_batch_size=4, max_batch_tokens=4096, max_wait_s=0.0, starvation_s=10)
    queues = {128: [bg(1, 10, at=0.0)], 256: [waiting(2, 200, at=5.0)]}
    assert next_batch(queues, 9.0, limits).bucket == 256  # type: ignore[union-attr]


def test_background_rows_fill_a_partial_online_batch_and_never_displace_an_online_row() -> None:
    """Four online rows and room for eight: the batch holds all four online rows, even the
    one further in length than most background rows, and background rows fill the rest."""
    limits = Limits(max_batch_size=8, max_batch_tokens=8192, max_wait_s=0.0, starvation_s=10)
    online = [waiting(i, n, at=1.0) for i, n in enumerate((10, 11, 14, 15))]
    background = [bg(10 + i, 12 + i, at=0.0) for i in range(10)]
    decision = next_batch({128: online + background}, 1.0, limits)
    assert isinstance(decision, Batch)
    assert {0, 1, 2, 3} <= set(decision.keys)
    assert len(decision.keys) == 8 and decision.trigger == "size"


def test_background_rows_fill_only_while_the_padding_rule_allows() -> None:
    limits = Limits(max_batch_size=8, max_batch_tokens=8192, max_wait_s=0.0, max_padding_ratio=0.2)
    online = [waiting(0, 100, at=1.0)]
    background = [bg(1, 90), bg(2, 5), bg(3, 5)]  # 90 fits; a 5 would pad over a fifth
    decision = next_batch({128: online + background}, 1.0, limits)
    assert isinstance(decision, Batch) and set(decision.keys) == {0, 1}


def test_a_bucket_of_background_rows_alone_is_batched_as_usual() -> None:
    queue = [bg(i, 10, at=1.0) for i in range(6)]
    decision = next_batch({128: queue}, 1.0, LIMITS)
    assert isinstance(decision, Batch) and decision.keys == (0, 1, 2, 3)


@given(
    st.lists(
        st.tuples(st.integers(1, 128), st.floats(0, 1), st.sampled_from([0, 1, 2])), min_size=1
    ),
    st.floats(1, 3),
)
def test_a_batch_never_holds_a_background_row_in_place_of_an_online_one(entries, now) -> None:
    """With online rows queued, the batch holds as many of them as it would without any
    background row: background rows only take seats online rows leave empty."""
    limits = Limits(max_batch_size=4, max_batch_tokens=512, max_wait_s=0.0, starvation_s=0.5)
    queue = [Waiting(i, n, at, p) for i, (n, at, p) in enumerate(entries)]
    online = [w for w in queue if w.priority != PRIORITY_BACKGROUND]
    decision = next_batch({128: queue}, now, limits)
    assert isinstance(decision, Batch)
    if online:
        alone = next_batch({128: online}, now, limits)
        assert isinstance(alone, Batch)
        chosen = {w.key for w in online} & set(decision.keys)
        assert chosen == set(alone.keys)


def test_background_rows_make_an_online_batch_at_most_a_fifth_slower() -> None:
    """Under the cost model (10 ms a forward + 0.1 ms a token) one online row of 20 tokens
    costs 12 ms: background rows of 20 tokens join while the batch stays within 14.4 ms."""
    limits = Limits(max_batch_size=16, max_batch_tokens=8192, max_wait_s=0.0)
    cost = Cost(0.010, 0.0001)
    queue = [waiting(0, 20, at=1.0), *(bg(i, 20) for i in range(1, 10))]
    decision = next_batch({128: queue}, 1.0, limits, Load(cost))
    assert isinstance(decision, Batch) and 0 in decision.keys
    assert len(decision.keys) == 2  # 2 x 20 tokens: 14 ms; 3 would be 16 ms


def test_background_alone_runs_whole_when_no_online_traffic_came_lately() -> None:
    limits = Limits(max_batch_size=16, max_batch_tokens=8192, max_wait_s=0.0)
    queue = [bg(i, 20) for i in range(16)]
    idle = next_batch({128: queue}, 1.0, limits, Load(online_idle_s=5.0))
    assert isinstance(idle, Batch) and len(idle.keys) == 16 and idle.background


def test_background_alone_runs_in_slices_while_online_traffic_is_live() -> None:
    """A slice computes within a fifth of the latency target: with 100 ms, 20 ms; under
    10 ms a forward + 0.1 ms a token, 100 padded tokens: five rows of 20."""
    limits = Limits(max_batch_size=16, max_batch_tokens=8192, max_wait_s=0.0, latency_slo_s=0.1)
    queue = [bg(i, 20) for i in range(16)]
    live = Load(Cost(0.010, 0.0001), online_idle_s=0.2)
    decision = next_batch({128: queue}, 1.0, limits, live)
    assert isinstance(decision, Batch) and len(decision.keys) == 5
    before_a_model = next_batch({128: queue}, 1.0, limits, Load(online_idle_s=0.2))
    assert isinstance(before_a_model, Batch) and len(before_a_model.keys) == 4
    assert (decision.trigger, before_a_model.trigger) == ("tokens", "size")  # full: run now


def test_filling_takes_the_longest_row_that_adds_no_padding_first() -> None:
    limits = Limits(max_batch_size=2, max_batch_tokens=4096, max_wait_s=0.0, starvation_s=10)
    queue = [waiting(0, 20, at=1.0), bg(1, 10), bg(2, 20), bg(3, 21)]
    decision = next_batch({128: queue}, 1.0, limits)
    assert isinstance(decision, Batch) and set(decision.keys) == {0, 2}


def test_a_background_row_too_short_to_join_does_not_stop_a_longer_one_joining() -> None:
    """Padding at most a fifth: a 5-token row would pad a 20-token batch by over a third, a
    21-token one pads it by one token, so the 21 joins though the 5 was tried first."""
    limits = Limits(max_batch_size=4, max_batch_tokens=4096, max_wait_s=0.0, max_padding_ratio=0.2)
    queue = [waiting(0, 20, at=1.0), bg(1, 5), bg(2, 21)]
    decision = next_batch({128: queue}, 1.0, limits)
    assert isinstance(decision, Batch) and set(decision.keys) == {0, 2}


def test_a_background_row_may_fill_an_online_batch_to_its_padded_budget_exactly() -> None:
    limits = Limits(max_batch_size=4, max_batch_tokens=40, max_wait_s=0.0)
    queue = [waiting(0, 20, at=1.0), bg(1, 20), bg(2, 20)]
    decision = next_batch({128: queue}, 1.0, limits)
    assert isinstance(decision, Batch) and 0 in decision.keys and len(decision.keys) == 2


def test_the_fill_bound_is_a_fifth_over_the_whole_online_batch() -> None:
    """Two online rows of 20 cost 14 ms (10 ms + 0.1 ms a token): up to 16.8 ms with
    background rows, so one more row of 20 (16 ms) joins and a second (18 ms) does not."""
    limits = Limits(max_batch_size=8, max_batch_tokens=8192, max_wait_s=0.0, starvation_s=10)
    queue = [waiting(0, 20, at=1.0), waiting(1, 20, at=1.0), *(bg(i, 20) for i in (2, 3, 4))]
    decision = next_batch({128: queue}, 1.0, limits, Load(Cost(0.010, 0.0001)))
    assert isinstance(decision, Batch) and len(decision.keys) == 3


@pytest.mark.parametrize("background", [True, False])
def test_online_and_background_batches_grow_by_the_cost_model_when_there_is_one(
    background: bool,
) -> None:
    """Rows of 2, 2 and 100 tokens pad past half (the rule before a cost model), but under a
    cost that is nearly all fixed overhead the long row is still worth taking along."""
    limits = Limits(max_batch_size=8, max_batch_tokens=8192, max_wait_s=0.0, starvation_s=10)
    make = bg if background else (lambda key, n, at=0.0: waiting(key, n, at))
    queue = [make(0, 2, at=0.5), make(1, 2, at=0.6), make(2, 100, at=0.7)]
    if not background:
        queue.append(bg(3, 200))  # a background row beside them: the online path
    load = Load(Cost(0.100, 1e-6), online_idle_s=5.0)
    decision = next_batch({128: queue}, 1.0, limits, load)
    assert isinstance(decision, Batch) and {0, 1, 2} <= set(decision.keys)
    without = next_batch({128: queue}, 1.0, limits, Load(online_idle_s=5.0))
    assert isinstance(without, Batch) and 2 not in without.keys


def test_a_slice_before_a_cost_model_is_a_quarter_of_the_batch_size_and_one_row_at_least() -> None:
    limits = Limits(max_batch_size=3, max_batch_tokens=8192, max_wait_s=0.0)
    queue = [bg(i, 20) for i in range(3)]
    decision = next_batch({128: queue}, 1.0, limits, Load(online_idle_s=0.1))
    assert isinstance(decision, Batch) and len(decision.keys) == 1


# Auto wait, one input at a time (the rate, the cost, the busy streams).
ONE = [waiting(0, 10, at=1.0)]


def test_auto_wait_runs_at_once_when_its_bucket_has_no_measured_rate() -> None:
    """A bucket missing from the rates counts as no arrivals, however large the overhead."""
    load = Load(Cost(2.0, 1e-5), {256: 1000.0}, computing=1)
    decision = next_batch({128: ONE}, 1.0, AUTO, load)
    assert isinstance(decision, Batch) and decision.trigger == "wait"


def test_auto_wait_runs_at_once_at_a_measured_rate_of_zero() -> None:
    """A rate of exactly zero expects no arrival: run now (no gap of 1/0 is computed)."""
    load = Load(Cost(2.0, 1e-5), {128: 0.0}, computing=1)
    decision = next_batch({128: ONE}, 1.0, AUTO, load)
    assert isinstance(decision, Batch) and decision.trigger == "wait"


def test_auto_wait_at_one_arrival_a_second_waits_a_quarter_of_the_latency_target() -> None:
    """A rate of 1/s still pays under a 2 s overhead; the wait is capped at oldest + slo/4."""
    load = Load(Cost(2.0, 1e-5), {128: 1.0}, computing=1)
    assert next_batch({128: ONE}, 1.0, AUTO, load) == Wait(pytest.approx(1.025, abs=1e-12))


def test_auto_wait_without_a_cost_model_runs_at_once_even_at_a_high_rate() -> None:
    """No fitted overhead: nothing says waiting pays, whatever the rate and the busy streams."""
    load = Load(None, {128: 1000.0}, computing=1)
    decision = next_batch({128: ONE}, 1.0, AUTO, load)
    assert isinstance(decision, Batch) and decision.trigger == "wait"


def test_auto_wait_uses_the_buckets_own_cost() -> None:
    """Only the bucket's fitted overhead is known (no overall fit): it makes the wait pay."""
    load = Load(None, {128: 1000.0}, computing=1, bucket_costs={128: Cost(0.004, 1e-5)})
    assert next_batch({128: ONE}, 1.0, AUTO, load) == Wait(pytest.approx(1.001))


def test_auto_wait_runs_at_once_when_the_gap_equals_the_overhead_per_member() -> None:
    """A gap of exactly fixed / size no longer pays: 4 ms at 250/s against 4 ms of overhead."""
    load = Load(Cost(0.004, 1e-5), {128: 250.0}, computing=1)
    decision = next_batch({128: ONE}, 1.0, AUTO, load)
    assert isinstance(decision, Batch) and decision.trigger == "wait"


def test_auto_wait_divides_the_overhead_among_the_members() -> None:
    """Two queued: a 3 ms gap is past 4 ms / 2, so they run now (it would pay for one alone)."""
    load = Load(Cost(0.004, 1e-5), {128: 1 / 0.003}, computing=1)
    two = [waiting(0, 10, at=1.0), waiting(1, 10, at=1.0)]
    decision = next_batch({128: two}, 1.0, AUTO, load)
    assert isinstance(decision, Batch) and decision.keys == (0, 1)
    assert isinstance(next_batch({128: ONE}, 1.0, AUTO, load), Wait)


# Growing a batch around its anchor.


def test_the_anchor_is_found_by_identity_among_rows_that_tie_on_length_and_arrival() -> None:
    """Rows of one entry queued in reverse key order: the batch of one is the lowest key."""
    limits = Limits(max_batch_size=1, max_batch_tokens=1024, max_wait_s=0.0)
    queue = [waiting(key, 10) for key in (4, 3, 2, 1)]
    decision = next_batch({128: queue}, 1.0, limits)
    assert isinstance(decision, Batch) and (decision.keys, decision.trigger) == ((1,), "size")


def test_rows_of_equal_length_always_join_under_a_cost_model() -> None:
    """Equal lengths add no padding, so even a token-bound cost takes all three rows."""
    queue = [waiting(i, 10, at=i * 0.001) for i in range(3)]
    decision = next_batch({128: queue}, 1.0, LIMITS, Load(Cost(1e-5, 1e-3)))
    assert isinstance(decision, Batch)
    assert (decision.keys, decision.trigger) == ((0, 1, 2), "wait")


def test_a_join_that_keeps_real_tokens_per_second_equal_is_taken() -> None:
    """With no fixed overhead, a second 10-token row leaves tokens per second unchanged."""
    queue = [waiting(0, 10, at=0.0), waiting(1, 10, at=0.001)]
    decision = next_batch({128: queue}, 1.0, LIMITS, Load(Cost(0.0, 2**-10)))
    assert isinstance(decision, Batch) and decision.keys == (0, 1)


def test_the_neighbour_with_less_padding_joins_whichever_side_it_is_on() -> None:
    """Anchor 10 between 9 and 15: the 9 pads 5 %, the 15 pads 17 %; the 9 joins."""
    limits = Limits(max_batch_size=2, max_batch_tokens=1024, max_wait_s=0.0)
    queue = [waiting(0, 10, at=0.0), waiting(1, 9, at=0.1), waiting(2, 15, at=0.2)]
    decision = next_batch({128: queue}, 1.0, limits)
    assert isinstance(decision, Batch) and (decision.keys, decision.trigger) == ((0, 1), "size")


def test_on_a_tie_the_shorter_neighbour_joins() -> None:
    """Anchor 10 between 5 and 20: both pad exactly 25 %; the shorter one joins."""
    limits = Limits(max_batch_size=2, max_batch_tokens=1024, max_wait_s=0.0)
    queue = [waiting(0, 10, at=0.0), waiting(1, 5, at=0.1), waiting(2, 20, at=0.2)]
    decision = next_batch({128: queue}, 1.0, limits)
    assert isinstance(decision, Batch) and decision.keys == (0, 1)


# Choosing among buckets.


def test_an_empty_bucket_does_not_hide_a_ready_one_after_it() -> None:
    """An empty queue is skipped and the next bucket still decides."""
    decision = next_batch({128: [], 256: [waiting(1, 200, at=0.0)]}, 1.0, LIMITS)
    assert isinstance(decision, Batch) and (decision.bucket, decision.keys) == (256, (1,))


def test_a_waiting_bucket_does_not_hide_a_ready_one_after_it() -> None:
    """A bucket still waiting is passed over for a later bucket that is ready."""
    queues = {128: [waiting(1, 10, at=1.0)], 256: [waiting(2, 200, at=0.5)]}
    decision = next_batch(queues, 1.005, LIMITS)
    assert isinstance(decision, Batch) and (decision.bucket, decision.keys) == (256, (2,))


def test_the_wait_is_until_the_earliest_deadline_of_all_waiting_buckets() -> None:
    """Two buckets waiting: wake at the first one's deadline (1.010), not the last's (1.015)."""
    queues = {128: [waiting(1, 10, at=1.0)], 256: [waiting(2, 200, at=1.005)]}
    assert next_batch(queues, 1.006, LIMITS) == Wait(pytest.approx(1.010))


def test_of_two_equally_urgent_ready_buckets_the_first_one_goes() -> None:
    """Same class, same arrival: the tie goes to the bucket met first."""
    queues = {128: [waiting(1, 10, at=0.0)], 256: [waiting(2, 200, at=0.0)]}
    decision = next_batch(queues, 1.0, LIMITS)
    assert isinstance(decision, Batch) and decision.bucket == 128
