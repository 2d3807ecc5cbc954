"""How generation answers are shaped: legacy completions or chat, whole or as stream events."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import orjson

from common.protocol import GenerationChunk
from gateway.backlog_store import Reservation
from gateway.quota_store import Charge
from gateway.routes import logprobs
from gateway.services import Services
from gateway.submit import Entries
from gateway.tokenize import ModelTokenizer
from gateway.tool_calls import ToolUse


@dataclass(frozen=True, slots=True)
class Shape:
    """What one request asked of its answer beyond the text."""

    tokenizer: ModelTokenizer
    with_ids: bool = False  # vLLM's return_token_ids
    logprobs: int | None = None  # alternatives shown per token; None: no log probabilities
    echo: list[str] | None = None  # each prompt's text, when it is returned before the answer
    prompt_ids: list[np.ndarray] = field(default_factory=list)  # for an echo's logprobs
    n: int = 1  # choices returned per prompt
    candidates: int = 1  # choices generated per prompt (best_of); the n likeliest are returned
    tools: ToolUse | None = None  # chat with tools: answers are read for calls


@dataclass(frozen=True, slots=True)
class Format:
    """How a route shapes its answers: OpenAI's legacy completions, or chat."""

    route: str
    id_prefix: str
    whole_object: str
    chunk_object: str
    chat: bool

    def event_choice(
        self, index: int, chunk: GenerationChunk, shape: Shape, prompt: int, offset: int
    ) -> tuple[dict, int]:
        """One choice of a streamed event, and its text offset after it; a choice's first
        event names the role (chat) or carries the echoed prompt (completions)."""
        first = offset < 0
        offset = max(offset, 0)
        if self.chat:
            delta = {"role": "assistant"} if first else {}
            if chunk.text:
                delta["content"] = chunk.text
            choice: dict = {"index": index, "delta": delta}
        else:
            echo = shape.echo[prompt] if shape.echo is not None and first else ""
            choice = {"index": index, "text": echo + chunk.text}
        choice["logprobs"], offset = self._logprobs(chunk, shape, prompt, first, offset)
        return self._finish(choice, chunk, shape.with_ids), offset

    def whole_choice(self, index: int, chunk: GenerationChunk, shape: Shape, prompt: int) -> dict:
        if self.chat and shape.tools is not None:
            return self.called(index, chunk.text, chunk, shape.tools, whole=True)
        if self.chat:
            message = {"role": "assistant", "content": chunk.text, "refusal": None}
            choice: dict = {"index": index, "message": message}
        else:
            echo = shape.echo[prompt] if shape.echo is not None else ""
            choice = {"index": index, "text": echo + chunk.text}
        choice["logprobs"] = self._logprobs(chunk, shape, prompt, True, 0)[0]
        return self._finish(choice, chunk, shape.with_ids)

    def called(
        self, index: int, text: str, last: GenerationChunk, tools: ToolUse, whole: bool, first=True
    ) -> dict:
        """A chat choice whose whole `text` is read for calls: `tool_calls` where it holds
        them (finish_reason `tool_calls`), else the text as it is; streamed, one delta."""
        found = tools.calls(text) if last.finish_reason != "length" or tools.forced else None
        content, calls = found if found is not None else (text, [])
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.openai(None if whole else i) for i, c in enumerate(calls)]
        if whole:
            choice: dict = {"index": index, "message": {**message, "refusal": None}}
        else:
            delta = message if first else {k: v for k, v in message.items() if k != "role"}
            choice = {"index": index, "delta": {k: v for k, v in delta.items() if v is not None}}
        choice["logprobs"] = None
        # calls read from a list cut short by max_tokens still say it was cut
        cut = last.finish_reason == "length"
        choice["finish_reason"] = "tool_calls" if calls and not cut else last.finish_reason or None
        return choice

    def _logprobs(
        self, chunk: GenerationChunk, shape: Shape, prompt: int, first: bool, offset: int
    ) -> tuple[dict | None, int]:
        if shape.logprobs is None:
            return None, offset
        ids, scores = chunk.token_ids(), chunk.scores() or logprobs.empty()
        if self.chat:
            return logprobs.chat(shape.tokenizer, ids, scores), offset
        echoed = None
        prompt_scores = chunk.prompt_scores() if shape.echo is not None and first else None
        if prompt_scores is not None:
            echoed, offset = logprobs.completion(
                shape.tokenizer, shape.prompt_ids[prompt], prompt_scores, offset
            )
        body, offset = logprobs.completion(shape.tokenizer, ids, scores, offset)
        return (logprobs.joined(echoed, body) if echoed else body), offset

    @staticmethod
    def _finish(choice: dict, chunk: GenerationChunk, with_ids: bool) -> dict:
        choice["finish_reason"] = chunk.finish_reason or None
        if with_ids:
            choice["token_ids"] = chunk.token_ids().tolist()
        return choice


@dataclass(slots=True)
class Submitted:
    """One generation request's entries, as the relay and the whole answer need them."""

    entries: Entries
    prompt_tokens: list[int]
    shape: Shape
    fingerprint: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    routed: list[list[bytes]] = field(default_factory=list)  # per entry: its affinity names
    owners: list[str | None] = field(default_factory=list)  # per entry: the worker routed to
    charge: Charge | None = None  # its tenant's quota charge, settled when the answer ends
    reserved: Reservation | None = None  # its tenant's backlog held, released then too

    @property
    def ids(self) -> list[str]:
        return self.entries.ids


def hand_back(services: Services, sub: Submitted, used_tokens: int) -> None:
    """What an ended answer's tenant was held to: its tokens charge settled to what it used,
    its backlog released (each in the background; nothing for a call without a tenant)."""
    services.quotas.settle(sub.charge, used_tokens)
    services.backlogs.release(sub.reserved)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage, with the prompt tokens the prefix cache served as it reports them."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def cached(finals: list[GenerationChunk]) -> int:
    """Cached prompt tokens of a request: each prompt counted once, by its first choice."""
    return sum(c.cached_tokens for c in finals if c.choice == 0)


def best(finals: list[GenerationChunk], candidates: int, n: int) -> list[list[GenerationChunk]]:
    """Per prompt, the n choices of highest cumulative log probability, best first (the
    worker scores every token when best_of asks for more candidates than choices)."""
    out = []
    for start in range(0, len(finals), candidates):
        group = finals[start : start + candidates]
        if candidates > n:
            group = sorted(group, key=lambda c: -float(np.sum(c.scores().logprobs)))[:n]  # type: ignore[union-attr]
        out.append(group)
    return out


def whole_body(fmt: Format, request_id: str, name: str, sub: Submitted, finals: list) -> bytes:
    shape = sub.shape
    choices = [
        fmt.whole_choice(p * shape.n + c, chunk, shape, p)
        for p, group in enumerate(best(finals, shape.candidates, shape.n))
        for c, chunk in enumerate(group)
    ]
    body = {
        "id": f"{fmt.id_prefix}{request_id}",
        "object": fmt.whole_object,
        "created": sub.created,
        "model": name,
        "system_fingerprint": sub.fingerprint,
        "choices": choices,
        "usage": usage(
            sum(sub.prompt_tokens), sum(c.completion_tokens for c in finals), cached(finals)
        ),
    }
    return orjson.dumps(body)
