"""Deadline-feasible admission against a real backlog, a real worker and a real redis-server."""

from __future__ import annotations

import asyncio
import time

import httpx
import redis

from common.streams import Keys
from tests.conftest import Processes, eventually, fire, texts, wait_ready
from tests.integration.test_observability import sample

# Four entries per 200 ms batch: about 20 entries/s, so 160 queued is about eight seconds.
SLOW = {"noop_compute_ms": 200, "max_batch_size": 4, "max_wait_ms": 0}
BACKLOG = 160


async def _post(url: str, body: dict, timeout_ms: int) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=90) as client:
        response = await client.post(
            "/v1/embeddings", json=body, headers={"X-Microbatch-Timeout-Ms": str(timeout_ms)}
        )
    return response, time.monotonic() - started


def _enqueued(redis_url: str) -> int:
    """Entries the gateway has added to the model's stream so far (XINFO STREAM entries-added)."""
    client = redis.Redis.from_url(redis_url)
    try:
        return client.xinfo_stream(Keys("mb").request("noop", 128))["entries-added"]
    finally:
        client.close()


async def _first_refusal(url: str, timeout_ms: int) -> tuple[httpx.Response, float]:
    """Probe until the gateway has measured the rate; probes admitted before that just 504."""
    for attempt in range(20):
        response, elapsed = await _post(url, {"input": f"probe {attempt}"}, timeout_ms)
        if response.status_code == 503:
            return response, elapsed
        assert response.status_code == 504, f"probe {attempt}: {response.status_code}"
        await asyncio.sleep(0.3)
    raise AssertionError("the gateway never refused a request it could not serve in time")


def test_a_request_that_cannot_meet_its_deadline_is_refused_at_admission(
    redis_url: str, processes: Processes
) -> None:
    common = {"redis_url": redis_url, "model": "noop"}
    processes.start("worker", **SLOW, **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)

    async def scenario() -> tuple[list[httpx.Response], httpx.Response, float, httpx.Response]:
        backlog = asyncio.create_task(
            fire(gateway.base_url, texts(BACKLOG), {"X-Microbatch-Timeout-Ms": "90000"})
        )
        await eventually(  # behind the whole backlog, a probe is refused or times out
            lambda: _enqueued(redis_url),
            30,
            f"the backlog of {BACKLOG} queued",
            until=lambda added: added >= BACKLOG,
        )
        refused, refused_s = await _first_refusal(gateway.base_url, 1000)
        generous, _ = await _post(gateway.base_url, {"input": "patient"}, 90_000)
        return await backlog, refused, refused_s, generous

    backlog, refused, refused_s, generous = asyncio.run(scenario())
    error = refused.json()["error"]
    assert error["code"] == "deadline_infeasible", error
    assert refused_s < 0.5, "refused at admission, not after waiting for the deadline"
    assert int(refused.headers["retry-after"]) >= 1
    assert "inputs/s" in error["message"] and "1000 ms deadline" in error["message"]
    assert generous.status_code == 200, "a deadline the backlog fits in is still admitted"
    assert [r.status_code for r in backlog] == [200] * BACKLOG
    metrics = httpx.get(f"{gateway.base_url}/metrics").text
    assert sample(metrics, "microbatch_rejected_total", reason="deadline_infeasible") == 1
