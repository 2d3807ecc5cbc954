"""Redis faults: restarts with and without data, out of memory, dropped connections."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import redis

from common.streams import Keys
from tests.conftest import (
    Processes,
    RedisServer,
    eventually,
    fire,
    free_port,
    queue_counts,
    texts,
    wait_ready,
    wait_until,
)
from tests.integration.test_observability import sample

QUICK = {"claim_idle_ms": 1000, "heartbeat_interval_ms": 200}


def own_redis(tmp_path, persist: bool) -> RedisServer:
    server = RedisServer(free_port(), tmp_path, persist=persist)
    server.start()
    return server


def wait_status(url: str, status: int, timeout: float = 30) -> None:
    def readyz() -> int | None:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/readyz", timeout=3).status_code
        return None  # no answer at all

    wait_until(
        readyz, timeout, f"/readyz answering {status}", until=lambda s: s == status, interval_s=0.2
    )


async def catalog_sees_redis_down(url: str) -> bool:
    """GET /readyz runs a catalog refresh and reports what it found."""
    async with httpx.AsyncClient(timeout=30) as client:
        return (await client.get(f"{url}/readyz")).json()["redis"] is False


def test_redis_restarted_with_its_data_everything_reconnects_and_accepted_work_finishes(
    processes: Processes, tmp_path
) -> None:
    server = own_redis(tmp_path, persist=True)
    common = {"redis_url": server.url, "model": "noop", **QUICK}
    processes.start("worker", noop_compute_ms=1500, max_batch_size=4, **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)

    async def scenario() -> tuple[list[httpx.Response], httpx.Response, float]:
        accepted = asyncio.create_task(fire(gateway.base_url, texts(4)))
        await eventually(  # queued and computing
            lambda: queue_counts(server.url),
            15,
            "the worker holding all four entries",
            until=lambda q: q.pending == 4,
        )
        server.kill()
        await eventually(
            lambda: catalog_sees_redis_down(gateway.base_url),
            10,
            "the gateway's catalog seeing Redis down",
        )
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=30) as client:
            during = await client.post(f"{gateway.base_url}/v1/embeddings", json={"input": "x"})
        fast = time.monotonic() - started
        server.start()  # same port, same append-only file
        return await accepted, during, fast

    accepted, during, fast = asyncio.run(scenario())
    assert during.status_code == 503 and int(during.headers["retry-after"]) >= 1
    assert fast < 1, f"the outage answer took {fast:.1f}s"  # 20 ms seen; a socket timeout: 5 s
    # The append-only file kept the entries and the pending list: nothing accepted is lost.
    assert [r.status_code for r in accepted] == [200] * 4
    wait_status(gateway.base_url, 200)
    after = httpx.post(f"{gateway.base_url}/v1/embeddings", json={"input": "after"}, timeout=30)
    assert after.status_code == 200
    server.kill()


def test_redis_restarted_empty_workers_recreate_groups_and_waiting_clients_get_504(
    processes: Processes, tmp_path
) -> None:
    server = own_redis(tmp_path, persist=False)
    common = {"redis_url": server.url, "model": "noop", **QUICK}
    worker = processes.start("worker", noop_compute_ms=2000, max_batch_size=1, **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)

    async def scenario() -> list[httpx.Response]:
        waiting = asyncio.create_task(
            fire(gateway.base_url, texts(3), {"X-Microbatch-Timeout-Ms": "4000"})
        )
        await eventually(  # one computing, two held: all three in the worker's hands
            lambda: queue_counts(server.url),
            15,
            "the worker holding all three entries",
            until=lambda q: q.pending == 3,
        )
        server.kill()
        server.start()  # empty: streams, groups, registry all gone
        return await waiting

    responses = asyncio.run(scenario())
    assert {r.status_code for r in responses} <= {200, 504}
    assert any(r.status_code == 504 for r in responses)
    wait_status(gateway.base_url, 200)  # the worker registered again and beats
    after = httpx.post(f"{gateway.base_url}/v1/embeddings", json={"input": "after"}, timeout=30)
    assert after.status_code == 200
    assert worker.popen.poll() is None, "no crash loop"
    client = redis.Redis(port=server.port)
    assert client.xinfo_groups("mb:{noop}:req:128")[0]["name"] == b"workers"
    client.close()
    server.kill()


def test_redis_out_of_memory_gets_503_with_retry_after(processes: Processes, tmp_path) -> None:
    server = own_redis(tmp_path, persist=False)
    common = {"redis_url": server.url, "model": "noop"}
    processes.start("worker", **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    client = redis.Redis(port=server.port)
    # below what Redis already holds, so every write is refused (noeviction, the default):
    # set at the memory in use, a key that expired or a trimmed stream in between let a write
    # through (a clean-clone CI run answered 200)
    client.config_set("maxmemory", "1")
    r = httpx.post(f"{gateway.base_url}/v1/embeddings", json={"input": "x"}, timeout=30)
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    client.config_set("maxmemory", "0")
    ok = httpx.post(f"{gateway.base_url}/v1/embeddings", json={"input": "x"}, timeout=30)
    assert ok.status_code == 200
    client.close()
    server.kill()


def test_replies_published_while_connections_drop_are_still_delivered(
    redis_url: str, processes: Processes
) -> None:
    common = {"redis_url": redis_url, "model": "noop", **QUICK}
    processes.start("worker", noop_compute_ms=800, max_batch_size=4, **common)
    gateway = processes.start("gateway", **common)
    wait_ready(gateway)
    client = redis.Redis.from_url(redis_url)

    def cut() -> None:  # every client connection, the gateway's reply reader included
        client.client_kill_filter(_type="normal", skipme=True)

    def replies_published() -> int:  # ever added: the gateway deletes what it has read
        every = client.scan_iter(match=Keys("mb").reply("*"))
        return sum(client.xinfo_stream(s)["entries-added"] for s in every)

    async def first_batch_answered() -> bool:
        async with httpx.AsyncClient(timeout=10) as http:
            text = (await http.get(f"{gateway.base_url}/metrics")).text
        route = {"route": "/v1/embeddings", "model": "noop", "status": "200"}
        try:
            return sample(text, "microbatch_requests_total", **route) >= 4
        except AssertionError:  # no sample: nothing answered yet
            return False

    async def scenario() -> list[httpx.Response]:
        requests = asyncio.create_task(fire(gateway.base_url, texts(8)))
        # Batches of up to four, 800 ms each: cut while the worker holds four entries, as soon
        # as four replies are published, and once four are answered, while the rest compute.
        await eventually(
            lambda: queue_counts(redis_url).pending >= 4, 15, "the first batch computing"
        )
        cut()
        await eventually(lambda: replies_published() >= 4, 15, "the first replies published")
        cut()
        await eventually(first_batch_answered, 15, "the first batch answered")
        cut()
        return await requests

    responses = asyncio.run(scenario())
    client.close()
    assert [r.status_code for r in responses] == [200] * 8
