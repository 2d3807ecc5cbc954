"""`BatchFeeder`: every gateway's watch over the fleet's unfinished batches.

Each gateway looks at the active batches a few times per lease and drives any that no live
gateway holds (`SET NX PX` on the batch's lease, renewed while it drives). So a batch
created on one gateway is driven by whichever takes it first, and when that gateway dies
its lease lapses and another resumes the batch where the results say it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from common import metrics
from common.backoff import Backoff
from common.tasks import spawn_supervised
from gateway.batch_records import BatchRecords, summarize
from gateway.batch_run import BatchRun

log = logging.getLogger("microbatch.batches")

RunFactory = Callable[[str, asyncio.Event], BatchRun]


class BatchFeeder:
    def __init__(
        self,
        records: BatchRecords,
        runs: RunFactory,
        holder: str,
        lease_ms: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._records, self._runs = records, runs
        self._holder, self._lease_ms = holder, lease_ms
        self._clock = clock
        self._driving: dict[str, asyncio.Task[None]] = {}
        self._lost: dict[str, asyncio.Event] = {}  # per batch driven: set, its driver stops

    @property
    def driving(self) -> list[str]:
        return sorted(self._driving)

    async def run(self, stop: asyncio.Event, changed: asyncio.Event) -> None:
        """Until `stop`: take up batches nobody drives, a few times per lease and at once
        when this gateway created one (`changed`, set on stop too); on stop, hand back the ones
        held."""
        backoff = Backoff()
        try:
            while not stop.is_set():
                try:
                    await self._take_up()
                    backoff.reset()
                except RedisError as exc:
                    await backoff.wait(log, "looking for batches to drive", exc)
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), self._lease_ms / 4000)
                changed.clear()
        finally:
            await self._hand_back()

    async def _hand_back(self) -> None:
        """On stop: tell each driver its lease is gone (it hangs up on its lines in flight
        and feeds no more), give them a lease's time, then cancel what is left. Never an
        endless wait: a lease not released lapses, and another gateway resumes the batch
        from its results."""
        tasks = list(self._driving.values())
        for lost in self._lost.values():
            lost.set()
        if not tasks:
            return
        _, stuck = await asyncio.wait(tasks, timeout=self._lease_ms / 1000)
        for task in stuck:
            task.cancel()
        if stuck:
            log.warning("%d batch drivers did not stop within a lease; cancelled", len(stuck))
            await asyncio.wait(stuck, timeout=self._lease_ms / 1000)

    async def _take_up(self) -> None:
        records = await self._records.active_records()
        _report(records)
        for batch_id in [record["id"] for record in records]:
            if batch_id in self._driving:
                continue
            if await self._records.take_lease(batch_id, self._holder, self._lease_ms):
                log.info("driving batch %s", batch_id)
                self._driving[batch_id] = spawn_supervised(
                    f"batch {batch_id}", self._drive(batch_id), self._ended(batch_id)
                )
        metrics.batches_driving.set(len(self._driving))

    def _ended(self, batch_id: str) -> Callable[[BaseException | None], None]:
        """A driver that died (a Redis outage mid-batch, a bug) is logged by its supervisor;
        its lease is released, and the next look takes the batch up again from its results."""

        def ended(exc: BaseException | None) -> None:
            self._driving.pop(batch_id, None)

        return ended

    async def _drive(self, batch_id: str) -> None:
        lost = self._lost[batch_id] = asyncio.Event()
        keeper = spawn_supervised(
            f"batch {batch_id} lease", self._keep_lease(batch_id, lost), lambda exc: lost.set()
        )
        try:
            await self._runs(batch_id, lost).drive()
        finally:
            keeper.cancel()
            self._driving.pop(batch_id, None)
            self._lost.pop(batch_id, None)
            with contextlib.suppress(RedisError):
                await self._records.release_lease(batch_id, self._holder)

    async def _keep_lease(self, batch_id: str, lost: asyncio.Event) -> None:
        """Renew at a third of the lease; a renewal refused (it lapsed and another took it)
        or failing past the lease's end stops this driver."""
        every_s, lease_s = self._lease_ms / 3000, self._lease_ms / 1000
        held_until = self._clock() + lease_s  # taken just now
        while True:
            await asyncio.sleep(every_s)
            try:
                if not await self._records.renew_lease(batch_id, self._holder, self._lease_ms):
                    lost.set()
                    return
                held_until = self._clock() + lease_s
            except RedisError as exc:
                log.warning("renewing the lease of batch %s failed: %s", batch_id, exc)
                if self._clock() >= held_until:  # it may have lapsed: another may drive now
                    lost.set()
                    return


def _report(records: list[dict[str, str]]) -> None:
    statuses, lines = summarize(records)
    for status in ("validating", "in_progress", "finalizing", "cancelling"):
        metrics.batches.labels(status).set(statuses.get(status, 0))
    for state, count in lines.items():
        metrics.unfinished_batch_lines.labels(state).set(count)
