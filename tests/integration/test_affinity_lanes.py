"""Cache-aware routing with tenants: a tenant's prompt routed to the worker caching its
prefix waits in that worker's stream for the tenant (read in the tenant's lane, by its fair
share), not in the worker's one stream for everyone; a dead worker's tenant streams are
adopted by a peer and forgotten once empty. Before, every tenant's affine prompts shared one
FIFO, outside the fair shares."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client import REGISTRY

from common import affinity_streams, lane_streams, status, streams
from common.keys import Keys
from common.settings import Settings
from common.store import close_store, open_store
from tests.conftest import RedisServer, free_port, wait_until
from tests.integration.in_process import InProcess
from worker.inbox import Inbox
from worker.lanes import LaneReader
from worker.liveness import Liveness

PREFIX = "mbafflane"
MODEL = "lm"
TENANTS = {"tenants": {"a": {"api_keys": ["sk-a"]}, "b": {"api_keys": ["sk-b"]}}}
QUICK = {"heartbeat_interval_ms": 200, "worker_stale_ms": 1000, "read_block_ms": 100}


@pytest.fixture(scope="module")
def fleet(module_redis: RedisServer, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("afflanes") / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    deployment = InProcess()
    common = {"redis_url": module_redis.url, "prefix": PREFIX, **QUICK}
    try:
        port = free_port()
        url = deployment.start_gateway(
            Settings(**common, port=port, gateway_id=f"al-{port}", tenants=path)
        )
        for i in range(2):  # one after the other: two loads of one model in one process race
            deployment.start_worker(
                Settings(
                    **common,
                    model=str(tiny_model),
                    served_model_name=MODEL,
                    worker_id=f"al{i}",
                    dtype="float32",
                )
            )
            wait_until(lambda: _workers(url), 60, "the worker live", until=lambda n, i=i: n > i)
        yield url, module_redis.url
    finally:
        deployment.close()


def _workers(url: str) -> int:
    """Live workers of the one model served (/readyz names it by its registered path)."""
    models = httpx.get(f"{url}/readyz").json().get("models", {})
    return max((m.get("live_workers", 0) for m in models.values()), default=0)


def _complete(url: str, key: str, prompt: list[int]) -> tuple[dict, str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    got = httpx.post(
        f"{url}/v1/completions",
        json={**body, "return_token_ids": True},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert got.status_code == 200, got.text
    return got.json(), got.headers["x-microbatch-worker"]


def _entries_read(store: redis.Redis, stream: str) -> int:
    if not store.exists(stream):
        return 0
    return sum(int(g["entries-read"] or 0) for g in store.xinfo_groups(stream))


def test_a_tenants_next_turn_waits_for_its_caching_worker_in_the_tenants_own_stream(
    fleet,
) -> None:
    url, redis_url = fleet
    store, keys = redis.Redis.from_url(redis_url), Keys(PREFIX)
    history = list(range(40, 130))
    answer, owner = _complete(url, "sk-a", history)  # the lane found, the prefix cached
    history += [*answer["choices"][0]["token_ids"], 7, 8]
    again, worker = _complete(url, "sk-a", history)
    assert worker == owner
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert _entries_read(store, keys.affinity(MODEL, owner, "a")) == 1
    assert _entries_read(store, keys.affinity(MODEL, owner)) == 0  # not the shared FIFO


def test_a_worker_reads_each_tenants_affinity_stream_in_its_lane(redis_url: str) -> None:
    """The reader adds a tenant's affinity stream to the tenant's lane where the worker is
    routed to by affinity, and only there."""

    async def scenario(url: str) -> tuple[dict[str, str], dict[str, str]]:
        store, keys = open_store(Settings(redis_url=url)), Keys(PREFIX)
        try:
            await store.hset(keys.lanes(MODEL), "a", "1.0")
            found = {}
            for name, affine in (("w", True), ("e", False)):
                base = [keys.request(MODEL, 128)]
                base += [keys.affinity(MODEL, name)] if affine else []
                reader = LaneReader(store, keys, MODEL, [128], base, name, time.monotonic)
                await reader.refresh(force=True)
                found[name] = {s: reader.lane_of(s) for s in reader.streams}
            return found["w"], found["e"]
        finally:
            await close_store(store)

    affine, plain = asyncio.run(scenario(redis_url))
    keys = Keys(PREFIX)
    assert affine[keys.affinity(MODEL, "w", "a")] == "a"
    assert affine[keys.affinity(MODEL, "w")] == ""  # its own stream stays the untenanted lane
    assert not any(":aff:" in s for s in plain)


def test_a_dead_workers_tenant_streams_are_adopted_then_forgotten_once_empty(
    redis_url: str,
) -> None:
    async def scenario(url: str) -> tuple[list[str], bool, bool, set[str]]:
        settings = Settings(redis_url=url, prefix=PREFIX, worker_stale_ms=1000)
        store, keys = open_store(settings), Keys(PREFIX)
        try:
            await store.hset(keys.lanes(MODEL), mapping={"a": "1.0", "b": "1.0"})
            long_ago = int(time.time() * 1000) - 120_000  # past 60 x worker_stale_ms
            await streams.heartbeat(store, keys, MODEL, "dead", long_ago, 1000, load=0)
            await store.hset(keys.load(MODEL), "dead", f"0 {long_ago}")
            held = await store.xadd(keys.affinity(MODEL, "dead", "a"), {"e": b"x"})
            liveness = Liveness(
                settings, store, Inbox(), model=MODEL, name="peer", register=_nothing,
                load=lambda: 0, hung=lambda: False, held_ids=list, affine=True,
            )  # fmt: skip
            orphans = await liveness.orphaned_streams()  # not forgotten: one holds an entry
            kept = await store.exists(keys.affinity(MODEL, "dead", "a")) == 1
            await store.xdel(keys.affinity(MODEL, "dead", "a"), held)
            forgotten = not await liveness.orphaned_streams()
            laned = await affinity_streams.laned_affinity_workers(store, keys, MODEL)
            return orphans, kept, forgotten, laned
        finally:
            await close_store(store)

    orphans, kept, forgotten, laned = asyncio.run(scenario(redis_url))
    keys = Keys(PREFIX)
    assert set(orphans) == {
        keys.affinity(MODEL, "dead"),
        keys.affinity(MODEL, "dead", "a"),
        keys.affinity(MODEL, "dead", "b"),
    }
    assert kept and forgotten
    assert laned == set()  # forgotten with its streams: no gateway routes there again


def test_prompts_waiting_in_affinity_streams_are_counted_as_queued_work(redis_url: str) -> None:
    """Affine prompts wait outside the bucket streams. The status, the gauges KEDA scales on
    (bucket "affinity"), admission's depth and the batch feeder's gate all count them: before,
    a fleet whose traffic was all multi-turn chats looked idle and was scaled in."""

    async def scenario(url: str) -> tuple[status.ModelStatus, int]:
        store, keys = open_store(Settings(redis_url=url, prefix=PREFIX)), Keys(PREFIX)
        try:
            await store.hset(keys.lanes("queued"), "a", "1.0")
            await store.hset(keys.load("queued"), mapping={"w0": "0 1", "w1": "0 1"})
            await store.xadd(keys.request("queued", 128), {"e": b"x"})
            for stream in (keys.affinity("queued", "w0"), keys.affinity("queued", "w1", "a")):
                await store.xgroup_create(stream, streams.GROUP, id="0", mkstream=True)
                for _ in range(3):
                    await store.xadd(stream, {"e": b"x"})
                await store.xreadgroup(streams.GROUP, "w", {stream: ">"}, 1)  # one in progress
            found = await status.model_status(store, keys, "queued", "causal-lm", [128], 1000)
            total = await lane_streams.queue_length(store, keys, "queued", [128])
            return found, total
        finally:
            await close_store(store)

    found, total = asyncio.run(scenario(redis_url))
    assert found.affinity is not None
    assert (found.affinity.depth, found.affinity.pending, found.affinity.lag) == (6, 2, 4)
    assert found.affinity.entries_read == 2  # what the delivery rate counts
    assert found.depth == 7 and total == 7
    status.export_gauges([found])
    gauge = {"model": "queued", "bucket": "affinity"}
    assert REGISTRY.get_sample_value("microbatch_queue_lag", gauge) == 4


def test_a_model_without_affinity_streams_has_no_affinity_row(redis_url: str) -> None:
    async def scenario(url: str) -> status.ModelStatus:
        store, keys = open_store(Settings(redis_url=url, prefix=PREFIX)), Keys(PREFIX)
        try:
            await store.xadd(keys.request("encoder", 128), {"e": b"x"})
            return await status.model_status(store, keys, "encoder", "embedding", [128], 1000)
        finally:
            await close_store(store)

    found = asyncio.run(scenario(redis_url))
    assert found.affinity is None and found.queues == found.buckets and found.depth == 1


async def _nothing() -> None:
    return None
