"""`GenerationLoop`: a causal-LM worker's schedule, one engine step at a time.

Each turn: drop cancelled and expired sequences, ask `scheduler.plan_step` whom to pause and
whom to admit, run one engine step on the compute thread, turn the new tokens into text
(`Sequence.advance`), and publish chunks (streamed requests) or final answers, acking each
entry with its final answer. Publishing is ordered, so one sequence's chunks reach its
gateway in order, and overlaps the next step. Reading, leases and dead letters are the
intake's, exactly as for embeddings.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from common import metrics, tracing
from common.clock import wall_ms
from common.protocol import GenerateEntry
from common.response_format import StructureError
from common.settings import Settings
from worker.compute_threads import ComputeThreads
from worker.entry_spans import event
from worker.generate.constraints import Constraint, Grammars
from worker.generate.engine import GenerationEngine
from worker.generate.sampling import Sampling
from worker.generate.scheduler import EngineLimits, plan_step
from worker.generate.sequence import Family, Sequence
from worker.generate.steps import Admission, Picked
from worker.held import Held
from worker.profiling import BatchProfiler
from worker.replies import Done, Reply, error_reply
from worker.wiring import Wiring

log = logging.getLogger("microbatch.worker")
DRAIN_POLL_S = 0.05


class GenerationLoop:
    def __init__(
        self,
        settings: Settings,
        wiring: Wiring,
        engine: GenerationEngine,
        tokenizer: object,  # tokenizers.Tokenizer: decode(ids, skip_special_tokens)
        compute: ComputeThreads,
        clock: Callable[[], float] = time.monotonic,
        profiler: BatchProfiler | None = None,
    ) -> None:
        self._settings = settings
        self._name = wiring.name
        self._inbox = wiring.inbox
        self._publisher = wiring.publisher
        self._engine = engine
        self._profiler = profiler
        self._tokenizer = tokenizer
        self._executor = compute.first
        self._clock = clock
        self._model = wiring.model
        self._limits = EngineLimits.from_settings(settings)
        self._waiting: dict[int, Sequence] = {}
        self._running: dict[int, Sequence] = {}
        self._keys = itertools.count()
        self._order = itertools.count()
        self._retire: list[int] = []  # rows to free before the next step
        self._names: dict[int, list[bytes]] = {}
        self._budgets: dict[int, int] = {}  # this step's prefill chunks, as planned
        self._cache_seen = (0, 0, 0)  # block manager counters already in the metrics
        self._grammars: Grammars | None = None  # built at the first structured request
        self._step_started_s: float | None = None  # set while a step computes
        self.steps_run = 0
        self.batches_run = 0

    # ---- what the intake and the liveness part ask ----------------------------------------

    @property
    def held(self) -> int:
        return len(self._waiting) + len(self._running)

    @property
    def busy(self) -> bool:
        return bool(self.held or self._retire)

    def room(self) -> int:
        """Entries to read now: no more than a few beyond what runs, so a burst spreads
        over every worker reading (each takes what it can start soon, and Redis serves
        blocked readers in turn) instead of filling the first one to read."""
        capacity = self._limits.max_running + max(1, self._limits.max_running // 4)
        read_ahead = max(2, self._limits.max_running // 8) - len(self._waiting)
        return min(capacity - self.held, read_ahead)

    def hung(self) -> bool:
        started = self._step_started_s
        return started is not None and (
            self._clock() - started > self._settings.max_batch_ms / 1000
        )

    def hold(self, held: Held) -> None:
        """One sequence per choice the entry asks for, siblings of one family; an entry whose
        response format cannot be compiled is answered 400 at once."""
        entry = held.entry
        if not isinstance(entry, GenerateEntry):
            raise TypeError("a generation loop was handed an embedding entry: this is a bug")
        n = entry.n
        try:
            constraints = [self._constraint(entry) for _ in range(n)]
        except StructureError as exc:
            error = error_reply(
                entry, 400, "invalid_request", f"response_format: {exc}", self._name
            )
            self._publisher.post([error], [(held.stream, held.entry_id)], ordered=True)
            return
        keys = [next(self._keys) for _ in range(n)]
        family = Family(keys, left=n)
        for choice, (key, constraint) in enumerate(zip(keys, constraints, strict=True)):
            attempt = f"{self._name}:{held.entry_id}:{key}"
            self._waiting[key] = Sequence.start(
                held,
                next(self._order),
                self._tokenizer,
                attempt,
                self._engine.eos_ids,
                family,
                Sampling.of(entry, self._engine.eos_ids, choice, constraint),
                choice,
            )
        self._inbox.wake()

    def _constraint(self, entry: object) -> Constraint | None:
        if not isinstance(entry, GenerateEntry) or not entry.response_format:
            return None
        if self._grammars is None:
            self._grammars = Grammars(
                self._tokenizer.to_str(),  # type: ignore[attr-defined]
                self._engine.vocab_size,
                self._engine.eos_ids,
            )
        return self._grammars.constraint(entry.response_format, entry.json_schema)

    # ---- the step loop ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Step until `stop` and, after it, until every sequence held has finished. (Live
        batching settings tune embedding batches; a generation worker has none to apply.)"""
        loop = asyncio.get_running_loop()
        while True:
            replies, done = self._drop_unwanted()
            admitted = self._plan()
            if replies or done:
                self._publisher.post(replies, done, ordered=True)
            if self._running:
                await self._step(loop, admitted)
                continue
            if self._retire:
                retire, self._retire = self._retire, []
                await loop.run_in_executor(self._executor, self._engine.retire, retire)
                continue  # entries may have arrived meanwhile: plan again before waiting
            if stop.is_set() and not self._inbox.reading and not self.held:
                return
            await self._inbox.wait(DRAIN_POLL_S if stop.is_set() else None)

    def _plan(self) -> list[tuple[int, Sequence]]:
        """Pause and admit as the policy says; the sequences admitted now."""
        plan = plan_step(
            [replace(s.view(k), pending=self._engine.pending(k)) for k, s in self._running.items()],
            [
                replace(s.view(k), scored=True)  # every position computed: nothing reused
                if s.prompt_logprobs() >= 0
                else replace(s.view(k), cached=self._cached(k, s))
                for k, s in self._waiting.items()
            ],
            self._limits,
        )
        self._budgets = plan.budgets
        for key in plan.preempt:
            self._waiting[key] = preempted = self._running.pop(key)
            self._retire.append(key)
            metrics.preemptions_total.labels(self._model).inc()
            event(preempted.held.span, "preempted", choice=preempted.choice)
        admitted = [(key, self._waiting.pop(key)) for key in plan.admit]
        for key, _ in admitted:
            self._names.pop(key, None)
        if admitted:
            self._inbox.room_freed()
        for key, seq in admitted:
            self._running[key] = seq
            if seq.queue_ms < 0:
                seq.queue_ms = max(0.0, wall_ms() - seq.entry.enqueued_ms)
            event(seq.held.span, "prefill", choice=seq.choice, tokens=len(seq.tokens()))
        return admitted

    def _cached(self, key: int, seq: Sequence) -> int:
        """Leading tokens of a waiting sequence the prefix cache holds now (its block names
        are computed once while it waits)."""
        if not self._engine.blocks.caching:
            return 0
        tokens = seq.tokens()
        names = self._names.get(key)
        if names is None:
            names = self._names[key] = self._engine.blocks.names(tokens.tolist())
        return self._engine.blocks.cached_tokens(tokens.tolist(), names)

    async def _step(
        self, loop: asyncio.AbstractEventLoop, admitted: list[tuple[int, Sequence]]
    ) -> None:
        newcomers = _admissions(admitted)
        retire, self._retire = self._retire, []
        budgets = self._budgets
        prefilled = sum(
            budgets.get(a.key, len(a.tokens)) for a in newcomers if a.same_as is None
        ) + sum(n for k, n in budgets.items() if k not in {a.key for a in newcomers})
        metrics.prefill_tokens_total.labels(self._model).inc(prefilled)

        def work() -> dict[int, Picked]:
            self._engine.retire(retire)
            return self._engine.step(newcomers, budgets)

        if self._profiler is not None and not self._profiler.finished:
            facts = {
                "running": len(self._running),
                "newcomers": len(newcomers),
                "prefill_tokens": prefilled,
            }
            work = functools.partial(self._profiler.run, "generate", facts, work)
        self._step_started_s = self._clock()
        try:
            new_tokens = await loop.run_in_executor(self._executor, work)
        finally:
            self._step_started_s = None
        self.steps_run += 1
        self.batches_run += 1
        metrics.batch_size.labels(self._model, "decode").observe(len(new_tokens))
        self._after_step(new_tokens)

    def _after_step(self, new_tokens: dict[int, Picked]) -> None:
        now_s = time.monotonic()
        replies: list[Reply] = []
        done: list[Done] = []
        until_ms = 0  # the latest deadline among them: publishing is retried until it
        for key, picked in new_tokens.items():
            seq = self._running.get(key)
            if seq is None:
                continue
            until_ms = max(until_ms, seq.entry.deadline_ms)
            if picked.failed is not None:  # its own options or grammar: it alone fails
                self._fail_family(seq, picked.failed, replies, done)
                continue
            observe_token(seq, self._model, now_s)
            text, finish = seq.advance(picked, self._engine.context)
            chunk = seq.chunk(text, finish, self._name)
            if chunk is not None:
                replies.append(chunk)
            if finish:
                self._finished(seq, finish)
                del self._running[key]
                self._retire.append(key)
                seq.family.left -= 1
                if not seq.family.left:  # the last choice: the entry is answered
                    seq.family.ended = True
                    done.append((seq.held.stream, seq.held.entry_id))
        metrics.generated_tokens_total.labels(self._model).inc(len(new_tokens))
        metrics.running_sequences.labels(self._model).set(len(self._running))
        metrics.kv_cache_usage_ratio.labels(self._model).set(self._engine.usage_ratio())
        self._count_cache()
        if replies or done:
            self._publisher.post(replies, done, until_ms=until_ms, ordered=True)
        if done:
            self._inbox.room_freed()

    def _finished(self, seq: Sequence, reason: str) -> None:
        tokens, cached = len(seq.generated), seq.cached_tokens
        event(seq.held.span, "finished", choice=seq.choice, reason=reason, tokens=tokens,
              cached_tokens=cached)  # fmt: skip

    def _fail_family(self, seq: Sequence, why: str, replies: list[Reply], done: list[Done]) -> None:
        """Answer a sequence's entry 500 and let every choice of it go (the engine has
        already freed the failed one); its step's other sequences go on."""
        span = seq.held.span
        log.error(
            "a sequence failed: %s",
            why,
            extra={"request_id": seq.entry.request_id} | tracing.log_ids(span),
        )
        event(span, "failed", reason=why)
        for table in (self._running, self._waiting):
            for key in [k for k, s in table.items() if s.family is seq.family]:
                table.pop(key)
                self._names.pop(key, None)
                self._retire.append(key)
        if not seq.family.ended:
            seq.family.ended = True
            message = f"generation failed for this request: {why}"
            replies.append(error_reply(seq.entry, 500, "inference_failed", message, self._name))
            done.append((seq.held.stream, seq.held.entry_id))

    def _count_cache(self) -> None:
        """Move the block manager's counters into the metrics."""
        stats, seen = self._engine.blocks.stats, self._cache_seen
        now = (stats.queried_tokens, stats.hit_tokens, stats.evictions)
        for counter, before, after in zip(
            (
                metrics.prefix_cache_queried_tokens_total,
                metrics.prefix_cache_hit_tokens_total,
                metrics.kv_cache_evictions_total,
            ),
            seen,
            now,
            strict=True,
        ):
            if after > before:
                counter.labels(self._model).inc(after - before)
        self._cache_seen = now

    def _drop_unwanted(self) -> tuple[list[Reply], list[Done]]:
        """Free sequences whose client left (ack only) or whose deadline passed (504)."""
        now_ms = wall_ms()
        unwanted = self._inbox.unwanted
        replies: list[Reply] = []
        done: list[Done] = []
        for table in (self._waiting, self._running):
            gone = [
                k
                for k, s in table.items()
                if unwanted(s.entry.id, s.entry.reply_to) or s.entry.deadline_ms <= now_ms
            ]
            for key in gone:
                seq = table.pop(key)
                self._names.pop(key, None)
                if table is self._running:
                    self._retire.append(key)
                if seq.family.ended:
                    continue  # a sibling already answered for the entry
                seq.family.ended = True
                done.append((seq.held.stream, seq.held.entry_id))
                metrics.cancelled_total.inc()
                if not unwanted(seq.entry.id, seq.entry.reply_to):
                    message = f"deadline passed after {len(seq.generated)} generated tokens"
                    error = error_reply(seq.entry, 504, "deadline_exceeded", message, self._name)
                    replies.append(error)
                    event(seq.held.span, "deadline", reason=message)
                else:
                    event(seq.held.span, "cancelled", reason="the client left")
        if done:
            metrics.running_sequences.labels(self._model).set(len(self._running))
            self._inbox.room_freed()
        return replies, done

    async def finish(self) -> None:
        """Steps run inline in `run`: nothing computes once it has returned."""


def observe_token(seq: Sequence, model: str, now_s: float) -> None:
    """A sequence's new token in the latency metrics: its first, or the gap since its last."""
    if seq.last_token_s is None:
        ttft_ms = wall_ms() - seq.entry.enqueued_ms
        metrics.time_to_first_token_seconds.labels(model).observe(max(0, ttft_ms) / 1000)
        event(seq.held.span, "first token", choice=seq.choice, ttft_ms=ttft_ms)
    else:
        metrics.inter_token_seconds.labels(model).observe(now_s - seq.last_token_s)
    seq.last_token_s = now_s


def _admissions(admitted: list[tuple[int, Sequence]]) -> list[Admission]:
    """What the engine prefills; fresh siblings joining together share one prefill."""
    sources: dict[int, int] = {}  # id(family) -> the key whose prefill siblings share
    out = []
    for key, seq in admitted:
        same_as = sources.setdefault(id(seq.family), key) if seq.fresh else key
        out.append(
            Admission(
                key,
                seq.tokens(),
                seq.sampling,
                logprobs=seq.entry.logprobs,
                prompt_logprobs=seq.prompt_logprobs(),
                same_as=None if same_as == key else same_as,
            )
        )
    return out
