"""Connection settings: TLS, credentials and the pool are what the URL says."""

from __future__ import annotations

import asyncio

from redis.asyncio.connection import BlockingConnectionPool, SSLConnection

from common.settings import Settings
from common.store import close_store, open_store


def test_rediss_urls_connect_over_tls_with_the_credentials_given() -> None:
    store = open_store(Settings(redis_url="rediss://app:secret@cache.internal:6380/2"))
    pool = store.connection_pool
    assert isinstance(pool, BlockingConnectionPool)
    assert pool.connection_class is SSLConnection
    kwargs = pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("cache.internal", 6380, 2)
    assert (kwargs["username"], kwargs["password"]) == ("app", "secret")
    assert kwargs["socket_timeout"] == 5.0
    asyncio.run(close_store(store))


def test_without_a_url_the_store_is_embedded() -> None:
    store = open_store(Settings())
    assert type(store).__name__ == "BurnerRedis"
    asyncio.run(close_store(store))
