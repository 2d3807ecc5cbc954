"""What the engine and the loop hand each other per step: plain data, no torch.

`Admission` is a sequence going into the engine (its prompt, plus what it generated before a
preemption); `Picked` is what one step gave one sequence. The loop's bookkeeping
(`sequence`) reads them without importing the engine, so it is tested without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from common.scores import Scores

if TYPE_CHECKING:  # a Sampling holds torch tensors; its type is all this module needs
    from worker.generate.sampling import Sampling


@dataclass(frozen=True, slots=True)
class Admission:
    """A sequence to prefill: its prompt, plus what it generated before a preemption."""

    key: int
    tokens: np.ndarray
    sampling: Sampling
    logprobs: int = -1  # alternatives to report per generated token; -1: no scores
    prompt_logprobs: int = -1  # the same for its prompt tokens (needs every position's logits)
    same_as: int | None = None  # a newcomer of this step with the same tokens: share its prefill


@dataclass(frozen=True, slots=True)
class Picked:
    """What one step gave one sequence: its next token, and the scores it asked for."""

    token: int
    scores: Scores | None = None
    prompt: Scores | None = None  # its prompt's, from the prefill that admitted it
    cached: int = -1  # from a prefill: leading tokens the prefix cache held; -1: a decode
    # why the sequence's own processing failed (its options, its grammar): then `token`
    # means nothing, the engine has let the sequence go, and the loop answers it 500
    failed: str | None = None
