"""`Intake`: a worker's Redis side — read, triage, cancel, beat, publish — for either loop.

The loop it feeds (embedding or generation) owns what it holds and decides what runs; the
intake owns every Redis exchange: it reads entries into the loop while the loop has room,
answers and dead-letters what `recovery.decide` refuses, keeps the cancel set, beats and
reads live batching settings, and publishes replies with their acks. It wakes the loop
through `changed`. Nothing cancels a Redis command mid-flight: loops end by checking `stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from redis.exceptions import RedisError, ResponseError

from common import metrics, streams
from common.backoff import Backoff, until_ok
from common.buckets import bucket_for
from common.protocol import DeadLetter, encode
from common.settings import Settings
from common.store import Store
from common.tasks import spawn_supervised
from worker import recovery
from worker.held import Held
from worker.replies import Done, Reply, error_reply
from worker.utilization import Utilization

log = logging.getLogger("microbatch.worker")
PUBLISH_ATTEMPTS = 5
BURST_POLL_S = 0.01


def _unhandled(exc: BaseException) -> None:
    raise RuntimeError("an intake task failed with no consumer to stop: this is a bug") from exc


def wall_ms() -> int:
    return int(time.time() * 1000)


class Loop(Protocol):
    """What the intake asks of the loop it feeds."""

    def hold(self, held: Held) -> None: ...

    def room(self) -> int:
        """How many more entries the loop wants now."""
        ...

    def hung(self) -> bool:
        """Whether a computation has run past `max_batch_ms` (stop beating and renewing)."""
        ...

    def live_limits(self, overrides: dict[str, str]) -> None:
        """Batching limits an operator set in Redis (`microbatch tune`)."""
        ...


class Intake:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        limits: recovery.EntryLimits,
        name: str,
        register: Callable[[], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.store = store
        self.name = name
        self.model = limits.model
        self.keys = streams.Keys(settings.prefix)
        self.streams = [self.keys.request(self.model, b) for b in settings.buckets]
        self.affine = limits.generates and settings.cache_aware_routing
        if self.affine:  # prompts routed here for the prefixes this worker caches
            self.streams.append(self.keys.affinity(self.model, name))
        self.changed = asyncio.Event()  # something arrived, left, finished or changed
        self.cancelled: set[str] = set()  # entry ids whose clients stopped waiting
        # (stream, entry id) held or computing here, until published; ids repeat across streams
        self.owned: set[Done] = set()
        self._limits = limits
        self._register = register
        self.on_crash: Callable[[BaseException], None] = _unhandled  # set by the Consumer
        self._clock = clock
        self._loop: Loop | None = None
        self._publishing: set[asyncio.Task] = set()
        self._publish_lock = asyncio.Lock()
        self._reply_ttl_s = max(60, 2 * settings.request_timeout_ms // 1000)
        self._expired: dict[str, float] = {}  # reply stream -> when this worker set its TTL
        self._last_beat_s = 0.0
        self._utilization = Utilization(settings.device)

    def crash(self, exc: BaseException) -> None:
        """A task died of a bug: stop the worker (peers reclaim what it held)."""
        self.on_crash(exc)
        self.changed.set()

    def feed(self, loop: Loop) -> None:
        self._loop = loop

    @property
    def loop(self) -> Loop:
        if self._loop is None:
            raise RuntimeError("the intake has no loop to feed: this is a bug")
        return self._loop

    async def wait_changed(self, timeout_s: float | None) -> None:
        """Until something changes or `timeout_s` passes. `asyncio.timeout`, not `wait_for`,
        which would start a task on every call (several per batch)."""
        self.changed.clear()
        if timeout_s is None:
            await self.changed.wait()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.changed.wait()

    async def ensure_groups(self, stop: asyncio.Event) -> None:
        await until_ok(
            lambda: streams.ensure_groups(self.store, self.streams), stop, log, "creating groups"
        )

    # ---- reading ---------------------------------------------------------------------------

    async def read_loop(self, stop: asyncio.Event, idle: Callable[[], bool] | None = None) -> None:
        """Read while not stopped; with `idle` (burst mode), read without blocking and set
        `stop` once a read finds nothing new while `idle()` says nothing is left to do."""
        backoff = Backoff()
        block_ms = None if idle is not None else self.settings.read_block_ms
        try:
            while not stop.is_set():
                await self.beat_if_due()
                if self.loop.room() <= 0:
                    await self.wait_changed(self.settings.heartbeat_interval_ms / 1000)
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
                    await self.wait_changed(BURST_POLL_S)
        finally:
            self.changed.set()  # wake the loop: reading is over, it may finish draining

    async def read_once(self, block_ms: int | None) -> int:
        """One XREADGROUP of new entries into the loop; how many were read."""
        try:
            read = await streams.read_group(
                self.store,
                self.name,
                dict.fromkeys(self.streams, ">"),
                count=self.loop.room(),
                block_ms=block_ms,
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("consumer group vanished (Redis lost data?); recreating")
            await streams.ensure_groups(self.store, self.streams)
            return 0
        if read:
            await self.accept(read, deliveries={})
        return len(read)

    async def accept(self, read: Sequence[streams.StreamEntry], deliveries: dict[str, int]) -> None:
        """Hand the loop what may run; answer, dead-letter and ack what may not."""
        now_ms = wall_ms()
        replies: list[Reply] = []
        done: list[Done] = []
        buckets = self.settings.buckets
        for item in read:
            if (item.stream, item.entry_id) in self.owned:
                continue  # our own entry, idle only because it waits here: already held
            count = deliveries.get(item.entry_id, 1)
            decision = recovery.decide(item.payload, count, now_ms, self._limits)
            if isinstance(decision, recovery.Process):
                entry = decision.entry
                # Prompts past the largest bucket share it; embedding inputs never get there.
                bucket = bucket_for(entry.longest, buckets) or buckets[-1]
                self.loop.hold(Held(entry, item.stream, item.entry_id, self._clock(), bucket))
                self.owned.add((item.stream, item.entry_id))
                continue
            done.append((item.stream, item.entry_id))
            if isinstance(decision, recovery.Reject):
                replies.append(
                    self.error(decision.entry, decision.status, decision.code, decision.message)
                )
            else:
                await self._dead_letter(item, count, decision, replies)
        if replies or done:
            await self.publish(replies, done)
        self.changed.set()

    async def _dead_letter(
        self,
        item: streams.StreamEntry,
        count: int,
        decision: recovery.DeadLetter,
        replies: list[Reply],
    ) -> None:
        request_id = decision.entry.request_id if decision.entry else None
        log.error(
            "dead-lettering %s from %s: %s",
            item.entry_id,
            item.stream,
            decision.reason,
            extra={"request_id": request_id},
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
        await streams.dead_letter(self.store, self.keys.dead(self.model), encode(letter))
        if decision.entry is not None:
            replies.append(self.error(decision.entry, 500, "dead_lettered", decision.reason))

    def error(self, entry: recovery.Entry, status: int, code: str, message: str) -> Reply:
        return error_reply(entry, status, code, message, self.name)

    # ---- liveness and live settings --------------------------------------------------------

    async def beat_if_due(self) -> None:
        """Beat only while the loop makes progress: a hung batch must fail readiness."""
        now = self._clock()
        if self.loop.hung():
            if now - self._last_beat_s >= self.settings.worker_stale_ms / 1000:
                log.error("batch running past max_batch_ms: not beating, peers will reclaim")
                self._last_beat_s = now
            return
        if now - self._last_beat_s < self.settings.heartbeat_interval_ms / 1000:
            return
        self._last_beat_s = now
        metrics.worker_loop_beat_timestamp_seconds.set_to_current_time()  # /healthz reads it
        metrics.device_utilization.set(self._utilization.sample())
        try:
            self.loop.live_limits(await streams.live_batching(self.store, self.keys, self.model))
        except RedisError as exc:
            log.warning("reading live batching settings failed: %s", exc)
        try:
            registered = await streams.heartbeat(
                self.store,
                self.keys,
                self.model,
                self.name,
                wall_ms(),
                self.settings.worker_stale_ms,
                load=self.loop.held if self.affine else None,
            )
            if not registered:  # Redis lost its data (restart without persistence, flush)
                log.warning("model registration vanished; registering %s again", self.model)
                await self._register()
        except RedisError as exc:
            log.warning("heartbeat failed: %s", exc)

    async def orphaned_streams(self) -> list[str]:
        """Affinity streams of peers that left or stopped beating: theirs to drain, ours
        now. Once no gateway can route to one (silent for 60 x `worker_stale_ms`, as the
        registry forgets it) and its stream is empty, its stream and entry are deleted."""
        if not self.affine:
            return []
        now = wall_ms()
        stale_ms = self.settings.worker_stale_ms
        live = {
            peer
            for peer, beat in await streams.worker_beats(self.store, self.keys, self.model)
            if beat >= now - stale_ms
        }
        out = []
        for peer, report in (await streams.worker_loads(self.store, self.keys, self.model)).items():
            if peer == self.name or peer in live:
                continue
            if report.beat_ms < now - 60 * stale_ms and await streams.forget_affinity(
                self.store, self.keys, self.model, peer
            ):
                continue
            out.append(self.keys.affinity(self.model, peer))
        return out

    # ---- cancellation ----------------------------------------------------------------------

    async def watch_cancellations(self, stop: asyncio.Event) -> None:
        """Poll the model's cancel set: entries whose clients left or whose deadline passed."""
        period_s = self.settings.cancel_poll_ms / 1000
        while not stop.is_set():
            await self.poll_cancellations()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)

    async def poll_cancellations(self) -> None:
        try:
            ids = await streams.cancelled(self.store, self.keys, self.model, wall_ms())
        except RedisError as exc:
            log.warning("reading cancellations failed: %s", exc)
            ids = set()
        if ids - self.cancelled:
            self.changed.set()
        self.cancelled = ids

    # ---- publishing ------------------------------------------------------------------------

    def publish_soon(self, replies: list[Reply], done: list[Done], ordered: bool = False) -> None:
        """Publish in the background; `ordered` ones reach Redis in the order given here."""
        work = self._publish_ordered(replies, done) if ordered else self.publish(replies, done)
        task = spawn_supervised("publish", work, self._on_publish_end)
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    def _on_publish_end(self, exc: BaseException | None) -> None:
        if exc is not None:
            self.crash(exc)

    async def _publish_ordered(self, replies: list[Reply], done: list[Done]) -> None:
        async with self._publish_lock:  # the lock queues publishers FIFO
            await self.publish(replies, done)

    async def publish(self, replies: list[Reply], done: list[Done]) -> None:
        """Reply then ack; on failure leave the entries pending so they are redone, not lost."""
        backoff = Backoff()
        expire = self._due_for_ttl({stream for stream, _ in replies})
        try:
            for _attempt in range(PUBLISH_ATTEMPTS):
                try:
                    await streams.complete(
                        self.store,
                        replies,
                        done,
                        reply_maxlen=self.settings.reply_maxlen,
                        reply_ttl_s=self._reply_ttl_s,
                        expire=expire,
                    )
                    now = self._clock()
                    self._expired.update(dict.fromkeys(expire, now))
                    return
                except RedisError as exc:
                    await backoff.wait(log, "publish", exc)
            log.error("gave up publishing %d replies; they stay pending for reclaim", len(done))
        finally:
            self.owned.difference_update(done)

    def _due_for_ttl(self, reply_streams: set[str]) -> list[str]:
        """Reply streams whose TTL this worker has not set in a quarter of it. A stream
        cannot expire sooner (its gateway sets the same TTL), so a reply never re-creates
        one without a TTL; the rest cost no EXPIRE per reply."""
        now, quarter = self._clock(), self._reply_ttl_s / 4
        if len(self._expired) > 4096:  # gateways come and go: forget the long-expired
            self._expired = {s: t for s, t in self._expired.items() if now - t < quarter}
        return [s for s in reply_streams if now - self._expired.get(s, -quarter) >= quarter]

    @property
    def publishing(self) -> bool:
        return bool(self._publishing)

    async def flush(self) -> None:
        """Wait for every publish in flight."""
        while self._publishing:
            await asyncio.gather(*list(self._publishing), return_exceptions=True)

    async def leave(self) -> None:
        try:
            await streams.leave(self.store, self.keys, self.model, self.name)
        except RedisError:
            log.warning("could not deregister %s; it ages out of the registry", self.name)
