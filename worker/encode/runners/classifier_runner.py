"""`ClassifierRunner`: a cross-encoder or classifier (…ForSequenceClassification), run by torch.

It serves through the embedding loop unchanged: a row is one text or one (query, document)
pair, already joined by the gateway's tokenizer ([CLS] q [SEP] d [SEP]); its "vector" is the
model's logits, one per label. The score function (sigmoid, softmax) is the gateway's to
apply, so a client may ask for raw logits without another forward.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from worker.encode.runners.torch_base import TorchModuleRunner
from worker.models import ModelFiles


def segment_separator(tokenizer_json: str) -> int | None:
    """The token that ends a pair's first segment, where the model gives segments their own
    type ids (BERT: [SEP]); None where it does not (RoBERTa, XLM-R: every type id is 0)."""
    encoding = Tokenizer.from_str(tokenizer_json).encode("a", "b")
    types = encoding.type_ids
    if 1 not in types:
        return None
    return int(encoding.ids[types.index(1) - 1])


class ClassifierRunner(TorchModuleRunner):
    """Rows of token ids in, one float32 logit per label out, padded to the batch's longest."""

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

        from worker.encode.runners.encoder import Scorer, same_values

        if threads:
            torch.set_num_threads(threads)
        model = AutoModelForSequenceClassification.from_pretrained(
            files.path, dtype=getattr(torch, dtype)
        )
        model = model.to(torch.device(device)).eval()
        super().__init__(model, files, device)
        self.dim = int(model.config.num_labels)
        separator = segment_separator(files.tokenizer_json)
        uses_types = int(getattr(model.config, "type_vocab_size", 0) or 0) > 1
        self._module = Scorer(model, separator if uses_types else None).eval()
        if torchscript:
            self._trace(model, files, agree=same_values)
