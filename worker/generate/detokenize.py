"""Token ids to text, one step at a time, correct across multi-byte and merge boundaries.

`IncrementalDetokenizer` follows the prefix/read-offset scheme of TGI and vLLM: it decodes a
short window of ids and emits only what the newest ids added, holding text back while it ends
in U+FFFD (a character whose bytes are split across tokens). `StopMatcher` holds back the
last `len(longest stop) - 1` characters so a stop sequence is never partly streamed, and cuts
the text where one appears.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # prompt ids kept so the first new token decodes with its real spacing


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_tail: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = [int(i) for i in prompt_tail[-CONTEXT_TOKENS:]]
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token: int) -> str:
        """Append one id; return the text it completes (may be empty while bytes are split)."""
        self._ids.append(int(token))
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        full_text = self._tokenizer.decode(self._ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back, invalid bytes shown as U+FFFD."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        full_text = self._tokenizer.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]


class StopMatcher:
    """Finds the first stop sequence in the text so far; releases only text that is final."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._released = 0

    @property
    def text(self) -> str:
        return self._text

    def add(self, delta: str) -> tuple[str, bool]:
        """Add new text; return (text now safe to send, whether a stop sequence was hit)."""
        start = max(0, len(self._text) - self._hold)  # a stop may straddle old and new text
        self._text += delta
        hits = [at for stop in self._stops if (at := self._text.find(stop, start)) != -1]
        if hits:
            self._text = self._text[: min(hits)]
            return self._release(len(self._text)), True
        return self._release(len(self._text) - self._hold), False

    def finish(self) -> str:
        """Release everything held back: the sequence ended without a stop sequence."""
        return self._release(len(self._text))

    def _release(self, upto: int) -> str:
        upto = max(upto, self._released)
        out = self._text[self._released : upto]
        self._released = upto
        return out
