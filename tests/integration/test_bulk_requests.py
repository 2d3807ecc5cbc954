"""Bulk requests: a request's inputs travel in a few entries, tokenized a block at a time.

Real redis-server, real gateway and worker processes, the real model. `max_entry_rows` is
set small so a modest request spans several blocks, buckets and entries, and its rows are
batched across entries (`max_batch_size` 3).
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from common.settings import DEFAULT_MODEL
from tests.conftest import (
    Processes,
    RedisServer,
    eventually,
    free_port,
    queue_counts,
    wait_ready,
    wait_until,
)
from tests.integration.test_embeddings_pipeline import cosine, text_of, tokenizer
from tests.integration.test_faults import QUICK, worker_metrics
from tests.integration.test_observability import sample
from tests.integration.test_trimming import batches_run

pytestmark = pytest.mark.process  # a module-scoped deployment of processes

ENTRY_ROWS = 4


@pytest.fixture(scope="module")
def bulk(module_redis: RedisServer, tmp_path_factory) -> Iterator[tuple[str, str]]:
    module_redis.flush()
    procs = Processes(tmp_path_factory.mktemp("bulk"))
    common = {"redis_url": module_redis.url, "max_batch_size": 3, "max_entry_rows": ENTRY_ROWS}
    procs.start("worker", **common)
    gateway = procs.start("gateway", **common)
    wait_ready(gateway)
    yield gateway.base_url, module_redis.url
    procs.stop_all()


def test_a_bulk_request_spread_over_entries_and_batches_keeps_input_order(
    bulk: tuple[str, str], reference_model
) -> None:
    url, _ = bulk
    rng = random.Random(5)
    lengths = [rng.choice([6, 40, 150, 300]) for _ in range(23)]  # three buckets, six blocks
    texts = [text_of(n, rng) for n in lengths]
    response = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    expected = reference_model.encode(texts, convert_to_numpy=True, normalize_embeddings=False)
    for item, alone in zip(body["data"], expected, strict=True):
        assert cosine(np.array(item["embedding"], np.float32), alone) >= 0.99999
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer().encode(t).ids) for t in texts)
    batches = response.headers["x-microbatch-batch-id"].split(",")
    assert len(batches) >= len(texts) // 3  # batches of at most three rows


@pytest.mark.parametrize(
    ("bad", "status", "why"),
    [("", 400, "input[17] is an empty string"), ("word " * 600, 413, "input[17] has")],
)
def test_a_bad_input_in_a_late_block_is_refused_by_its_index_and_nothing_is_left_queued(
    bulk: tuple[str, str], bad: str, status: int, why: str
) -> None:
    url, redis_url = bulk
    texts = [f"text number {i}" for i in range(20)]
    texts[17] = bad  # in the fifth block: four blocks were queued before it was tokenized
    response = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=120)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert why in error["message"] and error["param"] == "input[17]"
    # the entries queued before the bad block are cancelled or answered: none stay behind
    wait_until(
        lambda: queue_counts(redis_url, model=DEFAULT_MODEL),
        30,
        "the request streams drained",
        until=lambda q: q == (0, 0),
    )


def test_a_worker_killed_midway_through_a_bulk_entry_loses_none_of_its_rows(
    redis_url: str, processes: Processes
) -> None:
    """Two entries of six rows, batches of two at 400 ms: the worker dies with some rows
    computed and none answered; a peer redoes both entries whole, and nothing stays pending."""
    common = {"redis_url": redis_url, "model": "noop", "max_entry_rows": 6, **QUICK}
    doomed_port = free_port()
    marked = ("tests.fault_worker", "--marked")  # vectors that name their input
    doomed = processes.start_module(
        *marked, noop_compute_ms=400, max_batch_size=2, metrics_port=doomed_port, **common
    )
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    port = free_port()

    async def batches_of_the_doomed() -> float:
        async with httpx.AsyncClient(timeout=2) as client:
            try:
                metrics = await client.get(f"http://127.0.0.1:{doomed_port}/metrics")
            except httpx.ConnectError:  # its metrics server is not up yet
                return 0
        return batches_run(metrics.text)

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "noop", "input": [[101, 1000 + i, 102] for i in range(12)]}
            request = asyncio.create_task(
                client.post(f"{gateway.base_url}/v1/embeddings", json=body)
            )
            await eventually(
                lambda: queue_counts(redis_url),
                15,
                "the doomed worker holding both entries",
                until=lambda q: q.pending == 2,
            )
            # a batch or two of its rows computed, no entry (six rows) answered yet
            await eventually(batches_of_the_doomed, 15, "a batch computed", until=lambda n: n >= 1)
            doomed.signal(signal.SIGKILL)
            processes.start_module(*marked, metrics_port=port, **common)
            return await request

    response = asyncio.run(scenario())
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(12))
    # and each row's own vector in its place: redelivery kept the rows in input order
    assert [d["embedding"][0] for d in data] == [101 + 1000 + i + 102 for i in range(12)]
    assert not response.headers["x-microbatch-worker"].endswith(str(doomed.popen.pid))
    assert sample(worker_metrics(port), "microbatch_redeliveries_total") == 2
    assert queue_counts(redis_url) == (0, 0)


def test_a_wide_model_s_bulk_answer_is_split_to_fit_replies_not_dropped_unread(
    redis_url: str, processes: Processes
) -> None:
    """256 inputs of a 4,096-d model are 4 MiB of vectors, past what one reply may carry:
    the gateway sizes entries by the model's width, so the request is answered, not left
    to its deadline because its one reply was too big to read."""
    serve = processes.start(
        "serve", redis_url=redis_url, model="noop", noop_dim=4096, max_wait_ms=0
    )
    wait_ready(serve)
    body = {"model": "noop", "input": [f"text {i}" for i in range(256)]}
    headers = {"X-Microbatch-Timeout-Ms": "20000"}
    response = httpx.post(f"{serve.base_url}/v1/embeddings", json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(256))
    assert all(len(d["embedding"]) == 4096 for d in data)
