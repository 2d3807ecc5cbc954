"""A response's events as server-sent events (`/v1/responses`), from either of its sources.

`live`: a response run in the foreground, its chunks routed to this gateway's reply stream as
every generation request's are; the stream ends when the response does, and what still
generates is cancelled if the client leaves first. `stored`: a background response, its
chunks read from its own stream in Redis, from the start or past `starting_after`, on any
gateway; leaving stops only the reading, never the run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi.responses import StreamingResponse

from common.errors import MicrobatchError
from common.streams import id_order
from gateway.responses.events import Events
from gateway.responses.store import TERMINAL, ResponseStore, stored_reply
from gateway.routes.answers import Submitted, hand_back
from gateway.services import Services
from gateway.submit import enqueue_within

Finished = Callable[[Events], Awaitable[None]]  # stores a response's end (`events.final`)
POLL_MS = 1000  # a stored stream's reader looks at the record at least this often


def sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class _Stream(StreamingResponse):
    """Server-sent events that always run their clean-up, however the stream ends."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def live(services: Services, events: Events, sub: Submitted, finished: Finished) -> _Stream:
    """Queue the response's entry and stream its events; `finished` stores the end."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    entry_id, model = sub.ids[0], sub.entries.model
    services.router.expect_stream(entry_id, queue, model)

    async def run() -> AsyncIterator[bytes]:
        for event in events.opening():
            yield sse(event)
        try:
            async for event in _answered(services, events, sub, queue):
                yield sse(event)
        finally:
            services.routes_answered(model, sub.owners)
            hand_back(services, sub, sum(sub.prompt_tokens) + events.fold.completion_tokens)
        if events.final is not None:
            await finished(events)

    def close() -> None:
        services.router.forget([entry_id])
        if events.final is None:
            services.canceller.cancel(model, [entry_id], sub.entries.deadline_ms)

    return _Stream(run(), close)


async def _answered(
    services: Services, events: Events, sub: Submitted, queue: asyncio.Queue[Any]
) -> AsyncIterator[dict[str, Any]]:
    """The events of the entry's replies, queued first; a refusal or the deadline ends the
    response failed."""
    entries = sub.entries
    try:
        await enqueue_within(services, entries.items, entries.deadline_ms, entries.timeout_ms)
        while events.final is None:
            remaining_s = entries.deadline_ms / 1000 - time.time()
            reply = await asyncio.wait_for(queue.get(), max(0.0, remaining_s))
            if isinstance(reply, MicrobatchError):
                raise reply
            for event in events.feed(reply, int(time.time())):
                yield event
    except TimeoutError:
        for event in events.failed("the deadline passed while generating"):
            yield event
    except MicrobatchError as exc:
        for event in events.failed(exc.message):
            yield event


def stored(
    responses: ResponseStore, events: Events, starting_after: int, finished: Finished
) -> _Stream:
    """A background response's events past `starting_after`, read from Redis until it ends
    (or is cancelled or deleted)."""
    response_id = events.who.response_id

    def shown(batch: list[dict[str, Any]]) -> list[bytes]:
        return [sse(e) for e in batch if e["sequence_number"] > starting_after]

    async def run() -> AsyncIterator[bytes]:
        for out in shown(events.opening()):
            yield out
        after = "0-0"
        while events.final is None:
            found = await responses.chunks(response_id, after, block_ms=POLL_MS)
            for entry in found:
                after = entry.entry_id
                for out in shown(
                    events.feed(stored_reply(entry.payload), id_order(after)[0] // 1000)
                ):
                    yield out
            ended = None if found else await _ended_elsewhere(responses, events)
            if ended is not None:
                for out in shown(ended):
                    yield out
                return
        await finished(events)

    return _Stream(run(), lambda: None)


async def _ended_elsewhere(responses: ResponseStore, events: Events) -> list[dict] | None:
    """Where the record says the response ended without its chunks saying so (cancelled,
    failed at its deadline, deleted): the events that end its stream; None while it runs."""
    record = await responses.get(events.who.response_id)
    if record is None:
        return []
    if record.get("status") not in TERMINAL or not record.get("object"):
        return None
    return events.end_with(orjson.loads(record["object"]))
