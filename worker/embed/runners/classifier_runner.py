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


def token_types(ids, separator: int):
    """Type ids as the tokenizer gave them for a pair: 0 up to and including the first
    separator, 1 after it (a single text has its only separator last: all 0)."""
    is_sep = (ids == separator).long()
    return ((is_sep.cumsum(1) - is_sep) >= 1).long()


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
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        if threads:
            torch.set_num_threads(threads)
        self._torch = torch
        self._device = torch.device(device)
        model = AutoModelForSequenceClassification.from_pretrained(
            files.path, dtype=getattr(torch, dtype)
        ).to(self._device)
        self._model = model.eval()
        # the weights' and the forward's, as loaded; answers are float32 whatever it is
        self.dtype = str(model.dtype).removeprefix("torch.")
        self._pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        self.dim = int(model.config.num_labels)
        separator = segment_separator(files.tokenizer_json)
        uses_types = int(getattr(model.config, "type_vocab_size", 0) or 0) > 1
        self._separator = separator if uses_types else None

    def embed(self, rows: Sequence[np.ndarray], threads: int | None = None) -> list[RowResult]:
        use_threads(threads)
        return isolate_failures(self._forward, rows)

    def _forward(self, rows: Sequence[np.ndarray]) -> list[np.ndarray]:
        from worker.embed.collate import collate

        torch = self._torch
        ids, mask = collate(rows, self._pad_id)
        ids, mask = ids.to(self._device), mask.to(self._device)
        extra = {}
        if self._separator is not None:
            extra["token_type_ids"] = token_types(ids, self._separator) * mask
        with torch.inference_mode():
            logits = self._model(input_ids=ids, attention_mask=mask, **extra).logits
        return list(logits.float().cpu().numpy())
