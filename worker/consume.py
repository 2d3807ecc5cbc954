"""The worker's Redis loop: read → local bucket queues → policy → runner → publish → ack.

Three asyncio tasks share one event loop and the local queues (only this loop touches them):
the reader fills the queues with up to `sort_window` waiting entries, so idle peers get the
rest of a burst; the scheduler asks `batching.next_batch` what to run and hands each batch to
a free compute stream (`parallelism`: several at once on a CPU, a lone one on every core);
the reclaimer takes over entries left idle by dead peers. Nothing cancels a Redis command
mid-flight: loops end by checking `stop` between commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from redis.exceptions import RedisError, ResponseError

from common import metrics, streams
from common.buckets import bucket_for
from common.protocol import (
    DeadLetter,
    EmbeddingResult,
    ErrorReply,
    encode,
    pack_vector,
)
from common.settings import Settings
from common.store import Store
from worker import recovery
from worker.batching import Batch, Limits, Load, Waiting, next_batch
from worker.compute_threads import ComputeThreads, free_stream
from worker.load import ArrivalRate, BatchCost
from worker.parallelism import Parallelism
from worker.reclaim import Reclaimer
from worker.runner import Runner
from worker.utilization import Utilization

log = logging.getLogger("microbatch.worker")


@dataclass(slots=True)
class Held:
    """An entry this worker has read and not yet answered."""

    entry: recovery.Entry
    stream: str
    entry_id: str
    arrived_s: float
    bucket: int


def _wall_ms() -> int:
    return int(time.time() * 1000)


class Consumer:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        runner: Runner | None,  # None on a generation worker, which runs no embedding batch
        limits: recovery.EntryLimits,
        name: str,
        register: Callable[[], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
        compute: ComputeThreads | None = None,  # where the model was loaded, ideally
    ) -> None:
        self._register = register
        self._settings = settings
        self._store = store
        self._runner = runner
        self._entry_limits = limits
        self._batch_limits = Limits.from_settings(settings)
        self.name = name
        self._clock = clock
        self._keys = streams.Keys(settings.prefix)
        self._model = limits.model
        self._streams = [self._keys.request(self._model, b) for b in settings.buckets]
        self._queues: dict[int, dict[int, Held]] = {b: {} for b in settings.buckets}
        self._seq = itertools.count()
        self._batches = itertools.count()
        self._changed = asyncio.Event()
        # a runner says whether batches may compute side by side on it (torch on a CPU)
        self._parallel = Parallelism.from_settings(
            settings, concurrent_ok=bool(getattr(runner, "concurrent", False))
        )
        self._compute = compute or ComputeThreads()
        self._compute.ensure(self._parallel.streams)
        self._executor = self._compute.first  # what runs one thing at a time runs here
        # each computing batch: its threads, start, stream
        self._computing: dict[asyncio.Task, tuple[int, float, int]] = {}
        self._publishing: set[asyncio.Task] = set()
        # (stream, entry id) held or computing here, until published; ids repeat across streams
        self._owned: set[tuple[str, str]] = set()
        self._reply_ttl_s = max(60, 2 * settings.request_timeout_ms // 1000)
        self._last_beat_s = 0.0
        self._utilization = Utilization(settings.device)
        self._batch_started_s: float | None = None  # set while a generation step computes
        self._reclaimer = Reclaimer(
            store,
            name,
            self._streams,
            claim_idle_ms=settings.claim_idle_ms,
            accept=self._accept,
            room=self._room,
            owned=self._owned,
            hung=self.hung,
        )
        self.batches_run = 0
        self._cancelled: set[str] = set()  # entry ids whose clients stopped waiting
        self.crashed = False  # a loop died of a bug: the process must exit non-zero
        # batch time depends on the threads it ran on: one fit per thread count, overall and
        # per bucket (see batching.Load)
        self._costs: dict[int, BatchCost] = {}
        self._bucket_costs: dict[tuple[int, int], BatchCost] = {}
        self._arrivals = {b: ArrivalRate() for b in settings.buckets}

    def hung(self) -> bool:
        """A batch running past `max_batch_ms` means the model is stuck, not slow."""
        starts = [start for _, start, _ in self._computing.values()]
        if self._batch_started_s is not None:
            starts.append(self._batch_started_s)
        return bool(starts) and self._clock() - min(starts) > self._settings.max_batch_ms / 1000

    @property
    def held(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def _room(self) -> int:
        """How many more entries the reader may take: enough to sort a window by length,
        few enough that idle peers still get their share of a burst."""
        return max(self._batch_limits.max_batch_size, self._settings.sort_window) - self.held

    def _hold(self, held: Held) -> None:
        self._queues[held.bucket][next(self._seq)] = held
        self._arrivals[held.bucket].observe(held.arrived_s)

    def _load(self) -> Load:
        """Arrival rates, the batch cost at the thread count batches get under load (where
        the cost model's choices matter), else at any count already fitted, overall and per
        bucket, and how many batches compute now."""
        now = self._clock()
        rates = {b: rate.per_second(now) for b, rate in self._arrivals.items()}
        threads = self._parallel.threads_per_stream
        loaded = self._costs.get(threads)
        cost = loaded.estimate() if loaded is not None else None
        if cost is None:
            cost = next((c for c in (f.estimate() for f in self._costs.values()) if c), None)
        per_bucket = {}
        for (fit_threads, bucket), fit in self._bucket_costs.items():
            estimate = fit.estimate() if fit_threads == threads else None
            if estimate is not None:
                per_bucket[bucket] = estimate
        return Load(cost, rates, len(self._computing), per_bucket)

    # ---- lifecycle -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until `stop`; then finish and ack everything held, and return."""
        await self._until_ok(lambda: streams.ensure_groups(self._store, self._streams), stop)
        await self._reclaimer.drain_own_pending()
        reader = asyncio.create_task(self._read_loop(stop), name="reader")
        reclaimer = asyncio.create_task(self._reclaimer.run(stop), name="reclaimer")
        watcher = asyncio.create_task(self._watch_cancellations(stop), name="cancellations")
        for task in (reader, reclaimer, watcher):
            task.add_done_callback(lambda t: self._fail_on_crash(t, stop))
        try:
            await self._schedule_loop(stop, reader)
        except BaseException:
            stop.set()  # a crashed loop must end the process, not leave it hanging
            log.critical("the scheduling loop failed; stopping", exc_info=True)
            raise
        finally:
            await asyncio.gather(reader, reclaimer, watcher, return_exceptions=True)
            if self._computing:
                await asyncio.gather(*self._computing, return_exceptions=True)
            if self._publishing:
                await asyncio.gather(*self._publishing, return_exceptions=True)
            self._compute.shutdown()
            try:
                await streams.leave(self._store, self._keys, self._model, self.name)
            except RedisError:
                log.warning("could not deregister %s; it ages out of the registry", self.name)

    def _fail_on_crash(self, task: asyncio.Task, stop: asyncio.Event) -> None:
        """A loop that died of a bug stops the worker: peers reclaim what it held."""
        if not task.cancelled() and task.exception() is not None:
            log.critical("%s loop failed; stopping", task.get_name(), exc_info=task.exception())
            self.crashed = True
            stop.set()
            self._changed.set()

    async def _until_ok(self, op: Callable, stop: asyncio.Event) -> None:
        """Retry a start-up command with capped backoff until Redis answers."""
        delay = 0.05
        while not stop.is_set():
            try:
                await op()
                return
            except RedisError as exc:
                log.warning("redis not ready (%s); retrying in %.2fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    # ---- reading ---------------------------------------------------------------------------

    async def _read_loop(self, stop: asyncio.Event) -> None:
        try:
            await self._read_until(stop)
        finally:
            self._changed.set()  # wake the scheduler: reading is over, it may finish draining

    async def _read_until(self, stop: asyncio.Event) -> None:
        backoff = 0.05
        block_ms = self._settings.read_block_ms
        while not stop.is_set():
            await self._beat_if_due()
            room = self._room()
            if room <= 0:
                await self._wait_changed(self._settings.heartbeat_interval_ms / 1000)
                continue
            try:
                read = await streams.read_group(
                    self._store,
                    self.name,
                    dict.fromkeys(self._streams, ">"),
                    count=room,
                    block_ms=block_ms,
                )
                backoff = 0.05
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    log.warning("consumer group vanished (Redis lost data?); recreating")
                    await self._until_ok(
                        lambda: streams.ensure_groups(self._store, self._streams), stop
                    )
                    continue
                log.warning("read refused (%s); retrying in %.2fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            except RedisError as exc:
                log.warning("read failed (%s); retrying in %.2fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            if read:
                await self._accept(read, deliveries={})

    async def _beat_if_due(self) -> None:
        """Beat only while the loop makes progress: a hung batch must fail readiness."""
        now = self._clock()
        if self.hung():
            if now - self._last_beat_s >= self._settings.worker_stale_ms / 1000:
                log.error("batch running past max_batch_ms: not beating, peers will reclaim")
                self._last_beat_s = now
            return
        if now - self._last_beat_s < self._settings.heartbeat_interval_ms / 1000:
            return
        self._last_beat_s = now
        metrics.device_utilization.set(self._utilization.sample())
        await self._apply_live_settings()
        try:
            registered = await streams.heartbeat(
                self._store,
                self._keys,
                self._model,
                self.name,
                _wall_ms(),
                self._settings.worker_stale_ms,
            )
            if not registered:  # Redis lost its data (restart without persistence, flush)
                log.warning("model registration vanished; registering %s again", self._model)
                await self._register()
        except RedisError as exc:
            log.warning("heartbeat failed: %s", exc)

    async def _apply_live_settings(self) -> None:
        """Batching limits an operator (or `microbatch tune`) set in Redis, over the settings."""
        try:
            overrides = await streams.live_batching(self._store, self._keys, self._model)
        except RedisError as exc:
            log.warning("reading live batching settings failed: %s", exc)
            return
        base = Limits.from_settings(self._settings)
        try:
            limits = base.with_overrides(overrides, self._settings.max_tokens)
        except ValueError as exc:
            log.error("ignoring live batching settings: %s", exc)
            limits = base
        if limits != self._batch_limits:
            log.info("batching limits now %s", limits)
            self._batch_limits = limits
            self._changed.set()

    async def _wait_changed(self, timeout_s: float | None) -> None:
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    async def _accept(
        self, read: Sequence[streams.StreamEntry], deliveries: dict[str, int]
    ) -> None:
        """Queue what may run; answer, dead-letter and ack what may not."""
        now_ms = _wall_ms()
        replies: list[tuple[str, bytes]] = []
        done: list[tuple[str, str]] = []
        for item in read:
            if (item.stream, item.entry_id) in self._owned:
                continue  # our own entry, idle only because it waits here: already held
            count = deliveries.get(item.entry_id, 1)
            decision = recovery.decide(item.payload, count, now_ms, self._entry_limits)
            if isinstance(decision, recovery.Process):
                entry = decision.entry
                # Prompts past the largest bucket share it; embedding inputs never get there.
                bucket = bucket_for(entry.n_tokens, self._settings.buckets)
                bucket = self._settings.buckets[-1] if bucket is None else bucket
                self._hold(Held(entry, item.stream, item.entry_id, self._clock(), bucket))
                self._owned.add((item.stream, item.entry_id))
                continue
            done.append((item.stream, item.entry_id))
            if isinstance(decision, recovery.Reject):
                replies.append(
                    self._error(decision.entry, decision.status, decision.code, decision.message)
                )
            else:
                await self._dead_letter(item, count, decision, replies)
        if replies or done:
            await self._publish(replies, done)
        self._changed.set()

    async def _dead_letter(
        self, item: streams.StreamEntry, count: int, decision: recovery.DeadLetter, replies: list
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
        await streams.dead_letter(self._store, self._keys.dead(self._model), encode(letter))
        if decision.entry is not None:
            replies.append(self._error(decision.entry, 500, "dead_lettered", decision.reason))

    def _error(
        self, entry: recovery.Entry, status: int, code: str, message: str
    ) -> tuple[str, bytes]:
        kind = "invalid_request_error" if status < 500 else "server_error"
        if status == 504:
            kind = "timeout"
        reply = ErrorReply(
            id=entry.id, status=status, type=kind, code=code, message=message, worker=self.name
        )
        return entry.reply_to, encode(reply)

    # ---- cancellation ----------------------------------------------------------------------

    async def _watch_cancellations(self, stop: asyncio.Event) -> None:
        """Poll the model's cancel set: entries whose clients left or whose deadline passed."""
        period_s = self._settings.cancel_poll_ms / 1000
        while not stop.is_set():
            try:
                ids = await streams.cancelled(self._store, self._keys, self._model, _wall_ms())
            except RedisError as exc:
                log.warning("reading cancellations failed: %s", exc)
                ids = set()
            if ids - self._cancelled:
                self._changed.set()
            self._cancelled = ids
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)

    async def _drop_cancelled(self) -> None:
        """Ack held entries nobody waits for, without computing them."""
        dropped = [
            (bucket, key)
            for bucket, queue in self._queues.items()
            for key, held in queue.items()
            if held.entry.id in self._cancelled
        ]
        if not dropped:
            return
        done = [
            (held.stream, held.entry_id) for held in (self._queues[b].pop(k) for b, k in dropped)
        ]
        metrics.cancelled_total.inc(len(done))
        await self._publish([], done)

    # ---- scheduling ------------------------------------------------------------------------

    def _snapshot(self) -> dict[int, list[Waiting]]:
        return {
            bucket: [
                Waiting(key, h.entry.n_tokens, h.arrived_s, h.entry.priority)
                for key, h in q.items()
            ]
            for bucket, q in self._queues.items()
        }

    async def _schedule_loop(self, stop: asyncio.Event, reader: asyncio.Task) -> None:
        drain = Limits(self._batch_limits.max_batch_size, self._batch_limits.max_batch_tokens, 0.0)
        while True:
            draining = stop.is_set()
            limits = drain if draining else self._batch_limits
            if self._cancelled:
                await self._drop_cancelled()
            running = [threads for threads, _, _ in self._computing.values()]
            timeout: float | None = None
            if len(running) < self._parallel.streams:
                decision = next_batch(self._snapshot(), self._clock(), limits, self._load())
                if isinstance(decision, Batch):
                    more_held = self.held > len(decision.keys)
                    threads = self._parallel.threads_for(running, more_held)
                    busy = {stream for _, _, stream in self._computing.values()}
                    wide = threads is not None and threads > self._parallel.threads_per_stream
                    stream = free_stream(busy, self._parallel.streams, wide)
                    if threads is not None and stream is not None:
                        self._start_batch(decision, threads, stream, stop)
                        continue
                elif decision.until_s is not None:
                    timeout = max(0.0, decision.until_s - self._clock())
            if draining and reader.done() and not self.held and not self._computing:
                return
            if draining:
                timeout = 0.05 if timeout is None else min(timeout, 0.05)
            await self._wait_changed(timeout)

    def _start_batch(self, batch: Batch, threads: int, stream: int, stop: asyncio.Event) -> None:
        """Take the batch's entries off the queues now, so the next decision cannot pick
        them again, and compute it beside any other running batch."""
        queue = self._queues[batch.bucket]
        members = [queue.pop(key) for key in batch.keys]
        self._changed.set()  # room for the reader
        task = asyncio.create_task(self._run_batch(batch, members, threads, stream), name="batch")
        self._computing[task] = (threads, self._clock(), stream)
        task.add_done_callback(lambda t: self._batch_done(t, stop))

    def _batch_done(self, task: asyncio.Task, stop: asyncio.Event) -> None:
        self._computing.pop(task, None)
        self._changed.set()  # a stream is free
        self._fail_on_crash(task, stop)

    async def _run_batch(
        self, batch: Batch, members: list[Held], threads: int, stream: int
    ) -> None:
        start_ms = _wall_ms()
        t0 = time.perf_counter()
        rows = [h.entry.token_ids() for h in members]
        if self._runner is None:
            raise RuntimeError("an embedding batch reached a worker without a runner: a bug")
        results = await asyncio.wrap_future(
            self._compute.submit(stream, self._runner.embed, rows, threads=threads)
        )
        compute_s = time.perf_counter() - t0
        self._observe(batch, members, compute_s, start_ms, threads)
        batch_id = f"{self.name}:{next(self._batches)}"
        replies = []
        for held, result in zip(members, results, strict=True):
            if isinstance(result, Exception):
                log.error(
                    "input failed: %r",
                    result,
                    extra={"request_id": held.entry.request_id, "entry": held.entry.id},
                )
                replies.append(
                    self._error(held.entry, 500, "inference_failed", f"model failed: {result}")
                )
                continue
            reply = EmbeddingResult(
                id=held.entry.id,
                embedding=pack_vector(result),
                n_tokens=held.entry.n_tokens,
                batch_id=batch_id,
                batch_size=len(members),
                bucket=batch.bucket,
                queue_ms=max(0.0, start_ms - held.entry.enqueued_ms),
                compute_ms=compute_s * 1000,
                worker=self.name,
            )
            replies.append((held.entry.reply_to, encode(reply)))
        done = [(h.stream, h.entry_id) for h in members]
        task = asyncio.create_task(self._publish(replies, done))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)
        self.batches_run += 1

    def _observe(
        self, batch: Batch, members: list[Held], compute_s: float, start_ms: int, threads: int
    ) -> None:
        labels = (self._model, str(batch.bucket))
        metrics.batch_size.labels(*labels).observe(len(members))
        metrics.batch_tokens.labels(*labels).observe(batch.padded_tokens)
        metrics.padding_ratio.labels(*labels).observe(1 - batch.real_tokens / batch.padded_tokens)
        metrics.compute_seconds.labels(*labels).observe(compute_s)
        self._costs.setdefault(threads, BatchCost()).observe(batch.padded_tokens, compute_s)
        fit = self._bucket_costs.setdefault((threads, batch.bucket), BatchCost())
        fit.observe(batch.padded_tokens, compute_s)
        for held in members:
            metrics.queue_wait_seconds.labels(*labels).observe(
                max(0, start_ms - held.entry.enqueued_ms) / 1000
            )
        if log.isEnabledFor(logging.DEBUG):
            waits = [max(0, start_ms - h.entry.enqueued_ms) for h in members]
            log.debug(
                "batch",
                extra={
                    "model": self._model,
                    "bucket": batch.bucket,
                    "size": len(members),
                    "padded_tokens": batch.padded_tokens,
                    "real_tokens": batch.real_tokens,
                    "trigger": batch.trigger,
                    "max_wait_ms": max(waits),
                    "compute_ms": round(compute_s * 1000, 2),
                    "request_ids": sorted({h.entry.request_id for h in members}),
                },
            )

    async def _publish(self, replies: list[tuple[str, bytes]], done: list[tuple[str, str]]) -> None:
        """Reply then ack; on failure leave the entries pending so they are redone, not lost."""
        try:
            await self._publish_with_retries(replies, done)
        finally:
            self._owned.difference_update(done)

    async def _publish_with_retries(
        self, replies: list[tuple[str, bytes]], done: list[tuple[str, str]]
    ) -> None:
        delay = 0.05
        for _attempt in range(5):
            try:
                await streams.complete(
                    self._store,
                    replies,
                    done,
                    reply_maxlen=self._settings.reply_maxlen,
                    reply_ttl_s=self._reply_ttl_s,
                )
                return
            except RedisError as exc:
                log.warning("publish failed (%s); retrying in %.2fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        log.error(
            "gave up publishing %d replies; their entries stay pending for reclaim", len(done)
        )
