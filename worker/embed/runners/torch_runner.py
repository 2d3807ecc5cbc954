"""`TorchRunner`: a Hugging Face encoder run by torch, eager or as a checked TorchScript trace."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from worker.embed.runners.base import RowResult, isolate_failures
from worker.models import ModelFiles


def use_threads(threads: int | None) -> None:
    """Run this thread's torch ops on `threads` threads (None: as they are). torch's intra-op
    thread count belongs to the calling thread (its OpenMP team), so batches computing side
    by side on different threads may each have their own."""
    import torch

    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)


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
        dtype: str = "float32",
    ) -> None:
        import torch
        from transformers import AutoModel

        from worker.embed.collate import length_multiple
        from worker.embed.runners.encoder import Encoder, trace_checked

        if threads:
            torch.set_num_threads(threads)
        self._torch = torch
        self._device = torch.device(device)
        weights = getattr(torch, dtype)
        model = AutoModel.from_pretrained(files.path, dtype=weights).to(self._device)
        model.eval()
        # the weights' and the forward's, as loaded; answers are float32 whatever it is
        self.dtype = str(model.dtype).removeprefix("torch.")
        self._pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        # padded lengths on the grid this device and dtype compile kernels for
        self._multiple = length_multiple(device, self.dtype)
        self._limit = files.max_tokens
        self.dim = int(model.config.hidden_size)
        self._encode = Encoder(model, files.pooling).eval()
        self.traced = False  # whether batches run as a TorchScript trace
        if torchscript:
            vocab, pad = int(model.config.vocab_size), self._pad_id
            traced = trace_checked(self._encode, pad, files.max_tokens, vocab, self._device)
            if traced is not None:
                self._encode, self.traced = traced, True

    def padded_width(self, longest: int) -> int:
        """The length a batch whose longest row has `longest` tokens is computed at (its
        grid, where one applies): what the batch metrics count as padded."""
        from worker.embed.collate import padded_length

        return padded_length(longest, self._multiple, self._limit)

    def embed(self, rows: Sequence[np.ndarray], threads: int | None = None) -> list[RowResult]:
        use_threads(threads)
        return isolate_failures(self._forward, rows)

    def _forward(self, rows: Sequence[np.ndarray]) -> list[np.ndarray]:
        from worker.embed.collate import collate

        torch = self._torch
        ids, mask = collate(rows, self._pad_id, self._multiple, self._limit)
        with torch.inference_mode():
            pooled = self._encode(ids.to(self._device), mask.to(self._device))  # (B, D)
        return list(pooled.float().cpu().numpy())
