"""`Enqueuer`: coalesces the XADDs of concurrent requests into one pipelined round trip.

Under load many requests arrive between two event-loop turns; writing them in one pipeline
per model (per hash slot) costs one round trip instead of one each, and a Redis error fails
only the requests whose slot it hit. With one request in flight it is a plain XADD.
The flusher is supervised: if it dies of anything but a Redis error (a bug), every request
waiting on it fails at once with a 500, and the next request starts a new flusher.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from redis.exceptions import RedisError

from common import streams
from common.errors import InternalError, MicrobatchError, ServiceUnavailable
from common.store import Store
from common.tasks import spawn_supervised

log = logging.getLogger("microbatch.gateway")
Item = tuple[str, bytes]
Waiter = tuple[Sequence[Item], asyncio.Future[None]]


class Enqueuer:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._pending: list[Waiter] = []
        self._writing: list[Waiter] = []  # the group the flusher is writing now
        self._flusher: asyncio.Task | None = None

    async def add(self, items: Sequence[Item]) -> None:
        """Queue `items`; returns once Redis has them, raises ServiceUnavailable if it cannot."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((items, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = spawn_supervised("enqueue", self._flush(), self._flusher_ended)
        await asyncio.shield(future)  # a client that leaves does not cancel the write

    async def _flush(self) -> None:
        while self._pending:
            self._writing, self._pending = self._pending, []
            groups = _by_slot(self._writing)
            outcomes = (
                await asyncio.gather(*(self._write(g) for g in groups), return_exceptions=True)
                if len(groups) > 1
                else [await self._write(groups[0])]  # one slot: no task to gather; a bug
                # raised here ends the flusher as one returned by gather does
            )
            for group, outcome in zip(groups, outcomes, strict=True):
                if isinstance(outcome, BaseException) and not isinstance(outcome, MicrobatchError):
                    raise outcome  # a bug: `_flusher_ended` fails what is still unsettled
                _settle(group, outcome)
        self._writing = []

    async def _write(self, group: list[Waiter]) -> MicrobatchError | None:
        """One pipeline for one hash slot's waiters; a Redis error fails only them."""
        try:
            await streams.add_requests(self._store, [i for items, _ in group for i in items])
        except RedisError as exc:
            return ServiceUnavailable(f"queue unavailable: {type(exc).__name__}", retry_after_s=1.0)
        return None

    def _flusher_ended(self, exc: BaseException | None) -> None:
        """A flusher that died fails the group it was writing; what queued behind it gets a
        new flusher (each run settles at least one group, so a repeating bug cannot spin)."""
        if exc is None:
            return
        writing, self._writing = self._writing, []
        _settle(writing, InternalError("the queue writer failed; the gateway log has details"))
        if self._pending:
            self._flusher = spawn_supervised("enqueue", self._flush(), self._flusher_ended)


def _by_slot(waiters: list[Waiter]) -> list[list[Waiter]]:
    """Waiters grouped by the hash tag of their streams (every key of a model shares one), so
    on a Redis Cluster a master that fails over fails its own models' requests only."""
    groups: dict[str, list[Waiter]] = {}
    for waiter in waiters:
        items = waiter[0]
        groups.setdefault(_hash_tag(items[0][0]) if items else "", []).append(waiter)
    return list(groups.values())


def _hash_tag(key: str) -> str:
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if start >= 0 and end > start + 1 else key


def _settle(group: list[Waiter], error: MicrobatchError | None) -> None:
    for _, future in group:
        if future.done():
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
