"""One response's text, read from its chunks across every attempt that generated it.

A worker that dies mid-generation is replaced by a peer that starts the entry over under a new
attempt. Where the chat route can only end such a stream in error, a response continues it:
its sampling is seeded (greedy, or a seed the gateway drew), so the new attempt says again
what the dead one said, and only what goes past it is new. Every attempt's text is followed
on its own (a slow worker's late chunks may interleave with its successor's); text is given
once, the first time any attempt says it. An attempt that says something else is a
divergence, and the response fails rather than show text that contradicts itself. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.protocol import ErrorReply, GenerationChunk


@dataclass(slots=True)
class _Attempt:
    text: str = ""
    next_index: int = 0


@dataclass(slots=True)
class Fold:
    said: str = ""  # text given so far
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    worker: str = ""
    error: dict[str, str] | None = None  # OpenAI's ResponseError: code and message
    attempts: dict[str, _Attempt] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return bool(self.finish_reason) or self.error is not None

    def feed(self, reply: GenerationChunk | ErrorReply) -> str:
        """The text this reply adds to what was said; "" when it adds none."""
        if self.done:
            return ""
        if isinstance(reply, ErrorReply):
            self.error = {"code": "server_error", "message": reply.message}
            return ""
        attempt = self.attempts.setdefault(reply.attempt, _Attempt())
        if reply.index < attempt.next_index:  # delivered twice
            return ""
        if reply.index > attempt.next_index:
            self._fail(f"chunks {attempt.next_index}..{reply.index - 1} never arrived")
            return ""
        attempt.next_index += 1
        attempt.text += reply.text
        if not _agree(attempt.text, self.said):
            self._fail(
                f"a worker restarted this response after {len(self.said)} characters and "
                "generated different text"
            )
            return ""
        new = attempt.text[len(self.said) :]
        self.said += new
        if reply.attempt == next(reversed(self.attempts)):  # not a dead attempt's late chunk
            self.prompt_tokens, self.worker = reply.prompt_tokens, reply.worker
            self.cached_tokens = reply.cached_tokens
        self.completion_tokens = max(self.completion_tokens, reply.completion_tokens)
        if reply.finish_reason:
            self.finish_reason = reply.finish_reason
            self.completion_tokens = reply.completion_tokens
        return new

    def _fail(self, why: str) -> None:
        self.error = {"code": "server_error", "message": why}

    @property
    def restarts(self) -> int:
        return max(0, len(self.attempts) - 1)


def _agree(text: str, said: str) -> bool:
    """One of the two is the start of the other."""
    return text.startswith(said) if len(text) >= len(said) else said.startswith(text)
