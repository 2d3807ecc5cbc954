"""`DepthGate`: a batch line enters a model's queue only while that queue is short.

A stream is first in, first out, and a worker holds what it read until it runs it: an
online request queued behind a file's worth of batch lines would wait for them to be read
and run, whatever its priority. So a driver queues a line only while the model's queue
(entries waiting or running, every kind of traffic) holds fewer than `batch_queue_depth`:
online traffic that fills the queue by itself stops the feed (it leaves no capacity idle),
and an online request never waits behind more than that many lines, which the workers'
priority then lets it overtake once read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from common import lane_streams, streams
from common.store import Store

FRESH_S = 0.02  # one reading serves every line waiting on the same model this long
POLL_S = 0.01


class DepthGate:
    def __init__(
        self, store: Store, keys: streams.Keys, buckets: Sequence[int], max_depth: int
    ) -> None:
        self._store, self._keys, self._buckets = store, keys, tuple(buckets)
        self._max_depth = max_depth
        self._seen: dict[str, tuple[float, int]] = {}  # model -> (monotonic s, depth)

    async def depth(self, model: str) -> int:
        """Entries of `model` waiting or running, over its buckets (read at most every
        FRESH_S: XLEN is exact, entries are deleted once answered)."""
        seen = self._seen.get(model)
        if seen is not None and time.monotonic() - seen[0] < FRESH_S:
            return seen[1]
        total = await lane_streams.queue_length(self._store, self._keys, model, self._buckets)
        self._seen[model] = (time.monotonic(), total)
        return total

    async def wait(self, model: str, within_s: float) -> bool:
        """Until `model`'s queue is under the bound (True), or `within_s` passed (False)."""
        deadline = time.monotonic() + within_s
        while await self.depth(model) >= self._max_depth:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        seen = self._seen[model]
        self._seen[model] = (seen[0], seen[1] + 1)  # this line is about to add one
        return True
