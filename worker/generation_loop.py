"""`GenerationConsumer`: the worker's Redis loop for a causal LM, one engine step at a time.

It reads, reclaims, renews leases and dead-letters exactly as the embedding `Consumer` does;
only scheduling differs. Each turn: drop cancelled and expired sequences, ask
`generation.plan_step` whom to pause and whom to admit, run one engine step on the compute
thread, turn the new tokens into text, and publish chunks (streamed requests) or final
answers, acking each entry with its final answer. Publishing is ordered, so one sequence's
chunks reach its gateway in order, and overlaps the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

from common import metrics
from common.protocol import GenerateEntry, GenerationChunk, encode, pack_tokens
from common.settings import Settings
from common.store import Store
from worker import recovery
from worker.compute_threads import ComputeThreads
from worker.consume import Consumer, Held, _wall_ms
from worker.detokenize import IncrementalDetokenizer, StopMatcher
from worker.engine import Admission, GenerationEngine, Sampling
from worker.generation import EngineLimits, SeqView, plan_step

log = logging.getLogger("microbatch.worker")
Reply = tuple[str, bytes]


@dataclass(slots=True)
class Generating:
    """One prompt being generated here, from admission to its final answer."""

    held: Held
    order: int
    sampling: Sampling
    detokenizer: IncrementalDetokenizer
    stopper: StopMatcher
    attempt: str
    generated: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)  # tokens not yet in a chunk
    chunks: int = 0
    queue_ms: float = -1.0  # set when first scheduled
    last_token_s: float | None = None

    @property
    def entry(self) -> GenerateEntry:
        assert isinstance(self.held.entry, GenerateEntry)
        return self.held.entry

    def view(self, key: int) -> SeqView:
        """Its length counts the newest token too: one more than its cache holds, a bound."""
        return SeqView(
            key, self.entry.n_tokens + len(self.generated), self.entry.priority, self.order
        )

    def tokens(self):  # the prompt and everything generated: what a preempted one re-prefills
        import numpy as np

        return np.concatenate([self.entry.token_ids(), np.asarray(self.generated, "<u4")])


class GenerationConsumer(Consumer):
    def __init__(
        self,
        settings: Settings,
        store: Store,
        engine: GenerationEngine,
        tokenizer,  # tokenizers.Tokenizer: decode(ids, skip_special_tokens)
        limits: recovery.EntryLimits,
        name: str,
        register,
        compute: ComputeThreads | None = None,
    ) -> None:
        super().__init__(settings, store, None, limits, name, register, compute=compute)
        self._engine = engine
        self._tokenizer = tokenizer
        self._engine_limits = EngineLimits.from_settings(settings)
        self._waiting: dict[int, Generating] = {}
        self._running: dict[int, Generating] = {}
        self._order = itertools.count()
        self._publish_lock = asyncio.Lock()
        self._retire: list[int] = []  # rows to free before the next step
        self.steps_run = 0

    # ---- what the reader and the reclaimer see --------------------------------------------

    @property
    def held(self) -> int:
        return len(self._waiting) + len(self._running)

    def _room(self) -> int:
        capacity = self._engine_limits.max_running + max(1, self._engine_limits.max_running // 4)
        return capacity - self.held

    def _hold(self, held: Held) -> None:
        entry = held.entry
        assert isinstance(entry, GenerateEntry)
        key = next(self._seq)
        self._waiting[key] = Generating(
            held=held,
            order=next(self._order),
            sampling=Sampling(entry.temperature, entry.top_p, entry.seed),
            detokenizer=IncrementalDetokenizer(self._tokenizer, entry.token_ids()),
            stopper=StopMatcher(entry.stop),
            attempt=f"{self.name}:{held.entry_id}:{key}",
        )

    # ---- the step loop --------------------------------------------------------------------

    async def _schedule_loop(self, stop: asyncio.Event, reader: asyncio.Task) -> None:
        loop = asyncio.get_running_loop()
        while True:
            replies, done = self._drop_unwanted()
            plan = plan_step(
                [s.view(k) for k, s in self._running.items()],
                [s.view(k) for k, s in self._waiting.items()],
                self._engine_limits,
            )
            for key in plan.preempt:
                self._waiting[key] = self._running.pop(key)
                self._retire.append(key)
                metrics.preemptions_total.labels(self._model).inc()
            admitted = [(key, self._waiting.pop(key)) for key in plan.admit]
            for key, seq in admitted:
                self._running[key] = seq
                if seq.queue_ms < 0:
                    seq.queue_ms = max(0.0, _wall_ms() - seq.entry.enqueued_ms)
            if replies or done:
                self._publish_in_order(replies, done)
            if not self._running:
                if self._retire:
                    retire, self._retire = self._retire, []
                    await loop.run_in_executor(self._executor, self._engine.retire, retire)
                    continue  # entries may have arrived meanwhile: plan again before waiting
                if stop.is_set() and reader.done() and not self.held:
                    return
                await self._wait_changed(0.05 if stop.is_set() else None)
                continue
            await self._step(loop, admitted)

    async def _step(self, loop: asyncio.AbstractEventLoop, admitted: list) -> None:
        newcomers = [Admission(key, seq.tokens(), seq.sampling) for key, seq in admitted]
        retire, self._retire = self._retire, []

        def work() -> dict[int, int]:
            self._engine.retire(retire)
            return self._engine.step(newcomers)

        self._batch_started_s = self._clock()
        try:
            new_tokens = await loop.run_in_executor(self._executor, work)
        finally:
            self._batch_started_s = None
        self.steps_run += 1
        self.batches_run += 1
        metrics.batch_size.labels(self._model, "decode").observe(len(new_tokens))
        self._after_step(new_tokens)

    def _after_step(self, new_tokens: dict[int, int]) -> None:
        now_s = time.monotonic()
        replies: list[Reply] = []
        done: list[tuple[str, str]] = []
        finished: list[int] = []
        for key, token in new_tokens.items():
            seq = self._running.get(key)
            if seq is None:
                continue
            self._observe_token(seq, now_s)
            text, finish = self._advance(seq, token)
            chunk = self._chunk(seq, text, finish)
            if chunk is not None:
                replies.append(chunk)
            if finish:
                finished.append(key)
                done.append((seq.held.stream, seq.held.entry_id))
        for key in finished:
            del self._running[key]
            self._retire.append(key)
        metrics.generated_tokens_total.labels(self._model).inc(len(new_tokens))
        metrics.running_sequences.labels(self._model).set(len(self._running))
        metrics.kv_cache_usage_ratio.labels(self._model).set(
            self._engine.cache_positions() / self._engine_limits.kv_tokens
        )
        if replies or done:
            self._publish_in_order(replies, done)
        if finished:
            self._changed.set()  # room for the reader

    def _observe_token(self, seq: Generating, now_s: float) -> None:
        if seq.last_token_s is None:
            ttft_ms = _wall_ms() - seq.entry.enqueued_ms
            metrics.time_to_first_token_seconds.labels(self._model).observe(max(0, ttft_ms) / 1000)
        else:
            metrics.inter_token_seconds.labels(self._model).observe(now_s - seq.last_token_s)
        seq.last_token_s = now_s

    def _advance(self, seq: Generating, token: int) -> tuple[str, str]:
        """Take one token: the text it releases and the finish reason ("" while going on)."""
        seq.generated.append(token)
        seq.unsent.append(token)
        if token in self._engine.eos_ids:
            return seq.stopper.add(seq.detokenizer.flush())[0] + seq.stopper.finish(), "stop"
        text, hit = seq.stopper.add(seq.detokenizer.add(token))
        if hit:
            return text, "stop"
        entry = seq.entry
        at_limit = len(seq.generated) >= entry.max_tokens
        if at_limit or entry.n_tokens + len(seq.generated) >= self._engine.context:
            flushed, hit = seq.stopper.add(seq.detokenizer.flush())
            text += flushed
            return (text, "stop") if hit else (text + seq.stopper.finish(), "length")
        return text, ""

    def _chunk(self, seq: Generating, text: str, finish: str) -> Reply | None:
        entry = seq.entry
        if not entry.stream:
            if not finish:
                return None
            text, tokens = seq.stopper.text, seq.generated
        elif not text and not finish:
            return None  # nothing to show yet: the tokens ride with the next chunk
        else:
            tokens = seq.unsent
        chunk = GenerationChunk(
            id=entry.id,
            attempt=seq.attempt,
            index=seq.chunks,
            text=text,
            tokens=pack_tokens(tokens),
            finish_reason=finish,
            prompt_tokens=entry.n_tokens,
            completion_tokens=len(seq.generated),
            queue_ms=seq.queue_ms,
            worker=self.name,
        )
        seq.chunks += 1
        seq.unsent = []
        return entry.reply_to, encode(chunk)

    # ---- cancellation and deadlines -------------------------------------------------------

    def _drop_unwanted(self) -> tuple[list[Reply], list[tuple[str, str]]]:
        """Free sequences whose client left (ack only) or whose deadline passed (504)."""
        now_ms = _wall_ms()
        replies: list[Reply] = []
        done: list[tuple[str, str]] = []
        for table in (self._waiting, self._running):
            for key in [k for k, s in table.items() if self._unwanted(s, now_ms)]:
                seq = table.pop(key)
                if table is self._running:
                    self._retire.append(key)
                done.append((seq.held.stream, seq.held.entry_id))
                metrics.cancelled_total.inc()
                if seq.entry.id not in self._cancelled:
                    message = f"deadline passed after {len(seq.generated)} generated tokens"
                    replies.append(self._error(seq.entry, 504, "deadline_exceeded", message))
        if done:
            metrics.running_sequences.labels(self._model).set(len(self._running))
        return replies, done

    def _unwanted(self, seq: Generating, now_ms: int) -> bool:
        return seq.entry.id in self._cancelled or seq.entry.deadline_ms <= now_ms

    def _publish_in_order(self, replies: list[Reply], done: list[tuple[str, str]]) -> None:
        """Publish without waiting, yet in step order: the lock queues publishers FIFO."""

        async def publish() -> None:
            async with self._publish_lock:
                await self._publish(replies, done)

        task = asyncio.create_task(publish())
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)
