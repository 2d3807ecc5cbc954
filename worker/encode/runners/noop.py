"""`NoopRunner`: zero vectors without compute, so the whole queue path runs without a model."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np

from worker.encode.runners.base import RowResult, isolate_failures


class NoopRunner:
    """Zero vectors of a fixed size: measures the queue path itself.

    The knobs make it the fake runner of the fault tests: `compute_ms` simulates a model's
    time per batch; a row holding `fail_token` raises (a bad input inside a batch); a batch
    holding `crash_token` kills the process (a poison input that takes the worker down).
    One batch at a time, like the simplest model, so `compute_ms` is its whole capacity.
    """

    concurrent = False

    def __init__(
        self,
        dim: int,
        compute_ms: float = 0.0,
        fail_token: int | None = None,
        crash_token: int | None = None,
    ) -> None:
        self.dim = dim
        self._zero = np.zeros(dim, dtype=np.float32)
        self._compute_s = compute_ms / 1000
        self._fail_token = fail_token
        self._crash_token = crash_token

    def embed(self, rows: Sequence[np.ndarray], threads: int | None = None) -> list[RowResult]:
        if self._crash_token is not None and any((r == self._crash_token).any() for r in rows):
            os._exit(70)  # what a segfault or the OOM killer looks like from outside
        return isolate_failures(self._forward, rows)

    def _forward(self, rows: Sequence[np.ndarray]) -> list[np.ndarray]:
        if self._compute_s:
            time.sleep(self._compute_s)
        if self._fail_token is not None and any((r == self._fail_token).any() for r in rows):
            raise ValueError(f"input holds token {self._fail_token}")
        return [self._zero for _ in rows]
