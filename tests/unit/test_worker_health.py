"""The worker's `/healthz` policy and its HTTP port: no Redis, no torch."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge

from common import metrics
from worker import health

STALE_S = 30.0


@pytest.mark.parametrize(
    ("now_s", "last_beat_s", "ok", "status", "age_s"),
    [
        (1000.0, None, False, "starting", None),  # never beat: still loading the model
        (1000.0, 1000.0, True, "ok", 0.0),
        (1000.0, 990.0, True, "ok", 10.0),
        (1000.0, 1000.0 - STALE_S, True, "ok", STALE_S),  # the bound itself is still alive
        (1000.0, 1000.0 - STALE_S - 0.001, False, "stale", STALE_S + 0.001),
        (1000.0, 100.0, False, "stale", 900.0),
        (1000.0, 1002.0, True, "ok", 0.0),  # a beat a little ahead (clock step) is not old
    ],
)
def test_check_is_alive_while_the_last_beat_is_recent(
    now_s: float, last_beat_s: float | None, ok: bool, status: str, age_s: float | None
) -> None:
    result = health.check(now_s, last_beat_s, STALE_S)
    assert (result.ok, result.status, result.stale_after_s) == (ok, status, STALE_S)
    assert result.beat_age_s == pytest.approx(age_s)


@pytest.mark.parametrize(
    ("heartbeat_interval_ms", "expected_s"),
    [(1000, health.STALE_FLOOR_S), (100, health.STALE_FLOOR_S), (10_000, 50.0)],
)
def test_stale_after_is_a_few_beats_never_under_the_floor(
    heartbeat_interval_ms: int, expected_s: float
) -> None:
    assert health.stale_after_s(heartbeat_interval_ms) == expected_s


def test_the_body_says_the_status_and_the_age() -> None:
    body = json.loads(health.check(100.0, 87.5, STALE_S).body())
    assert body == {"status": "ok", "beat_age_s": 12.5, "stale_after_s": STALE_S}
    assert json.loads(health.check(100.0, None, STALE_S).body())["beat_age_s"] is None


def test_the_last_beat_is_read_from_the_gauge_the_intake_sets() -> None:
    gauge = metrics.worker_loop_beat_timestamp_seconds
    gauge.set(0)  # what a fresh process holds: never beat
    assert health.last_beat_s() is None
    gauge.set(1234.5)
    try:
        assert health.last_beat_s() == 1234.5
    finally:
        gauge.set(0)


def test_one_port_serves_healthz_and_metrics() -> None:
    registry = CollectorRegistry()
    Gauge("probe_example", "a metric only this registry has", registry=registry).set(7)
    beat = {"s": None}
    server = health.serve(
        0,
        "127.0.0.1",
        STALE_S,
        registry=registry,
        last_beat=lambda: beat["s"],
        clock=lambda: 1000.0,
    )
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        starting = httpx.get(f"{base}/healthz")
        assert starting.status_code == 503 and starting.json()["status"] == "starting"
        beat["s"] = 995.0
        ok = httpx.get(f"{base}/healthz")
        assert ok.status_code == 200 and ok.json() == {
            "status": "ok",
            "beat_age_s": 5.0,
            "stale_after_s": STALE_S,
        }
        assert ok.headers["content-type"] == "application/json"
        beat["s"] = 900.0
        stale = httpx.get(f"{base}/healthz")
        assert stale.status_code == 503 and stale.json()["status"] == "stale"
        assert "probe_example 7.0" in httpx.get(f"{base}/metrics").text
    finally:
        server.shutdown()
        server.server_close()
