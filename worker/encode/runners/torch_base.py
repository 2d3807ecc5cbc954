"""`TorchModuleRunner`: what every torch runner of the encoding loop shares, whatever it
computes per row (a pooled vector, a classifier's logits).

The model is loaded by the subclass; from there the batch path is one: threads per batch,
rows padded to the batch's longest on the device's length grid with a mask, the forward
under `inference_mode`, float32 rows out, a failing row isolated from its batch-mates, and
the module optionally replaced by its checked TorchScript trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from worker.encode.runners.base import RowResult, isolate_failures
from worker.models import ModelFiles


def use_threads(threads: int | None) -> None:
    """Run this thread's torch ops on `threads` threads (None: as they are). torch's intra-op
    thread count belongs to the calling thread (its OpenMP team), so batches computing side
    by side on different threads may each have their own."""
    import torch

    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)


class TorchModuleRunner:
    concurrent = True  # inference only: the module is never written to

    def __init__(self, model: Any, files: ModelFiles, device: str) -> None:
        """Facts of a loaded `model` every batch needs; the subclass sets `_module`."""
        import torch

        from worker.encode.collate import length_multiple

        self._torch = torch
        self._device = torch.device(device)
        # the weights' and the forward's, as loaded; answers are float32 whatever it is
        self.dtype = str(model.dtype).removeprefix("torch.")
        self._pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        # padded lengths on the grid this device and dtype compile kernels for
        self._multiple = length_multiple(device, self.dtype)
        self._limit = files.max_tokens
        self._module: Any = None
        self.traced = False  # whether batches run as a TorchScript trace (free of the GIL)

    def _trace(self, model: Any, files: ModelFiles, agree: Callable | None = None) -> None:
        """Swap the module for its TorchScript trace, if the trace agrees with it."""
        from worker.encode.runners.encoder import trace_checked

        vocab = int(model.config.vocab_size)
        options = {} if agree is None else {"agree": agree}
        traced = trace_checked(
            self._module, self._pad_id, files.max_tokens, vocab, self._device, **options
        )
        if traced is not None:
            self._module, self.traced = traced, True

    def padded_width(self, longest: int) -> int:
        """The length a batch whose longest row has `longest` tokens is computed at (its
        grid, where one applies): what the batch metrics count as padded."""
        from worker.encode.collate import padded_length

        return padded_length(longest, self._multiple, self._limit)

    def embed(self, rows: Sequence[np.ndarray], threads: int | None = None) -> list[RowResult]:
        use_threads(threads)
        return isolate_failures(self._forward, rows)

    def _forward(self, rows: Sequence[np.ndarray]) -> list[np.ndarray]:
        from worker.encode.collate import collate

        ids, mask = collate(rows, self._pad_id, self._multiple, self._limit)
        with self._torch.inference_mode():
            out = self._module(ids.to(self._device), mask.to(self._device))  # (B, D)
        return list(out.float().cpu().numpy())
