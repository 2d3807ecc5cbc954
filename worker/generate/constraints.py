"""Grammar-constrained decoding: one llguidance matcher per sequence, and the token mask it
puts on that sequence's row of a step's logits.

A matcher lives in the sequence's `Sampling`, so it follows the sequence through preemption
and resumption; it only ever sees the tokens the sequence took. Masks are computed row by
row inside the step, so a constrained sequence costs its own mask and nothing to the rows
beside it. Compiled grammars are cached by their text: a matcher for a schema seen before is
a copy (microseconds), not a compile.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

from common.response_format import StructureError, grammar

CACHED_GRAMMARS = 64
# 256 bytes x 8 bits: the additive penalty (0 or -inf) of each bit of a mask byte, so a
# mask applies as one gather and one add, with no branch per token (10x masked_fill_ here)
_PENALTY = np.where(
    (np.arange(256)[:, None] >> np.arange(8)) & 1, np.float32(0), np.float32(-np.inf)
).astype(np.float32)


class Constraint:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def mask(self, row: torch.Tensor) -> None:
        """Set every token the grammar forbids next to -inf in `row` (float32, in place)."""
        self._matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        penalty = _PENALTY[self._mask.view(np.uint8)].reshape(-1)[: row.numel()]
        row.add_(torch.from_numpy(penalty).to(row.device))

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows nothing more: the answer is whole."""
        return self._matcher.is_stopped()

    @property
    def failed(self) -> str:
        """Why the matcher gave up ("" while it has not): a bug, never the client's input."""
        return self._matcher.get_error() if self._matcher.is_error() else ""


class Grammars:
    """Compiles response formats for one model's tokenizer, keeping the latest compiled."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = sorted(eos_ids) or None
        self._tokenizer: LLTokenizer | None = None  # built on first use: ~0.2 s for 32k tokens
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()

    def constraint(self, kind: str, schema_text: str) -> Constraint:
        """A fresh matcher at the start of the grammar; `StructureError` if it cannot be."""
        text = grammar(kind, schema_text)
        template = self._compiled.get(text)
        if template is None:
            if self._tokenizer is None:
                self._tokenizer = LLTokenizer(
                    self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos
                )
            template = LLMatcher(self._tokenizer, text)
            if template.is_error():
                raise StructureError(template.get_error())
            self._compiled[text] = template
            if len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(text)
        return Constraint(template.deep_copy(), self._vocab_size)
