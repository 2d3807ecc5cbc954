"""The `Runner` seam: one result or one failure per row, in order; a failing batch is bisected.

Runners (`torch_runner`, `onnx_runner`, `hybrid_runner`, `noop`) are called from the
worker's compute threads, never from the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

RowResult = np.ndarray | Exception


class Runner(Protocol):
    dim: int
    concurrent: bool  # batches may compute side by side, each on its own threads

    def embed(self, rows: Sequence[np.ndarray], threads: int | None = None) -> list[RowResult]:
        """One float32 vector, or the exception that input caused, per row; on `threads`
        threads where the runner can choose per call (None: as loaded)."""
        ...


def example_rows(lengths: Sequence[int], pad_id: int, vocab_size: int) -> list[np.ndarray]:
    """Rows of these lengths of in-vocabulary ids, never the pad id: inputs to check or time a
    model on when no real text is at hand."""
    ids = [np.arange(1, n + 1, dtype=np.int64) % vocab_size for n in lengths]
    return [np.where(r == pad_id, (pad_id + 1) % vocab_size, r) for r in ids]


def isolate_failures(
    run: Callable[[Sequence[np.ndarray]], list[np.ndarray]], rows: Sequence[np.ndarray]
) -> list[RowResult]:
    """Run the batch; if it raises, split it in halves until only the culprits fail."""
    try:
        out = run(rows)
    except Exception as exc:
        if len(rows) == 1:
            return [exc]
        mid = len(rows) // 2
        return isolate_failures(run, rows[:mid]) + isolate_failures(run, rows[mid:])
    if len(out) != len(rows):
        raise RuntimeError(
            f"runner returned {len(out)} results for {len(rows)} rows: this is a bug"
        )
    return list(out)
