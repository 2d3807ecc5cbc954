"""`open_store`: a redis-asyncio client to a server or a Cluster, or the embedded burner-redis.

All three speak the redis-py asyncio API for the commands `common.streams` uses; the
differences that matter (pipeline arguments, `None` for an empty XREAD, the cluster client's
errors outside `RedisError`) are absorbed here and in `streams`, so every role runs the very
same stream code in every mode.
"""

from __future__ import annotations

import time
from typing import Any

import hiredis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    DataError,
    RedisClusterException,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.settings import Settings

# redis.asyncio.Redis, RedisCluster or burner_redis.BurnerRedis: the same command surface.
Store = Any

# A cluster node's connections: past this many at once a command fails (MaxConnectionsError,
# a 503) instead of waiting as the single-server pool does, so the bound is generous.
CLUSTER_CONNECTIONS_PER_NODE = 1024


def open_store(settings: Settings, *, max_connections: int = 64) -> Store:
    """Connect lazily; the first command reveals whether the server is there."""
    if settings.redis_url is None:
        from burner_redis import BurnerRedis

        return BurnerRedis()
    if settings.redis_cluster:
        return _open_cluster(settings.redis_url, settings.redis_socket_timeout_s)
    pool = BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=max_connections,
        timeout=settings.redis_socket_timeout_s,  # wait this long for a free connection
        socket_timeout=settings.redis_socket_timeout_s,
        socket_connect_timeout=settings.redis_socket_timeout_s,
        health_check_interval=30,
        # On the pool: redis-py gives every connection the pool's retry policy, and ignores
        # one passed to `Redis(connection_pool=...)`. A dropped connection or a Redis still
        # loading its data is retried; a timeout is not, since the command may have landed
        # (an XADD twice is a request computed twice).
        retry=Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.01), retries=3),
        retry_on_error=[BusyLoadingError, RedisConnectionError],
    )
    pool.connection_class = _packed_by_hiredis(pool.connection_class)
    return Redis(connection_pool=pool)


def _pack(args: tuple) -> bytes:
    """One command in RESP, packed in C; its first argument split on spaces ("CLIENT SETNAME")
    as redis-py's own packer splits it."""
    name = args[0]
    if isinstance(name, str):
        args = (*name.encode().split(), *args[1:])
    elif b" " in name:
        args = (*name.split(), *args[1:])
    try:
        return hiredis.pack_command(args)
    except TypeError as exc:  # None, bool, ...: what redis-py's encoder refuses too
        raise DataError(str(exc)) from None


class _HiredisPacking:
    """Commands packed by hiredis, as redis-py's sync client packs them when hiredis is
    installed; its asyncio client packs in Python, which cost a worker about a sixth of its
    CPU per single-text request under load (cProfile, wrk at 64 connections). The bytes are
    the same."""

    def pack_command(self, *args: Any) -> list[bytes]:
        return [_pack(args)]

    def pack_commands(self, commands: Any) -> list[bytes]:
        return [b"".join(_pack(tuple(command)) for command in commands)]


def _packed_by_hiredis(connection_class: type) -> type:
    """The pool's connection class (TCP, TLS or unix socket, as the URL chose it) with
    commands packed by hiredis."""
    return type(f"Hiredis{connection_class.__name__}", (_HiredisPacking, connection_class), {})


class ClusterUnavailable(RedisConnectionError):
    """The cluster client found no node for a command (none reachable, slot not covered).

    redis-py raises these as `RedisClusterException`, outside `RedisError`; as a connection
    error every loop retries them like any outage and the gateway answers 503.
    """


class StoreCluster(RedisCluster):
    """redis-py's cluster client with its topology errors raised as `RedisError`s, its
    seed nodes never forgotten (it drops a node from its startup list on every connection
    error, and with all of them dropped, a whole-cluster restart, it could never reconnect),
    and every node's commands packed by hiredis, as the single-server pool's are.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # `connection_kwargs` is the dict the nodes manager builds every node it discovers
        # from; the seed nodes were built already.
        packed = _packed_by_hiredis(self.connection_kwargs["connection_class"])
        self.connection_kwargs["connection_class"] = packed
        for node in self.startup_nodes:
            node.connection_class = packed

    async def initialize(self) -> RedisCluster:
        for node in self.startup_nodes:  # the nodes the URL named
            self.nodes_manager.startup_nodes.setdefault(node.name, node)
        try:
            return await super().initialize()
        except RedisClusterException as exc:
            raise ClusterUnavailable(str(exc)) from exc

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except RedisClusterException as exc:
            raise ClusterUnavailable(str(exc)) from exc
        except (RuntimeError, AttributeError) as exc:
            _raise_if_closed_transport(exc)
            raise

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        if shard_hint:
            raise ValueError("no shard hints in cluster mode")
        return StoreClusterPipeline(self, transaction)


class StoreClusterPipeline(ClusterPipeline):
    """Commands grouped by node, one round trip per node, no MULTI: never cross-slot."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        try:
            return await super().execute(raise_on_error, allow_redirections)
        except RedisClusterException as exc:
            raise ClusterUnavailable(str(exc)) from exc
        except (RuntimeError, AttributeError) as exc:
            _raise_if_closed_transport(exc)
            raise


def _raise_if_closed_transport(exc: RuntimeError | AttributeError) -> None:
    """A connection closed under a command is a connection error, to be retried like any
    outage: uvloop 0.23 raises RuntimeError ("the handler is closed") when redis-py's
    cluster client writes to a connection its dead master closed, and redis-py's own
    connection code meets a None reader or writer when another task's retry closed every
    connection of the client (its pipeline retry does) mid-command. Anything else is a bug
    and stays one."""
    if isinstance(exc, RuntimeError) and "handler is closed" in str(exc):
        raise RedisConnectionError(f"connection closed under the client: {exc}") from exc
    if isinstance(exc, AttributeError) and "'NoneType' object" in str(exc):
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None and tb.tb_frame.f_code.co_filename.endswith(
            ("redis/asyncio/connection.py", "redis/_parsers/base.py")
        ):
            raise RedisConnectionError(f"connection closed under the client: {exc}") from exc


def _open_cluster(url: str, timeout: float) -> RedisCluster:
    """`redis_url` names any node; the client learns the rest from CLUSTER SLOTS.

    Writes and reads go to masters only (a replica lags: a worker reading one would see
    entries twice or miss them). Partial slot coverage is accepted, so a model whose master
    is up keeps serving while another's slots are down (if the servers allow it).
    """
    return StoreCluster.from_url(
        url,
        max_connections=CLUSTER_CONNECTIONS_PER_NODE,
        require_full_coverage=False,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        health_check_interval=30,
        retry=Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.01), retries=3),
    )


# A script's clock, in us: Redis's TIME, the one every gateway shares. The embedded store has
# no TIME, and lives in one process whose clock is the only one: there the caller's clock
# stands in, given as the script's last argument ("" on a server). See `run_script`.
SCRIPT_CLOCK = """
local function now_us()
  local given = ARGV[#ARGV]
  if given ~= '' then return tonumber(given) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
"""


async def run_script(
    store: Store, script: str, keys: list[str], args: list[Any], clock: bool = False
) -> Any:
    """EVAL the same in every mode: arguments encoded as redis-py encodes them (the embedded
    store takes only strings and bytes), and with `clock` (a script that begins with
    `SCRIPT_CLOCK`) the clock argument appended."""
    values = [a if isinstance(a, str | bytes) else repr(a) for a in args]
    if clock:
        server = isinstance(store, Redis | RedisCluster)
        values.append("" if server else repr(time.time_ns() // 1000))
    return await store.eval(script, len(keys), *keys, *values)


def pipeline(store: Store) -> Any:
    """A non-transactional pipeline: one round trip (per node on a cluster), no MULTI."""
    if isinstance(store, Redis):
        return store.pipeline(transaction=False)
    return store.pipeline()


async def close_store(store: Store) -> None:
    await store.aclose()
    if isinstance(store, Redis):  # a client given a pool does not own it: close it too
        await store.connection_pool.disconnect()


class StoreRefused(Exception):
    """Redis answered but refused us (credentials, ACL, no cluster): retrying will not help."""


def _refusal(exc: BaseException | None) -> str | None:
    """Why Redis refused us, if it did: the cluster client buries the cause in a chain."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, AuthenticationError):
            return f"Redis refused the credentials in the URL: {exc}"
        if isinstance(exc, ResponseError) and ("NOPERM" in str(exc) or "NOAUTH" in str(exc)):
            return f"Redis refused this user: {exc}"
        if "Cluster mode is not enabled" in str(exc):
            return f"redis_cluster is set but the server is not a cluster node: {exc}"
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


async def check_access(store: Store) -> None:
    """Fail fast on a wrong or missing password, a user without rights, or a server that
    is not a cluster node where a cluster is expected.

    An unreachable server passes: it may come up later, and every loop retries on its own.
    """
    if not isinstance(store, Redis | RedisCluster):
        return
    try:
        await store.ping()
    except (ResponseError, RedisConnectionError, RedisTimeoutError) as exc:
        reason = _refusal(exc)
        if reason is not None:
            raise StoreRefused(reason) from None
        if isinstance(exc, ResponseError):
            raise
