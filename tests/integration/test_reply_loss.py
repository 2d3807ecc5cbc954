"""Replies deleted before their gateway read them fail their waiters at once, clearly."""

from __future__ import annotations

import asyncio

from common.errors import ServiceUnavailable
from common.keys import Keys
from common.settings import Settings
from common.store import close_store, open_store
from gateway.replies import ReplyRouter

STREAM = "mb:reply:lossy"


async def _run_briefly(router: ReplyRouter, s: float = 0.3) -> None:
    stop = asyncio.Event()
    reader = asyncio.ensure_future(router.run(stop))
    await asyncio.sleep(s)  # long enough for a read and its first check, on any machine
    stop.set()
    await asyncio.wait_for(reader, 5)


def test_a_waiter_whose_reply_was_deleted_unread_fails_now_not_at_its_deadline(
    redis_url: str,
) -> None:
    """A writer's length bound (reply_maxlen) can delete replies a slow gateway has not
    read; which ones, nobody can tell, so every waiter fails at once with a clear 503
    instead of some waiting out their whole deadline. Replies it read and deleted itself
    are not a loss."""

    async def scenario() -> tuple[bool, BaseException | None]:
        settings = Settings(redis_url=redis_url)
        store = open_store(settings)
        try:
            router = ReplyRouter(store, STREAM, block_ms=50, ttl_s=60, keys=Keys("mb"))
            await store.xadd(STREAM, {"m": b"read and deleted by the gateway: no loss"})
            await _run_briefly(router)  # reads it (nobody waits for it), notes the counts
            waiting = router.expect("e.1", "m")
            await _run_briefly(router)  # deletes what it read: still no loss
            clean = not waiting.done()
            await store.xadd(STREAM, {"m": b"never read"})
            await store.xtrim(STREAM, maxlen=0, approximate=False)  # a writer's bound hit it
            await _run_briefly(router)
            return clean, waiting.exception() if waiting.done() else None
        finally:
            await close_store(store)

    clean, error = asyncio.run(scenario())
    assert clean, "a reply the gateway read and deleted counted as lost"
    assert isinstance(error, ServiceUnavailable), error
    assert "deleted before it read them" in error.message
