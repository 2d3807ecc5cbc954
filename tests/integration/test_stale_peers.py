"""A worker that dies mid-batch gives its entries back when its heartbeat lapses, not when
they have sat pending for `claim_idle_ms` (set here to 20 s: most of the deadline).

In-process on a real redis-server: a ghost consumer reads two entries and dies (never beats,
never acks); a live worker beside it takes them within `worker_stale_ms` and answers them.
"""

from __future__ import annotations

import asyncio
import time

import redis

from common import streams
from common.protocol import EmbeddingResult, decode, encode
from common.settings import Settings
from common.store import close_store, open_store
from tests.conftest import eventually
from tests.integration.test_worker_burst import REPLY, RecordingRunner, _entry
from tests.integration.test_worker_drain import _worker


def test_a_dead_peer_s_entries_are_answered_once_its_heartbeat_lapses(redis_url: str) -> None:
    settings = Settings(
        redis_url=redis_url,
        model="noop",
        max_wait_ms=0,
        claim_idle_ms=20_000,  # waiting for it would cost most of the deadline
        worker_stale_ms=1000,
        heartbeat_interval_ms=200,
        read_block_ms=100,
    )
    stream = streams.Keys(settings.prefix).request("noop", 128)
    admin = redis.Redis.from_url(redis_url)

    async def scenario() -> tuple[float, dict]:
        store = open_store(settings)
        try:
            await streams.ensure_groups(store, [stream])
            await streams.add_requests(
                store, [(stream, encode(_entry(i, [1] * 4))) for i in range(2)]
            )
            admin.xreadgroup("workers", "ghost", {stream: ">"}, count=10)  # then it dies
            started = time.monotonic()
            stop = asyncio.Event()
            worker = asyncio.ensure_future(
                _worker(settings, store, "alive", RecordingRunner()).run(stop)
            )

            async def answered() -> dict:
                read = await streams.read_replies(store, REPLY, "0-0", count=10, block_ms=None)
                return {(r := decode(i.payload or b"")).id: r for i in read}

            replies = await eventually(answered, 10, "both answered", until=lambda r: len(r) == 2)
            took = time.monotonic() - started
            stop.set()
            await asyncio.wait_for(worker, 10)
            return took, replies
        finally:
            await close_store(store)

    try:
        took, replies = asyncio.run(scenario())
        pending = admin.xpending(stream, "workers")["pending"]
    finally:
        admin.close()
    assert all(isinstance(r, EmbeddingResult) for r in replies.values())
    assert took < 5, f"answered after {took:.1f} s: waited for claim_idle_ms, not the heartbeat"
    assert pending == 0
