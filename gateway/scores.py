"""Pure policy for encoder answers: logits to scores, rankings, and matryoshka vectors.

Workers return a classifier's raw logits and an embedding model's vectors as the model gives
them; what a request asks of them (a score function, the top n, fewer dimensions, unit
length) is applied here, so no option needs another forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FUNCTIONS = ("sigmoid", "softmax", "identity")


def activate(logits: np.ndarray, function: str) -> np.ndarray:
    """(rows, labels) logits through `function`, as sentence-transformers' CrossEncoder
    applies it (softmax over each row's labels)."""
    logits = logits.astype(np.float64)
    if function == "sigmoid":
        out = 1.0 / (1.0 + np.exp(-logits))
    elif function == "softmax":
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        out = shifted / shifted.sum(axis=1, keepdims=True)
    elif function == "identity":
        out = logits
    else:
        raise ValueError(f"unknown score function {function!r}")
    result: np.ndarray = out.astype(np.float32)
    return result


def ranking(scores: Sequence[float], top_n: int | None) -> list[int]:
    """Indices by score, highest first (ties keep input order); the first `top_n`."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order if top_n is None else order[:top_n]


def shorten(vectors: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Matryoshka: the first `dimensions` of each vector, then unit length when `normalize`
    (a truncated unit vector is no longer one)."""
    out = vectors if dimensions is None else vectors[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out = out / np.maximum(norms, 1e-12)
    return np.ascontiguousarray(out, dtype=np.float32)
