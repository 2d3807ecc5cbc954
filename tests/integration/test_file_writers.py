"""A file written part by part (a batch's output, a page of lines at a time) is the bytes
written, in order, across chunk boundaries; invisible until committed; gone when discarded.
Both stores: Redis (1 MiB chunks; 5 bytes here) and a folder."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common.keys import Keys
from common.settings import Settings
from common.store import close_store, open_store
from gateway import files
from gateway.files import DiskFiles, FileStore, RedisFiles, file_meta

PARTS = [b"", b"ab", b"cdefghijk", b"l", b"mnopqrstuvwxyz0123"]


async def _write_then_read(store: FileStore) -> tuple[object, bytes, object, bool]:
    writer = store.writer("file-abc1", None)
    for part in PARTS:
        await writer.write(part)
    before = await store.meta("file-abc1")  # nothing is visible before the commit
    meta = file_meta("file-abc1", writer.size, "out.jsonl", "batch_output", "o")
    await writer.commit(meta)
    content = await store.content("file-abc1")
    dropped = store.writer("file-abc2", None)
    await dropped.write(b"never seen" * 3)
    await dropped.discard()
    return before, content, await store.meta("file-abc1"), await store.meta("file-abc2") is None


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "CHUNK_BYTES", 5)


def test_redis_files_written_in_parts_are_whole_and_in_order(redis_url: str, small_chunks) -> None:
    async def scenario() -> tuple[object, bytes, object, bool, int]:
        store = open_store(Settings(redis_url=redis_url))
        try:
            got = await _write_then_read(RedisFiles(store, Keys("mbfw")))
            left = len([k async for k in store.scan_iter("mbfw:*abc2*")])
            return (*got, left)
        finally:
            await close_store(store)

    before, content, meta, dropped, left = asyncio.run(scenario())
    assert before is None
    assert content == b"".join(PARTS)
    assert meta is not None and meta.bytes == len(content)
    assert dropped and left == 0  # a discarded file leaves no chunk behind


def test_disk_files_written_in_parts_are_whole_and_in_order(tmp_path: Path) -> None:
    before, content, meta, dropped = asyncio.run(_write_then_read(DiskFiles(tmp_path)))
    assert before is None
    assert content == b"".join(PARTS)
    assert meta is not None and meta.bytes == len(content)
    assert dropped and sorted(p.name for p in tmp_path.iterdir()) == ["file-abc1", "file-abc1.json"]
