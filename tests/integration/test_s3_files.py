"""Files in an S3-compatible object store (`files_store=s3`): the bytes in the bucket, the
records in Redis. Proven against moto's S3 server (a real HTTP S3 API on loopback, through
boto3) and a real redis-server: the official `openai` client's Files API on two gateways
(any gateway reads any file), a batch whose output lands in the bucket under the prefix a
lifecycle rule can expire, and the writer's seam (multipart, invisible until committed,
aborted when discarded)."""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Iterator

import boto3
import pytest
import redis
from botocore.config import Config
from moto.server import ThreadedMotoServer
from openai import NotFoundError, OpenAI

from common.errors import ServiceUnavailable
from common.keys import Keys
from common.settings import Settings
from common.store import close_store, open_store
from gateway import s3_files
from gateway.files import file_meta
from gateway.s3_files import S3Files
from tests.conftest import RedisServer, free_port, wait_until
from tests.integration.batch_client import embedding_lines, finished, results, upload
from tests.integration.in_process import InProcess

BUCKET, PREFIX = "mb-files", "mbs3"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """moto's S3 server on a loopback port, with the bucket; boto3 reads the credentials
    from the environment, as a deployment's would."""
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket=BUCKET)
        yield url
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _objects(url: str) -> dict[str, int]:
    listed = boto3.client("s3", endpoint_url=url).list_objects_v2(Bucket=BUCKET)
    return {o["Key"]: o["Size"] for o in listed.get("Contents", [])}


def test_a_file_written_in_parts_is_one_object_visible_only_once_committed(
    redis_url: str, s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts of 5 MiB (S3's least), so 12 MiB in uneven writes is a three-part upload."""
    monkeypatch.setattr(s3_files, "PART_BYTES", 5 * 1024 * 1024)
    writes = [os.urandom(n) for n in (1, 3 * 1024 * 1024, 7 * 1024 * 1024 - 1, 2 * 1024 * 1024)]

    async def scenario() -> tuple[object, bytes, object, list, bool]:
        store = open_store(Settings(redis_url=redis_url))
        client = boto3.client("s3", endpoint_url=s3)
        files = S3Files(store, Keys(PREFIX), client, BUCKET, "parts")
        try:
            writer = files.writer("file-abc1", None)
            for part in writes:
                await writer.write(part)
            before = await files.meta("file-abc1")
            await writer.commit(file_meta("file-abc1", writer.size, "o.jsonl", "batch", "o"))
            content = await files.content("file-abc1")
            dropped = files.writer("file-abc2", 2**40)
            await dropped.write(os.urandom(6 * 1024 * 1024))
            await dropped.discard()
            uploads = client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
            return before, content, await files.meta("file-abc2"), uploads, True
        finally:
            await close_store(store)

    before, content, dropped, uploads, _ = asyncio.run(scenario())
    assert before is None  # nothing is visible before the commit
    assert content == b"".join(writes)
    assert dropped is None and uploads == []  # a discarded file leaves no upload behind
    assert _objects(s3)["parts/kept/file-abc1"] == len(content)
    assert "parts/expiring/file-abc2" not in _objects(s3)


def test_a_bucket_that_cannot_be_reached_is_a_503_naming_it_not_a_500(
    redis_url: str, s3: str
) -> None:
    """A store outage is the service's, not the request's: `ServiceUnavailable` (503), the
    bucket named, within the client's connect timeout."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = Config(connect_timeout=1, retries={"total_max_attempts": 1})

    async def scenario() -> None:
        store = open_store(Settings(redis_url=redis_url))
        client = boto3.client("s3", endpoint_url=dead, config=config)
        files = S3Files(store, Keys(PREFIX), client, BUCKET, "down")
        try:
            await files.put(file_meta("file-dead1", 3, "o.jsonl", "batch", "o"), b"abc")
        finally:
            await close_store(store)

    with pytest.raises(ServiceUnavailable, match=BUCKET):
        asyncio.run(scenario())


@pytest.fixture(scope="module")
def fleet(redis_server: RedisServer, s3: str) -> Iterator[tuple[list[str], str]]:
    """Two gateways with `files_store=s3` over one Redis and the noop embedding worker."""
    deployment = InProcess()
    common = {"redis_url": redis_server.url, "prefix": PREFIX, "read_block_ms": 100}
    stored = {"files_store": "s3", "files_s3_bucket": BUCKET, "files_s3_endpoint_url": s3}
    try:
        urls = []
        for _ in range(2):
            port = free_port()
            settings = Settings(**common, **stored, port=port, gateway_id=f"s3-{port}")
            urls.append(deployment.start_gateway(settings))
        deployment.start_worker(Settings(**common, model="noop", worker_id="noop"))
        with OpenAI(base_url=f"{urls[0]}/v1", api_key="none") as client:
            wait_until(lambda: len(client.models.list().data) == 1, 60, "the noop model served")
        yield urls, redis_server.url
    finally:
        deployment.close()


def test_the_files_api_keeps_the_bytes_in_the_bucket_and_any_gateway_reads_them(
    fleet, s3: str
) -> None:
    (first, second), redis_url = fleet
    data = b"".join(b'{"n": %d}\n' % n for n in range(200_000))  # 2.2 MB
    with (
        OpenAI(base_url=f"{first}/v1", api_key="none") as a,
        OpenAI(base_url=f"{second}/v1", api_key="none") as b,
    ):
        made = a.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        assert b.files.retrieve(made.id).bytes == len(data)
        assert b.files.content(made.id).content == data
        assert made.id in {f.id for f in b.files.list()}
        key = f"microbatch/files/kept/{made.id}"
        assert _objects(s3)[key] == len(data)
        held = redis.Redis.from_url(redis_url)
        chunks = list(held.scan_iter(f"{PREFIX}:*{made.id}*"))
        assert sum(held.memory_usage(k) or 0 for k in chunks) < 4096  # a record, no bytes
        assert b.files.delete(made.id).deleted
        assert key not in _objects(s3)
        with pytest.raises(NotFoundError):
            a.files.content(made.id)


def test_a_batchs_output_lands_in_the_bucket_under_the_expiring_prefix(fleet, s3: str) -> None:
    (first, _), _ = fleet
    lines = embedding_lines(20, model="noop")
    with OpenAI(base_url=f"{first}/v1", api_key="none") as client:
        batch = client.batches.create(
            input_file_id=upload(client, lines),
            endpoint="/v1/embeddings",
            completion_window="24h",
        )
        done = finished(client, batch.id)
        assert done.status == "completed", done
        answered = results(client, done.output_file_id)
    assert sorted(answered) == sorted(f"line-{n}" for n in range(20))
    assert f"microbatch/files/expiring/{done.output_file_id}" in _objects(s3)
