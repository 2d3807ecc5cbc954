"""`Intake`: a worker's reading side — read, triage, hand over — for either loop.

It reads entries while the loop has room, passes each through `triage.decide`, hands the
loop what may run (`hold`, its only call into the loop, with `room` its only question) and
takes a lease on it; what may not run it answers or dead-letters through the publisher at
once. New entries come from its own reader; the reclaimer brings it a dead peer's and its
own pending ones through `accept`. Nothing cancels a Redis command mid-flight: the reader
ends by checking `stop`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from redis.exceptions import RedisError, ResponseError

from common import metrics, streams, tracing
from common.backoff import Backoff, until_ok
from common.buckets import bucket_for
from common.clock import wall_ms
from common.protocol import DeadLetter, RequestEntry, encode
from common.settings import Settings
from common.store import Store
from worker import triage
from worker.entry_spans import EntrySpans
from worker.held import Held
from worker.inbox import Inbox
from worker.lane_shares import cost_of
from worker.lanes import LaneReader
from worker.leases import Leases
from worker.publisher import Publisher
from worker.replies import Done, Entry, Reply, error_reply

log = logging.getLogger("microbatch.worker")
BURST_POLL_S = 0.01
PROBE_EVERY_S = 0.005  # how often idle lanes are looked at while the loop is full


class Sink(Protocol):
    """What the intake asks of the loop it feeds: one call, one question."""

    def hold(self, held: Held) -> None: ...

    def room(self) -> int:
        """How many more entries the loop wants now."""
        ...


class Intake:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        limits: triage.EntryLimits,
        name: str,
        *,
        loop: Sink,
        inbox: Inbox,
        leases: Leases,
        publisher: Publisher,
        clock: Callable[[], float],
        spans: EntrySpans | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.name = name
        self.model = limits.model
        self._keys = streams.Keys(settings.prefix)
        base = request_streams(settings, limits, name)
        self._lanes = LaneReader(
            store, self._keys, limits.model, list(settings.buckets), base, name, clock
        )
        self.streams = self._lanes.streams  # grows as tenants' lanes are found
        self._limits = limits
        self._loop = loop
        self._inbox = inbox
        self._leases = leases
        self._publisher = publisher
        self._clock = clock
        self._spans = spans

    def room(self) -> int:
        return self._loop.room()

    async def ensure_groups(self, stop: asyncio.Event) -> None:
        async def create() -> None:
            await streams.ensure_groups(self.store, self.streams)
            await self._lanes.refresh(force=True)  # tenants' lanes, if any, from the start

        await until_ok(create, stop, log, "creating groups")

    # ---- reading ---------------------------------------------------------------------------

    async def read_loop(self, stop: asyncio.Event, idle: Callable[[], bool] | None = None) -> None:
        """Read while not stopped; with `idle` (burst mode), read without blocking and set
        `stop` once a read finds nothing new while `idle()` says nothing is left to do."""
        backoff = Backoff()
        block_ms = None if idle is not None else self.settings.read_block_ms
        try:
            while not stop.is_set():
                if self._loop.room() <= 0:
                    if not self._lanes.idle_lanes():
                        await self._inbox.wait_room(self.settings.heartbeat_interval_ms / 1000)
                    elif not await self.probe_idle():  # none came: look again soon
                        await self._inbox.wait_room(PROBE_EVERY_S)
                    continue
                try:
                    read = await self.read_once(block_ms)
                    backoff.reset()
                except RedisError as exc:
                    await backoff.wait(log, "read", exc)
                    continue
                if read:
                    await asyncio.sleep(0)  # the loop starts what arrived before the next read
                    continue
                if idle is not None:
                    if idle():
                        stop.set()
                        return
                    await self._inbox.wait_room(BURST_POLL_S)
        finally:
            self._inbox.reading_ended()  # the loop may finish draining

    async def probe_idle(self) -> int:
        """With the loop full, an entry of a tenant's lane that was idle, read at once (one
        over the loop's room, per such lane): it goes before the backlogged lanes' rows in
        the fair order, so it joins the next batch instead of waiting for the room."""
        try:
            read, asked = await self._lanes.probe()
        except RedisError as exc:  # the reads that follow back off; the probe just waits
            log.debug("probe of idle lanes failed: %s", exc)
            return 0
        costs = await self.accept(read, deliveries={}) if read else {}
        self._lanes.served(asked, costs)
        return len(read)

    async def read_once(self, block_ms: int | None) -> int:
        """One read of new entries into the loop (split between tenants' lanes by their
        shares, when there are lanes); how many were read."""
        try:
            await self._lanes.refresh()
            read, asked = await self._lanes.read(self._loop.room(), block_ms)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("consumer group vanished (Redis lost data?); recreating")
            await streams.ensure_groups(self.store, self.streams)
            self._lanes.lost_groups()
            return 0
        costs = await self.accept(read, deliveries={}) if read else {}
        if asked:
            self._lanes.served(asked, costs)
        return len(read)

    async def accept(
        self, read: Sequence[streams.StreamEntry], deliveries: dict[str, int]
    ) -> dict[str, int]:
        """Hand the loop what may run; answer, dead-letter and ack what may not. An entry
        cancelled before it was read is acked unseen: it costs the loop nothing. Returns the
        tokens handed over per stream (what a tenant's lane was served)."""
        now_ms = wall_ms()
        replies: list[Reply] = []
        done: list[Done] = []
        runnable: list[tuple[streams.StreamEntry, RequestEntry, int]] = []
        for item in read:
            if (item.stream, item.entry_id) in self._leases:
                continue  # our own entry, idle only because it waits here: already held
            count = deliveries.get(item.entry_id, 1)
            decision = triage.decide(item.payload, count, now_ms, self._limits)
            if isinstance(decision, triage.Process):
                runnable.append((item, decision.entry, count))
                continue
            done.append((item.stream, item.entry_id))
            if isinstance(decision, triage.Misversioned):
                log.warning("%s (answered 503 version_mismatch)", decision.message)
                replies.append(
                    error_reply(decision, 503, "version_mismatch", decision.message, self.name)
                )
            elif isinstance(decision, triage.Reject):
                replies.append(
                    error_reply(
                        decision.entry, decision.status, decision.code, decision.message, self.name
                    )
                )
                self._refused(item, decision.entry, count, decision.code, decision.message)
            else:
                await self._dead_letter(item, count, decision, replies)
        # Only entries that waited in the stream past one cancel poll are asked about here:
        # one read fresh off the stream is the liveness poll's to find (within
        # `cancel_poll_ms`), so an idle queue's path costs no extra round trip per read.
        waited = now_ms - self.settings.cancel_poll_ms
        asked = [entry.id for _, entry, _ in runnable if entry.enqueued_ms <= waited]
        cancelled = await self._cancelled(asked, now_ms)
        costs = self._hold(runnable, cancelled, done)
        if replies or done:
            await self._publisher.publish(replies, done)  # refusals: no answer worth waiting for
        return costs

    def _hold(
        self,
        runnable: list[tuple[streams.StreamEntry, RequestEntry, int]],
        cancelled: set[str],
        done: list[Done],
    ) -> dict[str, int]:
        """Hand the loop each runnable entry not cancelled meanwhile (those go to `done`);
        the tokens handed over per stream."""
        buckets = self.settings.buckets
        costs: dict[str, int] = {}
        for item, entry, count in runnable:
            if entry.id in cancelled:
                done.append((item.stream, item.entry_id))
                self._refused(item, entry, count, "cancelled", "the client left before it ran")
                continue
            # Prompts past the largest bucket share it; embedding inputs never get there.
            bucket = bucket_for(entry.longest, buckets) or buckets[-1]
            span = self._spans.read(entry, item.stream, count) if self._traced(entry) else None
            self._leases.take((item.stream, item.entry_id), entry.id, span)
            lane = self._lanes.lane_of(item.stream)
            held = Held(
                entry, item.stream, item.entry_id, self._clock(), bucket, count, span,
                lane, self._lanes.weight(lane),
            )  # fmt: skip
            self._loop.hold(held)
            costs[item.stream] = costs.get(item.stream, 0) + cost_of(entry)
        return costs

    def _refused(
        self, item: streams.StreamEntry, entry: Entry, count: int, event: str, why: str
    ) -> dict[str, str]:
        """Its spans, when traced; the ids a log line about it carries."""
        if self._spans is None or not self._traced(entry):
            return {}
        return tracing.log_ids(self._spans.refused(entry, item.stream, count, event, why))

    def _traced(self, entry: Entry) -> bool:
        """Tracing is on here and the request that queued it was sampled."""
        return self._spans is not None and bool(entry.traceparent)

    async def _cancelled(self, entry_ids: list[str], now_ms: int) -> set[str]:
        """Those of `entry_ids` whose clients already left; none if Redis cannot say (the
        loop still drops them when the liveness part's next poll finds them)."""
        if not entry_ids:
            return set()
        try:
            return await streams.cancelled_among(
                self.store, self._keys, self.model, entry_ids, now_ms
            )
        except RedisError as exc:
            log.warning("reading cancellations failed: %s", exc)
            return set()

    async def _dead_letter(
        self,
        item: streams.StreamEntry,
        count: int,
        decision: triage.DeadLetter,
        replies: list[Reply],
    ) -> None:
        entry = decision.entry
        traced = (
            self._refused(item, entry, count, "dead_lettered", decision.reason) if entry else {}
        )
        log.error(
            "dead-lettering %s from %s: %s",
            item.entry_id,
            item.stream,
            decision.reason,
            extra={"request_id": entry.request_id if entry else None} | traced,
        )
        metrics.dead_letters_total.inc()
        letter = DeadLetter(
            stream=item.stream,
            entry_id=item.entry_id,
            reason=decision.reason,
            deliveries=count,
            payload=item.payload or b"",
            worker=self.name,
        )
        dead = self._keys.dead(self.model)
        await streams.dead_letter(
            self.store,
            dead,
            encode(letter),
            now_ms=wall_ms(),
            max_age_ms=self.settings.dead_letter_max_age_s * 1000,
        )
        if decision.entry is not None:
            replies.append(
                error_reply(decision.entry, 500, "dead_lettered", decision.reason, self.name)
            )


def request_streams(settings: Settings, limits: triage.EntryLimits, name: str) -> list[str]:
    """The streams a worker reads: its model's buckets and, for a generation worker routed to
    by cache affinity, its own affinity stream."""
    keys = streams.Keys(settings.prefix)
    out = [keys.request(limits.model, b) for b in settings.buckets]
    if affine(settings, limits):  # prompts routed here for the prefixes this worker caches
        out.append(keys.affinity(limits.model, name))
    return out


def affine(settings: Settings, limits: triage.EntryLimits) -> bool:
    return limits.generates and settings.cache_aware_routing
