"""The continuous-batching policy: pure numbers in, a plan out; no torch, no Redis."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from common.protocol import PRIORITY_BACKGROUND, PRIORITY_BATCH, PRIORITY_INTERACTIVE
from worker.generate.scheduler import EngineLimits, SeqView, kv_usage, plan_step, prefill_groups

LIMITS = EngineLimits(max_running=4, step_tokens=100, kv_tokens=1000, chunked=False)
CHUNKED = EngineLimits(max_running=4, step_tokens=100, kv_tokens=1000, chunked=True)


def seq(key: int, length: int, order: int | None = None, priority: int = PRIORITY_BATCH) -> SeqView:
    return SeqView(key, length, priority, key if order is None else order)


def test_waiting_sequences_join_a_running_batch_while_the_limits_allow() -> None:
    plan = plan_step([seq(0, 10)], [seq(1, 30), seq(2, 30), seq(3, 30)], LIMITS)
    # decode 1 + 30 + 30 = 61 tokens; a third newcomer would make it 91 <= 100: allowed
    assert plan == plan.__class__((), (1, 2, 3), {})


def test_the_step_token_budget_stops_admission_in_arrival_order() -> None:
    plan = plan_step([seq(0, 10)], [seq(1, 60), seq(2, 10), seq(3, 60)], LIMITS)
    assert plan.admit == (1, 2)  # 3 would push the step past 100 tokens; 2 never overtakes 1


def test_a_long_prompt_is_not_overtaken_by_shorter_ones_behind_it() -> None:
    plan = plan_step([seq(0, 10)], [seq(1, 150), seq(2, 5)], LIMITS)
    assert plan.admit == ()  # 1 does not fit this step, and 2 may not jump the queue


def test_an_idle_engine_admits_one_sequence_even_past_the_step_budget() -> None:
    assert plan_step([], [seq(1, 500), seq(2, 5)], LIMITS).admit == (1,)


def test_choices_of_one_prompt_join_together_on_one_prefill() -> None:
    """Siblings share the first one's prefill, so they cost the step budget nothing more,
    even when the first fills it (an idle engine admits past the budget)."""
    siblings = [
        seq(1, 90),
        SeqView(2, 90, PRIORITY_BATCH, 2, 1),
        SeqView(3, 90, PRIORITY_BATCH, 3, 1),
    ]
    assert plan_step([seq(0, 5)], siblings, LIMITS).admit == (1, 2, 3)
    big = [seq(1, 500), SeqView(2, 500, PRIORITY_BATCH, 2, 1)]
    assert plan_step([], big, LIMITS).admit == (1, 2)
    alone = SeqView(2, 99, PRIORITY_BATCH, 2, 1)  # its sibling already runs: a prefill of its own
    assert plan_step([seq(0, 5), seq(1, 91)], [alone], LIMITS).admit == ()


def test_the_running_limit_caps_admission() -> None:
    running = [seq(i, 5) for i in range(3)]
    assert plan_step(running, [seq(7, 5), seq(8, 5)], LIMITS).admit == (7,)


def test_interactive_sequences_join_before_earlier_batch_ones() -> None:
    waiting = [seq(1, 10, order=1), seq(2, 10, order=2, priority=PRIORITY_INTERACTIVE)]
    assert plan_step([], waiting, EngineLimits(1, 100, 1000, chunked=False)).admit == (2,)


def test_the_newest_running_sequences_are_preempted_when_the_kv_budget_overflows() -> None:
    running = [seq(0, 300, order=0), seq(1, 300, order=1), seq(2, 300, order=2)]
    plan = plan_step(running, [seq(9, 5)], LIMITS)
    # 3 x 301 = 903 fits 1000; grow them to 400 and only two fit: 2 x 401 = 802
    assert plan.preempt == ()
    running = [seq(0, 400, order=0), seq(1, 400, order=1), seq(2, 400, order=2)]
    plan = plan_step(running, [seq(9, 5)], LIMITS)
    assert plan.preempt == (2,) and plan.admit == ()


def test_the_last_running_sequence_is_never_preempted() -> None:
    assert plan_step([seq(0, 5000)], [], LIMITS).preempt == ()


def test_a_preempted_sequence_rejoins_before_later_arrivals() -> None:
    waiting = [seq(5, 20, order=9), seq(2, 80, order=2)]  # 2 was preempted: it keeps order 2
    assert plan_step([], waiting, LIMITS).admit[0] == 2


@given(
    st.lists(st.integers(1, 400), max_size=6),
    st.lists(st.integers(1, 400), max_size=6),
)
def test_a_plan_never_exceeds_the_limits_once_something_runs(running: list, waiting: list) -> None:
    run = [seq(i, n) for i, n in enumerate(running)]
    wait = [seq(100 + i, n) for i, n in enumerate(waiting)]
    plan = plan_step(run, wait, LIMITS)
    kept = [s for s in run if s.key not in plan.preempt]
    joined = [s for s in wait if s.key in plan.admit]
    assert len(kept) + len(joined) <= max(LIMITS.max_running, len(run))
    if len(kept) > 1:
        assert kv_usage([s.length + 1 for s in kept]) <= LIMITS.kv_tokens
    if kept and joined:
        assert len(kept) + sum(s.length for s in joined) <= LIMITS.step_tokens
        assert kv_usage([*(s.length + 1 for s in kept), *(s.length for s in joined)]) <= 1000
    assert not (plan.preempt and plan.admit)


def test_prefill_groups_join_only_similar_lengths() -> None:
    lengths = [100, 16, 105, 200, 17, 18, 98]
    groups = prefill_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        real = sum(lengths[i] for i in group)
        padded = max(lengths[i] for i in group) * len(group)
        assert padded - real <= 0.1 * padded
    assert [sorted(g) for g in groups] == [[1, 4, 5], [0, 2, 6], [3]]


def test_a_long_prompt_starts_with_a_chunk_of_what_is_left_of_the_step() -> None:
    plan = plan_step([seq(0, 10)], [seq(1, 150), seq(2, 5)], CHUNKED)
    assert plan.admit == (1,) and plan.budgets == {1: 99}  # 2 still may not overtake 1


def test_a_prompt_begun_earlier_goes_on_first_then_newcomers_share_the_rest() -> None:
    filling = SeqView(1, 150, PRIORITY_BATCH, 1, pending=51)
    plan = plan_step([seq(0, 10), filling], [seq(2, 60)], CHUNKED)
    assert plan.budgets == {1: 51, 2: 48} and plan.admit == (2,)


def test_a_small_remainder_does_not_start_a_long_prompt() -> None:
    plan = plan_step(
        [seq(0, 10), SeqView(1, 150, PRIORITY_BATCH, 1, pending=80)], [seq(2, 60)], CHUNKED
    )
    assert plan.admit == ()  # 19 tokens left: below the smallest chunk worth starting


def test_an_idle_engine_starts_a_long_prompt_within_the_budget() -> None:
    plan = plan_step([], [seq(1, 500), seq(2, 5)], CHUNKED)
    assert plan.admit == (1,) and plan.budgets == {1: 100}


def test_a_prompt_asking_for_its_scores_is_chunked_even_with_chunked_prefill_off() -> None:
    scored = SeqView(1, 150, PRIORITY_BATCH, 1, scored=True)
    assert plan_step([seq(0, 10)], [scored], CHUNKED).budgets == {1: 99}  # beside a decode
    whole_prompts = replace(CHUNKED, chunked=False)
    assert plan_step([], [scored], whole_prompts).budgets == {1: 100}  # one chunk at a time
    assert plan_step([], [seq(2, 150)], whole_prompts).budgets == {}  # others: whole


@given(
    st.lists(st.tuples(st.integers(1, 400), st.integers(0, 400)), max_size=6),
    st.lists(st.integers(1, 400), max_size=6),
)
def test_a_chunked_step_never_exceeds_its_token_budget(running: list, waiting: list) -> None:
    run = [SeqView(i, n, PRIORITY_BATCH, i, pending=min(p, n)) for i, (n, p) in enumerate(running)]
    wait = [seq(100 + i, n) for i, n in enumerate(waiting)]
    plan = plan_step(run, wait, CHUNKED)
    if plan.preempt:
        return
    decodes = sum(1 for s in run if not s.pending)
    prefills = sum(plan.budgets.get(s.key, s.length) for s in wait if s.key in plan.admit) + sum(
        plan.budgets[s.key] for s in run if s.pending
    )
    if run or len(plan.admit) > 1:
        assert decodes + prefills <= max(CHUNKED.step_tokens, decodes)
    assert all(s.key in plan.budgets for s in run if s.pending)


def test_a_redelivered_prompt_prefills_in_an_engine_running_nothing_else() -> None:
    lone = SeqView(5, 40, PRIORITY_BATCH, 5, alone=True)
    behind = seq(6, 10)
    busy = plan_step([seq(0, 10)], [lone, behind], CHUNKED)
    assert busy.admit == ()  # it waits for the running one to end; nothing overtakes it
    idle = plan_step([], [lone, behind], CHUNKED)
    assert idle.admit == (5,)  # alone: nobody joins its step
    prefilling = replace(lone, pending=20)
    assert plan_step([prefilling], [behind], CHUNKED).admit == ()  # nor its next chunks
    decoding = replace(lone, alone=False)  # once it has its first token, others may join
    assert plan_step([decoding], [behind], CHUNKED).admit == (6,)


def test_background_sequences_join_after_every_online_one() -> None:
    waiting = [seq(1, 10, order=1, priority=PRIORITY_BACKGROUND), seq(2, 10, order=2)]
    assert plan_step([], waiting, EngineLimits(1, 100, 1000, chunked=False)).admit == (2,)


def test_kv_usage_rounds_each_sequence_up_to_whole_blocks() -> None:
    """Each length is rounded up to its own whole blocks, in positions; blocks of one by default."""
    assert kv_usage([5, 4, 1], 4) == 16  # 2 + 1 + 1 blocks of four
    assert kv_usage([3, 5]) == 8


def test_two_running_sequences_overflowing_the_kv_budget_pause_the_newer() -> None:
    """Preemption applies from two running sequences on: only the last one is never paused."""
    plan = plan_step([seq(0, 600), seq(1, 600)], [], LIMITS)
    assert plan == plan.__class__((1,), ())


def test_running_sequences_that_exactly_fill_the_kv_budget_after_the_decode_stay() -> None:
    """The KV budget holds each running sequence plus one token, inclusive: 2 x 500 = 1000."""
    plan = plan_step([seq(0, 499), seq(1, 499)], [], LIMITS)
    assert plan == plan.__class__((), (), {})


def test_preemption_counts_whole_kv_blocks() -> None:
    """Two sequences of 17 positions hold two blocks of 16 each: 64 > 48, so one is paused."""
    limits = EngineLimits(max_running=4, step_tokens=100, kv_tokens=48, block_size=16)
    assert plan_step([seq(0, 16), seq(1, 16)], [], limits).preempt == (1,)


WIDE = EngineLimits(max_running=4, step_tokens=1000, kv_tokens=1000, chunked=False)


def test_a_newcomer_exactly_filling_the_kv_budget_beside_the_next_decode_joins() -> None:
    """Admission counts running sequences one token longer, and the KV budget is inclusive."""
    assert plan_step([seq(0, 499)], [seq(1, 500)], WIDE).admit == (1,)  # 500 + 500
    assert plan_step([seq(0, 500)], [seq(1, 500)], WIDE).admit == ()  # 501 + 500 > 1000
    assert plan_step([seq(0, 499)], [seq(1, 501)], WIDE).admit == ()  # 500 + 501 > 1000


def test_an_idle_engine_admits_a_prompt_larger_than_the_kv_budget() -> None:
    """The KV check applies only beside running sequences: an idle engine takes anything."""
    assert plan_step([], [seq(1, 2000)], EngineLimits(4, 5000, 1000, chunked=False)).admit == (1,)


def test_admission_counts_whole_kv_blocks() -> None:
    """A decode at 16 (one block) and a 34-token prompt (three blocks) hold 64 > 60 positions."""
    limits = EngineLimits(max_running=4, step_tokens=100, kv_tokens=60, block_size=16)
    assert plan_step([seq(0, 15)], [seq(1, 34)], limits).admit == ()
    assert plan_step([seq(0, 15)], [seq(1, 32)], limits).admit == (1,)  # 16 + 32 = 48


def test_a_cached_prefix_costs_the_step_budget_nothing() -> None:
    """Only the uncached part of a prompt counts against the step's tokens: 1 + 22 <= 100."""
    cached = SeqView(1, 150, PRIORITY_BATCH, 1, cached=128)
    plan = plan_step([seq(0, 10)], [cached], LIMITS)
    assert plan.admit == (1,) and plan.budgets == {}


def test_a_one_token_prompt_waits_when_the_step_budget_is_spent() -> None:
    """With no token left beside the decodes, even a one-token prefill waits for the next step."""
    limits = EngineLimits(max_running=4, step_tokens=2, kv_tokens=1000)
    assert plan_step([seq(0, 10), seq(1, 10)], [seq(2, 1)], limits).admit == ()


def test_a_remainder_of_exactly_the_smallest_chunk_starts_a_long_prompt() -> None:
    """32 tokens left (the smallest chunk worth starting) is enough: the bound is inclusive."""
    filling = SeqView(1, 150, PRIORITY_BATCH, 1, pending=67)
    plan = plan_step([seq(0, 10), filling], [seq(2, 60)], CHUNKED)
    assert plan.admit == (2,) and plan.budgets == {1: 67, 2: 32}


def test_an_idle_engine_with_a_one_token_step_prefills_one_token_at_a_time() -> None:
    """A chunk is as large as the step allows, even a single token, never more."""
    limits = EngineLimits(max_running=4, step_tokens=1, kv_tokens=1000)
    plan = plan_step([], [seq(1, 5)], limits)
    assert plan.admit == (1,) and plan.budgets == {1: 1}


def test_prefill_groups_allow_padding_of_exactly_the_limit() -> None:
    """Padding equal to `max_padding` of the group's tokens still groups: 2 of 20 at 10 %."""
    assert prefill_groups([10, 8]) == [[1, 0]]
    assert prefill_groups([10, 7]) == [[1], [0]]  # 3 of 20: over the limit
