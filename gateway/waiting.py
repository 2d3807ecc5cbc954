"""Awaiting replies on behalf of a client that may leave, and telling workers when it does.

A request waits on futures (never on a Redis command) while a second task listens for the
ASGI `http.disconnect`; whichever comes first decides. Entries nobody awaits any more are
added to the model's cancel set, so workers drop them instead of computing answers that
would go nowhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from redis.exceptions import RedisError

from common import streams
from common.clock import wall_ms
from common.errors import ClientGone, DeadlineExceeded
from common.store import Store
from common.tasks import spawn_supervised

log = logging.getLogger("microbatch.gateway")


async def await_replies(
    disconnected: Callable[[], Awaitable[None]],
    futures: Sequence[asyncio.Future],
    timeout_ms: int,
    deadline_ms: int,
):
    """Every future's result in order; DeadlineExceeded at `deadline_ms` (wall clock; the
    request's `timeout_ms` is what the message says), ClientGone if the client disconnects
    first (`disconnected()` returns)."""
    single = len(futures) == 1  # the common case needs no gather
    gathered = futures[0] if single else asyncio.gather(*futures)
    watcher = spawn_supervised("disconnect-watch", disconnected(), _nothing)
    try:
        done, _ = await asyncio.wait(
            {gathered, watcher},
            timeout=max(0.0, (deadline_ms - wall_ms()) / 1000),
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        watcher.cancel()
    if gathered in done:
        return [gathered.result()] if single else gathered.result()
    gathered.cancel()
    gathered.add_done_callback(_retrieve)  # its CancelledError is expected, not news
    if watcher in done:
        raise ClientGone("client disconnected before the answer was ready")
    raise DeadlineExceeded(f"no answer within {timeout_ms} ms")


def _nothing(exc: BaseException | None) -> None:
    """Nothing waits on these tasks: a watcher that fails counts as a disconnect where it
    is awaited; a cancellation that fails is logged, and workers drop the entries at their
    deadline anyway."""


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class Canceller:
    """Sends cancellations in the background: the request path never waits on Redis for it."""

    def __init__(self, store: Store, keys: streams.Keys) -> None:
        self._store = store
        self._keys = keys

    def cancel(self, model: str, ids: Sequence[str], until_ms: int) -> None:
        if not ids:
            return
        spawn_supervised("cancel", self._send(model, list(ids), until_ms), _nothing)

    async def _send(self, model: str, ids: list[str], until_ms: int) -> None:
        try:
            await streams.cancel(self._store, self._keys, model, ids, until_ms)
        except RedisError as exc:  # the worker still drops them at their deadline
            log.warning("could not cancel %d entries: %s", len(ids), exc)
