"""`Enqueuer`: coalesces the XADDs of concurrent requests into one pipelined round trip.

Under load many requests arrive between two event-loop turns; writing them in one pipeline
costs one round trip instead of one each. With one request in flight it is a plain XADD.
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
            flat = [item for items, _ in self._writing for item in items]
            try:
                await streams.add_requests(self._store, flat)
            except RedisError as exc:
                error = ServiceUnavailable(
                    f"queue unavailable: {type(exc).__name__}", retry_after_s=1.0
                )
                _settle(self._writing, error)
                continue
            _settle(self._writing, None)
        self._writing = []

    def _flusher_ended(self, exc: BaseException | None) -> None:
        """A flusher that died fails the group it was writing; what queued behind it gets a
        new flusher (each run settles at least one group, so a repeating bug cannot spin)."""
        if exc is None:
            return
        writing, self._writing = self._writing, []
        _settle(writing, InternalError("the queue writer failed; the gateway log has details"))
        if self._pending:
            self._flusher = spawn_supervised("enqueue", self._flush(), self._flusher_ended)


def _settle(group: list[Waiter], error: MicrobatchError | None) -> None:
    for _, future in group:
        if future.done():
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
