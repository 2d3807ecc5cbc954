"""Dead letters hold raw prompts: they are kept for `dead_letter_max_age_s`, not forever."""

from __future__ import annotations

import asyncio
import time

import redis

from common import streams
from common.protocol import DeadLetter, decode
from common.settings import Settings
from common.store import close_store, open_store
from tests.integration.test_worker_burst import RecordingRunner
from tests.integration.test_worker_drain import _worker

DAY_MS = 24 * 3600 * 1000


def test_a_new_dead_letter_sweeps_out_those_past_their_age(redis_url: str) -> None:
    settings = Settings(redis_url=redis_url, model="noop", dead_letter_max_age_s=7 * 24 * 3600)
    keys = streams.Keys(settings.prefix)
    dead, stream = keys.dead("noop"), keys.request("noop", 128)
    admin = redis.Redis.from_url(redis_url)
    now = int(time.time() * 1000)
    admin.xadd(dead, {"m": b"a prompt from eight days ago"}, id=f"{now - 8 * DAY_MS}-0")
    admin.xadd(dead, {"m": b"a prompt from six days ago"}, id=f"{now - 6 * DAY_MS}-0")
    admin.xadd(stream, {"m": b"\x00 not msgpack"})  # garbage: dead-lettered on sight

    async def scenario() -> None:
        store = open_store(settings)
        try:
            await _worker(settings, store, "sweeper", RecordingRunner()).run_until_idle()
        finally:
            await close_store(store)

    try:
        asyncio.run(scenario())
        kept = admin.xrange(dead)
    finally:
        admin.close()
    payloads = [fields[b"m"] for _, fields in kept]
    assert b"a prompt from eight days ago" not in payloads
    assert b"a prompt from six days ago" in payloads
    newest = decode(payloads[-1])
    assert isinstance(newest, DeadLetter) and newest.payload == b"\x00 not msgpack"
