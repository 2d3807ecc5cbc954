"""The catalog refreshes single flight: a burst of probes or lookups is one registry read."""

from __future__ import annotations

import asyncio
from typing import Any

from common.settings import Settings
from common.store import close_store, open_store
from gateway.catalog import Catalog


class CountingStore:
    """The real client, counting registry reads (HGETALL of the model hash)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.registry_reads = 0

    async def hgetall(self, key: str) -> Any:
        if key.endswith(":models"):
            self.registry_reads += 1
            await asyncio.sleep(0.05)  # a Redis under load: refreshes overlap
        return await self.inner.hgetall(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_two_hundred_concurrent_refreshes_read_the_registry_once(redis_url: str) -> None:
    """1,500 unauthenticated /readyz calls once queued 1,500 refreshes behind a lock and
    pushed a probe past the kubelet's 3 s timeout: concurrent callers now share one."""

    async def scenario() -> int:
        settings = Settings(redis_url=redis_url)
        store = CountingStore(open_store(settings))
        try:
            catalog = Catalog(store, settings)  # type: ignore[arg-type]
            await asyncio.gather(*(catalog.refresh() for _ in range(200)))
            assert catalog.redis_ok
            return store.registry_reads
        finally:
            await close_store(store.inner)

    assert asyncio.run(scenario()) == 1
