"""`CallStream`: a forced tool call's JSON turned into OpenAI's streamed `tool_calls` deltas
as it is generated: each call's id and name once its arguments begin, then the arguments
text in fragments as they grow, as OpenAI streams them.

It relies on what the grammar guarantees a forced answer (gateway/tool_calls.py): compact
JSON, `{"name":"…","arguments":{…}}`, or a list of those; so a call's header is recognised
by one pattern and its arguments end where their object's braces balance.
"""

from __future__ import annotations

import re
from typing import Any

from gateway.tool_calls import call_id

HEADER = re.compile(r'[\[,]?\{"name":"((?:[^"\\]|\\.)*)","arguments":')


class CallStream:
    """Feed a forced answer's text as it arrives; get the deltas it completes."""

    def __init__(self) -> None:
        self.text = ""
        self.at = 0  # where scanning resumes
        self.calls = 0  # calls begun
        self.in_arguments = False
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas `text` completes: a new call's header, argument fragments."""
        self.text += text
        out: list[dict[str, Any]] = []
        while self.at < len(self.text):
            if self.in_arguments:
                start = self.at
                self._scan_arguments()
                if self.at > start:
                    fragment = self.text[start : self.at]
                    out.append({"index": self.calls - 1, "function": {"arguments": fragment}})
                continue
            header = HEADER.match(self.text, self.at)
            if header is None:  # not whole yet, or between calls: the rest is structure
                if self._between_calls():
                    self.at += 1
                    continue
                break
            self.at = header.end()
            self.in_arguments, self.depth = True, 0
            self.calls += 1
            out.append(
                {
                    "index": self.calls - 1,
                    "id": call_id(),
                    "type": "function",
                    "function": {"name": header.group(1), "arguments": ""},
                }
            )
        return out

    def _between_calls(self) -> bool:
        """A character that closes a call or the list (`}`, `]`), never a call's start."""
        return self.text[self.at] in "}]" and not self.in_arguments

    def _scan_arguments(self) -> None:
        """Advance over the arguments' text; leave them once their braces balance."""
        while self.at < len(self.text):
            char = self.text[self.at]
            self.at += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.in_arguments = False
                    return
