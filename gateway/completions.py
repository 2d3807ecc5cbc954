"""`POST /v1/completions`: OpenAI-compatible text generation, whole or streamed over SSE.

Each prompt becomes one `GenerateEntry` on its model's bucket stream (by prompt length). A
whole answer waits for one final chunk per prompt. A streamed answer relays every chunk as a
`data:` event and ends with `data: [DONE]`. When a worker dies mid-generation a peer starts
the prompt over under a new attempt: if nothing was streamed yet its chunks are relayed as
if nothing happened; otherwise the stream ends with an error event rather than repeat text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from common.buckets import bucket_for
from common.errors import (
    ContextLengthExceeded,
    DeadlineExceeded,
    InvalidRequest,
    MicrobatchError,
    ServiceUnavailable,
)
from common.protocol import (
    MAX_STOP_SEQUENCES,
    ErrorReply,
    GenerateEntry,
    GenerationChunk,
    encode,
    pack_tokens,
)
from gateway.app import (
    Call,
    Gateway,
    admit_or_refuse,
    api_call,
    parse_call,
    priority_of,
    timeout_ms_of,
    token_lists,
)
from gateway.catalog import ModelEntry
from gateway.schemas import CompletionRequest, GenerationParams
from gateway.waiting import ClientGone, await_replies

ROUTE = "/v1/completions"
COMPLETIONS_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": CompletionRequest.model_json_schema()}},
    }
}
MAX_STOP_CHARS = 256
CAUSAL_LM = "causal-lm"


def _stops(req: GenerationParams) -> list[str]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            f"stop has {len(stops)} sequences; at most {MAX_STOP_SEQUENCES}", param="stop"
        )
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"each stop sequence needs 1-{MAX_STOP_CHARS} characters", param="stop"
            )
    return stops


async def _prompts(gw: Gateway, model: ModelEntry, req: CompletionRequest) -> list[np.ndarray]:
    """Token ids per prompt; the context check comes with the tokens asked for."""
    try:
        return await token_lists(gw, model, req.prompt, field="prompt", check=False)
    except InvalidRequest as exc:  # the tokenizer speaks of input[i]; this route of prompt[i]
        exc.message = exc.message.replace("input", "prompt")
        exc.param = (exc.param or "prompt").replace("input", "prompt")
        raise


def new_token_limits(
    prompts: list[np.ndarray], asked: int | None, context: int, param: str = "max_tokens"
) -> list[int]:
    """New tokens per prompt: what was asked (checked against the context together with the
    prompt), or all the context leaves when nothing was asked."""
    limits = []
    for i, ids in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if len(ids) == 0:
            raise InvalidRequest(f"{where} is empty after tokenization", param=where)
        wanted = context - len(ids) if asked is None else asked
        if wanted < 1 or len(ids) + wanted > context:
            raise ContextLengthExceeded(
                f"{where} has {len(ids)} tokens and {param} is {wanted}: "
                f"{len(ids) + wanted} exceeds the model's context of {context} tokens",
                param=param,
            )
        limits.append(wanted)
    return limits


@dataclass(slots=True)
class _Submitted:
    ids: list[str]
    deadline_ms: int
    prompt_tokens: list[int]
    created: int = field(default_factory=lambda: int(time.time()))


def _entries(
    gw: Gateway,
    model: ModelEntry,
    req: GenerationParams,
    prompts: list[np.ndarray],
    new_tokens: list[int],
    timeout_ms: int,
    prio: int,
    request_id: str,
) -> tuple[_Submitted, list[tuple[str, bytes]]]:
    now_ms = int(time.time() * 1000)
    base = gw.next_id()
    stops = _stops(req)
    items, ids = [], []
    for i, (prompt, n_new) in enumerate(zip(prompts, new_tokens, strict=True)):
        entry = GenerateEntry(
            id=f"{base}.{i}",
            request_id=request_id,
            model=model.info.name,
            tokens=pack_tokens(prompt),
            deadline_ms=now_ms + timeout_ms,
            priority=prio,
            reply_to=gw.router.stream,
            enqueued_ms=now_ms,
            max_tokens=n_new,
            temperature=float(req.temperature),
            top_p=float(req.top_p),
            seed=-1 if req.seed is None else req.seed,
            stop=stops,
            stream=req.stream,
        )
        bucket = bucket_for(len(prompt), gw.settings.buckets) or gw.settings.buckets[-1]
        items.append((gw.keys.request(model.info.name, bucket), encode(entry)))
        ids.append(entry.id)
    submitted = _Submitted(ids, now_ms + timeout_ms, [len(p) for p in prompts])
    return submitted, items


def _raise_if_error(reply: GenerationChunk | ErrorReply) -> GenerationChunk:
    if isinstance(reply, ErrorReply):
        raise _as_error(reply)
    return reply


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


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
            choice: dict = {"index": index, "message": {"role": "assistant", "content": chunk.text}}
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


TEXT = Format(ROUTE, "cmpl-", "text_completion", "text_completion", chat=False)


def _whole_body(
    fmt: Format, request_id: str, name: str, sub: _Submitted, finals: list, with_ids: bool
) -> bytes:
    choices = [fmt.whole_choice(i, c, with_ids) for i, c in enumerate(finals)]
    body = {
        "id": f"{fmt.id_prefix}{request_id}",
        "object": fmt.whole_object,
        "created": sub.created,
        "model": name,
        "choices": choices,
        "usage": _usage(sum(sub.prompt_tokens), sum(c.completion_tokens for c in finals)),
    }
    return orjson.dumps(body)


async def completions(request: Request) -> Response:
    return await serve_generation(request, TEXT, CompletionRequest, _completion_prompts)


async def _completion_prompts(
    gw: Gateway, model: ModelEntry, req: CompletionRequest
) -> tuple[list[np.ndarray], list[int]]:
    prompts = await _prompts(gw, model, req)
    return prompts, new_token_limits(prompts, req.max_tokens, model.info.max_tokens)


async def serve_generation(request: Request, fmt: Format, schema: type, prepare) -> Response:
    """The shared path of both generation routes: `prepare` turns the validated body into
    token ids per prompt and new tokens per prompt; everything else is the same."""
    return await api_call(
        request, fmt.route, lambda call: _generate(request, call, fmt, schema, prepare)
    )


async def _generate(request: Request, call: Call, fmt: Format, schema: type, prepare) -> Response:
    gw, req, name, model = await parse_call(request, call, schema, CAUSAL_LM, "/v1/embeddings")
    request_id = call.request_id
    timeout_ms = timeout_ms_of(request, gw.settings.request_timeout_ms)
    prompts, new_tokens = await prepare(gw, model, req)
    admit_or_refuse(gw, model, len(prompts), timeout_ms)
    sub, items = _entries(
        gw, model, req, prompts, new_tokens, timeout_ms, priority_of(request), request_id
    )
    if req.stream:
        return _stream(gw, fmt, model.info.name, request_id, req, sub, items)
    futures = [gw.router.expect(i) for i in sub.ids]
    try:
        await gw.enqueuer.add(items)
        replies = await await_replies(request, futures, timeout_ms)
    except (ClientGone, DeadlineExceeded):
        gw.canceller.cancel(model.info.name, sub.ids, sub.deadline_ms)
        raise
    finally:
        gw.router.forget(sub.ids)
    finals = [_raise_if_error(r) for r in replies]
    return Response(
        _whole_body(fmt, request_id, name, sub, finals, req.return_token_ids),
        200,
        {
            "X-Request-ID": request_id,
            "X-Microbatch-Worker": ",".join({c.worker for c in finals}),
        },
        media_type="application/json",
    )


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


@dataclass(slots=True)
class _ChoiceState:
    attempt: str | None = None
    next_index: int = 0
    relayed: int = 0  # chunks sent to the client from the current attempt
    completion_tokens: int = 0
    finished: bool = False


class _Relay:
    """Turns the chunks of one request's prompts into SSE events, in order, then [DONE]."""

    def __init__(
        self,
        gw: Gateway,
        fmt: Format,
        name: str,
        request_id: str,
        req: GenerationParams,
        sub: _Submitted,
    ) -> None:
        self.gw, self.fmt, self.name, self.request_id, self.sub = gw, fmt, name, request_id, sub
        self.queue: asyncio.Queue = asyncio.Queue()
        self.states = {entry_id: _ChoiceState() for entry_id in sub.ids}
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.with_ids = req.return_token_ids
        for entry_id in sub.ids:
            gw.router.expect_stream(entry_id, self.queue)

    def _data(self, choices: list, **extra: object) -> bytes:
        body = {
            "id": f"{self.fmt.id_prefix}{self.request_id}",
            "object": self.fmt.chunk_object,
            "created": self.sub.created,
            "model": self.name,
            "choices": choices,
            **extra,
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"

    @staticmethod
    def _error(exc: MicrobatchError) -> bytes:
        return b"data: " + orjson.dumps(exc.body()) + b"\n\n"

    async def events(self, items: list[tuple[str, bytes]]) -> AsyncIterator[bytes]:
        try:
            await self.gw.enqueuer.add(items)
        except ServiceUnavailable as exc:
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
                yield self._data([], usage=_usage(sum(self.sub.prompt_tokens), completion))
        yield b"data: [DONE]\n\n"

    async def _next(self) -> GenerationChunk | ErrorReply:
        remaining_s = self.sub.deadline_ms / 1000 - time.time()
        try:
            reply = await asyncio.wait_for(self.queue.get(), max(0.0, remaining_s))
        except TimeoutError:
            raise DeadlineExceeded("the deadline passed while generating") from None
        if isinstance(reply, MicrobatchError):
            raise reply
        if isinstance(reply, ErrorReply):
            raise _as_error(reply)
        return reply

    def _relay(self, chunk: GenerationChunk) -> tuple[bytes, bool]:
        """The event for one chunk (maybe none) and whether the stream must end in error."""
        state = self.states[chunk.id]
        verdict = _follow(state, chunk)
        if verdict == "skip":
            return b"", False
        if verdict == "restarted":
            return self._error(_restarted(state)), True
        state.relayed += 1
        state.completion_tokens = chunk.completion_tokens
        if chunk.finish_reason:
            state.finished = True
            self.gw.router.answered(chunk.id)
        if not chunk.text and not chunk.finish_reason:
            return b"", False
        first = state.relayed == 1
        choice = self.fmt.event_choice(self.sub.ids.index(chunk.id), chunk, self.with_ids, first)
        return self._data([choice]), False

    def close(self) -> None:
        """However the stream ended: stop listening, and cancel what still generates."""
        unfinished = [i for i, s in self.states.items() if not s.finished]
        self.gw.router.forget(self.sub.ids)
        self.gw.canceller.cancel(self.name, unfinished, self.sub.deadline_ms)


def _stream(
    gw: Gateway,
    fmt: Format,
    name: str,
    request_id: str,
    req: GenerationParams,
    sub: _Submitted,
    items: list[tuple[str, bytes]],
) -> Response:
    relay = _Relay(gw, fmt, name, request_id, req, sub)
    return _CancellingStream(relay.events(items), relay.close, {"X-Request-ID": request_id})


def _follow(state: _ChoiceState, chunk: GenerationChunk) -> str:
    """What a chunk means for its choice: "relay", "skip" (a duplicate of one already
    relayed) or "restarted" (a new attempt after text of an earlier one was streamed)."""
    if state.attempt is None or (chunk.attempt != state.attempt and state.relayed == 0):
        state.attempt, state.next_index = chunk.attempt, 0
    if chunk.attempt != state.attempt:
        return "restarted"
    if chunk.index < state.next_index:
        return "skip"
    state.next_index = chunk.index + 1
    return "relay"


def _restarted(state: _ChoiceState) -> MicrobatchError:
    err = MicrobatchError(
        f"the worker generating this completion failed after {state.relayed} streamed chunks; "
        "a peer restarted it, so the text above is incomplete and would repeat: retry the request"
    )
    err.status, err.type, err.code = 502, "server_error", "worker_failed"
    return err


def _as_error(reply: ErrorReply) -> MicrobatchError:
    err = MicrobatchError(reply.message)
    err.status, err.type, err.code = reply.status, reply.type, reply.code
    return err
