"""The store's retry policy reaches its connections: a dropped connection is retried."""

from __future__ import annotations

import asyncio

import redis

from common.settings import Settings
from common.store import close_store, open_store


def test_a_command_on_a_connection_redis_dropped_is_retried_not_failed(redis_url: str) -> None:
    """redis-py ignores `retry=` on a client built around a pool: the pool must carry it,
    or every connection runs with no retry and a dropped one fails its next command."""
    admin = redis.Redis.from_url(redis_url)

    async def scenario() -> list[object]:
        store = open_store(Settings(redis_url=redis_url))
        try:
            await store.set("k", "v")
            admin.client_kill_filter(_type="normal", skipme=True)  # every pooled connection
            return [await store.get("k"), await store.ping()]
        finally:
            await close_store(store)

    try:
        assert asyncio.run(scenario()) == [b"v", True]
    finally:
        admin.close()
