"""Log probabilities as clients ask for them: of each chosen token, and of its k likeliest
alternatives, for generated tokens and (with `echo`) for the prompt.

Values are the model's raw distribution: log-softmax of its logits in float32, before
logit_bias, penalties, temperature or top-k/top-p (vLLM's default, `raw_logprobs`). So a
token's log probability equals a plain transformers forward's `log_softmax`, whatever the
sampling options, and a scoring client (lm-evaluation-harness) gets the model's own numbers.
"""

from __future__ import annotations

import numpy as np
import torch

from common.protocol import Scores

CPU = "cpu"  # where scores are gathered for numpy


def token_scores(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[Scores | None]:
    """Per row of `logits` (R, V): the chosen token's scores with `ks[r]` alternatives, or
    None where the row's sequence asked for none (k < 0)."""
    wanted = [r for r, k in enumerate(ks) if k >= 0]
    out: list[Scores | None] = [None] * len(ks)
    if not wanted:
        return out
    logprobs = torch.log_softmax(logits[wanted].float(), -1)
    picked = torch.tensor([tokens[r] for r in wanted], device=logprobs.device)
    chosen = logprobs.gather(1, picked[:, None])[:, 0].cpu()
    k_max = max(ks[r] for r in wanted)
    top = _on_cpu(logprobs.topk(k_max, -1)) if k_max else None
    for j, r in enumerate(wanted):
        k = ks[r]
        out[r] = Scores(
            chosen[j : j + 1].cpu().numpy().astype("<f4"),
            _top(top.indices[j : j + 1, :k] if top is not None else None, 1, "<u4"),
            _top(top.values[j : j + 1, :k] if top is not None else None, 1, "<f4"),
        )
    return out


def prompt_scores(logits: torch.Tensor, following: np.ndarray, k: int, first: bool) -> Scores:
    """Scores of a run of prompt tokens from the prefill logits of the positions before them
    (R, V): row i scores `following[i]` (token i+1 is scored by position i's distribution).
    A prompt prefilled in chunks is scored chunk by chunk, so no step holds more than one
    chunk's logits (an 8k prompt's whole-vocabulary logits would be gigabytes). The prompt's
    first token has no distribution before it: with `first`, a NaN row (shown as null)
    leads."""
    rows = len(following)
    logprobs = torch.log_softmax(logits[:rows].float(), -1)
    device = logprobs.device
    picked = torch.from_numpy(following.astype(np.int64)).to(device)
    lead = 1 if first else 0
    nan = torch.full((lead,), float("nan"), device=device)
    chosen = torch.cat([nan, logprobs.gather(1, picked[:, None])[:, 0]]).cpu()
    if not k:
        return Scores(
            chosen.cpu().numpy().astype("<f4"),
            _top(None, rows + lead, "<u4"),
            _top(None, rows + lead, "<f4"),
        )
    top = _on_cpu(logprobs.topk(k, -1))
    values = torch.cat([torch.full((lead, k), float("nan"), device=CPU), top.values])
    indices = torch.cat([torch.zeros((lead, k), dtype=torch.long, device=CPU), top.indices])
    return Scores(
        chosen.cpu().numpy().astype("<f4"), _top(indices, 0, "<u4"), _top(values, 0, "<f4")
    )


def _top(values: torch.Tensor | None, rows: int, dtype: str) -> np.ndarray:
    if values is None:
        return np.zeros((rows, 0), dtype)
    return values.cpu().numpy().astype(dtype)


def _on_cpu(top: torch.return_types.topk) -> torch.return_types.topk:
    """A topk's values and indices on the CPU (one copy each), where numpy reads them."""
    return torch.return_types.topk((top.values.cpu(), top.indices.cpu()))
