"""Log probabilities in the shapes clients read: legacy completions' and chat's.

The worker sends token ids with float32 scores; here each token becomes its text (decoded
alone, as vLLM shows it), -inf becomes vLLM's floor of -9999.0 (JSON has no infinity), and
the first prompt token, which nothing predicts, is null.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from common.protocol import Scores
from gateway.tokenize import ModelTokenizer

FLOOR = -9999.0


def _value(x: float) -> float | None:
    return None if math.isnan(x) else max(float(x), FLOOR)


def completion(
    tokenizer: ModelTokenizer, ids: Sequence[int] | np.ndarray, scores: Scores, offset: int
) -> tuple[dict, int]:
    """OpenAI's legacy `{tokens, token_logprobs, top_logprobs, text_offset}` for a run of
    tokens whose text starts at `offset`, and the offset after it. `top_logprobs` holds the
    chosen token and its k alternatives (so up to k + 1 entries, as OpenAI documents)."""
    pieces = [tokenizer.piece(int(t)) for t in ids]
    offsets = []
    for piece in pieces:
        offsets.append(offset)
        offset += len(piece)
    top: list[dict | None] = []
    for piece, value, alt_ids, alt_values in zip(
        pieces, scores.logprobs, scores.top_ids, scores.top_logprobs, strict=True
    ):
        if math.isnan(value):
            top.append(None)
            continue
        row = {piece: _value(value)}
        for alt, alt_value in zip(alt_ids, alt_values, strict=True):
            row.setdefault(tokenizer.piece(int(alt)), _value(alt_value))
        top.append(row)
    body = {
        "tokens": pieces,
        "token_logprobs": [_value(v) for v in scores.logprobs],
        "top_logprobs": top,
        "text_offset": offsets,
    }
    return body, offset


def joined(first: dict, second: dict) -> dict:
    """Two runs of legacy log probabilities as one (an echoed prompt, then the completion)."""
    return {key: first[key] + second[key] for key in first}


def chat(tokenizer: ModelTokenizer, ids: Sequence[int] | np.ndarray, scores: Scores) -> dict:
    """Chat's `{content: [{token, logprob, bytes, top_logprobs}], refusal}`."""
    content = []
    for token, value, alt_ids, alt_values in zip(
        ids, scores.logprobs, scores.top_ids, scores.top_logprobs, strict=True
    ):
        entry = _chat_token(tokenizer, int(token), value)
        entry["top_logprobs"] = [
            _chat_token(tokenizer, int(alt), alt_value)
            for alt, alt_value in zip(alt_ids, alt_values, strict=True)
        ]
        content.append(entry)
    return {"content": content, "refusal": None}


def _chat_token(tokenizer: ModelTokenizer, token: int, value: float) -> dict:
    piece = tokenizer.piece(token)
    return {"token": piece, "logprob": _value(value), "bytes": list(piece.encode())}


def empty() -> Scores:
    return Scores(np.zeros(0, "<f4"), np.zeros((0, 0), "<u4"), np.zeros((0, 0), "<f4"))
