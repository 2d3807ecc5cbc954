"""`Sequence`: one choice of one prompt being generated here, from admission to its answer.

It turns each new token into released text (detokenized, stop sequences held back) and a
finish reason, keeps the scores asked for, and packs what it has to say into a
`GenerationChunk`: pure bookkeeping, no engine, no Redis. An entry asking for `n` choices
becomes `n` sequences of one `Family`, which is answered (acked) when the last one ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from common.protocol import GenerateEntry, GenerationChunk, Scores, encode, pack_tokens
from worker.generate.detokenize import IncrementalDetokenizer, StopMatcher
from worker.generate.scheduler import SeqView
from worker.generate.steps import Picked
from worker.held import Held
from worker.replies import Reply, within_limit

if TYPE_CHECKING:  # its tensors stay in the loop and the engine
    from worker.generate.sampling import Sampling

log = logging.getLogger("microbatch.worker")


@dataclass(slots=True)
class Family:
    """The `n` choices of one entry: answered once, when the last of them ends."""

    keys: list[int]  # the sequences' keys, choice order
    left: int  # choices still generating
    ended: bool = False  # answered or dropped: nothing more is sent for the entry
    prompt: Scores | None = None  # the prompt's scores, once a prefill computed them


@dataclass(slots=True)
class Sequence:
    held: Held
    order: int
    sampling: Sampling
    detokenizer: IncrementalDetokenizer
    stopper: StopMatcher
    attempt: str  # names this try, so a gateway tells a restart from a duplicate
    family: Family
    choice: int = 0
    ends: frozenset[int] = frozenset()  # tokens that end it: EOS (unless ignored), stop ids
    generated: list[int] = field(default_factory=list)
    scores: list[Scores] = field(default_factory=list)  # per generated token, when asked
    sent: int = 0  # generated tokens already in a chunk
    chunks: int = 0
    queue_ms: float = -1.0  # set when first scheduled
    cached_tokens: int = -1  # prompt tokens its first prefill found cached; -1: not yet
    last_token_s: float | None = None

    @classmethod
    def start(
        cls,
        held: Held,
        order: int,
        tokenizer: object,
        attempt: str,
        eos_ids: set[int],
        family: Family,
        sampling: Sampling,
        choice: int = 0,
    ) -> Sequence:
        """`sampling` is made by the loop (`Sampling.of`: torch tensors), so this
        bookkeeping never imports torch."""
        entry = held.entry
        if not isinstance(entry, GenerateEntry):
            raise TypeError("a generation loop was handed an embedding entry: this is a bug")
        stop_ids = frozenset(entry.stop_ids().tolist())
        return cls(
            held=held,
            order=order,
            sampling=sampling,
            detokenizer=IncrementalDetokenizer(tokenizer, entry.token_ids()),
            stopper=StopMatcher(entry.stop),
            attempt=attempt,
            family=family,
            choice=choice,
            ends=stop_ids if entry.ignore_eos else stop_ids | eos_ids,
        )

    @property
    def entry(self) -> GenerateEntry:
        return self.held.entry  # type: ignore[return-value]  # checked in start()

    def view(self, key: int) -> SeqView:
        """Its length counts the newest token too: one more than its cache holds, a bound."""
        first = self.family.keys[0]
        shares = first if key != first and not self.generated else None
        return SeqView(
            key,
            self.entry.n_tokens + len(self.generated),
            self.entry.priority,
            self.order,
            shares,
            # the first choice, until its prefill has run once; its siblings then share it
            alone=self.held.alone and not self.generated and shares is None,
        )

    @property
    def fresh(self) -> bool:
        """Nothing generated yet: its prefill is its prompt's, shareable with its siblings."""
        return not self.generated

    def prompt_logprobs(self) -> int:
        """Alternatives per prompt token to compute at its prefill: only until computed once."""
        return self.entry.prompt_logprobs if self.family.prompt is None else -1

    def tokens(self) -> np.ndarray:
        """The prompt and everything generated: what a preempted one re-prefills."""
        return np.concatenate([self.entry.token_ids(), np.asarray(self.generated, "<u4")])

    def advance(self, picked: Picked, context: int) -> tuple[str, str]:
        """Take one token: the text it releases and the finish reason ("" while going on).
        An ending token (EOS, a stop id) adds no text. With `max_tokens` 0 (scoring a
        prompt) the prefill's token is not taken: it ends at once."""
        if picked.prompt is not None:
            self.family.prompt = picked.prompt
        if self.cached_tokens < 0 and picked.cached >= 0:
            self.cached_tokens = min(picked.cached, self.entry.n_tokens)
        if self.entry.max_tokens == 0:
            return "", "length"
        token = picked.token
        self.generated.append(token)
        if picked.scores is not None:
            self.scores.append(picked.scores)
        if token in self.ends:
            return self.stopper.add(self.detokenizer.flush())[0] + self.stopper.finish(), "stop"
        text, hit = self.stopper.add(self.detokenizer.add(token))
        if hit:
            return text, "stop"
        constraint = self.sampling.constraint
        if constraint is not None and (constraint.complete or constraint.failed):
            if constraint.failed:
                log.error("grammar matcher failed on %s: %s", self.entry.id, constraint.failed)
            flushed = self.stopper.add(self.detokenizer.flush())[0]
            return text + flushed + self.stopper.finish(), "stop"
        entry = self.entry
        at_limit = len(self.generated) >= entry.max_tokens
        if at_limit or entry.n_tokens + len(self.generated) >= context:
            flushed, reason = self.cut()
            return text + flushed, reason
        return text, ""

    def cut(self) -> tuple[str, str]:
        """End at a limit: the text still held back, and "stop" if it completes a stop
        sequence, else "length"."""
        flushed, hit = self.stopper.add(self.detokenizer.flush())
        return (flushed, "stop") if hit else (flushed + self.stopper.finish(), "length")

    def chunk(self, text: str, finish: str, worker: str) -> Reply | None:
        """What to send now: every release when streamed, else only the final answer."""
        entry = self.entry
        if not entry.stream:
            if not finish:
                return None
            text = self.stopper.text
        elif not text and not finish:
            return None  # nothing to show yet: the tokens ride with the next chunk
        tokens = self.generated[self.sent :]
        scores = self.scores[self.sent :]
        prompt = self.family.prompt if self.chunks == 0 else None
        chunk = GenerationChunk(
            id=entry.id,
            attempt=self.attempt,
            index=self.chunks,
            text=text,
            tokens=pack_tokens(tokens),
            finish_reason=finish,
            prompt_tokens=entry.n_tokens,
            completion_tokens=len(self.generated),
            cached_tokens=max(0, self.cached_tokens),
            queue_ms=self.queue_ms,
            worker=worker,
            choice=self.choice,
            **(Scores.concat(scores).pack() if scores else {}),
            **({f"prompt_{k}": v for k, v in prompt.pack().items()} if prompt else {}),
        )
        self.chunks += 1
        self.sent = len(self.generated)
        return within_limit((entry.reply_to, encode(chunk)), entry, worker)
