"""A real worker's metrics port answers `/healthz` from its consume loop's beat."""

from __future__ import annotations

import contextlib

import httpx

from tests.conftest import Processes, free_port, wait_until

BEAT = "microbatch_worker_loop_beat_timestamp_seconds"


def _get(url: str) -> httpx.Response | None:
    with contextlib.suppress(httpx.HTTPError):  # not listening yet
        return httpx.get(url, timeout=2)
    return None


def _beat(metrics_text: str) -> float:
    line = next(row for row in metrics_text.splitlines() if row.startswith(f"{BEAT} "))
    return float(line.split()[1])


def test_healthz_is_200_while_the_loop_beats_and_metrics_share_the_port(
    redis_url: str, processes: Processes
) -> None:
    port = free_port()
    worker = processes.start("worker", redis_url=redis_url, model="noop", metrics_port=port)
    base = f"http://127.0.0.1:{port}"

    def healthz() -> httpx.Response | None:
        assert worker.popen.poll() is None, worker.output()[-3000:]
        return _get(f"{base}/healthz")

    ok = wait_until(healthz, 60, "/healthz 200", until=lambda r: r and r.status_code == 200)
    body = ok.json()
    assert body["status"] == "ok" and body["beat_age_s"] <= body["stale_after_s"]
    assert ok.headers["content-type"] == "application/json"

    first = _beat(httpx.get(f"{base}/metrics", timeout=2).text)
    assert first > 0
    wait_until(  # the loop keeps beating: the gauge moves on
        lambda: _beat(httpx.get(f"{base}/metrics", timeout=2).text),
        15,
        "a later beat",
        until=lambda beat: beat > first,
    )
