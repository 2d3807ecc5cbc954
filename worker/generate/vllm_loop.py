"""`VllmLoop`: a causal-LM worker whose sequences run in vLLM's engine, under the queue.

What is microbatch's stays here, as with the paged engine: entries come from the intake
(leases, redelivery, dead letters), each choice is a `Sequence` that makes its text, stop
strings, chunks and final answer, and the entry is acked with that answer. A client that left
and a passed deadline cancel the choice's task, which aborts its request in vLLM. vLLM
schedules: each choice is one vLLM request, streamed back delta by delta. A vLLM engine that
dies takes the worker down, so what it held is redelivered to a peer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from contextlib import aclosing

from common import metrics
from common.clock import wall_ms
from common.protocol import GenerateEntry
from common.response_format import grammar_problem
from common.settings import Settings
from common.tasks import spawn_supervised
from worker.entry_spans import event
from worker.generate.loop import observe_token
from worker.generate.sampling import Sampling
from worker.generate.sequence import Family, Sequence
from worker.generate.vllm_engine import Refused, VllmEngine
from worker.generate.vllm_options import sampling_options
from worker.held import Held
from worker.replies import Done, Reply, error_reply
from worker.wiring import Wiring

log = logging.getLogger("microbatch.worker")
POLL_S = 0.05  # how often held sequences are checked for a client that left or a deadline
# vLLM samples (its own SamplingParams, vllm_options): a sequence here reads only its
# sampling's grammar, which vLLM enforces instead; no per-request tensors are built for it
NOT_SAMPLED_HERE = Sampling(temperature=0.0, top_p=1.0, seed=-1)


class VllmLoop:
    def __init__(
        self,
        settings: Settings,
        wiring: Wiring,
        engine: VllmEngine,
        tokenizer: object,  # tokenizers.Tokenizer: decode(ids, skip_special_tokens)
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._name = wiring.name
        self._inbox = wiring.inbox
        self._publisher = wiring.publisher
        self._model = wiring.model
        self._engine = engine
        self._tokenizer = tokenizer
        self._clock = clock
        self._keys = itertools.count()
        self._sequences: dict[int, Sequence] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._progress_s = clock()  # the engine's latest delta, or when it was last idle
        self._failed: BaseException | None = None  # a choice's task died: the engine is gone
        self.batches_run = 0  # deltas received: the engine's steps, as this worker saw them

    # ---- what the intake and the liveness part ask ----------------------------------------

    @property
    def held(self) -> int:
        return len(self._sequences)

    @property
    def busy(self) -> bool:
        return bool(self._sequences)

    def room(self) -> int:
        """What vLLM can run at once, and a few more to queue in it."""
        running = self._settings.max_running_seqs
        return max(0, running + max(1, running // 4) - self.held)

    def hung(self) -> bool:
        """Sequences held and no delta from the engine for longer than a batch may take."""
        limit_s = self._settings.max_batch_ms / 1000
        return bool(self._sequences) and self._clock() - self._progress_s > limit_s

    def hold(self, held: Held) -> None:
        """One vLLM request per choice the entry asks for; an entry whose response format
        cannot be enforced is answered 400 at once."""
        entry = held.entry
        if not isinstance(entry, GenerateEntry):
            raise TypeError("a generation loop was handed an embedding entry: this is a bug")
        problem = grammar_problem(entry.response_format, entry.json_schema) if (
            entry.response_format
        ) else None  # fmt: skip
        if problem is not None:
            self._refuse(held, f"response_format: {problem}")
            return
        if not self._sequences:
            self._progress_s = self._clock()
        keys = [next(self._keys) for _ in range(entry.n)]
        family = Family(keys, left=entry.n)
        for choice, key in enumerate(keys):
            attempt = f"{self._name}:{held.entry_id}:{key}"
            seq = Sequence.start(
                held,
                key,
                self._tokenizer,
                attempt,
                self._engine.eos_ids,
                family,
                NOT_SAMPLED_HERE,
                choice,
            )
            seq.queue_ms = max(0.0, wall_ms() - entry.enqueued_ms)
            self._sequences[key] = seq
            self._tasks[key] = spawn_supervised(
                f"vllm {attempt}", self._generate(key, seq), self._task_ended
            )
        # in vLLM: running, or queued in its scheduler
        metrics.running_sequences.labels(self._model).set(len(self._sequences))
        self._inbox.wake()

    def _refuse(self, held: Held, why: str) -> None:
        error = error_reply(held.entry, 400, "invalid_request", why, self._name)
        self._publisher.post([error], [(held.stream, held.entry_id)], ordered=True)

    def _task_ended(self, exc: BaseException | None) -> None:
        if exc is not None and self._failed is None:
            self._failed = exc
            self._inbox.wake()

    # ---- one choice ------------------------------------------------------------------------

    async def _generate(self, key: int, seq: Sequence) -> None:
        """Feed vLLM's deltas to the sequence and publish what it says, until it ends (here:
        a stop string, the limit; or in vLLM: EOS, a stop id, the grammar's end)."""
        options = sampling_options(seq.entry, seq.choice, self._engine.context)
        tokens = seq.entry.token_ids().tolist()
        finish = ""
        # closed as the sequence ends here (a stop string): that aborts its vLLM request
        deltas = aclosing(self._engine.generate(tokens, options, seq.attempt))
        try:
            async with deltas as outputs:
                async for picked, last in outputs:
                    self._progress_s = self._clock()
                    self.batches_run += 1
                    text = ""
                    for pick in picked:
                        observe_token(seq, self._model, time.monotonic())
                        said, finish = seq.advance(pick, self._engine.context)
                        text += said
                        if finish:
                            break
                    if last and not finish:  # vLLM's own end: max_tokens within the context
                        said, finish = seq.cut()
                        text += said
                    metrics.generated_tokens_total.labels(self._model).inc(len(picked))
                    self._say(seq, text, finish)
                    if finish:
                        return
        except Refused as exc:
            self._end_family(key, seq, error_reply(seq.entry, 400, "invalid_request", str(exc),
                                                   self._name))  # fmt: skip
        finally:
            self._sequences.pop(key, None)
            self._tasks.pop(key, None)
            metrics.running_sequences.labels(self._model).set(len(self._sequences))
            if not self._sequences:
                self._progress_s = self._clock()

    def _say(self, seq: Sequence, text: str, finish: str) -> None:
        if seq.family.ended:
            return
        chunk = seq.chunk(text, finish, self._name)
        replies = [chunk] if chunk is not None else []
        done: list[Done] = []
        if finish:
            event(seq.held.span, "finished", choice=seq.choice, reason=finish,
                  tokens=len(seq.generated), cached_tokens=seq.cached_tokens)  # fmt: skip
            seq.family.left -= 1
            if not seq.family.left:  # the last choice: the entry is answered
                seq.family.ended = True
                done.append((seq.held.stream, seq.held.entry_id))
        if replies or done:
            self._publisher.post(replies, done, until_ms=seq.entry.deadline_ms, ordered=True)
        if done:
            self._inbox.room_freed()

    def _end_family(self, key: int, seq: Sequence, reply: Reply) -> None:
        """Answer the entry with `reply` and stop every other choice of it (`key`'s own
        task is the one calling)."""
        for sibling in seq.family.keys:
            task = self._tasks.get(sibling)
            if task is not None and sibling != key:
                task.cancel()
        if not seq.family.ended:
            seq.family.ended = True
            self._publisher.post([reply], [(seq.held.stream, seq.held.entry_id)], ordered=True)
            self._inbox.room_freed()

    # ---- the loop --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Watch what is held for clients that left and deadlines, until `stop` and, after
        it, until every sequence held has finished; a dead choice task raises here."""
        while True:
            if self._failed is not None:
                raise RuntimeError("the vLLM engine failed") from self._failed
            self._drop_unwanted()
            if stop.is_set() and not self._inbox.reading and not self.held:
                return
            await self._inbox.wait(POLL_S if self._sequences or stop.is_set() else None)

    def _drop_unwanted(self) -> None:
        """Cancel the choices whose client left (ack only) or whose deadline passed (504)."""
        now_ms = wall_ms()
        unwanted = self._inbox.unwanted
        for key, seq in list(self._sequences.items()):
            left = unwanted(seq.entry.id, seq.entry.reply_to)
            if not left and seq.entry.deadline_ms > now_ms:
                continue
            self._sequences.pop(key)
            task = self._tasks.pop(key, None)
            if task is not None:
                task.cancel()  # aborts its vLLM request
            if seq.family.ended:
                continue
            seq.family.ended = True
            metrics.cancelled_total.inc()
            replies: list[Reply] = []
            if left:
                event(seq.held.span, "cancelled", reason="the client left")
            else:
                message = f"deadline passed after {len(seq.generated)} generated tokens"
                replies.append(error_reply(seq.entry, 504, "deadline_exceeded", message,
                                           self._name))  # fmt: skip
                event(seq.held.span, "deadline", reason=message)
            self._publisher.post(replies, [(seq.held.stream, seq.held.entry_id)], ordered=True)
            self._inbox.room_freed()

    async def finish(self) -> None:
        """Stop vLLM's engine once nothing is held (`run` has returned)."""
        await asyncio.to_thread(self._engine.shutdown)
