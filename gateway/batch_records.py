"""A batch's durable state in Redis: its record, each line's result, and who drives it.

Every fact a gateway needs to answer for a batch or to resume it lives here, so any gateway
serves any batch and a driver that dies loses nothing: a line's result is written once it
is known, keyed by its `custom_id` (a line run again after a crash replaces its own result,
never adds a second), and the lease says which gateway drives it now. The record's `status`
is written only by the driver; a cancel sets `cancelling_at`, which the driver acts on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import orjson

from common.keys import Keys
from common.store import Store, pipeline

TERMINAL = ("completed", "failed", "expired", "cancelled")
_COUNTED = ("total", "completed", "failed")
_TIMES = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)
_RENEW = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
)
_RELEASE = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('del', KEYS[1]) else return 0 end"
)


def new_batch_id() -> str:
    return "batch_" + os.urandom(12).hex()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def batch_object(record: Mapping[str, str]) -> dict[str, Any]:
    """OpenAI's `Batch` object from a stored record: `cancelling` while a cancel asked for
    is not yet done."""
    status = record["status"]
    if record.get("cancelling_at") and status not in TERMINAL:
        status = "cancelling"
    body: dict[str, Any] = {
        "id": record["id"],
        "object": "batch",
        "endpoint": record["endpoint"],
        "errors": orjson.loads(record["errors"]) if record.get("errors") else None,
        "input_file_id": record["input_file_id"],
        "completion_window": record["completion_window"],
        "status": status,
        "output_file_id": record.get("output_file_id") or None,
        "error_file_id": record.get("error_file_id") or None,
        "request_counts": {name: int(record.get(name) or 0) for name in _COUNTED},
        "metadata": orjson.loads(record["metadata"]) if record.get("metadata") else None,
    }
    for name in _TIMES:
        body[name] = int(record[name]) if record.get(name) else None
    return body


def summarize(records: list[dict[str, str]]) -> tuple[dict[str, int], dict[str, int]]:
    """Batches by the status a client sees, and their lines pending, answered and failed."""
    statuses: dict[str, int] = {}
    lines = {"pending": 0, "answered": 0, "failed": 0}
    for record in records:
        status = batch_object(record)["status"]
        statuses[status] = statuses.get(status, 0) + 1
        total, done, failed = (int(record.get(n) or 0) for n in _COUNTED)
        lines["answered"] += done
        lines["failed"] += failed
        lines["pending"] += max(0, total - done - failed)
    return statuses, lines


class BatchRecords:
    def __init__(self, store: Store, keys: Keys) -> None:
        self._store, self._keys = store, keys

    async def create(self, record: Mapping[str, str], kept_s: int) -> None:
        """Store a new batch. A batch is gone at most `kept_s` after its creation (its
        window, then its finished record's TTL), so the owner's index drops older ids here:
        it never grows without bound."""
        batch_id, owner, created = record["id"], record["owner"], int(record["created_at"])
        await self._store.hset(self._keys.batch(batch_id), mapping=dict(record))
        index = self._keys.batches(owner)
        await self._store.zadd(index, {batch_id: created})
        await self._store.zremrangebyscore(index, 0, created - kept_s - 1)  # whole seconds
        await self._store.sadd(self._keys.active_batches, batch_id)

    async def get(self, batch_id: str) -> dict[str, str] | None:
        raw = await self._store.hgetall(self._keys.batch(batch_id))
        return {_text(k): _text(v) for k, v in raw.items()} if raw else None

    async def update(self, batch_id: str, **fields: str | int) -> None:
        mapping = {name: str(value) for name, value in fields.items()}
        await self._store.hset(self._keys.batch(batch_id), mapping=mapping)

    async def owned(self, owner: str) -> list[str]:
        """The owner's batch ids, oldest first."""
        return [_text(i) for i in await self._store.zrange(self._keys.batches(owner), 0, -1)]

    async def active(self) -> list[str]:
        return sorted(_text(i) for i in await self._store.smembers(self._keys.active_batches))

    async def active_records(self) -> list[dict[str, str]]:
        found = [await self.get(batch_id) for batch_id in await self.active()]
        return [record for record in found if record is not None]

    async def driver(self, batch_id: str) -> str | None:
        """The gateway that holds the batch's lease now, if any."""
        holder = await self._store.get(self._keys.batch_lease(batch_id))
        return None if holder is None else _text(holder)

    async def finished(self, batch_id: str, ttl_s: int) -> None:
        """Off the active set; its record and results kept for `ttl_s`."""
        await self._store.srem(self._keys.active_batches, batch_id)
        for key in (self._keys.batch(batch_id), self._keys.batch_done(batch_id)):
            await self._store.expire(key, ttl_s)
        await self._store.delete(self._keys.batch_results(batch_id))

    async def save_result(self, batch_id: str, custom_id: str, answered: bool, line: bytes) -> None:
        pipe = pipeline(self._store)
        pipe.hset(self._keys.batch_results(batch_id), custom_id, line)
        pipe.hset(self._keys.batch_done(batch_id), custom_id, "o" if answered else "e")
        await pipe.execute()

    async def done(self, batch_id: str) -> dict[str, bool]:
        """custom_id -> answered, for every line with a result."""
        raw = await self._store.hgetall(self._keys.batch_done(batch_id))
        return {_text(k): _text(v) == "o" for k, v in raw.items()}

    async def results(self, batch_id: str, custom_ids: list[str]) -> dict[str, bytes]:
        """The results of these lines (a page of them: a batch's whole output is never read
        at once); a line without one is left out."""
        if not custom_ids:
            return {}
        key = self._keys.batch_results(batch_id)
        pipe = pipeline(self._store)  # one round trip; HGETs, as the embedded store has no HMGET
        for custom_id in custom_ids:
            pipe.hget(key, custom_id)
        found = await pipe.execute()
        return {cid: v for cid, v in zip(custom_ids, found, strict=True) if v is not None}

    async def take_lease(self, batch_id: str, holder: str, ms: int) -> bool:
        return bool(await self._store.set(self._keys.batch_lease(batch_id), holder, nx=True, px=ms))

    async def renew_lease(self, batch_id: str, holder: str, ms: int) -> bool:
        key = self._keys.batch_lease(batch_id)
        return bool(await self._store.eval(_RENEW, 1, key, holder, str(ms)))

    async def release_lease(self, batch_id: str, holder: str) -> None:
        await self._store.eval(_RELEASE, 1, self._keys.batch_lease(batch_id), holder)
