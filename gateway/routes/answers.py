"""How generation answers are shaped: legacy completions or chat, whole or as stream events."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import orjson

from common.protocol import GenerationChunk
from gateway.submit import Entries


@dataclass(frozen=True, slots=True)
class Format:
    """How a route shapes its answers: OpenAI's legacy completions, or chat."""

    route: str
    id_prefix: str
    whole_object: str
    chunk_object: str
    chat: bool

    def event_choice(self, index: int, chunk: GenerationChunk, with_ids: bool, first: bool):
        """One choice of a streamed event; a chat stream names the role in its first delta."""
        if self.chat:
            delta = {"role": "assistant"} if first else {}
            if chunk.text:
                delta["content"] = chunk.text
            choice: dict = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": chunk.text}
        return self._finish(choice, chunk, with_ids)

    def whole_choice(self, index: int, chunk: GenerationChunk, with_ids: bool) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": chunk.text, "refusal": None}
            choice: dict = {"index": index, "message": message}
        else:
            choice = {"index": index, "text": chunk.text}
        return self._finish(choice, chunk, with_ids)

    @staticmethod
    def _finish(choice: dict, chunk: GenerationChunk, with_ids: bool) -> dict:
        choice["logprobs"] = None
        choice["finish_reason"] = chunk.finish_reason or None
        if with_ids:
            choice["token_ids"] = chunk.token_ids().tolist()
        return choice


@dataclass(slots=True)
class Submitted:
    """One generation request's entries, as the relay and the whole answer need them."""

    entries: Entries
    prompt_tokens: list[int]
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def ids(self) -> list[str]:
        return self.entries.ids


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def whole_body(
    fmt: Format, request_id: str, name: str, sub: Submitted, finals: list, with_ids: bool
) -> bytes:
    choices = [fmt.whole_choice(i, c, with_ids) for i, c in enumerate(finals)]
    body = {
        "id": f"{fmt.id_prefix}{request_id}",
        "object": fmt.whole_object,
        "created": sub.created,
        "model": name,
        "choices": choices,
        "usage": usage(sum(sub.prompt_tokens), sum(c.completion_tokens for c in finals)),
    }
    return orjson.dumps(body)
