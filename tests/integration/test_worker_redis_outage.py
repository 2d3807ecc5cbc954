"""A Redis outage of seconds while a worker computes: the answer it computed still goes out.

Its own redis-server (append-only, fsync always, so a restart keeps everything), killed by
the runner while the batch computes and back 3 s later; the worker runs in-process in burst
mode. Publishing is retried until the entry's deadline, not a fixed ~1.5 s: a client whose
answer was computed gets it once Redis is back, instead of a 504 at its deadline.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from common import streams
from common.protocol import EmbeddingResult, decode, encode
from common.settings import Settings
from common.store import close_store, open_store
from tests.conftest import RedisServer, free_port
from tests.integration.test_worker_burst import REPLY, RecordingRunner, _entry
from worker.compute_threads import ComputeThreads
from worker.consumer import compose
from worker.encode.loop import EmbedLoop
from worker.encode.runners.base import RowResult
from worker.triage import EntryLimits

OUTAGE_S = 3.0


class KillsRedisWhileComputing(RecordingRunner):
    """Kills the server during the first batch and starts it again `OUTAGE_S` later."""

    def __init__(self, server: RedisServer) -> None:
        super().__init__()
        self._server = server
        self.restarted = threading.Event()

    def embed(self, rows: Sequence[np.ndarray], threads: int | None = None) -> list[RowResult]:
        if not self.batches:
            self._server.kill()
            threading.Thread(target=self._restart, daemon=True).start()
        return super().embed(rows, threads)

    def _restart(self) -> None:
        time.sleep(OUTAGE_S)
        self._server.start()
        self.restarted.set()


def test_an_answer_computed_during_a_short_outage_is_published_once_redis_is_back(
    tmp_path: Path,
) -> None:
    server = RedisServer(free_port(), tmp_path, persist=True)
    server.start()
    try:
        replies = asyncio.run(_scenario(server))
    finally:
        server.kill()
    [reply] = replies
    assert isinstance(reply, EmbeddingResult) and reply.vectors().tolist() == [[4.0]]


async def _scenario(server: RedisServer) -> list:
    settings = Settings(redis_url=server.url, model="noop", max_wait_ms=0)
    store = open_store(settings)
    keys = streams.Keys(settings.prefix)
    stream = keys.request("noop", 128)
    await streams.ensure_groups(store, [stream])
    await streams.add_requests(store, [(stream, encode(_entry(0, [1] * 4)))])
    runner = KillsRedisWhileComputing(server)
    compute = ComputeThreads()
    limits = EntryLimits(model="noop", max_tokens=512, vocab_size=0, max_deliveries=3)

    async def register() -> None:
        return None

    consumer = compose(
        settings,
        store,
        limits,
        "outage",
        lambda wiring: EmbedLoop(settings, wiring, runner, compute),
        register,
        compute,
    )
    try:
        await asyncio.wait_for(consumer.run_until_idle(), 45)
        assert consumer.crashed is None
        assert runner.restarted.is_set()
        read = await streams.read_replies(store, REPLY, "0-0", count=10, block_ms=None)
        assert await store.xlen(stream) == 0  # acked and deleted
        return [decode(item.payload or b"") for item in read]
    finally:
        await close_store(store)
