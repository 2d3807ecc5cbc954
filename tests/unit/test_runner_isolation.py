"""A failing batch is bisected: only the inputs that fail get an error."""

from __future__ import annotations

import numpy as np
import pytest

from worker.encode.runners.base import isolate_failures
from worker.encode.runners.noop import NoopRunner


def doubling_that_fails_on(poison: set[int]):
    calls = []

    def run(rows):
        calls.append(len(rows))
        if any(int(r[0]) in poison for r in rows):
            raise ValueError("poison in batch")
        return [r * 2 for r in rows]

    return run, calls


def test_one_poisoned_row_fails_alone_and_its_batch_mates_succeed() -> None:
    rows = [np.array([i]) for i in range(8)]
    run, _ = doubling_that_fails_on({5})
    results = isolate_failures(run, rows)
    assert isinstance(results[5], ValueError)
    assert [int(r[0]) for i, r in enumerate(results) if i != 5] == [0, 2, 4, 6, 8, 12, 14]


def test_a_clean_batch_runs_once() -> None:
    run, calls = doubling_that_fails_on(set())
    isolate_failures(run, [np.array([i]) for i in range(8)])
    assert calls == [8]


def test_a_runner_returning_the_wrong_count_is_a_bug() -> None:
    with pytest.raises(RuntimeError, match="this is a bug"):
        isolate_failures(lambda rows: rows[:-1], [np.array([1]), np.array([2])])


def test_noop_runner_answers_a_fixed_size_zero_vector_per_row() -> None:
    out = NoopRunner(dim=7).embed([np.array([1, 2]), np.array([3])])
    assert len(out) == 2
    assert all(v.shape == (7,) and not v.any() for v in out)
