"""`ClassifierRunner`: a cross-encoder or classifier (…ForSequenceClassification), run by torch.

It serves through the embedding loop unchanged: a row is one text or one (query, document)
pair, already joined by the gateway's tokenizer ([CLS] q [SEP] d [SEP]); its "vector" is the
model's logits, one per label. The score function (sigmoid, softmax) is the gateway's to
apply, so a client may ask for raw logits without another forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer

from worker.embed.runners.base import RowResult, isolate_failures
from worker.embed.runners.torch_runner import use_threads
from worker.models import ModelFiles


def segment_separator(tokenizer_json: str) -> int | None:
    """The token that ends a pair's first segment, where the model gives segments their own
    type ids (BERT: [SEP]); None where it does not (RoBERTa, XLM-R: every type id is 0)."""
    encoding = Tokenizer.from_str(tokenizer_json).encode("a", "b")
    types = encoding.type_ids
    if 1 not in types:
        return None
    return int(encoding.ids[types.index(1) - 1])


class ClassifierRunner:
    """Rows of token ids in, one float32 logit per label out, padded to the batch's longest."""

    concurrent = True  # inference only: the module is never written to

    def __init__(
        self,
        files: ModelFiles,
        *,
        device: str = "cpu",
        threads: int | None = None,
        dtype: str = "float32",
        torchscript: bool = False,
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        from worker.embed.collate import length_multiple
        from worker.embed.runners.encoder import Scorer, same_values, trace_checked

        if threads:
            torch.set_num_threads(threads)
        self._torch = torch
        self._device = torch.device(device)
        model = AutoModelForSequenceClassification.from_pretrained(
            files.path, dtype=getattr(torch, dtype)
        ).to(self._device)
        model.eval()
        # the weights' and the forward's, as loaded; answers are float32 whatever it is
        self.dtype = str(model.dtype).removeprefix("torch.")
        self._pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        # padded lengths on the grid this device and dtype compile kernels for
        self._multiple = length_multiple(device, self.dtype)
        self._limit = files.max_tokens
        self.dim = int(model.config.num_labels)
        separator = segment_separator(files.tokenizer_json)
        uses_types = int(getattr(model.config, "type_vocab_size", 0) or 0) > 1
        self._score = Scorer(model, separator if uses_types else None).eval()
        self.traced = False  # whether batches run as a TorchScript trace (free of the GIL)
        if torchscript:
            vocab, pad = int(model.config.vocab_size), self._pad_id
            traced = trace_checked(
                self._score, pad, files.max_tokens, vocab, self._device, agree=same_values
            )
            if traced is not None:
                self._score, self.traced = traced, True

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

        ids, mask = collate(rows, self._pad_id, self._multiple, self._limit)
        with self._torch.inference_mode():
            logits = self._score(ids.to(self._device), mask.to(self._device))
        return list(logits.cpu().numpy())
