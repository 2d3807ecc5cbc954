"""The embedding model as one torch module, eager or as a checked TorchScript trace.

Eager torch takes the GIL back between ops, so on a CPU the event loop and the other compute
streams stall each batch's forward; a trace runs the whole forward in C++ without the GIL
(and without Python's per-op overhead, a third of a short text's forward here). A trace
records Python control flow for the shape it saw only, so it is checked against eager on
other shapes before it serves, and eager serves wherever tracing fails or disagrees.
"""

from __future__ import annotations

import logging
import warnings

import torch

from worker.embed.collate import collate
from worker.embed.runners.base import example_rows
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
    encoder: torch.nn.Module, pad_id: int, max_tokens: int, vocab_size: int, device: torch.device
) -> torch.jit.ScriptModule | None:
    """`encoder` traced, or None (logged) where tracing fails or the trace and eager disagree
    (cosine under TRACE_MIN_COSINE, or another shape) on batches of other sizes and lengths."""
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
                cos = torch.nn.functional.cosine_similarity(want, got, dim=-1).min().item()
                if not cos >= TRACE_MIN_COSINE:
                    log.warning("TorchScript trace disagrees with eager (cos %.6f); eager", cos)
                    return None
    except Exception as exc:  # a model the tracer cannot follow: eager still serves it
        log.warning("TorchScript tracing failed (%s); running eager", exc)
        return None
    log.info("the encoder runs as a TorchScript trace")
    return traced
