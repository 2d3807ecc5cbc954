"""`Scores`: log probabilities of a run of tokens and of their likeliest alternatives.

Plain arrays, packed into and out of a `GenerationChunk`'s byte fields (`protocol`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Scores:
    """Log probabilities of a run of tokens and of each one's k likeliest alternatives."""

    logprobs: np.ndarray  # float32 [T]; NaN where there is none (a prompt's first token)
    top_ids: np.ndarray  # uint32 [T, k]
    top_logprobs: np.ndarray  # float32 [T, k]

    @classmethod
    def unpack(cls, logprobs: bytes, top_ids: bytes, top_logprobs: bytes) -> Scores | None:
        if not logprobs:
            return None
        values = np.frombuffer(logprobs, "<f4")
        k = len(top_ids) // 4 // len(values)
        return cls(
            values,
            np.frombuffer(top_ids, "<u4").reshape(len(values), k),
            np.frombuffer(top_logprobs, "<f4").reshape(len(values), k),
        )

    @classmethod
    def concat(cls, parts: list[Scores]) -> Scores:
        """Several runs' scores as one, in order (all with the same k)."""
        return cls(
            np.concatenate([p.logprobs for p in parts]),
            np.concatenate([p.top_ids for p in parts]),
            np.concatenate([p.top_logprobs for p in parts]),
        )

    def pack(self) -> dict[str, bytes]:
        """The three byte fields, as `GenerationChunk` names them (without a prefix)."""
        return {
            "logprobs": np.ascontiguousarray(self.logprobs, "<f4").tobytes(),
            "top_ids": np.ascontiguousarray(self.top_ids, "<u4").tobytes(),
            "top_logprobs": np.ascontiguousarray(self.top_logprobs, "<f4").tobytes(),
        }
