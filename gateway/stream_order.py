"""What each streamed chunk means for its choice: relay it, skip it, or end the stream.

A choice's chunks carry their index within one worker's attempt. Relayed in order and
without a hole they make the answer; a duplicate (a redelivery) is skipped; a new attempt
after text was streamed, or a chunk past a missing one, would put wrong text in front of the
client, so the stream ends with an error instead. Pure: no HTTP, no Redis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol


class Chunk(Protocol):
    attempt: str
    index: int


Verdict = Literal["relay", "skip", "restarted", "gap"]


@dataclass(slots=True)
class ChoiceState:
    attempt: str | None = None
    next_index: int = 0
    relayed: int = 0  # chunks sent to the client from the current attempt
    completion_tokens: int = 0
    cached_tokens: int = 0
    finished: bool = False
    offset: int = -1  # legacy logprobs' text offset so far; -1 before the first event
    held: str = ""  # a chat choice read for tool calls: its text, sent once it ends


def follow(state: ChoiceState, chunk: Chunk) -> Verdict:
    """What a chunk means for its choice: "relay", "skip" (a duplicate of one already
    relayed), "restarted" (a new attempt after text of an earlier one was streamed) or
    "gap" (chunks before it never arrived: relaying it would stream text with a hole)."""
    if state.attempt is None or (chunk.attempt != state.attempt and state.relayed == 0):
        state.attempt, state.next_index = chunk.attempt, 0
    if chunk.attempt != state.attempt:
        return "restarted"
    if chunk.index < state.next_index:
        return "skip"
    if chunk.index > state.next_index:
        return "gap"
    state.next_index = chunk.index + 1
    return "relay"
