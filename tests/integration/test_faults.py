"""Faults with real processes and real signals: every accepted request gets one answer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time

import httpx
import numpy as np
import redis
from typer.testing import CliRunner

from common.cli import app
from common.protocol import EmbeddingResult, decode, encode, pack_vector
from tests.conftest import (
    Processes,
    eventually,
    fire,
    free_port,
    queue_counts,
    texts,
    wait_ready,
    wait_until,
    wait_workers,
)
from tests.integration.test_observability import sample

POISON, BAD = 4242, 4343
QUICK = {"claim_idle_ms": 1000, "heartbeat_interval_ms": 200}


def worker_metrics(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics").text


def pending(redis_url: str) -> int:
    client = redis.Redis.from_url(redis_url)
    total = sum(
        client.xpending(k, "workers")["pending"] for k in client.scan_iter("mb:{noop}:req:*")
    )
    client.close()
    return total


def test_worker_killed_mid_batch_loses_nothing(redis_url: str, processes: Processes) -> None:
    common = {"redis_url": redis_url, "model": "noop", **QUICK}
    doomed = processes.start("worker", noop_compute_ms=3000, max_batch_size=4, **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    port = free_port()

    async def scenario() -> list[httpx.Response]:
        requests = asyncio.create_task(fire(gateway.base_url, texts(4)))
        await eventually(  # read and computing, not acked
            lambda: queue_counts(redis_url),
            15,
            "the doomed worker holding all four entries",
            until=lambda q: q.pending == 4,
        )
        doomed.signal(signal.SIGKILL)
        processes.start("worker", metrics_port=port, **common)
        return await requests

    responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 4
    assert all(
        not r.headers["x-microbatch-worker"].endswith(str(doomed.popen.pid)) for r in responses
    )
    assert sample(worker_metrics(port), "microbatch_redeliveries_total") == 4
    assert pending(redis_url) == 0


def test_killed_after_publishing_before_acking_the_duplicate_is_dropped_and_counted(
    redis_url: str, processes: Processes
) -> None:
    common = {"redis_url": redis_url, "model": "noop", **QUICK}
    first = processes.start("worker", **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    first.signal(signal.SIGKILL)  # its heartbeat stays fresh a few seconds: requests are admitted
    first.wait(10)
    client = redis.Redis.from_url(redis_url)

    async def scenario() -> httpx.Response:
        request = asyncio.create_task(fire(gateway.base_url, texts(1)))
        # Play the dead worker up to the crash: read, publish the reply, never ack.
        read = await eventually(
            lambda: client.xreadgroup("workers", "ghost", {"mb:{noop}:req:128": ">"}, count=1),
            15,
            "the request on its stream",
            interval_s=0.02,
        )
        entry = decode(read[0][1][0][1][b"m"])
        reply = EmbeddingResult(
            id=entry.id,
            embeddings=pack_vector(np.zeros((entry.row_lengths().size, 384), np.float32)),
            rows=entry.row_lengths().size,
            n_tokens=entry.n_tokens,
            batch_ids=["ghost:0"],
            batch_size=1,
            bucket=128,
            queue_ms=0.0,
            compute_ms=0.0,
            worker="ghost",
        )
        client.xadd(entry.reply_to, {"m": encode(reply)})
        [response] = await request
        processes.start("worker", **common)  # redoes the unacked entry
        return response

    response = asyncio.run(scenario())
    assert response.status_code == 200 and response.headers["x-microbatch-worker"] == "ghost"
    duplicates = wait_until(
        lambda: sample(
            httpx.get(f"{gateway.base_url}/metrics").text, "microbatch_duplicate_replies_total"
        ),
        15,
        "the duplicate reply counted",
    )
    assert duplicates == 1
    assert pending(redis_url) == 0
    client.close()


def test_every_worker_killed_then_one_started_serves_backlog_and_orphans(
    redis_url: str, processes: Processes
) -> None:
    common = {"redis_url": redis_url, "model": "noop", **QUICK}
    doomed = [
        processes.start("worker", noop_compute_ms=500, max_batch_size=4, **common) for _ in range(2)
    ]
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    wait_workers(gateway, "noop", 2)

    async def scenario() -> list[httpx.Response]:
        requests = asyncio.create_task(fire(gateway.base_url, texts(24)))
        await eventually(  # orphans: entries the doomed workers read and will never ack
            lambda: queue_counts(redis_url),
            15,
            "the doomed workers holding a batch's worth of entries",
            until=lambda q: q.pending >= 4,
        )
        for proc in doomed:
            proc.signal(signal.SIGKILL)
        processes.start("worker", **common)
        return await requests

    responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 24
    assert pending(redis_url) == 0


def test_a_slow_but_alive_worker_is_not_robbed(redis_url: str, processes: Processes) -> None:
    common = {"redis_url": redis_url, "model": "noop", **QUICK}
    slow = processes.start("worker", noop_compute_ms=3500, max_batch_size=4, **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    port = free_port()

    client = redis.Redis.from_url(redis_url)
    idle_seen: list[int] = []

    async def scenario() -> list[httpx.Response]:
        requests = asyncio.create_task(fire(gateway.base_url, texts(4)))
        await eventually(
            lambda: queue_counts(redis_url),
            15,
            "the slow worker holding all four entries",
            until=lambda q: q.pending == 4,
        )
        processes.start("worker", metrics_port=port, **common)  # an idle peer, claiming eagerly
        async with asyncio.timeout(45):  # four 3 s batches, however slow the host
            while not requests.done():  # the slow worker keeps renewing its lease meanwhile
                rows = client.xpending_range("mb:{noop}:req:128", "workers", "-", "+", 10)
                idle_seen.extend(row["time_since_delivered"] for row in rows)
                await asyncio.sleep(0.05)
        return await requests

    responses = asyncio.run(scenario())
    client.close()
    assert [r.status_code for r in responses] == [200] * 4
    assert idle_seen and max(idle_seen) < 1000, "entries never look idle past claim_idle_ms"
    assert {r.headers["x-microbatch-worker"] for r in responses} == {f"{_host()}-{slow.popen.pid}"}
    # A peer can claim an entry only while it is pending: once all four are acked (and
    # deleted), any robbery has happened and been counted, and none can happen any more.
    wait_until(
        lambda: queue_counts(redis_url), 10, "all four entries acked", until=lambda q: q == (0, 0)
    )
    assert sample(worker_metrics(port), "microbatch_redeliveries_total") == 0
    assert (
        sample(httpx.get(f"{gateway.base_url}/metrics").text, "microbatch_duplicate_replies_total")
        == 0
    )


def _host() -> str:
    import socket

    return socket.gethostname()


def test_a_hung_worker_fails_readiness_and_its_entries_go_to_a_peer(
    redis_url: str, processes: Processes
) -> None:
    common = {"redis_url": redis_url, "model": "noop", "worker_stale_ms": 1500, **QUICK}
    hung = processes.start("worker", noop_compute_ms=120_000, max_batch_ms=1000, **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)

    async def scenario() -> list[httpx.Response]:
        requests = asyncio.create_task(fire(gateway.base_url, texts(2)))
        await eventually(
            lambda: queue_counts(redis_url),
            15,
            "the hung worker holding both entries",
            until=lambda q: q.pending == 2,
        )
        processes.start("worker", **common)
        return await requests

    responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 2
    assert all(
        not r.headers["x-microbatch-worker"].endswith(str(hung.popen.pid)) for r in responses
    )
    # Readiness fails within worker_stale_ms of the hang: its loop no longer beats.
    hung_name = f"{_host()}-{hung.popen.pid}"

    def status() -> dict:
        result = CliRunner().invoke(
            app, ["status", "--redis-url", redis_url, "--json", "--worker-stale-ms", "1500"]
        )
        [model] = json.loads(result.output)
        return model

    def live(model: dict) -> dict[str, bool]:
        return {w["name"]: w["live"] for w in model["workers"]}

    model = wait_until(
        status,
        10,
        "the hung worker no longer live",
        until=lambda m: not live(m)[hung_name],
        interval_s=0.2,
    )
    assert live(model)[hung_name] is False
    assert model["live_workers"] == 1
    hung.signal(signal.SIGKILL)


def test_a_poison_input_is_dead_lettered_after_max_deliveries_without_a_crash_loop(
    redis_url: str, processes: Processes
) -> None:
    common = {
        "redis_url": redis_url,
        "model": "noop",
        "max_deliveries": 2,
        "worker_id": "w-poison",
        **QUICK,
    }
    crashing = ("tests.fault_worker", "--crash-token", str(POISON))
    worker = processes.start_module(*crashing, **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)

    async def scenario() -> tuple[httpx.Response, int]:
        nonlocal worker
        request = asyncio.create_task(fire(gateway.base_url, [{"input": [[101, POISON, 102]]}]))
        restarts = 0
        async with asyncio.timeout(45):  # three deliveries and their restarts
            while not request.done():
                await asyncio.sleep(0.1)
                if worker.popen.poll() is not None:
                    assert worker.popen.returncode == 70
                    restarts += 1
                    worker = processes.start_module(*crashing, **common)  # as an orchestrator
        [response] = await request
        return response, restarts

    response, restarts = asyncio.run(scenario())
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "dead_lettered"
    assert "max_deliveries 2" in response.json()["error"]["message"]
    assert restarts == 2  # two crashes, then dead-lettered before it could run a third time
    client = redis.Redis.from_url(redis_url)
    assert client.xlen("mb:{noop}:dead") == 1
    client.close()
    ok = httpx.post(f"{gateway.base_url}/v1/embeddings", json={"input": "fine"}, timeout=30)
    assert ok.status_code == 200 and worker.popen.poll() is None


def test_one_bad_input_fails_alone_and_its_batch_mates_succeed(
    redis_url: str, processes: Processes
) -> None:
    common = {
        "redis_url": redis_url,
        "model": "noop",
        "max_batch_size": 8,
        "max_wait_ms": 500,
    }
    worker = processes.start_module("tests.fault_worker", "--fail-token", str(BAD), **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    bodies = [{"input": [[101, 7, 102]]}] * 7 + [{"input": [[101, BAD, 102]]}]
    responses = asyncio.run(fire(gateway.base_url, bodies))
    assert [r.status_code for r in responses[:7]] == [200] * 7
    assert responses[7].status_code == 500
    assert responses[7].json()["error"]["code"] == "inference_failed"
    assert {r.headers["x-microbatch-batch-size"] for r in responses[:7]} == {"8"}
    assert worker.popen.poll() is None


def one_slow_worker(redis_url: str, processes: Processes):
    """A gateway and one noop worker taking 1.5 s per batch of one: entries wait behind it."""
    port = free_port()
    common = {"redis_url": redis_url, "model": "noop"}
    processes.start(
        "worker", noop_compute_ms=1500, max_batch_size=1, max_wait_ms=0, metrics_port=port, **common
    )
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    return gateway, port


def test_entries_past_their_deadline_are_skipped_without_compute(
    redis_url: str, processes: Processes
) -> None:
    gateway, port = one_slow_worker(redis_url, processes)

    async def scenario() -> tuple[httpx.Response, list[httpx.Response], float]:
        first = asyncio.create_task(fire(gateway.base_url, texts(1, "first")))
        await eventually(  # read, so computing: batches of one start at once
            lambda: queue_counts(redis_url),
            15,
            "the first batch computing",
            until=lambda q: q.pending == 1,
        )
        started = time.monotonic()
        late = await fire(gateway.base_url, texts(3, "late"), {"X-Microbatch-Timeout-Ms": "400"})
        elapsed = time.monotonic() - started
        [answer] = await first
        return answer, late, elapsed

    answer, late, elapsed = asyncio.run(scenario())
    assert answer.status_code == 200
    assert [r.status_code for r in late] == [504] * 3
    assert all("400 ms" in r.json()["error"]["message"] for r in late)
    assert elapsed < 3, "504 comes at the deadline, not after the compute"
    # An entry is deleted once acked, whether skipped or computed, and a computed one is
    # counted before its ack: with the streams empty the batch count is final.
    wait_until(
        lambda: queue_counts(redis_url),
        20,
        "the late entries acked",
        until=lambda q: q == (0, 0),
    )
    text = worker_metrics(port)
    assert sample(text, "microbatch_batch_size_count", model="noop", bucket="128") == 1


def test_a_client_that_disconnects_is_cancelled_and_its_entry_never_computed(
    redis_url: str, processes: Processes
) -> None:
    gateway, port = one_slow_worker(redis_url, processes)

    async def scenario() -> httpx.Response:
        first = asyncio.create_task(fire(gateway.base_url, texts(1, "first")))
        await eventually(  # the first batch is computing; the next entries wait
            lambda: queue_counts(redis_url),
            15,
            "the first batch computing",
            until=lambda q: q.pending == 1,
        )
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=0.5) as client:
            with contextlib.suppress(httpx.TimeoutException):  # the client gives up: gone
                await client.post("/v1/embeddings", json={"input": ["leaving", "early"]})
        [answer] = await first
        return answer

    answer = asyncio.run(scenario())
    assert answer.status_code == 200
    # Long enough for the worker to have run the two, had it not known: it acks (and deletes)
    # an entry only after computing it or dropping it, so an empty stream means it is done.
    wait_until(
        lambda: queue_counts(redis_url),
        20,
        "the two cancelled entries acked",
        until=lambda q: q == (0, 0),
    )
    text = worker_metrics(port)
    assert sample(text, "microbatch_batch_size_count", model="noop", bucket="128") == 1
    assert sample(text, "microbatch_cancelled_total") == 2
    assert pending(redis_url) == 0


def test_a_backlog_over_max_queue_depth_is_refused_fast_and_accepted_work_finishes(
    redis_url: str, processes: Processes
) -> None:
    common = {"redis_url": redis_url, "model": "noop", "max_queue_depth": 5}
    processes.start("worker", noop_compute_ms=200, max_batch_size=1, max_wait_ms=0, **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    responses = asyncio.run(fire(gateway.base_url, texts(20)))
    codes = [r.status_code for r in responses]
    assert codes.count(200) >= 5 and codes.count(503) >= 10
    assert set(codes) == {200, 503}
    refused = next(r for r in responses if r.status_code == 503)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "overloaded"
    assert "max_queue_depth 5" in refused.json()["error"]["message"]
    metrics = httpx.get(f"{gateway.base_url}/metrics").text
    assert sample(metrics, "microbatch_rejected_total", reason="queue_full") == codes.count(503)
