"""A worker reads ahead only what it can start within the latency target, so a backlog spreads."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.encode.window import ComputeRate, read_window


def window(rate: float | None, *, sort: int = 64, batch: int = 8, streams: int = 1) -> int:
    return read_window(
        sort_window=sort,
        max_batch_size=batch,
        streams=streams,
        rows_per_s=rate,
        horizon_s=0.1,
    )


@pytest.mark.parametrize(
    ("rate", "streams", "expected", "why"),
    [
        (None, 1, 64, "not measured yet: the sort window, as before"),
        (80.0, 1, 8, "100 ms per batch of 8: one batch waiting, no more"),
        (10.0, 1, 8, "slower than a batch per horizon: still one full batch"),
        (10.0, 2, 16, "a full batch for every compute stream"),
        (300.0, 1, 30, "what it starts within the latency target"),
        (300.0, 2, 60, "two streams start twice as much"),
        (1e6, 1, 64, "a fast worker keeps the whole sort window"),
    ],
)
def test_the_window_is_what_the_worker_starts_soon(
    rate: float | None, streams: int, expected: int, why: str
) -> None:
    assert window(rate, streams=streams) == expected, why


def test_a_batch_larger_than_the_sort_window_still_fits() -> None:
    assert window(None, sort=4, batch=16) == 16
    assert window(80.0, sort=4, batch=16) == 16


@given(
    rate=st.one_of(st.none(), st.floats(0.01, 1e6)),
    sort=st.integers(1, 512),
    batch=st.integers(1, 128),
    streams=st.integers(1, 8),
)
def test_the_window_stays_between_one_batch_and_the_sort_window(
    rate: float | None, sort: int, batch: int, streams: int
) -> None:
    got = window(rate, sort=sort, batch=batch, streams=streams)
    assert min(batch * streams, max(batch, sort)) <= got <= max(batch, sort)


def test_the_rate_is_entries_over_compute_seconds_of_recent_batches() -> None:
    rate = ComputeRate(window=4, min_batches=2)
    rate.observe(8, 0.1)
    assert rate.per_second() is None  # one batch is not a measurement
    rate.observe(8, 0.1)
    assert rate.per_second() == pytest.approx(80.0)
    for _ in range(4):  # the old batches leave the window
        rate.observe(16, 0.1)
    assert rate.per_second() == pytest.approx(160.0)


def test_a_batch_without_a_duration_is_ignored() -> None:
    rate = ComputeRate(min_batches=1)
    rate.observe(8, 0.0)
    rate.observe(0, 0.1)
    rate.observe(8, float("nan"))
    assert rate.per_second() is None


def test_the_rate_by_default_is_measured_from_four_batches() -> None:
    """Four batches are a measurement, three are not."""
    rate = ComputeRate()
    for _ in range(3):
        rate.observe(8, 0.1)
    assert rate.per_second() is None
    rate.observe(8, 0.1)
    assert rate.per_second() == pytest.approx(80.0)


def test_the_rate_by_default_covers_the_last_32_batches() -> None:
    """After 32 batches of 8 rows and 32 of 16, only the 16-row batches count."""
    rate = ComputeRate()
    for rows in (8, 16):
        for _ in range(32):
            rate.observe(rows, 0.1)
    assert rate.per_second() == pytest.approx(160.0, rel=1e-9)


def test_a_batch_of_one_row_counts() -> None:
    """One row in half a second is a rate of 2 rows per second."""
    rate = ComputeRate(min_batches=1)
    rate.observe(1, 0.5)
    assert rate.per_second() == pytest.approx(2.0)
