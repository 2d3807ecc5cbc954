"""`Sequence`: one prompt being generated here, from admission to its final answer.

It turns each new token into released text (detokenized, stop sequences held back) and a
finish reason, and packs what it has to say into a `GenerationChunk`: pure bookkeeping, no
engine, no Redis.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from common.protocol import GenerateEntry, GenerationChunk, encode, pack_tokens
from worker.generate.detokenize import IncrementalDetokenizer, StopMatcher
from worker.generate.sampling import Sampling
from worker.generate.scheduler import SeqView
from worker.intake import Held
from worker.replies import Reply


@dataclass(slots=True)
class Sequence:
    held: Held
    order: int
    sampling: Sampling
    detokenizer: IncrementalDetokenizer
    stopper: StopMatcher
    attempt: str  # names this try, so a gateway tells a restart from a duplicate
    ends: frozenset[int] = frozenset()  # tokens that end it: EOS (unless ignored), stop ids
    generated: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)  # tokens not yet in a chunk
    chunks: int = 0
    queue_ms: float = -1.0  # set when first scheduled
    last_token_s: float | None = None

    @classmethod
    def start(
        cls, held: Held, order: int, tokenizer: object, attempt: str, eos_ids: set[int]
    ) -> Sequence:
        entry = held.entry
        if not isinstance(entry, GenerateEntry):
            raise TypeError("a generation loop was handed an embedding entry: this is a bug")
        stop_ids = frozenset(entry.stop_ids().tolist())
        return cls(
            held=held,
            order=order,
            sampling=Sampling.of(entry, eos_ids),
            detokenizer=IncrementalDetokenizer(tokenizer, entry.token_ids()),
            stopper=StopMatcher(entry.stop),
            attempt=attempt,
            ends=stop_ids if entry.ignore_eos else stop_ids | eos_ids,
        )

    @property
    def entry(self) -> GenerateEntry:
        return self.held.entry  # type: ignore[return-value]  # checked in start()

    def view(self, key: int) -> SeqView:
        """Its length counts the newest token too: one more than its cache holds, a bound."""
        return SeqView(
            key, self.entry.n_tokens + len(self.generated), self.entry.priority, self.order
        )

    def tokens(self) -> np.ndarray:
        """The prompt and everything generated: what a preempted one re-prefills."""
        return np.concatenate([self.entry.token_ids(), np.asarray(self.generated, "<u4")])

    def advance(self, token: int, context: int) -> tuple[str, str]:
        """Take one token: the text it releases and the finish reason ("" while going on).
        An ending token (EOS, a stop id) adds no text."""
        self.generated.append(token)
        self.unsent.append(token)
        if token in self.ends:
            return self.stopper.add(self.detokenizer.flush())[0] + self.stopper.finish(), "stop"
        text, hit = self.stopper.add(self.detokenizer.add(token))
        if hit:
            return text, "stop"
        entry = self.entry
        at_limit = len(self.generated) >= entry.max_tokens
        if at_limit or entry.n_tokens + len(self.generated) >= context:
            flushed, hit = self.stopper.add(self.detokenizer.flush())
            text += flushed
            return (text, "stop") if hit else (text + self.stopper.finish(), "length")
        return text, ""

    def chunk(self, text: str, finish: str, worker: str) -> Reply | None:
        """What to send now: every release when streamed, else only the final answer."""
        entry = self.entry
        if not entry.stream:
            if not finish:
                return None
            text, tokens = self.stopper.text, self.generated
        elif not text and not finish:
            return None  # nothing to show yet: the tokens ride with the next chunk
        else:
            tokens = self.unsent
        chunk = GenerationChunk(
            id=entry.id,
            attempt=self.attempt,
            index=self.chunks,
            text=text,
            tokens=pack_tokens(tokens),
            finish_reason=finish,
            prompt_tokens=entry.n_tokens,
            completion_tokens=len(self.generated),
            queue_ms=self.queue_ms,
            worker=worker,
        )
        self.chunks += 1
        self.unsent = []
        return entry.reply_to, encode(chunk)
