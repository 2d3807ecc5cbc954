"""Streamed generation over SSE: every chunk relayed as a `data:` event, then `data: [DONE]`.

When a worker dies mid-generation a peer starts the prompt over under a new attempt: if
nothing was streamed yet its chunks are relayed as if nothing happened; otherwise the stream
ends with an error event rather than repeat text. However the stream ends, what still
generates is cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import orjson
from fastapi.responses import Response, StreamingResponse

from common.errors import (
    DeadlineExceeded,
    MicrobatchError,
    ServiceUnavailable,
    WorkerFailed,
    error_from_reply,
)
from common.protocol import ErrorReply, GenerationChunk
from gateway.call_stream import CallStream
from gateway.routes.answers import Format, Submitted, hand_back, usage
from gateway.schemas import GenerationParams
from gateway.services import Services
from gateway.stream_order import ChoiceState, follow
from gateway.submit import enqueue_within


class _CancellingStream(StreamingResponse):
    """A streaming response that always runs its clean-up, however the stream ends."""

    def __init__(self, content: AsyncIterator[bytes], on_close, headers: dict) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Relay:
    """Turns the chunks of one request's prompts into SSE events, in order, then [DONE]."""

    def __init__(
        self,
        services: Services,
        fmt: Format,
        name: str,
        request_id: str,
        req: GenerationParams,
        sub: Submitted,
    ) -> None:
        self.services, self.fmt, self.name, self.request_id, self.sub = (
            services,
            fmt,
            name,
            request_id,
            sub,
        )
        self.queue: asyncio.Queue = asyncio.Queue()
        self.n = sub.shape.n
        self.states = {(i, c): ChoiceState() for i in sub.ids for c in range(self.n)}
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self._calls: dict[tuple[str, int], CallStream] = {}  # forced tool calls, per choice
        for entry_id in sub.ids:
            services.router.expect_stream(entry_id, self.queue, sub.entries.model)

    def _data(self, choices: list, **extra: object) -> bytes:
        body = {
            "id": f"{self.fmt.id_prefix}{self.request_id}",
            "object": self.fmt.chunk_object,
            "created": self.sub.created,
            "model": self.name,
            "system_fingerprint": self.sub.fingerprint,
            "choices": choices,
            **extra,
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"

    @staticmethod
    def _error(exc: MicrobatchError) -> bytes:
        return b"data: " + orjson.dumps(exc.body()) + b"\n\n"

    async def events(self, items: list[tuple[str, bytes]]) -> AsyncIterator[bytes]:
        try:
            async for event in self._events(items):
                yield event
        finally:
            self.services.routes_answered(self.sub.entries.model, self.sub.owners)
            generated = sum(s.completion_tokens for s in self.states.values())
            hand_back(self.services, self.sub, sum(self.sub.prompt_tokens) + generated)

    async def _events(self, items: list[tuple[str, bytes]]) -> AsyncIterator[bytes]:
        entries = self.sub.entries
        try:
            await enqueue_within(self.services, items, entries.deadline_ms, entries.timeout_ms)
        except (ServiceUnavailable, DeadlineExceeded) as exc:  # `close` cancels what landed
            yield self._error(exc)
            yield b"data: [DONE]\n\n"
            return
        while not all(s.finished for s in self.states.values()):
            try:
                out, failed = self._relay(await self._next())
            except MicrobatchError as exc:
                out, failed = self._error(exc), True
            if out:
                yield out
            if failed:
                break
        else:
            if self.include_usage:
                completion = sum(s.completion_tokens for s in self.states.values())
                hit = sum(s.cached_tokens for (_, c), s in self.states.items() if c == 0)
                yield self._data([], usage=usage(sum(self.sub.prompt_tokens), completion, hit))
        yield b"data: [DONE]\n\n"

    async def _next(self) -> GenerationChunk | ErrorReply:
        remaining_s = self.sub.entries.deadline_ms / 1000 - time.time()
        try:
            reply = await asyncio.wait_for(self.queue.get(), max(0.0, remaining_s))
        except TimeoutError:
            raise DeadlineExceeded("the deadline passed while generating") from None
        if isinstance(reply, MicrobatchError):
            raise reply
        if isinstance(reply, ErrorReply):
            raise error_from_reply(reply.status, reply.code, reply.message)
        return reply

    def _relay(self, chunk: GenerationChunk) -> tuple[bytes, bool]:
        """The event for one chunk (maybe none) and whether the stream must end in error."""
        state = self.states[(chunk.id, chunk.choice)]
        verdict = follow(state, chunk)
        if verdict == "skip":
            return b"", False
        if verdict == "restarted":
            return self._error(_restarted(state)), True
        if verdict == "gap":
            return self._error(_gap(state, chunk)), True
        if state.relayed == 0 and chunk.choice == 0 and self.sub.routed:
            names = self.sub.routed[self.sub.ids.index(chunk.id)]
            self.services.learn_route(names, chunk.worker)
        state.relayed += 1
        state.completion_tokens = chunk.completion_tokens
        state.cached_tokens = chunk.cached_tokens
        if chunk.finish_reason:
            state.finished = True
            if all(self.states[(chunk.id, c)].finished for c in range(self.n)):
                self.services.router.answered(chunk.id)
        if not chunk.text and not chunk.finish_reason:
            return b"", False
        prompt = self.sub.ids.index(chunk.id)
        index = prompt * self.n + chunk.choice
        if self.sub.shape.tools is not None:
            return self._held(index, chunk, state), False
        choice, state.offset = self.fmt.event_choice(
            index, chunk, self.sub.shape, prompt, state.offset
        )
        return self._data([choice]), False

    def _held(self, index: int, chunk: GenerationChunk, state: ChoiceState) -> bytes:
        """A choice read for tool calls: its role at once; a forced call streamed as its
        JSON grows (gateway/call_stream.py); free text whole when it ends (a call in it is
        known only then)."""
        tools = self.sub.shape.tools
        assert tools is not None
        first, state.offset = state.offset < 0, 0
        state.held += chunk.text
        role = {"role": "assistant", "content": ""}
        head = self._data([self._delta(index, role)]) if first else b""  # only the first
        calls = (
            self._calls.setdefault((chunk.id, chunk.choice), CallStream()) if tools.forced else None
        )
        deltas = calls.feed(chunk.text) if calls is not None else []
        if chunk.finish_reason and not (calls and calls.calls):  # no call streamed: read whole
            return head + self._data(
                [self.fmt.called(index, state.held, chunk, tools, False, False)]
            )
        if not deltas and not chunk.finish_reason:
            return head
        finish = None
        if chunk.finish_reason:  # a call cut by max_tokens says so, as OpenAI's do
            whole = chunk.finish_reason != "length" and tools.calls(state.held) is not None
            finish = "tool_calls" if whole else chunk.finish_reason
        delta = {"tool_calls": deltas} if deltas else {}
        return head + self._data([self._delta(index, delta, finish)])

    @staticmethod
    def _delta(index: int, delta: dict, finish: str | None = None) -> dict:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}

    def close(self) -> None:
        """However the stream ended: stop listening, and cancel what still generates."""
        unfinished = list({i for (i, _), s in self.states.items() if not s.finished})
        self.services.router.forget(self.sub.ids)
        self.services.canceller.cancel(self.name, unfinished, self.sub.entries.deadline_ms)


def stream(
    services: Services,
    fmt: Format,
    name: str,
    request_id: str,
    req: GenerationParams,
    sub: Submitted,
) -> Response:
    """Queue the entries and relay their chunks as SSE events, then [DONE]."""
    relay = _Relay(services, fmt, name, request_id, req, sub)
    headers = {"X-Request-ID": request_id}
    return _CancellingStream(relay.events(sub.entries.items), relay.close, headers)


def _gap(state: ChoiceState, chunk: GenerationChunk) -> WorkerFailed:
    return WorkerFailed(
        f"chunks {state.next_index}..{chunk.index - 1} of this completion never arrived (its "
        "replies were deleted unread), so the text above has a hole: retry the request"
    )


def _restarted(state: ChoiceState) -> WorkerFailed:
    return WorkerFailed(
        f"the worker generating this completion failed after {state.relayed} streamed chunks; "
        "a peer restarted it, so the text above is incomplete and would repeat: retry the request"
    )
