"""`ReplyRouter`: one reader per gateway process resolves the futures of waiting requests.

Waiting is cancelled on the future, never on a Redis command: the reader task alone talks
to the reply stream, so a cancelled request can never leave a reply unread on a connection.
The first reply for an id wins; later ones (redelivery after a worker crash) are counted.
A streamed generation instead gets a queue that receives every chunk for its id, in order,
until a final chunk or an error; its reader decides what a chunk from a new attempt means.
An entry of several choices is answered by `Choices`, a sink that resolves one future when
every choice has its final chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from redis.exceptions import RedisError

from common import metrics, streams
from common.backoff import Backoff
from common.clock import wall_ms
from common.errors import ServiceUnavailable, openai_type
from common.protocol import (
    EmbeddingResult,
    ErrorReply,
    GenerationChunk,
    ProtocolError,
    VersionMismatch,
    decode,
)
from common.settings_checks import GATEWAY_BEAT_MS
from common.store import Store

log = logging.getLogger("microbatch.gateway")

Reply = EmbeddingResult | GenerationChunk | ErrorReply
KEEP_ALIVE_EVERY_S = GATEWAY_BEAT_MS / 1000  # and the gateway's beat, for workers


class Sink(Protocol):
    """Where every reply for an id goes: a stream's queue, or a `Choices`."""

    def put_nowait(self, item: Reply | Exception) -> None: ...


class Choices:
    """Collects the final chunk of each of `n` choices of each entry; `future` resolves to
    them in (entry, choice) order, or fails with the first error. A choice's first final
    chunk wins (a restarted attempt's duplicate is ignored)."""

    def __init__(self, entry_ids: list[str], n: int) -> None:
        self.future: asyncio.Future[list[Reply]] = asyncio.get_running_loop().create_future()
        self._order = [(entry_id, c) for entry_id in entry_ids for c in range(n)]
        self._finals: dict[tuple[str, int], GenerationChunk] = {}

    def put_nowait(self, item: Reply | Exception) -> None:
        if self.future.done():
            return
        if isinstance(item, Exception):
            self.future.set_exception(item)
        elif isinstance(item, ErrorReply):
            self.future.set_result([item])  # the caller raises it
        elif isinstance(item, GenerationChunk) and item.finish_reason:
            self._finals.setdefault((item.id, item.choice), item)
            if len(self._finals) == len(self._order):
                self.future.set_result([self._finals[key] for key in self._order])


class ReplyRouter:
    def __init__(
        self, store: Store, stream: str, *, block_ms: int, ttl_s: int, keys: streams.Keys
    ) -> None:
        self.stream = stream
        self._store = store
        self._keys = keys
        self._block_ms = block_ms
        self._ttl_s = ttl_s
        self._waiting: dict[str, asyncio.Future[Reply]] = {}
        self._streams: dict[str, Sink] = {}
        # entry id -> (its model, the rows it carries): what each model's waiters hold
        self._holds: dict[str, tuple[str, int]] = {}
        self._rows_by_model: dict[str, int] = {}
        self._answered: dict[str, float] = {}  # recently resolved ids, to tell duplicates apart
        self._last_id = "0-0"
        self._trimmed = "0-0"  # the last id deleted from the stream (read and handled)
        self._read_total = 0  # replies read since this gateway started
        self._unpruned = 0  # of them, those still in the stream (the last read's)
        self._gone_before: int | None = None  # replies gone from the stream before it read

    def expect(self, entry_id: str, model: str, rows: int = 1) -> asyncio.Future[Reply]:
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting[entry_id] = future
        self._hold(entry_id, model, rows)
        return future

    def expect_stream(self, entry_id: str, queue: Sink, model: str) -> None:
        """Deliver every reply for `entry_id` into `queue` (one queue may serve many ids)."""
        self._streams[entry_id] = queue
        self._hold(entry_id, model, 1)

    def _hold(self, entry_id: str, model: str, rows: int) -> None:
        if entry_id not in self._holds:
            self._holds[entry_id] = (model, rows)
            self._rows_by_model[model] = self._rows_by_model.get(model, 0) + rows

    def forget(self, entry_ids: list[str]) -> None:
        for entry_id in entry_ids:
            self._waiting.pop(entry_id, None)
            self._streams.pop(entry_id, None)
            held = self._holds.pop(entry_id, None)
            if held is not None:
                self._rows_by_model[held[0]] -= held[1]

    def waiting(self, model: str) -> int:
        """Rows (an encoder entry's inputs, a generation's prompts) of `model` awaiting an
        answer here: admission weighs a model's backlog, not every model's (the soak saw
        chat refused against a bulk embedding in flight)."""
        return self._rows_by_model.get(model, 0)

    async def run(self, stop: asyncio.Event) -> None:
        """Read replies and resolve their waiters; each read first deletes what the one
        before it handed over (this reader is the stream's only one), so a reply stream
        holds only replies not yet read, however much traffic it answered."""
        backoff = Backoff()
        last_alive = 0.0
        while not stop.is_set():
            consumed = self._last_id if self._last_id != self._trimmed else None
            try:
                read = await streams.read_replies(
                    self._store,
                    self.stream,
                    self._last_id,
                    count=1000,
                    block_ms=self._block_ms,
                    consumed=consumed,
                )
                if consumed is not None:
                    self._trimmed = consumed
                self._read_total += len(read)
                self._unpruned = len(read)  # read; deleted by the next read's trim
                if time.monotonic() - last_alive > KEEP_ALIVE_EVERY_S:
                    await streams.keep_alive(
                        self._store, self._keys, self.stream, self._ttl_s, wall_ms()
                    )
                    last_alive = time.monotonic()
                    self._forget_old_answers()
                    await self._check_for_lost_replies()
                backoff.reset()
            except RedisError as exc:
                await backoff.wait(log, "reply read", exc)
                continue
            for item in read:
                self._last_id = item.entry_id
                self._resolve(item.payload)

    def _resolve(self, payload: bytes | None) -> None:
        try:
            reply = decode(payload or b"")
        except ProtocolError as exc:
            log.error("unreadable reply: %s", exc)
            if exc.id is None:
                return  # it names no request: nothing to answer
            reply = unreadable(exc.id, exc)
        if not isinstance(reply, EmbeddingResult | GenerationChunk | ErrorReply):
            log.error("dropping unexpected %s on the reply stream", type(reply).__name__)
            return
        stream = self._streams.get(reply.id)
        if stream is not None:
            stream.put_nowait(reply)
            return
        future = self._waiting.pop(reply.id, None)
        if future is None:
            if reply.id in self._answered:
                metrics.duplicate_replies_total.inc()
            return  # a duplicate, or its client is gone: nothing waits for it
        self._answered[reply.id] = time.monotonic()
        if not future.done():
            future.set_result(reply)

    def _forget_old_answers(self, horizon_s: float = 60.0) -> None:
        cutoff = time.monotonic() - horizon_s
        while self._answered:  # insertion order is time order: drop from the front
            oldest, answered_at = next(iter(self._answered.items()))
            if answered_at >= cutoff:
                break
            del self._answered[oldest]

    async def _check_for_lost_replies(self) -> None:
        """Every reply ever added was read by this gateway or is still in its stream, unless
        a writer's length bound deleted some unread: count them (entries-added is kept across
        deletions) and fail the waiters when any went missing."""
        counts = await streams.added_and_held(self._store, self.stream)
        if counts is None:
            return
        added, held = counts
        gone_unread = added - held - (self._read_total - self._unpruned)
        if self._gone_before is None:
            self._gone_before = gone_unread  # from before this gateway started: not its loss
        elif gone_unread > self._gone_before:
            self._gone_before = gone_unread
            self._lost_unread()

    def _lost_unread(self) -> None:
        """Replies this gateway had not read were deleted: which, no one can say, so every
        waiter now fails with a clear error rather than some waiting out their deadline."""
        log.error("replies on %s were deleted before they were read", self.stream)
        self.fail_all(
            ServiceUnavailable(
                "replies to this gateway were deleted before it read them (its reply stream "
                "passed reply_maxlen): retry the request",
                retry_after_s=1.0,
            )
        )

    async def leave(self) -> None:
        """Stopping for good: tell workers nobody reads this stream any more, so they drop
        what they still generate for it instead of running it to its deadline."""
        try:
            await streams.gateway_left(self._store, self._keys, self.stream, wall_ms())
        except RedisError as exc:  # they find it gone once its beat is stale
            log.warning("could not tell workers this gateway left: %s", exc)

    def answered(self, entry_id: str) -> None:
        """A stream's reader got its final chunk: later chunks for the id are duplicates."""
        self._streams.pop(entry_id, None)
        self._answered[entry_id] = time.monotonic()

    def fail_all(self, exc: Exception) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(exc)
        self._waiting.clear()
        self._holds.clear()
        self._rows_by_model.clear()
        for queue in {id(q): q for q in self._streams.values()}.values():
            queue.put_nowait(exc)
        self._streams.clear()


def unreadable(entry_id: str, exc: ProtocolError) -> ErrorReply:
    """The answer for a reply this gateway cannot read but which names its request: its
    waiter fails at once instead of at its deadline. A wire version this release does not
    read is a fleet mid-upgrade (503, retry); anything else a worker's bug (502)."""
    status, code = (
        (503, "version_mismatch") if isinstance(exc, VersionMismatch) else (502, "malformed_reply")
    )
    message = f"the worker's answer could not be read: {exc}"
    return ErrorReply(
        id=entry_id, status=status, type=openai_type(status), code=code, message=message,
        worker="",
    )  # fmt: skip
