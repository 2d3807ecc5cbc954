"""Batching policy: a pure function of the local bucket queues, the clock and the limits.

`next_batch` answers "what should the model run now?" with a `Batch` or a `Wait`. A bucket
is ready when its next batch is full (`max_batch_size`), when the padded-token budget
(`max_batch_tokens`) stops it growing, when its oldest entry has waited `max_wait_s`, or when
it holds an interactive entry. `max_wait_s` is an upper bound, not a delay: with 0 every
bucket is ready the moment it holds anything. Batches never mix buckets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.protocol import PRIORITY_INTERACTIVE
from common.settings import Settings


@dataclass(frozen=True, slots=True)
class Waiting:
    """What the policy sees of one queued entry."""

    key: int  # the consumer's handle for the entry
    n_tokens: int
    arrived_s: float  # monotonic time the worker queued it
    priority: int


@dataclass(frozen=True, slots=True)
class Limits:
    max_batch_size: int
    max_batch_tokens: int  # padded: batch size x longest member
    max_wait_s: float

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(settings.max_batch_size, settings.max_batch_tokens, settings.max_wait_ms / 1000)

    def with_overrides(self, overrides: Mapping[str, str], min_tokens: int) -> Limits:
        """These limits with live overrides (`max_batch_size`, `max_batch_tokens`,
        `max_wait_ms` as strings, as an operator or `tune` wrote them). Raises ValueError
        naming the first bad value; unknown names are errors too, so typos do not pass."""
        size, tokens, wait_s = self.max_batch_size, self.max_batch_tokens, self.max_wait_s
        for name, raw in overrides.items():
            if name == "max_batch_size":
                size = int(raw)
            elif name == "max_batch_tokens":
                tokens = int(raw)
            elif name == "max_wait_ms":
                wait_s = float(raw) / 1000
            else:
                raise ValueError(f"unknown live batching setting {name!r}")
        if size < 1 or tokens < min_tokens or not wait_s >= 0:
            raise ValueError(
                f"live batching settings out of range: max_batch_size {size}, "
                f"max_batch_tokens {tokens} (at least {min_tokens}), max_wait_ms {wait_s * 1000}"
            )
        return Limits(size, tokens, wait_s)


@dataclass(frozen=True, slots=True)
class Batch:
    bucket: int
    keys: tuple[int, ...]
    padded_tokens: int
    real_tokens: int
    trigger: str  # size | tokens | wait | priority


@dataclass(frozen=True, slots=True)
class Wait:
    until_s: float | None  # None: nothing queued, wait for arrivals


def _take(queue: Sequence[Waiting], limits: Limits) -> tuple[list[Waiting], bool]:
    """Interactive entries first, then FIFO, while size and padded budget allow.

    Returns the members and whether the token budget (not the queue running out) stopped it.
    """
    ordered = sorted(queue, key=lambda w: (w.priority != PRIORITY_INTERACTIVE, w.arrived_s))
    members: list[Waiting] = []
    longest = 0
    for entry in ordered:
        if len(members) == limits.max_batch_size:
            break
        grown = max(longest, entry.n_tokens)
        if members and grown * (len(members) + 1) > limits.max_batch_tokens:
            return members, True
        members.append(entry)
        longest = grown
    return members, False


def _trigger(
    queue: Sequence[Waiting], members: list[Waiting], budget_hit: bool, now_s: float, limits: Limits
) -> str | None:
    if len(members) == limits.max_batch_size:
        return "size"
    if budget_hit:
        return "tokens"
    if any(w.priority == PRIORITY_INTERACTIVE for w in queue):
        return "priority"
    if now_s - min(w.arrived_s for w in queue) >= limits.max_wait_s:
        return "wait"
    return None


def next_batch(
    queues: Mapping[int, Sequence[Waiting]], now_s: float, limits: Limits
) -> Batch | Wait:
    """Pick the ready bucket with an interactive entry, else the one waiting longest."""
    best: tuple[tuple[bool, float], Batch] | None = None
    wake: float | None = None
    for bucket, queue in queues.items():
        if not queue:
            continue
        oldest = min(w.arrived_s for w in queue)
        members, budget_hit = _take(queue, limits)
        trigger = _trigger(queue, members, budget_hit, now_s, limits)
        if trigger is None:
            deadline = oldest + limits.max_wait_s
            wake = deadline if wake is None else min(wake, deadline)
            continue
        interactive = any(w.priority == PRIORITY_INTERACTIVE for w in queue)
        rank = (not interactive, oldest)
        longest = max(w.n_tokens for w in members)
        batch = Batch(
            bucket=bucket,
            keys=tuple(w.key for w in members),
            padded_tokens=longest * len(members),
            real_tokens=sum(w.n_tokens for w in members),
            trigger=trigger,
        )
        if best is None or rank < best[0]:
            best = (rank, batch)
    return best[1] if best is not None else Wait(wake)
