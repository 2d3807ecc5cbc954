"""Model runners: one result or one failure per row, in order; a failing batch is bisected.

`TorchRunner` runs a Hugging Face encoder; `NoopRunner` answers zero vectors without compute,
so the whole queue path can be exercised and measured without a model. Both are called from
the worker's single compute thread, never from the event loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from worker.models import ModelFiles

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


class TorchRunner:
    """A transformers encoder with the pooling its sentence-transformers config asks for."""

    concurrent = True  # inference only: the module is never written to

    def __init__(
        self,
        files: ModelFiles,
        *,
        device: str = "cpu",
        threads: int | None = None,
        torchscript: bool = False,
    ) -> None:
        import torch
        from transformers import AutoModel

        from worker.encoder import Encoder, trace_checked

        if threads:
            torch.set_num_threads(threads)
        self._torch = torch
        self._device = torch.device(device)
        model = AutoModel.from_pretrained(files.path, dtype=torch.float32).to(self._device)
        model.eval()
        self._pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        self.dim = int(model.config.hidden_size)
        self._encode = Encoder(model, files.pooling).eval()
        self.traced = False  # whether batches run as a TorchScript trace
        if torchscript:
            vocab, pad = int(model.config.vocab_size), self._pad_id
            traced = trace_checked(self._encode, pad, files.max_tokens, vocab, self._device)
            if traced is not None:
                self._encode, self.traced = traced, True

    def embed(self, rows: Sequence[np.ndarray], threads: int | None = None) -> list[RowResult]:
        # torch's intra-op thread count belongs to the calling thread (its OpenMP team), so
        # batches computing side by side on different threads may each have their own
        if threads is not None and threads != self._torch.get_num_threads():
            self._torch.set_num_threads(threads)
        return isolate_failures(self._forward, rows)

    def _forward(self, rows: Sequence[np.ndarray]) -> list[np.ndarray]:
        from worker.collate import collate

        torch = self._torch
        ids, mask = collate(rows, self._pad_id)
        with torch.inference_mode():
            pooled = self._encode(ids.to(self._device), mask.to(self._device))  # (B, D)
        return list(pooled.float().cpu().numpy())
