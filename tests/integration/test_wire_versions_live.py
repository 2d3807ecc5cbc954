"""Which wire version each worker reads, as a real Redis keeps it beside the live set: what
a gateway's catalog decides traced entries by (docs/operations.md, rolling upgrades)."""

from __future__ import annotations

import asyncio

from common import streams
from common.settings import Settings
from common.store import close_store, open_store
from common.wire_compat import VERSION


def test_a_worker_s_wire_version_lives_as_long_as_its_place_in_the_live_set(
    redis_url: str,
) -> None:
    async def scenario() -> None:
        settings = Settings(redis_url=redis_url, prefix="wirelive")
        store = open_store(settings)
        keys = streams.Keys(settings.prefix)
        try:
            for name in ("w-left", "w-crashed", "w-live"):
                await streams.heartbeat(store, keys, "m", name, now_ms=1_000, stale_ms=1_000)
            await streams.leave(store, keys, "m", "w-left")  # its entry goes with it
            # a worker that died without leaving: dropped from the live set by later beats
            await store.zrem(keys.workers("m"), "w-crashed")
            await store.zadd(keys.workers("m"), {"w-old": 1_000})  # a release that says none
            known = {"w-live", "w-old"}
            assert await streams.wire_versions(store, keys, "m", known) == {"w-live": VERSION}
            left = await store.hgetall(keys.wire("m"))
            assert {k.decode() if isinstance(k, bytes) else k for k in left} == {"w-live"}
        finally:
            await close_store(store)

    asyncio.run(scenario())
