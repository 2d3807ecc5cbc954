"""Stored files (OpenAI's Files API): a batch's input and its output and error files.

Two stores behind one seam (a third, `gateway.s3_files`, keeps the bytes in an object
store). `RedisFiles` keeps a file in the queue's Redis (metadata in a
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
    file_id: str, size: int, filename: str, purpose: str, owner: str, ttl_s: int | None = None
) -> FileMeta:
    now = int(time.time())
    expires = None if ttl_s is None else now + ttl_s
    return FileMeta(file_id, size, now, filename, purpose, owner, expires)


def expiry(ttl_s: int | None) -> int | None:
    return None if ttl_s is None else int(time.time()) + ttl_s


class FileWriter(Protocol):
    """A file written part by part (a batch's output, page by page, never whole in memory);
    visible only once committed."""

    size: int

    async def write(self, data: bytes) -> None: ...
    async def commit(self, meta: FileMeta) -> None: ...
    async def discard(self) -> None: ...


class FileStore(Protocol):
    async def put(self, meta: FileMeta, data: bytes) -> None: ...
    def writer(self, file_id: str, expires_at: int | None) -> FileWriter: ...
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
        writer = self.writer(meta.id, meta.expires_at)
        await writer.write(data)
        await writer.commit(meta)

    def writer(self, file_id: str, expires_at: int | None) -> _RedisWriter:
        return _RedisWriter(self, file_id, expires_at)

    async def index(self, meta: FileMeta, chunks: int, ttl: int | None) -> None:
        """Make a file visible: its record (with its chunk count), in its owner's index."""
        record = orjson.dumps({**asdict(meta), "chunks": chunks})
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


class _RedisWriter:
    """Chunks as they fill, metadata last: a file is visible only once whole (a rewrite of
    the same id, as a resumed batch's output is, replaces it in place)."""

    def __init__(self, files: RedisFiles, file_id: str, expires_at: int | None) -> None:
        self._files, self._id, self._pending = files, file_id, bytearray()
        self._ttl = None if expires_at is None else max(1, expires_at - int(time.time()))
        self._chunks = self.size = 0

    async def write(self, data: bytes) -> None:
        self._pending += data
        self.size += len(data)
        while len(self._pending) >= CHUNK_BYTES:
            await self._flush(bytes(self._pending[:CHUNK_BYTES]))
            del self._pending[:CHUNK_BYTES]

    async def _flush(self, chunk: bytes) -> None:
        key = self._files._keys.file_chunk(self._id, self._chunks)
        await self._files._store.set(key, chunk, ex=self._ttl)
        self._chunks += 1

    async def commit(self, meta: FileMeta) -> None:
        if self._pending:
            await self._flush(bytes(self._pending))
            self._pending.clear()
        await self._files.index(meta, self._chunks, self._ttl)

    async def discard(self) -> None:
        for index in range(self._chunks):
            await self._files._store.delete(self._files._keys.file_chunk(self._id, index))


class DiskFiles:
    """`<dir>/<id>` holds the bytes, `<id>.json` the metadata, written after the bytes and
    renamed into place, so a reader never sees half a file."""

    def __init__(self, folder: Path) -> None:
        self._dir = folder.expanduser()
        self._dir.mkdir(parents=True, exist_ok=True)

    async def put(self, meta: FileMeta, data: bytes) -> None:
        writer = self.writer(meta.id, meta.expires_at)
        await writer.write(data)
        await writer.commit(meta)

    def writer(self, file_id: str, expires_at: int | None) -> _DiskWriter:
        return _DiskWriter(self._dir, file_id)

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


class _DiskWriter:
    """Appends to `<id>.partial`; the commit renames it into place, then writes the
    metadata the same way, so a reader never sees half a file."""

    def __init__(self, folder: Path, file_id: str) -> None:
        self._dir, self._id, self.size = folder, file_id, 0
        self._partial = folder / f"{file_id}.partial"
        self._partial.unlink(missing_ok=True)

    def _append(self, data: bytes) -> None:
        with self._partial.open("ab") as out:
            out.write(data)

    async def write(self, data: bytes) -> None:
        await asyncio.to_thread(self._append, data)
        self.size += len(data)

    def _commit(self, meta: FileMeta) -> None:
        self._partial.touch()  # an empty file is a file
        self._partial.replace(self._dir / self._id)
        partial = self._dir / f"{self._id}.json.partial"
        partial.write_bytes(orjson.dumps(asdict(meta)))
        partial.replace(self._dir / f"{self._id}.json")

    async def commit(self, meta: FileMeta) -> None:
        await asyncio.to_thread(self._commit, meta)

    async def discard(self) -> None:
        await asyncio.to_thread(self._partial.unlink, True)


def _safe_id(file_id: str) -> bool:
    """Ids name files on disk: ours are `file-<hex>`, anything else is not one of ours."""
    return file_id.startswith("file-") and file_id[5:].isalnum() and len(file_id) <= 64
