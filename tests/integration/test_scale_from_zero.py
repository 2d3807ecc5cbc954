"""Scale from zero with real processes: a model whose workers all stopped stays known, its
gateway stays ready, and a request whose deadline allows the measured cold start waits in
the queue for a worker to start; one whose deadline does not is refused at once."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import redis

from tests.conftest import Processes, RedisServer, wait_ready, wait_until

PREFIX = "mbzero"


def test_a_request_waits_for_a_worker_to_start_when_its_deadline_allows(
    processes: Processes, redis_server: RedisServer
) -> None:
    common = {"redis_url": redis_server.url, "prefix": PREFIX, "model": "noop"}
    worker = processes.start("worker", **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    cold_ms = int(redis.Redis.from_url(redis_server.url).get(f"{PREFIX}:{{noop}}:cold_start"))
    assert 0 < cold_ms < 120_000  # the worker's own start, interpreter and imports included

    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    wait_until(
        lambda: httpx.get(f"{gateway.base_url}/readyz").json()["models"]["noop"]["live_workers"],
        30,
        "the gateway seeing no live worker",
        until=lambda n: n == 0,
    )
    assert httpx.get(f"{gateway.base_url}/readyz").status_code == 200  # still takes requests
    assert httpx.get(f"{gateway.base_url}/readyz/noop").status_code == 503

    short = max(1, cold_ms // 2)
    started = time.monotonic()
    refused = httpx.post(
        f"{gateway.base_url}/v1/embeddings",
        json={"input": "too soon"},
        headers={"x-microbatch-timeout-ms": str(short)},
    )
    assert refused.status_code == 503 and time.monotonic() - started < 1.0
    assert refused.json()["error"]["code"] == "no_workers"
    assert int(refused.headers["retry-after"]) >= max(1, round(cold_ms / 1000) - 1)

    answered: list[httpx.Response] = []

    def ask() -> None:
        answered.append(
            httpx.post(
                f"{gateway.base_url}/v1/embeddings",
                json={"input": "worth the wait"},
                headers={"x-microbatch-timeout-ms": str(cold_ms * 4 + 30_000)},
                timeout=cold_ms / 1000 * 4 + 60,
            )
        )

    waiting = threading.Thread(target=ask)
    waiting.start()
    wait_until(
        lambda: redis.Redis.from_url(redis_server.url).xlen(f"{PREFIX}:{{noop}}:req:128"),
        10,
        "the request queued with no worker to take it",
    )
    processes.start("worker", **common)  # what KEDA's activation on the queue's lag does
    waiting.join(cold_ms / 1000 * 4 + 90)
    assert [a.status_code for a in answered] == [200]
    wait_until(
        lambda: httpx.get(f"{gateway.base_url}/readyz/noop").status_code,
        10,
        "the model ready again",
        until=lambda status: status == 200,
    )
