"""`Enqueuer`: coalesces the XADDs of concurrent requests into one pipelined round trip.

Under load many requests arrive between two event-loop turns; writing them in one pipeline
costs one round trip instead of one each. With one request in flight it is a plain XADD.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from redis.exceptions import RedisError

from common import streams
from common.errors import ServiceUnavailable
from common.store import Store

Item = tuple[str, bytes]


class Enqueuer:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._pending: list[tuple[Sequence[Item], asyncio.Future[None]]] = []
        self._flusher: asyncio.Task | None = None

    async def add(self, items: Sequence[Item]) -> None:
        """Queue `items`; returns once Redis has them, raises ServiceUnavailable if it cannot."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((items, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        await asyncio.shield(future)  # a client that leaves does not cancel the write

    async def _flush(self) -> None:
        while self._pending:
            group, self._pending = self._pending, []
            flat = [item for items, _ in group for item in items]
            try:
                await streams.add_requests(self._store, flat)
            except RedisError as exc:
                error = ServiceUnavailable(
                    f"queue unavailable: {type(exc).__name__}", retry_after_s=1.0
                )
                for _, future in group:
                    if not future.done():
                        future.set_exception(error)
                continue
            for _, future in group:
                if not future.done():
                    future.set_result(None)
