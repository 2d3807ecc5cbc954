"""The driver of a batch keeps a model's queue short: with `batch_queue_depth` 4 and a slow
worker, the request streams never hold more than a few entries while a batch runs, so an
online request is never queued behind a file's worth of lines (a stream is FIFO)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
from openai import OpenAI

from common.settings import Settings
from tests.conftest import RedisServer, free_port, wait_until
from tests.integration.batch_client import finished, upload
from tests.integration.in_process import InProcess

PREFIX = "mbgate"
DEPTH = 4


@pytest.fixture
def gateway(redis_server: RedisServer) -> Iterator[str]:
    deployment = InProcess()
    common = {"redis_url": redis_server.url, "prefix": PREFIX, "read_block_ms": 100}
    try:
        deployment.start_worker(
            Settings(**common, model="noop", noop_compute_ms=20, worker_id="slow-noop")
        )
        port = free_port()
        yield deployment.start_gateway(
            Settings(**common, port=port, gateway_id=f"g-{port}", batch_queue_depth=DEPTH)
        )
    finally:
        deployment.close()


def test_a_batch_never_fills_the_queue_past_its_depth(
    gateway: str, redis_server: RedisServer, closing
) -> None:
    client = closing.enter_context(OpenAI(base_url=f"{gateway}/v1", api_key="none", max_retries=0))
    wait_until(lambda: len(client.models.list().data), 60, "the noop worker live")
    lines = [
        {"custom_id": f"g{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}
        for i in range(200)
    ]
    file_id = upload(client, lines)
    r = redis.Redis.from_url(redis_server.url)
    streams = [f"{PREFIX}:{{noop}}:req:{bucket}" for bucket in (128, 256, 512)]
    deepest, done = 0, threading.Event()

    def watch() -> None:
        nonlocal deepest
        while not done.is_set():
            deepest = max(deepest, sum(r.xlen(s) for s in streams))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
        )
        batch = finished(client, batch.id, 60, interval_s=0.1)
    finally:
        done.set()
        watcher.join()
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == 200
    # one reading serves the lines starting within 20 ms, each counted as it goes: a line
    # or two over the bound may slip in while a reading is that old
    assert 0 < deepest <= DEPTH + 2, deepest
