"""A queue write that stalls ends at the request's deadline, not after it (issue 34, item 5).

Real redis-server, a real `noop` worker process, the gateway in-process under uvicorn.
`CLIENT PAUSE … WRITE` holds every write command for seconds, as a failover or a stalled
Redis would: the request gets its 504 at its own deadline, and once writes resume the entry
it landed is cancelled, so no worker computes it.
"""

from __future__ import annotations

import time

import httpx
import redis

from common.store import open_store
from tests.conftest import Processes, free_port, wait_until
from tests.integration.test_supervision import FaultyStore, _settings, gateway_in_thread

PAUSE_MS = 4000
TIMEOUT_MS = 600


def test_a_stalled_queue_write_answers_504_at_the_deadline(
    redis_url: str, processes: Processes
) -> None:
    metrics_port = free_port()
    processes.start("worker", redis_url=redis_url, model="noop", metrics_port=metrics_port)
    worker_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    settings = _settings(redis_url)
    admin = redis.Redis.from_url(redis_url)
    try:
        with gateway_in_thread(settings, FaultyStore(open_store(settings))) as url:
            assert httpx.post(f"{url}/v1/embeddings", json={"input": "warm"}).status_code == 200
            before = _computed(worker_metrics)
            admin.client_pause(PAUSE_MS, all=False)  # writes wait; reads go on
            started = time.monotonic()
            late = httpx.post(
                f"{url}/v1/embeddings",
                json={"input": "stalled"},
                headers={"X-Microbatch-Timeout-Ms": str(TIMEOUT_MS)},
                timeout=30,
            )
            took = time.monotonic() - started
            assert late.status_code == 504, late.text
            assert "did not take this request" in late.json()["error"]["message"]
            assert took < PAUSE_MS / 1000 / 2, f"504 after {took:.1f} s: waited out the pause"
            admin.client_unpause()
            wait_until(
                lambda: admin.xlen(_stream()), 10, "the stalled entry acked", until=lambda n: n == 0
            )
            assert _computed(worker_metrics) == before  # cancelled before any worker read it
    finally:
        admin.close()


def _stream() -> str:
    from common.streams import Keys

    return Keys("mb").request("noop", 128)


def _computed(metrics_url: str) -> float:
    """Entries the worker has put in batches (the count of its batch-size histogram)."""
    text = httpx.get(metrics_url, timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("microbatch_batch_size_sum")
    )
