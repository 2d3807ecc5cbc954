"""How a worker spreads its cores over batches: streams, threads, the lone-batch boost."""

from __future__ import annotations

import pytest

from worker.compute_threads import free_stream
from worker.encode.parallelism import Parallelism


@pytest.mark.parametrize(
    ("cores", "streams", "threads"),
    [(1, 1, 1), (2, 2, 1), (4, 4, 1), (8, 2, 4), (16, 4, 4), (64, 16, 4)],
)
def test_auto_streams_per_core_count(cores: int, streams: int, threads: int) -> None:
    plan = Parallelism.choose(cores, "auto", None, concurrent_ok=True)
    assert (plan.streams, plan.threads_per_stream) == (streams, threads)
    assert plan.adaptive == (streams > 1)


def test_one_stream_where_batches_cannot_run_side_by_side() -> None:
    plan = Parallelism.choose(8, "auto", None, concurrent_ok=False)
    assert (plan.streams, plan.threads_per_stream, plan.adaptive) == (1, 8, False)
    assert Parallelism.choose(8, 4, None, concurrent_ok=False).streams == 1


def test_fixed_threads_turn_adaptation_off() -> None:
    plan = Parallelism.choose(2, "auto", 1, concurrent_ok=True)
    assert (plan.streams, plan.threads_per_stream, plan.adaptive) == (2, 1, False)
    assert plan.threads_for([], more_held=False) == 1


def test_a_lone_batch_with_nothing_else_queued_takes_every_core() -> None:
    plan = Parallelism.choose(2, "auto", None, concurrent_ok=True)
    assert plan.threads_for([], more_held=False) == 2


def test_under_load_batches_share_the_cores() -> None:
    plan = Parallelism.choose(2, "auto", None, concurrent_ok=True)
    assert plan.threads_for([], more_held=True) == 1
    assert plan.threads_for([1], more_held=True) == 1
    assert plan.threads_for([1], more_held=False) == 1
    assert plan.threads_for([1, 1], more_held=True) is None  # every stream busy


def test_a_batch_waits_while_a_lone_one_holds_every_core() -> None:
    """Never more threads than cores: the next batch starts when the lone one ends."""
    plan = Parallelism.choose(2, "auto", None, concurrent_ok=True)
    assert plan.threads_for([2], more_held=True) is None
    wide = Parallelism.choose(16, "auto", None, concurrent_ok=True)
    assert wide.threads_for([16], more_held=True) is None
    assert wide.threads_for([4, 4, 4], more_held=True) == 4


def test_a_wide_batch_runs_on_stream_zero_only() -> None:
    """Only one thread may ever run a batch on every core (libgomp's spinning)."""
    assert free_stream(set(), streams=2, wide=True) == 0
    assert free_stream({0}, streams=2, wide=True) is None
    assert free_stream({1}, streams=2, wide=True) == 0


def test_narrow_batches_leave_stream_zero_for_last() -> None:
    assert free_stream(set(), streams=4, wide=False) == 3
    assert free_stream({3, 2}, streams=4, wide=False) == 1
    assert free_stream({1, 2, 3}, streams=4, wide=False) == 0
    assert free_stream({0, 1, 2, 3}, streams=4, wide=False) is None
