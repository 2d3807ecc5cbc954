"""Queue-state rules and the metric contract, without Redis."""

from __future__ import annotations

import pytest
from prometheus_client import Counter
from prometheus_client.metrics import MetricWrapperBase

from common import metrics
from common.status import bucket_status
from common.streams import GroupInfo


def test_lag_comes_from_redis_when_redis_reports_it() -> None:
    status = bucket_status(128, GroupInfo(length=10, pending=4, lag=6, oldest_ms=1_000), 3_000)
    assert (status.depth, status.lag, status.pending, status.lag_from_redis) == (10, 6, 4, True)
    assert status.oldest_age_s == 2.0


def test_null_lag_falls_back_to_depth_minus_pending() -> None:
    # XINFO GROUPS lag is NULL after trims/XDEL; entries are deleted on ack, so XLEN is exact.
    status = bucket_status(128, GroupInfo(length=10, pending=4, lag=None, oldest_ms=None), 3_000)
    assert (status.lag, status.lag_from_redis, status.oldest_age_s) == (6, False, None)


def test_a_lag_past_what_the_stream_holds_is_not_believed() -> None:
    """After a restart from its append-only file, Redis 7.0 reported a lag of 1,469 on an
    empty stream (the soak): admission read it as a backlog and refused every request."""
    status = bucket_status(128, GroupInfo(length=0, pending=0, lag=1469, oldest_ms=None), 3_000)
    assert status.lag == 0
    status = bucket_status(128, GroupInfo(length=10, pending=4, lag=50, oldest_ms=None), 3_000)
    assert status.lag == 6


# The metric contract of DESIGN.md section 2.
DESIGN_METRICS = {
    "microbatch_requests_total": {"route", "model", "status"},
    "microbatch_request_duration_seconds": {"route", "model"},
    "microbatch_inflight_requests": set(),
    "microbatch_rejected_total": {"reason"},
    "microbatch_duplicate_replies_total": set(),
    "microbatch_queue_wait_seconds": {"model", "bucket"},
    "microbatch_batch_size": {"model", "bucket"},
    "microbatch_batch_tokens": {"model", "bucket"},
    "microbatch_padding_ratio": {"model", "bucket"},
    "microbatch_compute_seconds": {"model", "bucket"},
    "microbatch_redeliveries_total": set(),
    "microbatch_dead_letters_total": set(),
    "microbatch_device_utilization": set(),
    "microbatch_queue_depth": {"model", "bucket"},
    "microbatch_queue_lag": {"model", "bucket"},
    "microbatch_workers": {"model"},
    "microbatch_generated_tokens_total": {"model"},
    "microbatch_time_to_first_token_seconds": {"model"},
    "microbatch_inter_token_seconds": {"model"},
    "microbatch_running_sequences": {"model"},
    "microbatch_kv_cache_usage_ratio": {"model"},
}


def _declared() -> dict[str, set[str]]:
    out = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            suffix = "_total" if isinstance(value, Counter) else ""
            out[value._name + suffix] = set(value._labelnames)
    return out


@pytest.mark.parametrize(("name", "labels"), sorted(DESIGN_METRICS.items()))
def test_every_design_metric_is_exported_with_its_labels(name: str, labels: set[str]) -> None:
    declared = _declared()
    assert name in declared, f"{name} is in DESIGN.md but not exported"
    assert declared[name] == labels
