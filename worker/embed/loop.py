"""`EmbedLoop`: the embedding worker's schedule — bucket queues → policy → runner → replies.

It alone owns the local bucket queues of rows (filled by the intake while it has room: up to
`sort_window` rows, and no more than it can start within the latency target
(`window.read_window`), so peers get the rest of a burst or a backlog). An entry brings
several rows of one request; each row waits and is batched on its own, beside other
requests' rows, and the entry's `Assembly` gathers their vectors. Each turn it drops the rows
of cancelled or expired entries, asks `batching.next_batch` what to run, and hands each batch
to a free compute stream (`parallelism`: several at once on a CPU, a lone one on every core);
an entry whose rows are all computed is answered and acknowledged by the intake.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Callable

from common import metrics
from common.settings import Settings
from common.tasks import spawn_supervised
from worker.compute_threads import ComputeThreads, free_stream
from worker.embed.assembly import Assembly, BatchFacts
from worker.embed.batching import Batch, Limits, Load, Waiting, next_batch
from worker.embed.cost import Observations
from worker.embed.parallelism import Parallelism
from worker.embed.runners.base import Runner
from worker.embed.window import ServiceRate, read_window
from worker.intake import Held, Intake, wall_ms
from worker.profiling import BatchProfiler
from worker.replies import Done, Reply

log = logging.getLogger("microbatch.worker")
DRAIN_POLL_S = 0.05
ROWS_PER_ENTRY_WEIGHT = 0.1  # of each entry read in the mean that sizes the next read
Row = tuple[Assembly, int]  # an entry's assembly, and the row's index in the entry


class EmbedLoop:
    def __init__(
        self,
        settings: Settings,
        intake: Intake,
        runner: Runner,
        compute: ComputeThreads,
        clock: Callable[[], float] = time.monotonic,
        profiler: BatchProfiler | None = None,
    ) -> None:
        self._settings = settings
        self._intake = intake
        self._runner = runner
        self._profiler = profiler
        self._clock = clock
        self._model = intake.model
        self._limits = Limits.from_settings(settings)
        self._queues: dict[int, dict[int, Row]] = {b: {} for b in settings.buckets}
        # what the policy sees of each queued row, made once when it arrives
        self._views: dict[int, dict[int, Waiting]] = {b: {} for b in settings.buckets}
        self._entries: dict[Done, Assembly] = {}  # held here: queued, computing, or both
        self._rows_per_entry = 1.0
        self._seq = itertools.count()
        self._batch_ids = itertools.count()
        # a runner says whether batches may compute side by side on it (torch on a CPU)
        self._parallel = Parallelism.from_settings(
            settings, concurrent_ok=bool(getattr(runner, "concurrent", False))
        )
        self._compute = compute
        self._compute.ensure(self._parallel.streams)
        # each computing batch: its threads, start, stream
        self._computing: dict[asyncio.Task, tuple[int, float, int]] = {}
        self._observed = Observations(settings.buckets)
        self._rate = ServiceRate()  # rows per compute second: bounds the read window
        self.batches_run = 0
        intake.feed(self)

    # ---- what the intake asks ---------------------------------------------------------------

    @property
    def held(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @property
    def busy(self) -> bool:
        return bool(self.held or self._computing)

    def room(self) -> int:
        """Entries to read: rows enough to sort a window by length, no more than this worker
        starts soon (what it leaves on the stream goes to a peer with room), at the rows per
        entry it has been reading; at least one while there is room for a row."""
        window = read_window(
            sort_window=self._settings.sort_window,
            max_batch_size=self._limits.max_batch_size,
            streams=self._parallel.streams,
            entries_per_s=self._rate.per_second(),
            horizon_s=self._limits.latency_slo_s,
        )
        rows = window - self.held
        return max(1, round(rows / self._rows_per_entry)) if rows > 0 else 0

    def hung(self) -> bool:
        """A batch running past `max_batch_ms` means the model is stuck, not slow."""
        starts = [start for _, start, _ in self._computing.values()]
        return bool(starts) and self._clock() - min(starts) > self._settings.max_batch_ms / 1000

    def hold(self, held: Held) -> None:
        assembly = Assembly.of(held)
        self._entries[(held.stream, held.entry_id)] = assembly
        queue, views = self._queues[held.bucket], self._views[held.bucket]
        priority = assembly.entry.priority
        for index, row in enumerate(assembly.rows):
            key = next(self._seq)
            queue[key] = (assembly, index)
            views[key] = Waiting(key, len(row), held.arrived_s, priority)
        n = len(assembly.rows)
        self._observed.arrival(held.bucket, held.arrived_s, n)
        self._rows_per_entry += ROWS_PER_ENTRY_WEIGHT * (n - self._rows_per_entry)

    def live_limits(self, overrides: dict[str, str]) -> None:
        base = Limits.from_settings(self._settings)
        try:
            limits = base.with_overrides(overrides, self._settings.max_tokens)
        except ValueError as exc:
            log.error("ignoring live batching settings: %s", exc)
            limits = base
        if limits != self._limits:
            log.info("batching limits now %s", limits)
            self._limits = limits
            self._intake.changed.set()

    # ---- scheduling ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, reading: Callable[[], bool]) -> None:
        """Schedule until `stop` and, after it, until everything held is answered."""
        drain = Limits(self._limits.max_batch_size, self._limits.max_batch_tokens, 0.0)
        while True:
            draining = stop.is_set()
            await self._drop_unwanted()
            timeout = self._start_what_may_run(drain if draining else self._limits)
            if timeout == 0.0:
                continue  # a batch started: ask again at once
            if draining and not reading() and not self.held and not self._computing:
                return
            if draining:
                timeout = DRAIN_POLL_S if timeout is None else min(timeout, DRAIN_POLL_S)
            await self._intake.wait_changed(timeout)

    def _start_what_may_run(self, limits: Limits) -> float | None:
        """Start the batch the policy picks, if a stream is free: 0.0 when one started, else
        how long until the policy wants to be asked again (None: when something changes)."""
        running = [threads for threads, _, _ in self._computing.values()]
        if len(running) >= self._parallel.streams:
            return None
        decision = next_batch(self._snapshot(), self._clock(), limits, self._load())
        if isinstance(decision, Batch):
            more_held = self.held > len(decision.keys)
            threads = self._parallel.threads_for(running, more_held)
            busy = {stream for _, _, stream in self._computing.values()}
            wide = threads is not None and threads > self._parallel.threads_per_stream
            stream = free_stream(busy, self._parallel.streams, wide)
            if threads is not None and stream is not None:
                self._start_batch(decision, threads, stream)
                return 0.0
            return None
        if decision.until_s is None:
            return None
        return max(1e-9, decision.until_s - self._clock())

    def _snapshot(self) -> dict[int, list[Waiting]]:
        return {bucket: list(views.values()) for bucket, views in self._views.items()}

    def _load(self) -> Load:
        """Arrival rates, and the batch cost at the thread count batches get under load."""
        cost, per_bucket = self._observed.cost_at(self._parallel.threads_per_stream)
        rates = self._observed.rates(self._clock())
        return Load(cost, rates, len(self._computing), per_bucket)

    async def _drop_unwanted(self) -> None:
        """Before any compute: drop the queued rows of entries whose client left (acked) or
        whose deadline passed while they waited here (answered 504), once none of their rows
        is computing (read early, within `sort_window`)."""
        cancelled, now_ms = self._intake.cancelled, wall_ms()
        dropped = [
            a
            for a in self._entries.values()
            if not a.dropped and (a.entry.id in cancelled or a.entry.deadline_ms <= now_ms)
        ]
        if not dropped:
            return
        skipped = 0  # rows that will never compute
        for assembly in dropped:
            assembly.dropped = "cancelled" if assembly.entry.id in cancelled else "deadline"
            queue = self._queues[assembly.held.bucket]
            views = self._views[assembly.held.bucket]
            for key in [k for k, (a, _) in queue.items() if a is assembly]:
                del queue[key], views[key]
                skipped += 1
        metrics.cancelled_total.inc(skipped)
        replies, done = self._settle(dropped, now_ms)
        await self._intake.publish(replies, done)

    def _settle(self, assemblies: list[Assembly], now_ms: int) -> tuple[list[Reply], list[Done]]:
        """The replies and acks of those entries that are settled, which leave the loop."""
        replies, done = [], []
        for assembly in assemblies:
            if not assembly.settled:
                continue
            held = assembly.held
            del self._entries[(held.stream, held.entry_id)]
            done.append((held.stream, held.entry_id))
            reply = assembly.reply(held.bucket, self._intake.name, now_ms)
            if reply is not None:
                replies.append(reply)
        return replies, done

    # ---- running a batch -------------------------------------------------------------------

    def _start_batch(self, batch: Batch, threads: int, stream: int) -> None:
        """Take the batch's rows off the queues now, so the next decision cannot pick them
        again, and compute it beside any other running batch."""
        queue, views = self._queues[batch.bucket], self._views[batch.bucket]
        members = [queue.pop(key) for key in batch.keys]
        for key in batch.keys:
            del views[key]
        for assembly, _ in members:
            assembly.started(1)
        self._intake.changed.set()  # room for the reader
        task = spawn_supervised(
            "batch", self._run_batch(batch, members, threads, stream), self._batch_ended
        )
        self._computing[task] = (threads, self._clock(), stream)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task) -> None:
        self._computing.pop(task, None)
        self._intake.changed.set()  # a stream is free

    def _batch_ended(self, exc: BaseException | None) -> None:
        if exc is not None:
            self._intake.crash(exc)

    async def _run_batch(self, batch: Batch, members: list[Row], threads: int, stream: int) -> None:
        start_ms = wall_ms()
        t0 = time.perf_counter()
        rows = [a.rows[i] for a, i in members]
        work = functools.partial(self._runner.embed, rows, threads=threads)
        if self._profiler is not None and not self._profiler.finished:
            profiled = _profile_facts(batch, members, start_ms, threads)
            work = functools.partial(self._profiler.run, "embed", profiled, work)
        results = await asyncio.wrap_future(self._compute.submit(stream, work))
        compute_s = time.perf_counter() - t0
        self._observe(batch, members, compute_s, start_ms, threads)
        facts = BatchFacts(
            f"{self._intake.name}:{next(self._batch_ids)}", len(members), start_ms, compute_s
        )
        by_entry: dict[int, list[tuple[int, object]]] = {}
        for (assembly, index), result in zip(members, results, strict=True):
            by_entry.setdefault(id(assembly), []).append((index, result))
            if isinstance(result, Exception):
                log.error(
                    "input failed: %r",
                    result,
                    extra={"request_id": assembly.entry.request_id, "entry": assembly.entry.id},
                )
        assemblies = list({id(a): a for a, _ in members}.values())
        for assembly in assemblies:
            assembly.filled(iter(by_entry[id(assembly)]), facts)
        replies, done = self._settle(assemblies, wall_ms())
        if done:
            self._intake.publish_soon(replies, done)
        self.batches_run += 1

    def _observe(
        self, batch: Batch, members: list[Row], compute_s: float, start_ms: int, threads: int
    ) -> None:
        labels = (self._model, str(batch.bucket))
        metrics.batch_size.labels(*labels).observe(len(members))
        metrics.batch_tokens.labels(*labels).observe(batch.padded_tokens)
        metrics.padding_ratio.labels(*labels).observe(1 - batch.real_tokens / batch.padded_tokens)
        metrics.compute_seconds.labels(*labels).observe(compute_s)
        self._observed.batch(threads, batch.bucket, batch.padded_tokens, compute_s)
        self._rate.observe(len(members), compute_s)
        waits_ms = [max(0, start_ms - a.entry.enqueued_ms) for a, _ in members]
        queue_wait = metrics.queue_wait_seconds.labels(*labels)  # one lookup, not one per row
        for wait_ms in waits_ms:
            queue_wait.observe(wait_ms / 1000)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "batch",
                extra={
                    "model": self._model,
                    "bucket": batch.bucket,
                    "size": len(members),
                    "padded_tokens": batch.padded_tokens,
                    "real_tokens": batch.real_tokens,
                    "trigger": batch.trigger,
                    "max_wait_ms": max(waits_ms),
                    "compute_ms": round(compute_s * 1000, 2),
                    "request_ids": sorted({a.entry.request_id for a, _ in members}),
                },
            )

    async def finish(self) -> None:
        """Wait for every batch still computing."""
        while self._computing:
            await asyncio.gather(*list(self._computing), return_exceptions=True)


def _profile_facts(
    batch: Batch, members: list[Row], start_ms: int, threads: int
) -> dict[str, object]:
    """What a profiled batch's trace says about it: its padding and its rows' queueing."""
    waits_ms = [max(0, start_ms - a.entry.enqueued_ms) for a, _ in members]
    return {
        "bucket": batch.bucket,
        "rows": len(members),
        "longest": batch.padded_tokens // len(members),
        "real_tokens": batch.real_tokens,
        "padded_tokens": batch.padded_tokens,
        "padding_ratio": round(1 - batch.real_tokens / batch.padded_tokens, 4),
        "trigger": batch.trigger,
        "threads": threads,
        "queue_wait_ms_max": max(waits_ms),
        "queue_wait_ms_mean": round(sum(waits_ms) / len(waits_ms), 1),
    }
