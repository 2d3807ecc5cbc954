"""Fault 14, trimming: nothing un-acked is ever trimmed, and a lost payload is never run.

Request streams are never trimmed by count: each entry is deleted right after it is acked, so
a stream holds only what is waiting or in progress. Someone else's XDEL or XTRIM can still
remove the payload of an entry a worker holds pending; whoever takes that entry over must
count it and move on, never run it and never crash.
"""

from __future__ import annotations

import asyncio
import re
import signal

import httpx
import redis

from common.protocol import DeadLetter, decode
from tests.conftest import (
    Proc,
    Processes,
    eventually,
    fire,
    free_port,
    texts,
    wait_ready,
    wait_until,
)
from tests.integration.test_faults import pending, worker_metrics
from tests.integration.test_observability import sample

STREAM = "mb:{noop}:req:128"
QUICK = {"claim_idle_ms": 1000, "heartbeat_interval_ms": 200}
# Eight requests sent at once make one batch that computes for long: eight pending.
SLOW = {"noop_compute_ms": 5000, "max_batch_size": 8, "max_wait_ms": 500}
HELD = 8


def batches_run(metrics: str) -> float:
    """Batches a worker ran, over every bucket (0 when it ran none)."""
    return sum(
        float(v) for v in re.findall(r"^microbatch_batch_size_count\{.*\} (\S+)$", metrics, re.M)
    )


def _token_bodies(n: int) -> list[dict]:
    """Request i has i + 3 tokens, so an answer routed to the wrong request would show."""
    return [{"input": [[101] + [7] * (i % 120 + 1) + [102]]} for i in range(n)]


def _held_by(client: redis.Redis, consumer: str) -> list[str]:
    rows = client.xpending_range(STREAM, "workers", "-", "+", 100, consumername=consumer)
    return [row["message_id"].decode() for row in rows]


def test_hundreds_of_requests_each_get_one_answer_and_leave_the_streams_empty(
    redis_url: str, processes: Processes
) -> None:
    common = {"redis_url": redis_url, "model": "noop"}
    processes.start("worker", noop_compute_ms=5, **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    bodies = _token_bodies(300)

    responses = asyncio.run(fire(gateway.base_url, bodies))

    assert [r.status_code for r in responses] == [200] * 300
    assert [r.json()["usage"]["prompt_tokens"] for r in responses] == [
        len(b["input"][0]) for b in bodies
    ]
    metrics = httpx.get(f"{gateway.base_url}/metrics").text
    assert sample(metrics, "microbatch_duplicate_replies_total") == 0
    client = redis.Redis.from_url(redis_url)
    request_streams = list(client.scan_iter("mb:{noop}:req:*"))
    assert request_streams
    # Ack and delete travel in the pipeline right behind the reply: give it a moment to land.
    wait_until(
        lambda: sum(client.xlen(s) for s in request_streams),
        5,
        "empty streams",
        until=lambda n: n == 0,
    )
    assert pending(redis_url) == 0
    assert client.xlen("mb:{noop}:dead") == 0
    client.close()


def _hold_then(gateway: Proc, client: redis.Redis, consumer: str, act) -> list[httpx.Response]:
    """Send HELD requests, wait until `consumer` holds them all pending, then `act()`."""

    async def scenario() -> list[httpx.Response]:
        headers = {"X-Microbatch-Timeout-Ms": "4000"}
        requests = asyncio.create_task(fire(gateway.base_url, texts(HELD), headers))
        await eventually(
            lambda: len(_held_by(client, consumer)),
            10,
            "the worker holding every request",
            until=lambda n: n >= HELD,
        )
        act()
        return await requests

    return asyncio.run(scenario())


def test_a_peer_never_runs_pending_entries_whose_payload_was_deleted(
    redis_url: str, processes: Processes
) -> None:
    common = {"redis_url": redis_url, "model": "noop", **QUICK}
    stuck = processes.start("worker", worker_id="stuck", **SLOW, **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    client = redis.Redis.from_url(redis_url)
    port = free_port()
    deleted: list[str] = []

    def stop_and_delete() -> None:
        stuck.signal(signal.SIGSTOP)  # holds its entries, renews nothing
        deleted.extend(_held_by(client, "stuck"))
        assert client.xdel(STREAM, *deleted) == HELD
        processes.start("worker", worker_id="peer", metrics_port=port, **common)

    try:
        responses = _hold_then(gateway, client, "stuck", stop_and_delete)
        assert [r.status_code for r in responses] == [504] * HELD, "none of them ran"
        wait_until(
            lambda: sample(worker_metrics(port), "microbatch_dead_letters_total"),
            15,
            "the peer counting every lost payload",
            until=lambda n: n == HELD,
        )
        assert batches_run(worker_metrics(port)) == 0
        assert pending(redis_url) == 0, "the lost entries left the pending list"
        ok = httpx.post(f"{gateway.base_url}/v1/embeddings", json={"input": "after"}, timeout=30)
        assert ok.status_code == 200 and ok.headers["x-microbatch-worker"] == "peer"
    finally:
        stuck.signal(signal.SIGKILL)  # a stopped process would sit on SIGTERM at teardown
        client.close()


def test_a_successor_dead_letters_its_pending_entries_trimmed_away_and_stays_up(
    redis_url: str, processes: Processes
) -> None:
    common = {"redis_url": redis_url, "model": "noop", "worker_id": "same", **QUICK}
    first = processes.start("worker", **SLOW, **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    client = redis.Redis.from_url(redis_url)
    port = free_port()
    successor: list[Proc] = []

    def kill_and_trim() -> None:
        first.signal(signal.SIGKILL)
        first.wait(10)
        client.xtrim(
            STREAM, maxlen=0, approximate=False
        )  # the plain MAXLEN trim that ignores the pending list
        assert client.xlen(STREAM) == 0 and pending(redis_url) == HELD
        successor.append(processes.start("worker", metrics_port=port, **common))

    responses = _hold_then(gateway, client, "same", kill_and_trim)

    assert [r.status_code for r in responses] == [504] * HELD, "none of them ran"
    wait_until(
        lambda: client.xlen("mb:{noop}:dead"),
        15,
        "every lost entry dead-lettered",
        until=lambda n: n == HELD,
    )
    letters = [decode(fields[b"m"]) for _, fields in client.xrange("mb:{noop}:dead")]
    assert all(isinstance(d, DeadLetter) and "payload lost" in d.reason for d in letters)
    metrics = worker_metrics(port)
    assert sample(metrics, "microbatch_dead_letters_total") == HELD
    assert batches_run(metrics) == 0
    assert pending(redis_url) == 0
    ok = httpx.post(f"{gateway.base_url}/v1/embeddings", json={"input": "after"}, timeout=30)
    assert ok.status_code == 200 and successor[0].popen.poll() is None
    client.close()


def test_answered_replies_leave_the_reply_stream_and_redis_memory(
    redis_url: str, processes: Processes
) -> None:
    """The gateway, a reply stream's only reader, deletes what it has read: after any amount
    of answered traffic its stream holds nothing, and Redis is back near its idle size. (Each
    answer here is 256 x 384 floats, 393 KB: counted by length alone, the 20 of them stayed,
    and so would 10,000 per gateway.)"""
    serve = processes.start(
        "serve", redis_url=redis_url, model="noop", max_wait_ms=0, max_queue_depth=8192
    )
    wait_ready(serve)
    client = redis.Redis.from_url(redis_url)
    idle = client.info("memory")["used_memory"]
    bodies = [{"input": [f"text {i} {j}" for j in range(256)]} for i in range(20)]
    responses = asyncio.run(fire(serve.base_url, bodies))
    assert [r.status_code for r in responses] == [200] * 20
    [reply_stream] = list(client.scan_iter("mb:reply:*"))
    wait_until(lambda: client.xlen(reply_stream), 5, "read replies deleted", until=lambda n: n == 0)
    grown = client.info("memory")["used_memory"] - idle
    client.close()
    assert grown < 2_000_000, f"Redis grew {grown} bytes for 20 answered requests"
