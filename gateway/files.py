"""Stored files (OpenAI's Files API): a batch's input and its output and error files.

Two stores behind one seam. `RedisFiles` keeps a file in the queue's Redis (metadata in a
hash, bytes in 1 MiB chunks, a file's keys in one Cluster slot), so every gateway of a fleet
reads every file with no other setting; `DiskFiles` keeps them in a folder, for `serve` with
its embedded store (which lives in process memory: files there would not outlive it).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from common.keys import Keys
from common.store import Store

CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class FileMeta:
    id: str
    bytes: int
    created_at: int  # unix seconds
    filename: str
    purpose: str  # batch (uploaded), batch_output (written by a batch)
    owner: str  # the digest of the API key that owns it ("-" with keys off)
    expires_at: int | None = None

    def object(self) -> dict[str, Any]:
        """OpenAI's `File` object."""
        body = {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
        }
        if self.expires_at is not None:
            body["expires_at"] = self.expires_at
        return body


def new_file_id() -> str:
    return "file-" + os.urandom(12).hex()


def file_meta(
    file_id: str, data: bytes, filename: str, purpose: str, owner: str, ttl_s: int | None = None
) -> FileMeta:
    now = int(time.time())
    expires = None if ttl_s is None else now + ttl_s
    return FileMeta(file_id, len(data), now, filename, purpose, owner, expires)


class FileStore(Protocol):
    async def put(self, meta: FileMeta, data: bytes) -> None: ...
    async def meta(self, file_id: str) -> FileMeta | None: ...
    async def content(self, file_id: str) -> bytes: ...
    async def delete(self, file_id: str) -> bool: ...
    async def list(self, owner: str) -> list[FileMeta]: ...  # oldest first


def _meta_of(raw: dict[str, Any]) -> FileMeta:
    return FileMeta(**raw)


class RedisFiles:
    def __init__(self, store: Store, keys: Keys) -> None:
        self._store, self._keys = store, keys

    async def put(self, meta: FileMeta, data: bytes) -> None:
        """Chunks first, metadata last: a file is visible only once whole (a rewrite of the
        same id, as a resumed batch's output is, replaces it in place)."""
        chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
        ttl = None if meta.expires_at is None else max(1, meta.expires_at - int(time.time()))
        for index, chunk in enumerate(chunks):
            await self._store.set(self._keys.file_chunk(meta.id, index), chunk, ex=ttl)
        record = orjson.dumps({**asdict(meta), "chunks": len(chunks)})
        await self._store.set(self._keys.file(meta.id), record, ex=ttl)
        await self._store.zadd(self._keys.files(meta.owner), {meta.id: meta.created_at})
        if meta.expires_at is not None:
            await self.list(meta.owner)  # a batch's output: drop expired ids from the index

    async def _record(self, file_id: str) -> dict[str, Any] | None:
        raw = await self._store.get(self._keys.file(file_id))
        return None if raw is None else orjson.loads(raw)

    async def meta(self, file_id: str) -> FileMeta | None:
        record = await self._record(file_id)
        if record is None:
            return None
        record.pop("chunks")
        return _meta_of(record)

    async def content(self, file_id: str) -> bytes:
        record = await self._record(file_id)
        if record is None:
            raise FileNotFoundError(file_id)
        parts = [
            await self._store.get(self._keys.file_chunk(file_id, i))
            for i in range(record["chunks"])
        ]
        if any(part is None for part in parts):
            raise FileNotFoundError(file_id)  # expired between the record and its chunks
        return b"".join(parts)

    async def delete(self, file_id: str) -> bool:
        record = await self._record(file_id)
        if record is None:
            return False
        await self._store.delete(self._keys.file(file_id))
        for index in range(record["chunks"]):
            await self._store.delete(self._keys.file_chunk(file_id, index))
        await self._store.zrem(self._keys.files(record["owner"]), file_id)
        return True

    async def list(self, owner: str) -> list[FileMeta]:
        """The owner's files; ids whose file expired leave the index as they are seen."""
        index = self._keys.files(owner)
        ids = [
            i.decode() if isinstance(i, bytes) else i
            for i in await self._store.zrange(index, 0, -1)
        ]
        found = [(file_id, await self.meta(file_id)) for file_id in ids]
        gone = [file_id for file_id, meta in found if meta is None]
        if gone:
            await self._store.zrem(index, *gone)
        return [meta for _, meta in found if meta is not None]


class DiskFiles:
    """`<dir>/<id>` holds the bytes, `<id>.json` the metadata, written after the bytes and
    renamed into place, so a reader never sees half a file."""

    def __init__(self, folder: Path) -> None:
        self._dir = folder.expanduser()
        self._dir.mkdir(parents=True, exist_ok=True)

    def _write(self, meta: FileMeta, data: bytes) -> None:
        for name, payload in ((meta.id, data), (f"{meta.id}.json", orjson.dumps(asdict(meta)))):
            partial = self._dir / f"{name}.partial"
            partial.write_bytes(payload)
            partial.replace(self._dir / name)

    async def put(self, meta: FileMeta, data: bytes) -> None:
        await asyncio.to_thread(self._write, meta, data)

    def _read_meta(self, file_id: str) -> FileMeta | None:
        path = self._dir / f"{file_id}.json"
        if not _safe_id(file_id) or not path.exists():
            return None
        meta = _meta_of(orjson.loads(path.read_bytes()))
        if meta.expires_at is not None and meta.expires_at < time.time():
            return None
        return meta

    async def meta(self, file_id: str) -> FileMeta | None:
        return await asyncio.to_thread(self._read_meta, file_id)

    async def content(self, file_id: str) -> bytes:
        if await self.meta(file_id) is None:
            raise FileNotFoundError(file_id)
        return await asyncio.to_thread((self._dir / file_id).read_bytes)

    async def delete(self, file_id: str) -> bool:
        if await self.meta(file_id) is None:
            return False
        for name in (f"{file_id}.json", file_id):
            (self._dir / name).unlink(missing_ok=True)
        return True

    async def list(self, owner: str) -> list[FileMeta]:
        def scan() -> list[FileMeta]:
            found = [self._read_meta(p.name[: -len(".json")]) for p in self._dir.glob("*.json")]
            return sorted((m for m in found if m and m.owner == owner), key=lambda m: m.created_at)

        return await asyncio.to_thread(scan)


def _safe_id(file_id: str) -> bool:
    """Ids name files on disk: ours are `file-<hex>`, anything else is not one of ours."""
    return file_id.startswith("file-") and file_id[5:].isalnum() and len(file_id) <= 64
