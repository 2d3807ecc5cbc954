"""Stored files in an S3-compatible object store (AWS S3, MinIO, Ceph, R2): the bytes there,
the metadata and each owner's index in the queue's Redis.

For a fleet whose files are large: `RedisFiles` holds every byte in Redis's memory, beside
the queue (a 100 MiB upload is 100 MiB of Redis), while an object store holds them on disk
at a fraction of the cost and any gateway reads them. Metadata stays in Redis, so listing,
ownership and expiry are `RedisFiles`' own, and a file is visible only once its record is
written after its object. The client is boto3 (the maintained AWS SDK), run off the event
loop; credentials come from its usual chain (environment, config files, instance roles),
never from microbatch's settings. A part-by-part file (a batch's output) is a multipart
upload, so it is never whole in memory. Objects of files that expire (a batch's output and
error files) are written under `<prefix>/expiring/`, so one lifecycle rule on that prefix
removes them where the Redis record's expiry cannot reach (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from common.errors import ServiceUnavailable
from common.keys import Keys
from common.store import Store
from gateway.files import FileMeta, RedisFiles

if TYPE_CHECKING:
    from common.settings import Settings

PART_BYTES = 8 * 1024 * 1024  # S3 parts are at least 5 MiB, but the last


def s3_client(settings: Settings) -> Any:
    """A boto3 client for `files_s3_endpoint_url` (AWS where unset)."""
    try:
        import boto3
    except ImportError as exc:  # an optional dependency: say how to get it
        raise RuntimeError("files_store s3 needs boto3: pip install 'microbatch[s3]'") from exc
    from botocore.config import Config

    # a bucket that cannot be reached is a 503 within seconds, not a minute's hang per try
    config = Config(connect_timeout=5, read_timeout=60, retries={"mode": "standard"})
    return boto3.client("s3", endpoint_url=settings.files_s3_endpoint_url or None, config=config)


class S3Files:
    def __init__(self, store: Store, keys: Keys, client: Any, bucket: str, prefix: str) -> None:
        self._index = RedisFiles(store, keys)  # records only: every file has 0 chunks there
        self._client, self._bucket, self._prefix = client, bucket, prefix.strip("/")

    def key(self, file_id: str, expires_at: int | None) -> str:
        kind = "kept" if expires_at is None else "expiring"
        return f"{self._prefix}/{kind}/{file_id}"

    async def _call(self, method: str, **kwargs: Any) -> Any:
        """One S3 call off the event loop; a store that fails is a 503 naming it (a missing
        object stays `NoSuchKey`, for the caller to read as a missing file)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return await asyncio.to_thread(getattr(self._client, method), **kwargs)
        except self._client.exceptions.NoSuchKey:
            raise
        except (BotoCoreError, ClientError) as exc:
            raise ServiceUnavailable(
                f"the file store (bucket {self._bucket!r}) failed: {exc}"
            ) from exc

    async def put(self, meta: FileMeta, data: bytes) -> None:
        writer = self.writer(meta.id, meta.expires_at)
        await writer.write(data)
        await writer.commit(meta)

    def writer(self, file_id: str, expires_at: int | None) -> _S3Writer:
        return _S3Writer(self, self.key(file_id, expires_at), expires_at)

    async def meta(self, file_id: str) -> FileMeta | None:
        return await self._index.meta(file_id)

    async def content(self, file_id: str) -> bytes:
        meta = await self.meta(file_id)
        if meta is None:
            raise FileNotFoundError(file_id)
        try:
            got = await self._call(
                "get_object", Bucket=self._bucket, Key=self.key(file_id, meta.expires_at)
            )
        except self._client.exceptions.NoSuchKey as exc:
            raise FileNotFoundError(file_id) from exc
        return await asyncio.to_thread(got["Body"].read)

    async def delete(self, file_id: str) -> bool:
        meta = await self.meta(file_id)
        if meta is None or not await self._index.delete(file_id):
            return False
        key = self.key(file_id, meta.expires_at)
        await self._call("delete_object", Bucket=self._bucket, Key=key)
        return True

    async def list(self, owner: str) -> list[FileMeta]:
        return await self._index.list(owner)


class _S3Writer:
    """Parts of `PART_BYTES` as they fill; the commit completes the upload, then writes the
    record, so a reader never sees half a file (a rewrite of the same id replaces it)."""

    def __init__(self, files: S3Files, key: str, expires_at: int | None) -> None:
        self._files, self._key, self._expires_at = files, key, expires_at
        self._pending = bytearray()
        self._parts: list[dict[str, Any]] = []
        self._upload: str | None = None
        self.size = 0

    async def write(self, data: bytes) -> None:
        self._pending += data
        self.size += len(data)
        while len(self._pending) >= PART_BYTES:
            await self._part(bytes(self._pending[:PART_BYTES]))
            del self._pending[:PART_BYTES]

    async def _part(self, chunk: bytes) -> None:
        files = self._files
        if self._upload is None:
            made = await files._call("create_multipart_upload", Bucket=files._bucket, Key=self._key)
            self._upload = made["UploadId"]
        number = len(self._parts) + 1
        done = await files._call(
            "upload_part",
            Bucket=files._bucket,
            Key=self._key,
            UploadId=self._upload,
            PartNumber=number,
            Body=chunk,
        )
        self._parts.append({"ETag": done["ETag"], "PartNumber": number})

    async def commit(self, meta: FileMeta) -> None:
        files = self._files
        if self._upload is None:  # small: one request
            await files._call(
                "put_object", Bucket=files._bucket, Key=self._key, Body=bytes(self._pending)
            )
        else:
            if self._pending:
                await self._part(bytes(self._pending))
            await files._call(
                "complete_multipart_upload",
                Bucket=files._bucket,
                Key=self._key,
                UploadId=self._upload,
                MultipartUpload={"Parts": self._parts},
            )
        self._pending.clear()
        ttl = None if self._expires_at is None else max(1, self._expires_at - int(time.time()))
        await files._index.index(meta, 0, ttl)

    async def discard(self) -> None:
        if self._upload is not None:
            files = self._files
            await files._call(
                "abort_multipart_upload", Bucket=files._bucket, Key=self._key, UploadId=self._upload
            )
