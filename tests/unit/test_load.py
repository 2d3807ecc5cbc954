"""The worker's own load model: batch cost by least squares, and arrival rate."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.encode.cost import ArrivalRate, BatchCost


def test_cost_recovers_fixed_overhead_and_per_token_time() -> None:
    cost = BatchCost()
    for padded in range(100, 2000, 50):
        cost.observe(padded, 0.004 + 2e-5 * padded)
    fit = cost.estimate()
    assert fit is not None
    assert fit.fixed_s == pytest.approx(0.004, rel=1e-6)
    assert fit.per_token_s == pytest.approx(2e-5, rel=1e-6)
    assert fit.seconds(1000) == pytest.approx(0.024, rel=1e-6)


def test_cost_needs_enough_batches_and_spread() -> None:
    cost = BatchCost(min_batches=8)
    for _ in range(7):
        cost.observe(500, 0.01)
    assert cost.estimate() is None  # too few
    cost.observe(500, 0.01)
    assert cost.estimate() is None  # every batch the same size
    cost.observe(1500, 0.03)
    assert cost.estimate() is not None


def test_cost_ignores_nonsense_observations() -> None:
    cost = BatchCost(min_batches=2)
    cost.observe(0, 0.01)
    cost.observe(100, 0.0)
    cost.observe(100, float("nan"))
    assert cost.estimate() is None


@pytest.mark.parametrize(
    ("window", "batches", "rel"),
    [
        ({"window": 32}, 32, 1e-6),
        ({}, 128, 1e-9),  # the default window: 128 batches
    ],
    ids=["window of 32", "default window"],
)
def test_cost_follows_the_window_as_the_machine_changes(
    window: dict[str, int], batches: int, rel: float
) -> None:
    """Old batches leave the fit: after a window of slower batches, only those count."""
    cost = BatchCost(**window)  # built in the test, not at collection
    for padded in range(100, 100 * (batches + 1), 100):
        cost.observe(padded, 0.002 + 1e-5 * padded)
    for padded in range(100, 100 * (batches + 1), 100):
        cost.observe(padded, 0.008 + 3e-5 * padded)
    fit = cost.estimate()
    assert fit is not None
    assert fit.fixed_s == pytest.approx(0.008, rel=1e-6)
    assert fit.per_token_s == pytest.approx(3e-5, rel=rel)


def test_running_sums_match_a_fit_from_scratch_after_many_batches() -> None:
    """The O(1) update must not drift from least squares over the window itself."""
    rng = random.Random(7)
    running = BatchCost(window=64)
    points = []
    for _ in range(5000):
        padded = rng.randint(8, 8192)
        seconds = 0.003 + 1.5e-5 * padded + rng.uniform(-1e-3, 1e-3)
        running.observe(padded, seconds)
        points.append((padded, seconds))
    scratch = BatchCost(window=64)
    for padded, seconds in points[-64:]:
        scratch.observe(padded, seconds)
    got, want = running.estimate(), scratch.estimate()
    assert got is not None and want is not None
    assert got.fixed_s == pytest.approx(want.fixed_s, rel=1e-9, abs=1e-12)
    assert got.per_token_s == pytest.approx(want.per_token_s, rel=1e-9)


def test_arrival_rate_from_gaps_decays_in_silence() -> None:
    rate = ArrivalRate(weight=0.5)
    assert rate.per_second(0.0) == 0.0
    for i in range(20):
        rate.observe(i * 0.01)  # 100 per second
    assert rate.per_second(0.19) == pytest.approx(100, rel=1e-6)
    assert rate.per_second(1.19) == pytest.approx(1.0, rel=1e-6)  # a second of silence


@given(st.lists(st.tuples(st.floats(0, 0.5), st.integers(1, 300)), min_size=1, max_size=30))
def test_an_entrys_rows_counted_at_once_equal_its_rows_counted_one_by_one(
    entries: list[tuple[float, int]],
) -> None:
    at_once, one_by_one, at = ArrivalRate(), ArrivalRate(), 0.0
    for gap, rows in entries:
        at += gap
        at_once.observe(at, rows)
        for _ in range(rows):
            one_by_one.observe(at)
    now = at + 0.001
    assert at_once.per_second(now) == pytest.approx(one_by_one.per_second(now), rel=1e-9)


def test_observations_keep_a_fit_per_thread_count_and_per_bucket() -> None:
    from worker.encode.cost import Observations

    seen = Observations([128, 512])
    assert seen.cost_at(4) == (None, {})  # nothing measured yet
    for tokens in range(100, 1700, 100):  # 16 batches on 4 threads: 2 ms + 10 us a token
        seen.batch(4, 128, tokens, 0.002 + tokens * 1e-5)
    for tokens in range(200, 3400, 200):  # and on 1 thread, in the long bucket: 4 x slower
        seen.batch(1, 512, tokens, 0.008 + tokens * 4e-5)
    cost, per_bucket = seen.cost_at(4)
    assert cost is not None and cost.fixed_s == pytest.approx(0.002)
    assert cost.per_token_s == pytest.approx(1e-5)
    assert set(per_bucket) == {128} and per_bucket[128].fixed_s == pytest.approx(0.002)
    one, one_per_bucket = seen.cost_at(1)
    assert one is not None and one.per_token_s == pytest.approx(4e-5)
    assert set(one_per_bucket) == {512}
    fallback, none = seen.cost_at(2)  # never run on 2 threads: any fitted count, no bucket
    assert fallback in (cost, one) and none == {}


def test_observations_count_arrivals_per_bucket() -> None:
    from worker.encode.cost import Observations

    seen = Observations([128, 512])
    assert seen.rates(0.0) == {128: 0.0, 512: 0.0}
    for i in range(50):
        seen.arrival(128, i * 0.01)  # 100 a second
    seen.arrival(512, 0.0, count=3)
    seen.arrival(512, 0.49, count=1)
    rates = seen.rates(0.49)
    assert rates[128] == pytest.approx(100, rel=0.05)
    assert 0 < rates[512] < rates[128]


def test_limits_come_from_the_settings_field_by_field() -> None:
    from common.settings import Settings
    from worker.encode.batching import Limits
    from worker.generate.scheduler import EngineLimits

    settings = Settings(
        max_batch_size=7, max_batch_tokens=9000, max_wait_ms=12, latency_slo_ms=250,
        max_padding_ratio=0.3, starvation_ms=40, max_running_seqs=5, max_step_tokens=300,
        kv_cache_tokens=4096, kv_block_size=8, chunked_prefill=False,
    )  # fmt: skip
    assert Limits.from_settings(settings) == Limits(7, 9000, 0.012, 0.25, 0.3, 0.04)
    assert Limits.from_settings(Settings(max_wait_ms="auto")).max_wait_s is None
    assert EngineLimits.from_settings(settings) == EngineLimits(5, 300, 4096, 8, False)


def test_cost_by_default_fits_from_eight_batches() -> None:
    """Eight batches of different sizes are enough for the default fit."""
    cost = BatchCost()
    for padded in range(100, 900, 100):
        cost.observe(padded, 0.004 + 2e-5 * padded)
    fit = cost.estimate()
    assert fit is not None and fit.fixed_s == pytest.approx(0.004, rel=1e-6)


def test_cost_with_no_batches_is_none_without_fitting() -> None:
    """Asked before any batch (even with no minimum), the estimate is None: nothing is fitted."""
    assert BatchCost(min_batches=0).estimate() is None


def test_cost_is_fitted_once_per_new_batch_not_once_per_question() -> None:
    """Asked before every batch: the fit runs again only after a new observation."""
    cost = BatchCost(min_batches=2)
    fits = []
    fit = cost._fit
    cost._fit = lambda: fits.append(1) or fit()  # type: ignore[method-assign]
    cost.observe(100, 0.003)
    cost.observe(200, 0.005)
    first, second = cost.estimate(), cost.estimate()
    assert first is not None and first == second and len(fits) == 1
    cost.observe(300, 0.007)
    assert cost.estimate() is not None and len(fits) == 2


def test_cost_spread_of_exactly_the_threshold_is_enough() -> None:
    """Sizes 999 and 1001, four each: variance 8 = 1e-6 x mean^2 x n, the bound, fits."""
    cost = BatchCost()
    for padded in (999, 1001) * 4:
        cost.observe(padded, 0.001 * padded)
    fit = cost.estimate()
    assert fit is not None and fit.per_token_s == pytest.approx(0.001)


def test_cost_spread_just_under_the_threshold_is_not_enough() -> None:
    """Seven of 1000 and one of 1001: variance 0.875 is under 1e-6 x mean^2 x n (about 8)."""
    cost = BatchCost()
    for padded in (1000,) * 7 + (1001,):
        cost.observe(padded, 0.001 * padded)
    assert cost.estimate() is None


def test_arrival_rate_by_default_weighs_a_new_gap_one_tenth() -> None:
    """Gaps of 1 s then 0.5 s: the mean gap is 1 + 0.1 x (0.5 - 1) = 0.95 s."""
    rate = ArrivalRate()
    for at in (0.0, 1.0, 1.5):
        rate.observe(at)
    assert rate.per_second(1.5) == pytest.approx(1 / 0.95, rel=1e-12)


def test_arrival_rate_by_default_caps_a_gap_at_ten_seconds() -> None:
    """A 20 s gap counts as 10 s in the mean (and the silence since is none)."""
    rate = ArrivalRate()
    rate.observe(0.0)
    rate.observe(20.0)
    assert rate.per_second(20.0) == pytest.approx(0.1, rel=1e-12)


def test_two_rows_arriving_first_start_the_rate_with_a_gap_of_zero() -> None:
    """The first entry's two rows: the second came 0 s after the first, a rate at once."""
    rate = ArrivalRate()
    rate.observe(0.0, count=2)
    assert rate.per_second(0.5) == pytest.approx(2.0)


def test_a_rate_of_simultaneous_arrivals_is_capped_at_a_million_a_second() -> None:
    """A mean gap of zero asked at the last arrival divides by a floor of 1 us, not zero."""
    rate = ArrivalRate()
    rate.observe(0.0, count=2)
    assert rate.per_second(0.0) == pytest.approx(1e6)


def test_an_entrys_second_row_folds_one_zero_gap_into_the_mean() -> None:
    """Gap 1 s, then a second row with it: weight 0.5 halves the mean gap to 0.5 s."""
    rate = ArrivalRate(weight=0.5)
    rate.observe(0.0)
    rate.observe(1.0, count=2)
    assert rate.per_second(1.0) == pytest.approx(2.0)


def test_observations_pass_an_entrys_row_count_to_the_rate() -> None:
    """Three rows at 0 s: a mean gap of zero, so 2 per second half a second later."""
    from worker.encode.cost import Observations

    seen = Observations([128])
    seen.arrival(128, 0.0, count=3)
    assert seen.rates(0.5) == {128: pytest.approx(2.0)}


def test_observations_mark_when_online_traffic_last_came() -> None:
    """The loop's `online_idle_s` is measured from `last_online_s`: never, at first (idle
    for ever); an arrival is online unless it says not; background rows and late reports
    of earlier arrivals leave it."""
    from worker.encode.cost import Observations

    seen = Observations([128])
    assert seen.last_online_s == float("-inf")
    seen.arrival(128, 1.0)
    assert seen.last_online_s == 1.0
    seen.arrival(128, 2.0, online=False)
    seen.arrival(128, 0.5, count=2)
    assert seen.last_online_s == 1.0
