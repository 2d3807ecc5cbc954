"""What one choice of a generation entry asks of vLLM's engine, and what its outputs mean here.

Pure translation, no vLLM import, so it is unit-tested without the engine:

- `sampling_options`: every option an entry carries, as `SamplingParams` keywords. Each
  option that changes the output reaches vLLM, or is kept here where this side enforces it
  alike for both engines: stop strings (`StopMatcher`, on the same detokenized text) and the
  context limit. The response format goes as its enforced JSON schema to vLLM's `guidance`
  backend, the same llguidance grammar the paged engine builds.
- `picks`: one streamed delta of vLLM's (token ids, log-probability dicts) as the `Picked`
  the loop's `Sequence` takes, so answers are built by the same code for both engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from common.protocol import GenerateEntry
from common.response_format import enforced_schema
from common.scores import Scores
from worker.generate.steps import Picked


class Logprob(Protocol):
    """vLLM's `Logprob`: one token's log probability (and its rank, not read here)."""

    logprob: float


TokenLogprobs = Mapping[int, Logprob]


def sampling_options(entry: GenerateEntry, choice: int, context: int) -> dict[str, Any]:
    """`SamplingParams` keywords for choice `choice` of `entry`. Choice c of a seeded entry
    draws from seed + c, as the paged engine's. vLLM generates at least one token: a prompt
    to score (`max_tokens` 0) takes one, which `Sequence.advance` drops."""
    bias_ids, biases = entry.logit_bias()
    room = max(1, context - entry.n_tokens)
    options: dict[str, Any] = {
        "n": 1,
        "temperature": entry.temperature,
        "top_p": entry.top_p,
        "top_k": entry.top_k,
        "min_p": entry.min_p,
        "presence_penalty": entry.presence_penalty,
        "frequency_penalty": entry.frequency_penalty,
        "repetition_penalty": entry.repetition_penalty,
        "seed": entry.seed + choice if entry.seed >= 0 else None,
        "max_tokens": min(max(1, entry.max_tokens), room),
        "min_tokens": entry.min_tokens,
        "stop_token_ids": [int(t) for t in entry.stop_ids()],
        "ignore_eos": entry.ignore_eos,
        "logit_bias": {int(t): float(b) for t, b in zip(bias_ids, biases, strict=True)} or None,
        "logprobs": entry.logprobs if entry.logprobs >= 0 else None,
        "prompt_logprobs": entry.prompt_logprobs if entry.prompt_logprobs >= 0 else None,
        "detokenize": False,  # text is made here, by the same detokenizer as the paged engine's
    }
    if entry.response_format:
        options["structured_json"] = enforced_schema(entry.response_format, entry.json_schema)
    return options


def picks(
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs] | None,
    k: int,
    *,
    first: bool = False,
    cached: int = -1,
    prompt: tuple[Sequence[int], Sequence[TokenLogprobs | None]] | None = None,
    prompt_k: int = -1,
) -> list[Picked]:
    """One delta's tokens, each with its scores when asked (`k` ≥ 0); the first delta of a
    request carries the prompt's cached length and, given its (tokens, dicts), its scores."""
    out = []
    for i, token in enumerate(token_ids):
        scores = token_scores([token], [logprobs[i]], k) if logprobs and k >= 0 else None
        head = first and i == 0
        out.append(
            Picked(
                int(token),
                scores,
                prompt=prompt_scores(*prompt, prompt_k) if head and prompt is not None else None,
                cached=cached if head else -1,
            )
        )
    return out


def token_scores(tokens: Sequence[int], dicts: Sequence[TokenLogprobs], k: int) -> Scores:
    """Each token's log probability and its `k` likeliest alternatives, likeliest first;
    vLLM adds the chosen token to its top k when it ranks below them."""
    chosen = np.array([d[t].logprob for t, d in zip(tokens, dicts, strict=True)], "<f4")
    ids = np.zeros((len(tokens), k), "<u4")
    values = np.zeros((len(tokens), k), "<f4")
    for row, d in enumerate(dicts):
        top = sorted(d.items(), key=lambda item: -item[1].logprob)[:k]
        ids[row, : len(top)] = [t for t, _ in top]
        values[row, : len(top)] = [lp.logprob for _, lp in top]
    return Scores(chosen, ids, values)


def prompt_scores(tokens: Sequence[int], dicts: Sequence[TokenLogprobs | None], k: int) -> Scores:
    """The prompt's scores; vLLM has none for its first token (NaN, as the paged engine's)."""
    rest = token_scores(tokens[1:], [d or {} for d in dicts[1 : len(tokens)]], k)
    return Scores(
        np.concatenate([np.full((1,), np.nan, "<f4"), rest.logprobs]),
        np.concatenate([np.zeros((1, k), "<u4"), rest.top_ids]),
        np.concatenate([np.full((1, k), np.nan, "<f4"), rest.top_logprobs]),
    )
