"""Responses in Redis: each one's record, a background run's chunks, and the runs not yet done.

A record holds what any gateway needs to answer for the response or to continue its
conversation: its owner (an API key's digest: another key reads nothing), its identity, the
conversation's items and, once it ends, the `Response` itself. A background run's worker
writes its chunks straight into the response's own stream (its `reply_to`), so they outlive
the gateway that queued it; whichever gateway reads them first and sees the end writes the
final record, at most once (`_FINISH` keeps the first terminal status, a cancel's included).
"""

from __future__ import annotations

from typing import Any

import orjson

from common.keys import Keys
from common.protocol import ErrorReply, GenerationChunk, ProtocolError, decode
from common.store import Store, run_script
from common.streams import StreamEntry, entries_of

TERMINAL = ("completed", "incomplete", "failed", "cancelled")
# KEYS: record, events; ARGV: status, object, record ttl (s), events ttl (s), worker,
# terminal statuses...
_FINISH = """
local now = redis.call('hget', KEYS[1], 'status')
if not now then return 0 end
for i = 6, #ARGV do if now == ARGV[i] then return 0 end end
redis.call('hset', KEYS[1], 'status', ARGV[1], 'object', ARGV[2], 'worker', ARGV[5])
redis.call('expire', KEYS[1], ARGV[3])
if redis.call('exists', KEYS[2]) == 1 then redis.call('expire', KEYS[2], ARGV[4]) end
return 1
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class ResponseStore:
    def __init__(self, store: Store, keys: Keys) -> None:
        self._store, self._keys = store, keys

    def events_stream(self, response_id: str) -> str:
        return self._keys.response_events(response_id)

    async def put(self, response_id: str, record: dict[str, Any], ttl_s: int) -> None:
        """Store a response's record; a background one is also listed as running until its
        `deadline_ms`."""
        key = self._keys.response(response_id)
        mapping = {k: v if isinstance(v, str) else orjson.dumps(v) for k, v in record.items()}
        await self._store.hset(key, mapping=mapping)
        await self._store.expire(key, ttl_s)
        if record.get("background") == "1":
            await self._store.zadd(
                self._keys.active_responses, {response_id: int(record["deadline_ms"])}
            )

    async def get(self, response_id: str) -> dict[str, str] | None:
        raw = await self._store.hgetall(self._keys.response(response_id))
        return {_text(k): _text(v) for k, v in raw.items()} if raw else None

    async def finish(
        self,
        response_id: str,
        status: str,
        body: dict[str, Any],
        ttl_s: int,
        events_ttl_s: int,
        worker: str = "",
    ) -> bool:
        """Write the response's end (and the worker that answered it, which caches its
        conversation) unless it already has one; off the running list either way. Whether
        this call wrote it."""
        keys = [self._keys.response(response_id), self._keys.response_events(response_id)]
        args = [status, orjson.dumps(body), ttl_s, events_ttl_s, worker, *TERMINAL]
        wrote = await run_script(self._store, _FINISH, keys, args)
        await self._store.zrem(self._keys.active_responses, response_id)
        return bool(wrote)

    async def delete(self, response_id: str) -> None:
        await self._store.delete(self._keys.response(response_id))
        await self._store.delete(self._keys.response_events(response_id))
        await self._store.zrem(self._keys.active_responses, response_id)

    async def forget(self, response_id: str) -> None:
        """Off the running list (it ended, or its record is gone)."""
        await self._store.zrem(self._keys.active_responses, response_id)

    async def running(self, start: int, count: int) -> list[tuple[str, int]]:
        """Background responses not yet finished, soonest deadline first, from the
        `start`th: (id, deadline ms)."""
        key = self._keys.active_responses
        found = await self._store.zrange(key, start, start + count - 1, withscores=True)
        return [(_text(i), int(score)) for i, score in found]

    async def chunks(
        self, response_id: str, after: str = "0-0", block_ms: int | None = None, count: int = 512
    ) -> list[StreamEntry]:
        """The chunks stored after stream id `after`; with `block_ms`, waiting that long for
        one where there is none yet."""
        stream = self._keys.response_events(response_id)
        if block_ms is None:
            start = "-" if after == "0-0" else f"({after}"
            return entries_of(stream, await self._store.xrange(stream, start, "+", count=count))
        read = await self._store.xread({stream: after}, count=count, block=block_ms)
        return [e for name, found in read or [] for e in entries_of(name, found)]


def stored_reply(payload: bytes | None) -> GenerationChunk | ErrorReply:
    """A stored chunk; one Redis lost, or one this gateway cannot read, fails the response."""
    if payload is None:
        return _lost("a chunk of this response was lost")
    try:
        reply = decode(payload)
    except ProtocolError as exc:
        return _lost(f"a chunk of this response could not be read: {exc}")
    if not isinstance(reply, GenerationChunk | ErrorReply):
        return _lost("a reply that is not generation's reached this response")
    return reply


def _lost(message: str) -> ErrorReply:
    return ErrorReply(
        id="", status=500, type="server_error", code="server_error", message=message, worker=""
    )
