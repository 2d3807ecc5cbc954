"""`EmbedLoop`: the embedding worker's schedule — bucket queues → policy → runner → replies.

It alone owns the local bucket queues of rows (filled by the intake while it has room: up to
`sort_window` rows, and no more than it can start within the latency target
(`window.read_window`), so peers get the rest of a burst or a backlog). An entry brings
several rows of one request; each row waits and is batched on its own, beside other
requests' rows, and the entry's `Assembly` gathers their vectors. Each turn it drops the rows
of cancelled or expired entries, asks `batching.next_batch` what to run, and hands each batch
to a free compute stream (`parallelism`: several at once on a CPU, a lone one on every core);
on one stream (a GPU) the next full batch waits on the compute thread behind the running
one, so the device never idles through the loop's turn between them. An entry whose rows
are all computed is answered and acknowledged by the intake.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import time
from collections.abc import Callable

from common import metrics, tracing
from common.clock import wall_ms
from common.settings import Settings
from common.tasks import spawn_supervised
from worker.compute_threads import ComputeThreads, free_stream
from worker.encode.assembly import Assembly, BatchFacts
from worker.encode.batching import Batch, Limits, Load, Wait, next_batch
from worker.encode.cost import Observations
from worker.encode.handoff import Behind, Part, by_entry, profile_facts, timed
from worker.encode.parallelism import Parallelism
from worker.encode.report import BatchReport
from worker.encode.row_queues import Row, RowQueues
from worker.encode.runners.base import Runner
from worker.encode.window import ComputeRate, read_window
from worker.entry_spans import event
from worker.held import Held
from worker.profiling import BatchProfiler
from worker.replies import Done, Reply
from worker.wiring import Wiring

log = logging.getLogger("microbatch.worker")
DRAIN_POLL_S = 0.05
FULL_TRIGGERS = ("size", "tokens")  # a batch no arrival can make bigger
# a worker looks for expired entries this long after their deadline: the gateway, which owns
# the client's deadline, answers it first, with the client's own timeout in its message
DEADLINE_GRACE_S = 0.1
ROWS_PER_ENTRY_WEIGHT = 0.1  # of each entry read in the mean that sizes the next read


class EmbedLoop:
    def __init__(
        self,
        settings: Settings,
        wiring: Wiring,
        runner: Runner,
        compute: ComputeThreads,
        clock: Callable[[], float] = time.monotonic,
        profiler: BatchProfiler | None = None,
    ) -> None:
        self._settings = settings
        self._name = wiring.name
        self._inbox = wiring.inbox
        self._publisher = wiring.publisher
        self._supervisor = wiring.supervisor
        self._runner = runner
        self._profiler = profiler
        self._clock = clock
        self._model = wiring.model
        self._limits = Limits.from_settings(settings)
        self._overrides = self._inbox.overrides  # the live settings applied
        self._rows = RowQueues(settings.buckets)
        self._entries: dict[Done, Assembly] = {}  # held here: queued, computing, or both
        # the next deadline due, for `_drop_unwanted`
        self._seen_version = -1  # the inbox's version `_drop_unwanted` last looked at
        self._next_deadline_ms: float = math.inf
        self._rows_per_entry = 1.0
        self._batch_ids = itertools.count()
        # a runner says whether batches may compute side by side on it (torch on a CPU)
        self._parallel = Parallelism.from_settings(
            settings, concurrent_ok=bool(getattr(runner, "concurrent", False))
        )
        self._compute = compute
        self._compute.ensure(self._parallel.streams)
        # each computing batch: its threads, start, stream
        self._computing: dict[asyncio.Task, tuple[int, float, int]] = {}
        self._lone: asyncio.Task | None = None  # a redelivered row's batch: nothing beside it
        # batches handed to the compute thread behind the running one (`_queue_behind`),
        # revocable until they start
        self._behind: dict[asyncio.Task, Behind] = {}
        self._observed = Observations(settings.buckets)
        # a runner may say the width it computes a batch at (a grid in bfloat16 on a CPU)
        self._report = BatchReport(self._model, getattr(runner, "padded_width", None), wiring.spans)
        self._rate = ComputeRate()  # rows per compute second: bounds the read window
        self.batches_run = 0

    # ---- what the intake and the liveness part ask ----------------------------------------

    @property
    def held(self) -> int:
        return self._rows.held

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
            rows_per_s=self._rate.per_second(),
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
        self._rows.add(held.bucket, assembly)
        if self._behind and held.lane:  # a tenant's rows may come before the queued batch's
            self._revoke_behind(self._rows.ahead_of(assembly))
        n = len(assembly.rows)
        self._observed.arrival(held.bucket, held.arrived_s, n, not assembly.background)
        self._next_deadline_ms = min(self._next_deadline_ms, assembly.entry.deadline_ms)
        if self._inbox.unwanted(assembly.entry.id, assembly.entry.reply_to):
            self._seen_version = -1  # cancelled before it arrived: look at once
        self._rows_per_entry += ROWS_PER_ENTRY_WEIGHT * (n - self._rows_per_entry)
        self._inbox.wake()

    def _apply_overrides(self) -> None:
        """The batching limits an operator set in Redis (`microbatch tune`), when the
        liveness part posted new ones."""
        overrides = self._inbox.overrides
        if overrides is self._overrides:
            return
        self._overrides = overrides
        base = Limits.from_settings(self._settings)
        try:
            limits = base.with_overrides(overrides, self._settings.max_tokens)
        except ValueError as exc:
            log.error("ignoring live batching settings: %s", exc)
            limits = base
        if limits != self._limits:
            log.info("batching limits now %s", limits)
            self._limits = limits

    # ---- scheduling ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Schedule until `stop` and, after it, until everything held is answered."""
        while True:
            draining = stop.is_set()
            self._apply_overrides()
            self._drop_unwanted()
            timeout = self._start_what_may_run(self._draining() if draining else self._limits)
            if timeout == 0.0:
                continue  # a batch started: ask again at once
            if draining and not self._inbox.reading and not self.held and not self._computing:
                return
            if draining:
                timeout = DRAIN_POLL_S if timeout is None else min(timeout, DRAIN_POLL_S)
            if self._behind:  # revoke it before it starts if a deadline passes first
                due_s = max(0.0, (self._next_deadline_ms - wall_ms()) / 1000 + DEADLINE_GRACE_S)
                timeout = due_s if timeout is None else min(timeout, due_s)
            await self._inbox.wait(timeout)

    def _draining(self) -> Limits:
        """Past `stop`, nothing more will arrive: no batch waits for company."""
        return Limits(self._limits.max_batch_size, self._limits.max_batch_tokens, 0.0)

    def _start_what_may_run(self, limits: Limits) -> float | None:
        """Start the batch the policy picks, if a stream is free: 0.0 when one started, else
        how long until the policy wants to be asked again (None: when something changes)."""
        running = [threads for threads, _, _ in self._computing.values()]
        if len(running) >= self._parallel.streams:
            return self._queue_behind(limits)
        decision = self._decide(limits)
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

    def _decide(self, limits: Limits) -> Batch | Wait:
        """A redelivered row first, alone: once nothing computes, and nothing beside it."""
        lone = self._rows.lone()
        if lone is not None:
            return Wait(None) if self._computing else lone
        if self._lone is not None:
            return Wait(None)  # its batch ends, and wakes the loop
        return next_batch(self._rows.in_order(), self._clock(), limits, self._load(), ordered=True)

    def _queue_behind(self, limits: Limits) -> float | None:
        """On one stream (a GPU, or a CPU batch on every core), the next batch is handed to
        the compute thread while the running one computes, once it is full: the device starts
        it the moment the running one ends, instead of idling through the loop's turn after
        it (the replies, the acks, the next decision), which the loop now spends while the
        next batch computes. One waits at most; a batch that could still grow waits for the
        stream as before, and so does one of background rows while online traffic is live.
        0.0 when one was queued, else None (ask again on a change)."""
        if self._parallel.streams != 1 or len(self._computing) != 1:
            return None
        decision = self._decide(limits)
        if not isinstance(decision, Batch) or decision.trigger not in FULL_TRIGGERS:
            return None
        if decision.background and self._load().online_live:
            return None  # an online row read meanwhile goes first
        self._start_batch(decision, self._parallel.threads_per_stream, 0, behind=True)
        return 0.0

    def _revoke_behind(self, before: float | None = None) -> int:
        """Take back a batch queued behind the running one, if it has not started, that holds
        rows of a dropped entry (its other rows queue again, the dropped ones never compute),
        or, with `before`, a row whose place in the fair order is after it (a tenant's row
        read since goes first). Rows skipped so."""
        skipped = 0
        for task, behind in list(self._behind.items()):
            dropped = any(a.dropped for a, _, _ in behind.entries)
            later = before is not None and self._rows.latest(behind.batch.keys) > before
            if not (dropped or later) or not behind.future.cancel():
                continue
            del self._behind[task]
            back = []
            for key, (assembly, index) in zip(behind.batch.keys, behind.members, strict=True):
                assembly.computing -= 1
                if assembly.dropped:
                    skipped += 1
                else:
                    back.append((key, (assembly, index)))
            self._rows.put_back(behind.batch.bucket, back)
        return skipped

    def _load(self) -> Load:
        """Arrival rates, and the batch cost at the thread count batches get under load."""
        cost, per_bucket = self._observed.cost_at(self._parallel.threads_per_stream)
        now_s = self._clock()
        idle_s = now_s - self._observed.last_online_s  # since online traffic last came
        return Load(cost, self._observed.rates(now_s), len(self._computing), per_bucket, idle_s)

    def _drop_unwanted(self) -> None:
        """Before any compute: drop the queued rows of entries whose client left (acked) or
        whose deadline passed while they waited here (answered 504), once none of their rows
        is computing (read early, within `sort_window`)."""
        inbox, now_ms = self._inbox, wall_ms()
        if inbox.version == self._seen_version and now_ms < self._next_deadline_ms:
            return  # no new cancellations and no deadline passed: nothing to look for
        self._seen_version = inbox.version
        dropped = []
        for a in self._entries.values():
            if a.dropped:
                continue
            if inbox.unwanted(a.entry.id, a.entry.reply_to):
                a.dropped = "cancelled"
            elif a.entry.deadline_ms <= now_ms:
                a.dropped = "deadline"
            else:
                continue
            dropped.append(a)
        revoked = self._revoke_behind()
        self._next_deadline_ms = min(
            (a.entry.deadline_ms for a in self._entries.values() if not a.dropped),
            default=math.inf,
        )
        if not dropped:
            return
        skipped = revoked  # rows that will never compute
        for assembly in dropped:
            skipped += self._rows.drop(assembly)
        metrics.cancelled_total.inc(skipped)
        replies, done = self._settle(dropped, now_ms)
        self._publisher.post(replies, done)
        self._inbox.room_freed()

    def _settle(self, assemblies: list[Assembly], now_ms: int) -> tuple[list[Reply], list[Done]]:
        """The replies and acks of those entries that are settled, which leave the loop."""
        replies, done = [], []
        for assembly in assemblies:
            if not assembly.settled:
                continue
            held = assembly.held
            del self._entries[(held.stream, held.entry_id)]
            if assembly.dropped:
                event(held.span, assembly.dropped)
            done.append((held.stream, held.entry_id))
            if assembly.first_start_ms is not None:  # once, to its first batch's real start
                wait_ms = max(0, assembly.first_start_ms - assembly.entry.enqueued_ms)
                self._report.metrics.of(held.bucket).queue_wait.observe(wait_ms / 1000)
            reply = assembly.reply(held.bucket, self._name, now_ms)
            if reply is not None:
                replies.append(reply)
        return replies, done

    # ---- running a batch -------------------------------------------------------------------

    def _start_batch(self, batch: Batch, threads: int, stream: int, behind: bool = False) -> None:
        """Take the batch's rows off the queues now, so the next decision cannot pick them
        again, and compute it beside any other running batch."""
        members = self._rows.take(batch.bucket, batch.keys, started=not behind)
        entries = by_entry(members)
        now_ms = wall_ms()
        for assembly, indices, _ in entries:
            assembly.computing += len(indices)
        self._inbox.room_freed()
        # Submitted here, not in the task: the compute thread starts now, not a loop turn
        # later, behind whatever else is ready (the reader's next XREADGROUP, most often).
        rows = [a.rows[i] for a, i in members]
        work = functools.partial(self._runner.embed, rows, threads=threads)
        if self._profiler is not None and not self._profiler.finished:
            profiled = profile_facts(batch, members, now_ms, threads)
            work = functools.partial(self._profiler.run, "embed", profiled, work)
        submitted = self._compute.submit(stream, timed, work)
        computed = asyncio.wrap_future(submitted)
        task = spawn_supervised(
            "batch",
            self._finish_batch(batch, members, entries, threads, computed),
            self._supervisor.ended,
        )
        if behind:
            self._behind[task] = Behind(submitted, batch, members, entries)
        self._computing[task] = (threads, self._clock(), stream)
        if batch.trigger == "alone":
            self._lone = task
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task) -> None:
        self._computing.pop(task, None)
        self._lone = None if task is self._lone else self._lone
        self._behind.pop(task, None)
        for waiting, behind in self._behind.items():  # it starts now: timed from here
            threads, _, stream = self._computing[waiting]
            self._computing[waiting] = (threads, self._clock(), stream)
            self._rows.started(behind.batch.keys)
        self._inbox.wake()  # a stream is free
        self._inbox.room_freed()

    async def _finish_batch(
        self,
        batch: Batch,
        members: list[Row],
        entries: list[Part],
        threads: int,
        computed: asyncio.Future[tuple[list, int, float]],
    ) -> None:
        """Wait for a started batch's results, hand them to their entries, and answer every
        entry it completed."""
        results, start_ms, compute_s = await computed
        if len(results) != len(members):  # a runner bug: stop the worker, lose nothing
            raise ValueError(f"runner returned {len(results)} results for {len(members)} rows")
        facts = BatchFacts(
            f"{self._name}:{next(self._batch_ids)}", len(members), start_ms, compute_s
        )
        self._observe(batch, members, facts, threads)
        for assembly, indices, places in entries:
            ours = [results[place] for place in places]
            for result in ours:
                if isinstance(result, Exception):
                    log.error(
                        "input failed: %r",
                        result,
                        extra={"request_id": assembly.entry.request_id, "entry": assembly.entry.id}
                        | tracing.log_ids(assembly.held.span),
                    )
                    event(assembly.held.span, "input failed", reason=repr(result))
            assembly.filled(indices, ours, facts)
        replies, done = self._settle([assembly for assembly, _, _ in entries], wall_ms())
        if done:
            until_ms = max(assembly.entry.deadline_ms for assembly, _, _ in entries)
            self._publisher.post(replies, done, until_ms=until_ms)
        self.batches_run += 1

    def _observe(self, batch: Batch, members: list[Row], facts: BatchFacts, threads: int) -> None:
        self._observed.batch(threads, batch.bucket, batch.padded_tokens, facts.compute_s)
        self._rate.observe(len(members), facts.compute_s)
        self._report.batch(batch, members, facts, threads)

    async def finish(self) -> None:
        """Wait for every batch still computing."""
        while self._computing:
            await asyncio.gather(*list(self._computing), return_exceptions=True)
