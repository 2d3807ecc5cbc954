"""Admission refuses fast, with a retry hint; the service rate it trusts is measured fairly."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway import admission
from gateway.admission import Admitted, QueueState, Rejected, admit
from gateway.catalog import DeliveryRate


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
    assert (decision.reason, decision.code) == ("no_workers", "no_workers")


def test_a_request_that_cannot_meet_its_deadline_is_refused_at_admission() -> None:
    # 200 entries ahead at 20 entries/s is ten seconds of waiting; the deadline is one.
    state = QueueState(depth=200, live_workers=1, service_rate_per_s=20.0)
    decision = admit(state, 1, 4096, timeout_ms=1000)
    assert isinstance(decision, Rejected)
    assert (decision.reason, decision.code) == ("deadline_infeasible", "deadline_infeasible")
    assert "200 inputs" in decision.message
    assert "20.0 inputs/s" in decision.message
    assert "1000 ms deadline" in decision.message


def test_a_request_whose_deadline_covers_the_backlog_is_admitted() -> None:
    state = QueueState(depth=200, live_workers=1, service_rate_per_s=20.0)
    assert admit(state, 1, 4096, timeout_ms=30_000) == Admitted()


def test_the_queue_may_take_four_fifths_of_the_deadline_the_request_itself_included() -> None:
    # 15 ahead + 1 = 0.8 s at 20/s, four fifths of a one-second deadline: feasible.
    # The rest is for the request's own batch and reply; 2 inputs would not leave it.
    state = QueueState(depth=15, live_workers=1, service_rate_per_s=20.0)
    assert admit(state, 1, 4096, timeout_ms=1000) == Admitted()
    assert isinstance(admit(state, 2, 4096, timeout_ms=1000), Rejected)


def test_without_a_measured_rate_any_deadline_is_admitted() -> None:
    state = QueueState(depth=4000, live_workers=1, service_rate_per_s=None)
    assert admit(state, 1, 4096, timeout_ms=1) == Admitted()


def test_retry_after_is_how_long_until_the_backlog_fits_the_deadline() -> None:
    # 401 entries at 10/s is 40.1 s; a 10 s deadline (8 s of queue) fits after ~32 s.
    state = QueueState(depth=400, live_workers=1, service_rate_per_s=10.0)
    decision = admit(state, 1, 4096, timeout_ms=10_000)
    assert isinstance(decision, Rejected)
    assert 32.0 <= decision.retry_after_s <= 32.2


def test_retry_after_is_at_least_a_second_and_at_most_a_minute() -> None:
    barely = admit(QueueState(17, 1, 20.0), 1, 4096, timeout_ms=1000)
    hopeless = admit(QueueState(4000, 1, 1.0), 1, 4096, timeout_ms=1000)
    assert isinstance(barely, Rejected) and barely.retry_after_s == 1.0
    assert isinstance(hopeless, Rejected) and hopeless.retry_after_s == 60.0


def test_a_full_queue_is_refused_before_the_deadline_is_even_considered() -> None:
    decision = admit(QueueState(4096, 1, 1.0), 1, 4096, timeout_ms=1000)
    assert isinstance(decision, Rejected)
    assert (decision.reason, decision.code) == ("queue_full", "overloaded")


def test_a_measured_rate_of_zero_is_a_bug_not_a_measurement() -> None:
    with pytest.raises(ValueError, match="positive"):
        QueueState(depth=1, live_workers=1, service_rate_per_s=0.0)


@given(
    depth=st.integers(0, 10_000),
    n_inputs=st.integers(1, 100),
    rate=st.floats(0.01, 10_000),
    timeout_ms=st.integers(1, 600_000),
)
def test_deadline_refusal_matches_the_wait_it_reports(
    depth: int, n_inputs: int, rate: float, timeout_ms: int
) -> None:
    decision = admit(QueueState(depth, 1, rate), n_inputs, 10**9, timeout_ms=timeout_ms)
    infeasible = (depth + n_inputs) / rate > 0.8 * timeout_ms / 1000
    assert isinstance(decision, Rejected) == infeasible
    if isinstance(decision, Rejected):
        assert 1.0 <= decision.retry_after_s <= 60.0


# ---- the service rate admission trusts (gateway.catalog.DeliveryRate) ----------------------


def test_the_service_rate_is_measured_only_across_a_backlog() -> None:
    rate = DeliveryRate(chunk_s=2.0)
    assert rate.observe(0.0, {128: 0}, backlog=True) is None
    assert (
        rate.observe(1.0, {128: 20}, backlog=True) is None
    )  # one busy second is not a whole chunk
    assert rate.observe(2.0, {128: 40}, backlog=True) == 20.0


def test_without_a_backlog_deliveries_are_arrivals_and_give_no_rate() -> None:
    rate = DeliveryRate(chunk_s=1.0)
    readings = [rate.observe(float(t), {128: 5 * t}, backlog=False) for t in range(10)]
    assert readings == [None] * 10


def test_a_rate_outlives_the_backlog_only_for_the_window() -> None:
    # The next burst lands between two refreshes: the capacity just measured still holds.
    rate = DeliveryRate(window_s=5.0, chunk_s=1.0)
    rate.observe(0.0, {128: 0}, backlog=True)
    assert rate.observe(2.0, {128: 40}, backlog=True) == 20.0
    assert rate.observe(3.0, {128: 45}, backlog=False) == 20.0
    assert rate.observe(8.0, {128: 45}, backlog=False) is None


def test_deliveries_in_batch_sized_jumps_average_to_the_true_rate() -> None:
    # A worker reads 16 entries every 0.8 s (20/s); the gateway looks every 0.25 s.
    rate = DeliveryRate(window_s=10.0, chunk_s=2.0)
    seen = None
    for step in range(40):
        now = step * 0.25
        seen = rate.observe(now, {128: 16 * int(now / 0.8)}, backlog=True)
    assert seen is not None and abs(seen - 20.0) < 2.0


def test_a_store_that_cannot_count_reports_no_rate_and_forgets_the_window() -> None:
    rate = DeliveryRate(chunk_s=1.0)
    rate.observe(0.0, {128: 0}, backlog=True)
    assert rate.observe(1.0, {128: 10}, backlog=True) == 10.0
    assert rate.observe(2.0, None, backlog=True) is None
    assert rate.observe(3.0, {128: 500}, backlog=True) is None  # a fresh start, not 490 in a second


def test_a_counter_that_went_back_after_redis_lost_its_data_is_ignored() -> None:
    rate = DeliveryRate(chunk_s=1.0)
    rate.observe(0.0, {128: 1000}, backlog=True)
    assert rate.observe(1.0, {128: 3}, backlog=True) is None
    assert rate.observe(2.0, {128: 13}, backlog=True) == 10.0


def test_old_intervals_leave_the_window_so_the_rate_follows_the_workers() -> None:
    rate = DeliveryRate(window_s=5.0, chunk_s=1.0)
    read = 0
    for t in range(10):  # 10/s, then a second worker joins: 30/s
        read += 10 if t < 5 else 30
        rate.observe(float(t), {128: read}, backlog=True)
    assert rate.observe(10.0, {128: read + 30}, backlog=True) == 30.0


def test_a_batch_longer_than_the_window_is_not_a_zero_rate() -> None:
    rate = DeliveryRate(window_s=5.0, chunk_s=1.0)
    assert [rate.observe(float(t), {128: 16}, backlog=True) for t in range(6)] == [None] * 6


def test_a_bucket_first_counted_mid_run_adds_only_what_it_delivers_from_then_on() -> None:
    # Redis counts a bucket's deliveries only once something was read from it.
    rate = DeliveryRate(chunk_s=1.0)
    rate.observe(0.0, {128: 0}, backlog=True)
    assert rate.observe(1.0, {128: 10, 256: 500}, backlog=True) == 10.0
    rate.observe(2.0, {128: 20, 256: 505}, backlog=True)
    assert rate.observe(3.0, {128: 30, 256: 510}, backlog=True) == 15.0


def test_a_rush_of_expired_entries_being_skipped_does_not_pass_for_capacity() -> None:
    # 20/s of real work, then one chunk in which the worker skipped 600 expired entries.
    rate = DeliveryRate(window_s=10.0, chunk_s=1.0)
    read = 0
    for t in range(1, 10):
        read += 600 if t == 5 else 20
        seen = rate.observe(float(t), {128: read}, backlog=True)
    assert seen == 20.0


def test_a_generation_queue_is_bounded_in_tokens_as_well_as_rows() -> None:
    from gateway.admission import TokenAsk

    state = QueueState(depth=10, live_workers=1)  # ten sequences, about 900 tokens each
    fits = TokenAsk(tokens=1000, tokens_per_row=900.0, max_queued_tokens=10_000)
    assert admit(state, 1, 4096, tokens=fits) == Admitted()
    over = TokenAsk(tokens=1001, tokens_per_row=900.0, max_queued_tokens=10_000)
    decision = admit(state, 1, 4096, tokens=over)
    assert isinstance(decision, Rejected)
    assert (decision.reason, decision.code) == ("queue_full", "overloaded")
    assert "9000 tokens" in decision.message and "max_queued_tokens 10000" in decision.message


def test_a_per_model_mean_starts_at_its_default_and_follows_what_is_seen() -> None:
    from gateway.admission import PerModelMean

    mean = PerModelMean(default=None)
    assert mean.of("m") is None
    mean.observe("m", 800, 2)  # two sequences of 400 tokens
    assert mean.of("m") == 400
    mean.observe("m", 4000, 1)
    assert mean.of("m") == pytest.approx(400 + 0.05 * 3600)
    assert mean.of("other") is None


def test_each_refusal_is_whole_and_the_depth_limit_is_inclusive() -> None:
    nobody = admit(QueueState(depth=0, live_workers=0), 1, 100)
    assert nobody == Rejected(
        "no_workers", "no live worker serves this model right now", 1.0, code="no_workers"
    )
    assert admit(QueueState(depth=95, live_workers=1), 5, 100) == Admitted()  # 100: room
    full = admit(QueueState(depth=96, live_workers=1), 5, 100)
    assert full == Rejected(
        "queue_full",
        "queue for this model holds 96 inputs; adding 5 would exceed max_queue_depth 100",
        1.0,
    )
    assert full.code == "overloaded"


def test_a_measured_rate_that_is_not_positive_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="a measured service rate is positive; report None"):
        QueueState(depth=1, live_workers=1, service_rate_per_s=0.0)


def test_a_per_model_mean_with_a_default_answers_it_for_an_unseen_model() -> None:
    from gateway.admission import PerModelMean

    assert PerModelMean(default=1.0).of("never-seen") == 1.0


def test_no_worker_and_no_measured_start_is_refused_at_once() -> None:
    decision = admit(QueueState(depth=0, live_workers=0), 1, 100, timeout_ms=60_000)
    assert isinstance(decision, Rejected) and decision.code == "no_workers"
    assert decision.retry_after_s == 1.0


def test_no_worker_but_time_for_one_to_start_is_queued_durably() -> None:
    """Scale from zero: a worker takes 5 s to start; a 10 s deadline leaves 8 s for the
    queue (QUEUE_SHARE_OF_DEADLINE), so the request waits for it; 6 s leaves 4.8 s: refused
    at once, told to come back when a worker could be up."""
    cold = QueueState(depth=0, live_workers=0, cold_start_ms=5000)
    assert isinstance(admit(cold, 1, 100, timeout_ms=10_000), Admitted)
    refused = admit(cold, 1, 100, timeout_ms=6000)
    assert isinstance(refused, Rejected) and refused.code == "no_workers"
    assert refused.retry_after_s == 5.0 and "5000 ms to start" in refused.message
    assert isinstance(admit(cold, 1, 100, timeout_ms=None), Rejected)


def test_a_model_waiting_for_its_first_worker_still_bounds_its_queue() -> None:
    full = QueueState(depth=100, live_workers=0, cold_start_ms=1000)
    decision = admit(full, 1, 100, timeout_ms=60_000)
    assert isinstance(decision, Rejected) and decision.reason == "queue_full"


def test_a_tenants_backlog_cap_admits_up_to_it_and_names_what_it_holds() -> None:
    assert admission.tenant_backlog("acme", queued=200, tokens=100, cap=300) is None
    refused = admission.tenant_backlog("acme", queued=200, tokens=101, cap=300)
    assert refused is not None and refused.code == "tenant_queue_full"
    assert "'acme' has 200 tokens" in refused.message and "max_queued_tokens 300" in refused.message


def test_a_queue_full_in_tokens_is_refused_whole_with_a_one_second_retry() -> None:
    """The token bound's refusal is queue_full, overloaded, retry after exactly 1 s."""
    from gateway.admission import TokenAsk

    over = TokenAsk(tokens=1001, tokens_per_row=900.0, max_queued_tokens=10_000)
    decision = admit(QueueState(depth=10, live_workers=1), 1, 4096, tokens=over)
    assert decision == Rejected(
        "queue_full",
        "queue for this model holds about 9000 tokens (prompts + max_tokens); adding 1001 "
        "would exceed max_queued_tokens 10000",
        1.0,
    )
    assert isinstance(decision, Rejected) and decision.code == "overloaded"


def test_a_per_model_mean_observed_answers_the_models_new_mean() -> None:
    """What the gateway sizes a generation request's token ask with (it asserts not None)."""
    from gateway.admission import PerModelMean

    mean = PerModelMean(default=None)
    assert mean.observe("m", 800, 2) == 400
    assert mean.observe("m", 4000, 1) == pytest.approx(400 + 0.05 * 3600)
    assert mean.observe("m", 0, 0) == mean.of("m")  # nothing to fold in: the mean as it was


def test_a_cold_start_of_exactly_the_queues_share_of_the_deadline_is_queued() -> None:
    """8 s to start against a 10 s deadline: the queue's four fifths are met, not exceeded."""
    cold = QueueState(depth=0, live_workers=0, cold_start_ms=8000)
    assert admit(cold, 1, 100, timeout_ms=10_000) == Admitted()
    assert isinstance(admit(cold, 1, 100, timeout_ms=9_999), Rejected)


@pytest.mark.parametrize(
    ("cold_start_ms", "timeout_ms", "retry_after_s"),
    [(6000, 6000, 6.0), (1500, 1000, 1.5), (500, 500, 1.0), (90_000, 60_000, 60.0)],
)
def test_no_worker_in_time_is_refused_whole_with_the_start_as_the_retry(
    cold_start_ms: int, timeout_ms: int, retry_after_s: float
) -> None:
    """The retry is the worker's start, at least a second and at most a minute; the message
    names both the start and this request's deadline."""
    state = QueueState(depth=0, live_workers=0, cold_start_ms=cold_start_ms)
    assert admit(state, 1, 100, timeout_ms=timeout_ms) == Rejected(
        "no_workers",
        f"no live worker serves this model right now, and one takes about {cold_start_ms} ms "
        f"to start: more than this request's {timeout_ms} ms deadline allows",
        retry_after_s,
        code="no_workers",
    )


def test_a_tenants_backlog_refusal_is_whole_with_a_one_second_retry() -> None:
    assert admission.tenant_backlog("acme", queued=200, tokens=101, cap=300) == Rejected(
        "tenant_queue_full",
        "tenant 'acme' has 200 tokens (prompts + max_tokens) queued for this model; adding "
        "101 would exceed its max_queued_tokens 300",
        1.0,
        code="tenant_queue_full",
    )
