"""Generation scheduling policy: which sequences join, and which pause, at the next step.

Iteration-level (continuous) batching, as in Orca, vLLM and TGI: every step decodes one token
for each running sequence; between steps finished sequences leave and waiting ones join while
the step's token budget, the running-sequence limit and the KV budget allow. The KV cache is
paged: a sequence holds whole blocks, so the budget bounds the sum of each sequence's length
rounded up to a block (counting shared prefix blocks once per owner: never more than the
pool holds). When it would be exceeded the newest sequences are paused (preempted) and later
recomputed from their prompt plus what they generated, mostly from the prefix cache;
nothing is dropped. A prompt's cached prefix costs the step budget nothing.

A pure function of plain numbers, like `batching.next_batch`: no torch, no Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.settings import Settings


@dataclass(frozen=True, slots=True)
class SeqView:
    """What the policy sees of one sequence."""

    key: int
    length: int  # tokens it holds in the KV cache (running) or its prompt (waiting)
    priority: int
    order: int  # arrival order; a preempted sequence keeps its own, so it rejoins first
    shares: int | None = None  # a sibling whose prefill it shares when both join at once
    cached: int = 0  # leading prompt tokens the prefix cache holds (waiting only)
    pending: int = 0  # running, its prompt not all prefilled yet: tokens still to compute
    # its prompt asks for scores: chunked even with chunked prefill off, since a prefill keeps
    # every position's whole-vocabulary logits (8k positions x 152k: ~5 GB in one step)
    scored: bool = False
    # redelivered (a worker may have died on it): it prefills in an engine running nothing
    # else, and nothing joins until its prefill is done
    alone: bool = False


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_running: int  # sequences decoding together
    step_tokens: int  # prefill plus decode tokens one step may compute
    kv_tokens: int  # KV cache positions, each sequence's rounded up to whole blocks
    block_size: int = 1
    chunked: bool = True  # a long prompt prefills over several steps, beside the decodes

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineLimits:
        return cls(
            settings.max_running_seqs,
            settings.max_step_tokens,
            settings.kv_cache_tokens,
            settings.kv_block_size,
            settings.chunked_prefill,
        )


@dataclass(frozen=True, slots=True)
class StepPlan:
    preempt: tuple[int, ...]  # running keys to pause, newest first
    admit: tuple[int, ...]  # waiting keys to prefill this step, in order
    # prompt tokens each key prefills this step, where capped (a chunk); others: all left
    budgets: dict[int, int] = field(default_factory=dict)


MIN_CHUNK = 32  # a smaller chunk of a waiting prompt is not worth starting it this step


def kv_usage(lengths: Sequence[int], block_size: int = 1) -> int:
    """Cache positions that sequences of these lengths hold: whole blocks each."""
    return sum(-(-n // block_size) for n in lengths) * block_size


def plan_step(
    running: Sequence[SeqView], waiting: Sequence[SeqView], limits: EngineLimits
) -> StepPlan:
    """Pause the newest while the next decode would overflow the KV budget; then admit.

    Waiting sequences join in priority, then arrival, order and never overtake one another,
    so a long prompt cannot be starved by a stream of short ones. The last running sequence
    is never paused (it could not make progress anywhere), and one sequence is always
    admitted into an idle engine, so every request is served. With chunked prefill a prompt
    larger than what is left of the step budget starts with a chunk of it and continues
    next step (prompts begun earlier first), as in vLLM and Sarathi: a step never grows past
    the budget, so running sequences keep their pace while long prompts arrive.
    """
    kept = sorted(running, key=lambda s: s.order)
    preempt: list[int] = []
    while (
        len(kept) > 1
        and kv_usage([s.length + 1 for s in kept], limits.block_size) > limits.kv_tokens
    ):
        preempt.append(kept.pop().key)
    if preempt:
        return StepPlan(tuple(preempt), ())

    step_tokens, budgets = _continue_prefills(kept, limits)
    admit = _admit(kept, waiting, limits, step_tokens, budgets)
    return StepPlan((), tuple(admit), budgets)


def _continue_prefills(kept: Sequence[SeqView], limits: EngineLimits) -> tuple[int, dict[int, int]]:
    """The step's tokens after the decodes and the prompts begun earlier (oldest first),
    and those prompts' chunks."""
    step_tokens = sum(1 for s in kept if not s.pending)
    budgets: dict[int, int] = {}
    for s in kept:
        if s.pending:
            budgets[s.key] = min(s.pending, max(0, limits.step_tokens - step_tokens))
            step_tokens += budgets[s.key]
    return step_tokens, budgets


def _admit(
    kept: Sequence[SeqView],
    waiting: Sequence[SeqView],
    limits: EngineLimits,
    step_tokens: int,
    budgets: dict[int, int],
) -> list[int]:
    """Waiting keys to admit in order, adding a chunk to `budgets` where one starts."""
    lengths = [s.length + 1 for s in kept]  # after this step's decode
    admit: list[int] = []
    if any(s.alone and s.pending for s in kept):
        return admit  # a lone prefill still running: nobody joins it
    queue = sorted(waiting, key=lambda s: (s.priority, s.order))  # interactive, batch, background
    for seq in queue:
        idle = not lengths
        if seq.alone and not (idle and not admit):
            break  # it waits for an idle engine; the queue behind it waits too (no overtaking)
        # a shared prefill costs once; a cached prefix nothing (its last token is computed)
        prefill = 0 if seq.shares in admit else seq.length - seq.cached
        room = limits.step_tokens - step_tokens
        if len(lengths) + 1 > limits.max_running:
            break
        if not idle and kv_usage([*lengths, seq.length], limits.block_size) > limits.kv_tokens:
            break
        if prefill > max(0, room):
            chunked = limits.chunked or seq.scored
            if chunked and (idle or room >= min(prefill, MIN_CHUNK)):
                budgets[seq.key] = prefill = max(1, room)  # a chunk now, the rest later
            elif not idle:
                break
        admit.append(seq.key)
        lengths.append(seq.length)
        step_tokens += prefill
        if seq.alone:
            break
    return admit


def prefill_groups(lengths: Sequence[int], max_padding: float = 0.1) -> list[list[int]]:
    """Indices of newcomers grouped for prefill: similar lengths together, so padding stays
    under `max_padding` of each group's tokens. A prefill is compute-bound on its own, so
    a group buys little and padding costs in full: groups are only ever as large as free."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group is not None:
            real = sum(lengths[j] for j in group) + lengths[i]
            padded = lengths[i] * (len(group) + 1)  # sorted: the newcomer is the longest
            if padded - real <= max_padding * padded:
                group.append(i)
                continue
        groups.append([i])
    return groups
