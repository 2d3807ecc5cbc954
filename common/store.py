"""`open_store`: a redis-asyncio client to a real server, or the embedded burner-redis store.

Both speak the redis-py asyncio API for the commands `common.streams` uses; the two
differences that matter (pipeline arguments, `None` for an empty XREAD) are absorbed here
and in `streams`, so every role runs the very same stream code in both modes.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import AuthenticationError, BusyLoadingError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.settings import Settings

# redis.asyncio.Redis or burner_redis.BurnerRedis: the same command surface.
Store = Any


def open_store(settings: Settings, *, max_connections: int = 64) -> Store:
    """Connect lazily; the first command reveals whether the server is there."""
    if settings.redis_url is None:
        from burner_redis import BurnerRedis

        return BurnerRedis()
    pool = BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=max_connections,
        timeout=settings.redis_socket_timeout_s,  # wait this long for a free connection
        socket_timeout=settings.redis_socket_timeout_s,
        socket_connect_timeout=settings.redis_socket_timeout_s,
        health_check_interval=30,
    )
    return Redis(
        connection_pool=pool,
        retry=Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.01), retries=3),
        retry_on_error=[BusyLoadingError, RedisConnectionError, RedisTimeoutError],
    )


def pipeline(store: Store) -> Any:
    """A non-transactional pipeline: one round trip, no MULTI."""
    if isinstance(store, Redis):
        return store.pipeline(transaction=False)
    return store.pipeline()


async def close_store(store: Store) -> None:
    await store.aclose()
    if isinstance(store, Redis):  # a client given a pool does not own it: close it too
        await store.connection_pool.disconnect()


class StoreRefused(Exception):
    """Redis answered but refused us (credentials, ACL): retrying will not help."""


async def check_access(store: Store) -> None:
    """Fail fast on a wrong or missing password or a user without rights.

    An unreachable server passes: it may come up later, and every loop retries on its own.
    """
    if not isinstance(store, Redis):
        return
    try:
        await store.ping()
    except AuthenticationError as exc:
        raise StoreRefused(f"Redis refused the credentials in the URL: {exc}") from None
    except ResponseError as exc:
        if "NOPERM" in str(exc) or "NOAUTH" in str(exc):
            raise StoreRefused(f"Redis refused this user: {exc}") from None
        raise
    except (RedisConnectionError, RedisTimeoutError):
        return
