"""The embedding model (and a sequence classifier) as one torch module, eager or as a checked
TorchScript trace.

Eager torch takes the GIL back between ops, so on a CPU the event loop and the other compute
streams stall each batch's forward; a trace runs the whole forward in C++ without the GIL
(and without Python's per-op overhead, a third of a short text's forward here). A trace
records Python control flow for the shape it saw only, so it is checked against eager on
other shapes before it serves, and eager serves wherever tracing fails or disagrees.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import torch

from worker.encode.collate import collate
from worker.encode.runners.base import example_rows
from worker.models import Pooling

TRACE_MIN_COSINE = 0.9999  # the backends' bar against the reference
log = logging.getLogger("microbatch.worker")


class Encoder(torch.nn.Module):
    """A transformers encoder and its pooling: (input_ids, attention_mask) -> (B, D)."""

    def __init__(self, model: torch.nn.Module, pooling: Pooling) -> None:
        super().__init__()
        self.model = model
        self.pooling = pooling

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask)
        # pooled and normalised in float32 whatever the weights' dtype: a bfloat16 mean over
        # hundreds of tokens would lose more than the forward itself
        return pool(hidden.last_hidden_state.float(), attention_mask, self.pooling)


class Scorer(torch.nn.Module):
    """A sequence classifier: (input_ids, attention_mask) -> float32 logits (B, labels), its
    segment ids derived from the first `separator` where the model uses them (None: it does
    not), so it has the encoder's signature and the same checked trace serves it."""

    def __init__(self, model: torch.nn.Module, separator: int | None) -> None:
        super().__init__()
        self.model = model
        self.separator = separator

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        extra = {}
        if self.separator is not None:
            extra["token_type_ids"] = token_types(input_ids, self.separator) * attention_mask
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, **extra)
        return out.logits.float()


def token_types(ids: torch.Tensor, separator: int) -> torch.Tensor:
    """Type ids as the tokenizer gave them for a pair: 0 up to and including the first
    separator, 1 after it (a single text has its only separator last: all 0)."""
    is_sep = (ids == separator).long()
    return ((is_sep.cumsum(1) - is_sep) >= 1).long()


def same_direction(want: torch.Tensor, got: torch.Tensor) -> bool:
    """Embeddings agree when every row points the same way (cosine >= TRACE_MIN_COSINE)."""
    cos = torch.nn.functional.cosine_similarity(want, got, dim=-1).min().item()
    return cos >= TRACE_MIN_COSINE


def same_values(want: torch.Tensor, got: torch.Tensor) -> bool:
    """Logits agree value by value: a single logit has no direction to compare."""
    return torch.allclose(want, got, rtol=1e-4, atol=1e-5)


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """(B, T, D), (B, T) -> (B, D), over real tokens only: padding never reaches the vector."""
    if pooling.mode == "cls":
        out = hidden[:, 0]
    elif pooling.mode == "max":
        out = hidden.masked_fill(mask.unsqueeze(-1) == 0, torch.finfo(hidden.dtype).min).amax(1)
    else:
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        out = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(out, p=2, dim=1) if pooling.normalize else out


def _batch(lengths: list[int], pad_id: int, vocab_size: int, device: torch.device):
    """Rows of in-vocabulary ids (never the pad id) of these lengths, padded as a batch."""
    ids, mask = collate(example_rows(lengths, pad_id, vocab_size), pad_id)
    return ids.to(device), mask.to(device)


def trace_checked(
    encoder: torch.nn.Module,
    pad_id: int,
    max_tokens: int,
    vocab_size: int,
    device: torch.device,
    agree: Callable[[torch.Tensor, torch.Tensor], bool] = same_direction,
) -> torch.jit.ScriptModule | None:
    """`encoder` traced, or None (logged) where tracing fails or the trace and eager disagree
    (`agree` false, or another shape) on batches of other sizes and lengths."""
    longest = max(2, min(max_tokens, 96))
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's shape warnings: the check decides
            example = _batch([8, 5], pad_id, vocab_size, device)
            traced = torch.jit.trace(encoder, example, check_trace=False)
            for lengths in ([3], [longest, 7, 1]):
                ids, mask = _batch(lengths, pad_id, vocab_size, device)
                want, got = encoder(ids, mask), traced(ids, mask)
                if got.shape != want.shape:
                    log.warning("TorchScript trace changed the output shape; running eager")
                    return None
                if not agree(want, got):
                    log.warning("TorchScript trace disagrees with eager; running eager")
                    return None
    except Exception as exc:  # a model the tracer cannot follow: eager still serves it
        log.warning("TorchScript tracing failed (%s); running eager", exc)
        return None
    log.info("the model runs as a TorchScript trace")
    return traced
