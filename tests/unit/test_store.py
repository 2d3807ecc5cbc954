"""Connection settings: TLS, credentials and the pool are what the URL says."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio.connection import BlockingConnectionPool, SSLConnection

from common.settings import Settings
from common.store import close_store, open_store


def test_rediss_urls_connect_over_tls_with_the_credentials_given() -> None:
    store = open_store(Settings(redis_url="rediss://app:secret@cache.internal:6380/2"))
    pool = store.connection_pool
    assert isinstance(pool, BlockingConnectionPool)
    assert issubclass(pool.connection_class, SSLConnection)  # commands packed by hiredis
    kwargs = pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("cache.internal", 6380, 2)
    assert (kwargs["username"], kwargs["password"]) == ("app", "secret")
    assert kwargs["socket_timeout"] == 5.0
    asyncio.run(close_store(store))


def test_without_a_url_the_store_is_embedded() -> None:
    store = open_store(Settings())
    assert type(store).__name__ == "BurnerRedis"
    asyncio.run(close_store(store))


def test_a_cluster_url_opens_the_cluster_client_on_masters_only() -> None:
    from common.store import StoreCluster, StoreClusterPipeline, pipeline

    settings = Settings(redis_url="redis://app:secret@node-a:7000/0", redis_cluster=True)
    store = open_store(settings)
    assert isinstance(store, StoreCluster)
    assert [n.name for n in store.startup_nodes] == ["node-a:7000"]
    assert store.read_from_replicas is False and store.load_balancing_strategy is None
    kwargs = store.connection_kwargs
    assert (kwargs["username"], kwargs["password"]) == ("app", "secret")
    assert kwargs["socket_timeout"] == 5.0
    assert isinstance(pipeline(store), StoreClusterPipeline)
    asyncio.run(close_store(store))


def test_cluster_topology_errors_are_redis_errors_every_loop_retries() -> None:
    import pytest
    from redis.exceptions import RedisError

    from common.store import check_access

    port = 1  # nothing listens: no node reachable
    store = open_store(Settings(redis_url=f"redis://127.0.0.1:{port}", redis_cluster=True))

    async def probe() -> None:
        await check_access(store)  # unreachable passes: the loops retry on their own
        with pytest.raises(RedisError, match="cannot be connected"):
            await store.xlen("mb:{noop}:req:128")
        await close_store(store)

    asyncio.run(probe())


def test_a_connection_closed_under_a_command_is_a_connection_error_and_a_bug_is_not() -> None:
    """redis-py's cluster pipeline retry closes every connection of the client; a command
    in flight on one of them then meets a None writer inside redis-py's connection code."""
    import pytest
    from redis.asyncio.connection import Connection
    from redis.exceptions import ConnectionError as RedisConnectionError

    from common.store import _raise_if_closed_transport

    async def write_on_closed() -> None:
        connection = Connection()
        connection._writer = None  # what a concurrent disconnect leaves
        await connection._send_packed_command([b"PING\r\n"])

    try:
        asyncio.run(write_on_closed())
    except AttributeError as exc:
        closed = exc
    with pytest.raises(RedisConnectionError):
        _raise_if_closed_transport(closed)
    _raise_if_closed_transport(AttributeError("'NoneType' object has no attribute 'x'"))  # ours
    with pytest.raises(RedisConnectionError):
        _raise_if_closed_transport(RuntimeError("the handler is closed"))


def test_commands_are_packed_by_hiredis_into_the_bytes_redis_py_would_send(monkeypatch) -> None:
    """redis-py's asyncio client packs commands in Python; the store's packs them in C."""
    import hiredis
    from redis.asyncio.connection import Connection
    from redis.exceptions import DataError

    calls = []
    real = hiredis.pack_command
    monkeypatch.setattr(hiredis, "pack_command", lambda args: calls.append(args) or real(args))
    store = open_store(Settings(redis_url="redis://127.0.0.1:6379/0"))
    packer = store.connection_pool.connection_class()
    commands = [("XADD", "k", "MAXLEN", "~", 100, "*", "m", b"\x00\xff"), ("CLIENT SETNAME", "x")]
    for command in commands:
        expected = b"".join(Connection().pack_command(*command))
        assert b"".join(packer.pack_command(*command)) == expected
    pipelined = b"".join(b"".join(Connection().pack_command(*c)) for c in commands)
    assert b"".join(packer.pack_commands(commands)) == pipelined
    assert len(calls) == 4
    with pytest.raises(DataError):
        packer.pack_command("SET", "k", None)
    asyncio.run(close_store(store))
