"""`Sampling`: how one sequence picks its next token, and `sample` for a whole step.

The logits of a row go through the sequence's own processors: its grammar's mask (structured
output), then in vLLM's order logit_bias, min_tokens, repetition penalty, frequency and
presence penalties; then greedy argmax at temperature 0, else temperature, top_k, top_p and
min_p before a draw from the row's own generator, so a seeded sequence draws the same
whatever shares its batch. Penalties count
what the sequence generated, kept here, so a preempted sequence resumes with them intact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from common.protocol import GenerateEntry
from worker.generate.constraints import Constraint

CPU = "cpu"  # where a sequence's option tensors are kept; each use moves them to the row's
FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(slots=True)
class Sampling:
    temperature: float  # 0 = greedy
    top_p: float
    seed: int  # -1 = unseeded
    top_k: int = 0  # 0 = every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (token ids, biases)
    min_tokens: int = 0
    banned_early: torch.Tensor | None = None  # EOS (unless ignored) and stop ids
    prompt_ids: torch.Tensor | None = None  # distinct prompt ids, for the repetition penalty
    constraint: Constraint | None = None  # response_format's grammar, masked in first
    counts: dict[int, int] = field(default_factory=dict)  # generated token -> times
    generated: int = 0
    generator: torch.Generator | None = field(init=False, default=None)

    def _generator(self, device: torch.device) -> torch.Generator:
        """This sequence's random stream, on the device its logits live on (a CPU generator
        cannot draw from a CUDA tensor); seeded once, so a seeded draw is reproducible."""
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device)
            if self.seed >= 0:
                self.generator.manual_seed(self.seed)
            else:
                self.generator.seed()
        return self.generator

    @classmethod
    def of(
        cls,
        entry: GenerateEntry,
        eos_ids: set[int],
        choice: int = 0,
        constraint: Constraint | None = None,
    ) -> Sampling:
        """The options an entry carries; `eos_ids` are what min_tokens holds back. Choice c
        of a seeded entry draws from seed + c (as vLLM), so the whole set is reproducible."""
        bias_ids, biases = entry.logit_bias()
        early = set(entry.stop_ids().tolist()) | (set() if entry.ignore_eos else eos_ids)
        return cls(
            entry.temperature,
            entry.top_p,
            entry.seed + choice if entry.seed >= 0 else -1,
            top_k=entry.top_k,
            min_p=entry.min_p,
            presence_penalty=entry.presence_penalty,
            frequency_penalty=entry.frequency_penalty,
            repetition_penalty=entry.repetition_penalty,
            bias=(_ids(bias_ids), torch.from_numpy(biases.copy()).to(CPU))
            if len(bias_ids)
            else None,
            min_tokens=entry.min_tokens,
            banned_early=_ids(sorted(early)) if entry.min_tokens and early else None,
            prompt_ids=_ids(np.unique(entry.token_ids()))
            if entry.repetition_penalty != 1.0
            else None,
            constraint=constraint,
        )

    @property
    def adjusts(self) -> bool:
        """Whether any processor changes this row's logits."""
        return bool(
            self.constraint is not None
            or self.bias is not None
            or (self.banned_early is not None and self.generated < self.min_tokens)
            or self.repetition_penalty != 1.0
            or (self.counts and (self.presence_penalty or self.frequency_penalty))
        )

    def adjust(self, row: torch.Tensor) -> None:
        """Apply the processors to one row of float32 logits, in place, on its device: the
        options' tensors are kept on the CPU and moved to the row's device where used."""
        device = row.device
        if self.constraint is not None:
            self.constraint.mask(row)
        if self.bias is not None:
            row.index_add_(0, self.bias[0].to(device), self.bias[1].to(device))
        if self.banned_early is not None and self.generated < self.min_tokens:
            row[self.banned_early.to(device)] = float("-inf")
        if self.repetition_penalty != 1.0:
            seen = self._seen().to(device)
            values = row[seen]
            penalty = self.repetition_penalty
            row[seen] = torch.where(values > 0, values / penalty, values * penalty)
        if self.counts and (self.presence_penalty or self.frequency_penalty):
            ids = _ids(list(self.counts), device)
            times = torch.tensor(list(self.counts.values()), dtype=row.dtype, device=device)
            row[ids] -= times * self.frequency_penalty + self.presence_penalty

    def draw(self, row: torch.Tensor) -> int:
        """One token from the row at this sequence's temperature, top_k, top_p and min_p.
        Options at the edge of their range (a temperature or repetition penalty of 5e-324)
        would overflow the logits to inf, which softmax turns into NaN: the row is scaled
        from its maximum (the likeliest at 0, the rest at or below), an overflowed logit
        counts as the largest finite one, and a row with no finite distribution left gives
        its likeliest token, the limit those options tend to; never an exception that
        would take the worker and every sequence in its step down."""
        finite = torch.nan_to_num(row.float(), nan=float("-inf"), posinf=FLOAT32_MAX)
        scaled = (finite - finite.max()) / self.temperature  # the likeliest at 0: no overflow
        probs = torch.softmax(scaled, -1)
        if 0 < self.top_k < probs.numel():
            kth = probs.topk(self.top_k).values[-1]
            probs[probs < kth] = 0.0
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if self.min_p > 0:
            probs[probs < self.min_p * probs.max()] = 0.0
        if not bool(torch.isfinite(probs).all()) or not bool(probs.sum() > 0):
            return int(finite.argmax())
        return int(torch.multinomial(probs, 1, generator=self._generator(probs.device)))

    def took(self, token: int) -> None:
        self.generated += 1
        if self.constraint is not None:
            self.constraint.accept(token)
        if self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0:
            self.counts[token] = self.counts.get(token, 0) + 1

    def _seen(self) -> torch.Tensor:
        generated = _ids(list(self.counts))
        if self.prompt_ids is None:
            return generated
        return torch.unique(torch.cat([self.prompt_ids, generated]))


def _ids(values: object, device: torch.device | str = CPU) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64), device=device)


def sample(logits: torch.Tensor, settings: Sequence[Sampling]) -> tuple[list[int], dict[int, str]]:
    """One token per row (B, V): argmax at temperature 0, else a draw; each row's sequence
    records what it took. A row whose own processors or draw raise (its options, its
    grammar) fails alone: it is left out of the tokens' meaning and named, with why, in the
    second value, so one sequence cannot take its step's others, or its worker, down."""
    failed: dict[int, str] = {}
    if any(s.adjusts for s in settings):
        logits = logits.float().clone()
        for i, s in enumerate(settings):
            if s.adjusts:
                try:
                    s.adjust(logits[i])
                except Exception as exc:  # a sequence's own failure, isolated
                    failed[i] = f"{type(exc).__name__}: {exc}"
    out = logits.argmax(-1).tolist()
    for i, s in enumerate(settings):
        if i in failed:
            continue
        try:
            if s.temperature > 0:
                out[i] = s.draw(logits[i])
            s.took(out[i])
        except Exception as exc:  # as above
            failed[i] = f"{type(exc).__name__}: {exc}"
    return out, failed
