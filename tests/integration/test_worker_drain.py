"""A draining worker keeps what it holds: no peer takes and reruns it while it finishes.

Two workers in-process on one real redis-server, `claim_idle_ms` 1 s: the first is told to
stop (SIGTERM's path) while its batch computes for 3 s; the second, idle beside it, claims
whatever looks abandoned. The first renews its leases until its drain ends, so the second
computes nothing and each entry is answered once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import numpy as np

from common import streams
from common.protocol import decode, encode
from common.settings import Settings
from common.store import close_store, open_store
from tests.conftest import eventually
from tests.integration.test_worker_burst import REPLY, RecordingRunner, _entry
from worker.compute_threads import ComputeThreads
from worker.consumer import Consumer, compose
from worker.encode.loop import EmbedLoop
from worker.encode.runners.base import RowResult
from worker.triage import EntryLimits

BATCH_S = 3.0


class Slow(RecordingRunner):
    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()

    def embed(self, rows: Sequence[np.ndarray], threads: int | None = None) -> list[RowResult]:
        self.started.set()
        time.sleep(BATCH_S)
        return super().embed(rows, threads)


def _worker(settings: Settings, store, name: str, runner: RecordingRunner) -> Consumer:
    compute = ComputeThreads()
    limits = EntryLimits(model="noop", max_tokens=512, vocab_size=0, max_deliveries=3)

    async def register() -> None:
        return None

    return compose(
        settings,
        store,
        limits,
        name,
        lambda wiring: EmbedLoop(settings, wiring, runner, compute),
        register,
        compute,
    )


def test_a_draining_worker_renews_its_leases_so_no_peer_reruns_its_batch(redis_url: str) -> None:
    settings = Settings(
        redis_url=redis_url,
        model="noop",
        max_wait_ms=0,
        max_batch_size=4,
        claim_idle_ms=1000,
        read_block_ms=100,
    )
    draining, peer = Slow(), RecordingRunner()

    async def scenario() -> list:
        store_a, store_b = open_store(settings), open_store(settings)
        try:
            stream = streams.Keys(settings.prefix).request("noop", 128)
            await streams.add_requests(
                store_a, [(stream, encode(_entry(i, [1] * 4))) for i in range(4)]
            )
            stop_a, stop_b = asyncio.Event(), asyncio.Event()
            a = asyncio.ensure_future(_worker(settings, store_a, "a", draining).run(stop_a))
            await eventually(draining.started.is_set, 10, "the batch computing")
            b = asyncio.ensure_future(_worker(settings, store_b, "b", peer).run(stop_b))
            stop_a.set()  # SIGTERM: finish what it holds, read nothing new
            await asyncio.wait_for(a, 3 * BATCH_S)
            stop_b.set()
            await asyncio.wait_for(b, 10)
            read = await streams.read_replies(store_a, REPLY, "0-0", count=100, block_ms=None)
            return [decode(item.payload or b"").id for item in read]
        finally:
            await close_store(store_a)
            await close_store(store_b)

    answered = asyncio.run(scenario())
    assert peer.batches == []  # the peer took nothing from the draining worker
    assert sorted(answered) == [f"e.{i}" for i in range(4)]  # each answered once
