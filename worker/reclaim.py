"""Recovery I/O: drain our own pending entries, reclaim dead peers', renew our own leases.

A live worker re-claims the entries it holds (XCLAIM IDLE 0 JUSTID, which on Redis resets
their idle time without counting a delivery), so peers' XAUTOCLAIM never takes work from a
slow but alive worker. A worker whose batch runs past `max_batch_ms` counts as hung: it stops
renewing (and beating), so its entries go to peers after `claim_idle_ms`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from common import metrics, pending, streams
from common.store import Store
from worker.intake import Intake
from worker.leases import Leases

log = logging.getLogger("microbatch.worker")


class Reclaimer:
    """Brings the intake what peers (and this worker's past self) left pending, and keeps
    this worker's own leases fresh. It asks two questions, as callables: whether the loop is
    hung (then it neither renews nor claims) and which dead peers' streams to drain."""

    def __init__(
        self,
        store: Store,
        intake: Intake,
        leases: Leases,
        *,
        claim_idle_ms: int,
        stale_ms: int,
        hung: Callable[[], bool],
        orphans: Callable[[], Awaitable[list[str]]],
        live_peers: Callable[[], Awaitable[set[str]]],
    ) -> None:
        self._store = store
        self._intake = intake
        self._consumer = intake.name
        self._streams = intake.streams
        self._leases = leases
        self._claim_idle_ms = claim_idle_ms
        self._stale_ms = stale_ms
        self._hung = hung
        self._orphans = orphans
        self._live_peers = live_peers

    async def drain_own_pending(self) -> None:
        """After a restart under the same name, our own pending entries come first."""
        for stream in self._streams:
            last = "0"
            while True:
                read = await streams.read_group(
                    self._store, self._consumer, {stream: last}, count=100, block_ms=None
                )
                if not read:
                    break
                last = read[-1].entry_id
                ids = [e.entry_id for e in read]
                counts = await pending.delivery_counts(self._store, stream, ids)
                metrics.redeliveries_total.inc(len(read))
                await self._intake.accept(read, counts)

    async def run(self, stop: asyncio.Event, drained: asyncio.Event) -> None:
        """Renew leases every third of `claim_idle_ms` until `drained`; reclaim from peers
        every half until `stop`. A draining worker still holds and computes what it read,
        so it renews until the drain ends, or a peer would take and run it again (Sidekiq
        and Celery extend a job's visibility for as long as it runs, shutdown included)."""
        period_s = max(0.1, self._claim_idle_ms / 3000)
        passes = 0
        while not drained.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drained.wait(), period_s)
                return
            passes += 1
            if self._hung():
                continue  # neither renew nor claim: even claiming to ourselves would keep them
            try:
                await self._renew()
                if passes % 2 == 0 and not stop.is_set():
                    for stream in self._streams:
                        await self._reclaim(stream)
            except RedisError as exc:
                log.warning("reclaim or lease renewal failed: %s", exc)

    async def take_from_dead_peers(self, stop: asyncio.Event, period_s: float) -> None:
        """Every `period_s`: take at once what peers whose heartbeat went stale were holding
        (waiting `claim_idle_ms` would cost their clients up to the whole deadline), and
        what a dead peer's own (affinity) stream holds."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)
                return
            if self._hung():
                continue
            try:
                await self._take_from_stale()
                for stream in await self._orphans():
                    await self._adopt(stream)
            except RedisError as exc:
                log.warning("taking a dead peer's entries failed: %s", exc)

    async def _take_from_stale(self) -> None:
        """Pending entries of consumers that neither beat nor touched the stream for
        `worker_stale_ms` (Sidekiq's and Celery's way: a dead worker's jobs go back as soon
        as its heartbeat lapses). A consumer that read just now but has not beaten yet (a
        worker starting) is not stale: both its beat and its idle time must have lapsed."""
        live = await self._live_peers()
        for stream in self._streams:
            for peer in await pending.consumers(self._store, stream):
                if peer.name == self._consumer or peer.name in live or not peer.pending:
                    continue
                if peer.idle_ms < self._stale_ms or (room := self._intake.room()) <= 0:
                    continue
                claimed, counts = await pending.claim_pending_of(
                    self._store, stream, peer.name, self._consumer, room
                )
                log.warning("took %d entries from stale peer %s", len(claimed), peer.name)
                metrics.redeliveries_total.inc(len(claimed))
                await self._intake.accept(claimed, counts)

    async def _adopt(self, stream: str) -> None:
        if not await self._store.exists(stream):
            return  # a tenant's stream of the peer's that no gateway ever wrote to
        # a gateway may have written a tenant's before the peer had found its lane (and made
        # the group); the group starts at 0, so those entries are read all the same
        await streams.ensure_groups(self._store, [stream])
        while (room := self._intake.room()) > 0:
            read = await streams.read_group(
                self._store, self._consumer, {stream: ">"}, count=room, block_ms=None
            )
            if not read:
                break
            log.warning("took %d entries from the stream of dead peer %s", len(read), stream)
            metrics.redeliveries_total.inc(len(read))
            await self._intake.accept(read, {})
        await self._reclaim(stream)

    async def _renew(self) -> None:
        for stream, ids in self._leases.by_stream().items():
            await pending.renew_leases(self._store, stream, self._consumer, ids)

    async def _reclaim(self, stream: str) -> None:
        cursor = "0-0"
        while self._intake.room() > 0:
            cursor, claimed, deleted = await pending.autoclaim(
                self._store,
                stream,
                self._consumer,
                min_idle_ms=self._claim_idle_ms,
                start=cursor,
                count=self._intake.room(),
            )
            if deleted:
                log.warning("%d pending entries on %s had lost their payload", len(deleted), stream)
                metrics.dead_letters_total.inc(len(deleted))
            # Our own entries are not redeliveries: claiming them only renewed them.
            claimed = [e for e in claimed if (e.stream, e.entry_id) not in self._leases]
            if claimed:
                ids = [e.entry_id for e in claimed]
                counts = await pending.delivery_counts(self._store, stream, ids)
                metrics.redeliveries_total.inc(len(claimed))
                await self._intake.accept(claimed, counts)
            if cursor == "0-0":
                return
