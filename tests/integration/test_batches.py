"""The Batch and Files APIs through the official `openai` client, on a real redis-server
with real models: a batch's lines run as the same requests sent online would, its answers
land in OpenAI's output and error files, and a bad file, a cancel, an expiry and a gateway
that stops mid-batch each end the way OpenAI's documentation says."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import redis
from openai import ConflictError, NotFoundError, OpenAI
from typer.testing import CliRunner

from common.cli import app
from common.settings import Settings
from gateway.auth import owner_of
from tests.conftest import RedisServer, free_port, wait_until
from tests.integration.batch_client import embedding_lines, finished, results, upload
from tests.integration.in_process import InProcess
from tests.integration.test_observability import sample
from tests.openai import schema_errors

PREFIX = "mbbatch"
KEY, OTHER_KEY = "key-a", "key-b"
TERMINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def fleet(redis_server: RedisServer, tiny_model: Path) -> Iterator[tuple[InProcess, str, dict]]:
    """Two gateways over one Redis (any gateway serves any batch), an embedding worker (the
    default MiniLM) and a generation worker (the tiny random-weight Llama, greedy)."""
    deployment = InProcess()
    common = {"redis_url": redis_server.url, "prefix": PREFIX, "read_block_ms": 100}
    gateway = {**common, "api_keys": [KEY, OTHER_KEY], "batch_lease_ms": 1500}
    try:
        urls = [deployment.start_gateway(gateway_settings(gateway)) for _ in range(2)]
        with OpenAI(base_url=f"{urls[0]}/v1", api_key=KEY) as client:
            # one load at a time: transformers' loading is not safe on two threads at once
            for n, settings in enumerate(
                (
                    Settings(**common, max_wait_ms=0, worker_id="embedder"),
                    Settings(
                        **common,
                        model=str(tiny_model),
                        served_model_name=["tiny"],
                        worker_id="llama",
                    ),
                ),
                start=1,
            ):
                deployment.start_worker(settings)
                wait_until(
                    lambda n=n: deployment.failures or len(client.models.list().data) == n,
                    120,
                    f"{n} models served",
                )
        assert not deployment.failures
        yield deployment, urls[0], {"urls": urls, **gateway}
    finally:
        deployment.close()


def gateway_settings(config: dict) -> Settings:
    """One more gateway: its own port and reply stream (one process holds them all)."""
    port = free_port()
    config = {k: v for k, v in config.items() if k != "urls"}
    return Settings(**config, port=port, gateway_id=f"gateway-{port}")


_made: list[OpenAI] = []


def client_of(url: str, key: str = KEY) -> OpenAI:
    """A client the test's teardown closes (`closed_clients`)."""
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    _made.append(client)
    return client


@pytest.fixture(autouse=True)
def closed_clients() -> Iterator[None]:
    yield
    while _made:
        _made.pop().close()


def answering(client: OpenAI, lines: list[dict]):
    """An embeddings batch of `lines`, once some of them are answered."""
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/embeddings", completion_window="24h"
    )
    wait_until(
        lambda: client.batches.retrieve(batch.id).request_counts.completed,
        60,
        f"lines of {batch.id} answered",
        interval_s=0.05,
    )
    return batch


def test_an_embeddings_batch_answers_every_line_as_the_same_request_online(fleet) -> None:
    _, url, _ = fleet
    client = client_of(url)
    lines = embedding_lines(120)
    file_id = upload(client, lines)
    stored = client.files.retrieve(file_id)
    assert schema_errors("OpenAIFile", stored.model_dump(exclude_none=True)) == []
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/embeddings",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status == "validating"
    batch = finished(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 120, "completed": 120, "failed": 0}
    assert batch.metadata == {"job": "nightly"} and batch.error_file_id is None
    raw = client.batches.retrieve(batch.id).model_dump(exclude_none=True)
    assert schema_errors("Batch", raw) == []
    answers = results(client, batch.output_file_id)
    assert sorted(answers) == sorted(line["custom_id"] for line in lines)
    inputs = [line["body"]["input"] for line in lines[:8]]
    online = client.embeddings.create(model="all-MiniLM-L6-v2", input=inputs)
    for line, expected in zip(lines[:8], online.data, strict=True):
        response = answers[line["custom_id"]]["response"]
        assert response["status_code"] == 200
        assert schema_errors("CreateEmbeddingResponse", response["body"]) == []
        got = np.array(response["body"]["data"][0]["embedding"])
        np.testing.assert_allclose(got, np.array(expected.embedding), atol=1e-5)
    # output files are the owner's too, and listed as batch output
    listed = client.files.list().model_dump(exclude_none=True)
    assert schema_errors("ListFilesResponse", listed) == []
    assert batch.output_file_id in {f["id"] for f in listed["data"]}


def test_a_chat_batch_is_token_identical_to_greedy_online_answers(fleet) -> None:
    _, url, _ = fleet
    client = client_of(url)
    lines = [
        {
            "custom_id": f"chat-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"tell me about {i}"}],
                "max_tokens": 8,
                "temperature": 0,
            },
        }
        for i in range(6)
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch = finished(client, batch.id)
    assert batch.status == "completed", batch
    answers = results(client, batch.output_file_id)
    for line in lines:
        online = client.chat.completions.create(**line["body"])
        body = answers[line["custom_id"]]["response"]["body"]
        assert schema_errors("CreateChatCompletionResponse", body) == []
        assert body["choices"][0]["message"]["content"] == online.choices[0].message.content


def test_a_line_the_route_refuses_goes_to_the_error_file_with_its_answer(
    fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """... in input order in each file, as the files are written a page of lines at a time
    (pages of 2 here: the drivers run in this process)."""
    monkeypatch.setattr("gateway.batch_run.FINALIZE_PAGE", 2)
    _, url, _ = fleet
    client = client_of(url)
    lines = embedding_lines(5, "mixed")
    for refused in (1, 3):
        lines[refused]["body"] = {"input": []}  # the route's 4xx, not the file's problem
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/embeddings", completion_window="24h"
    )
    batch = finished(client, batch.id)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 5, "completed": 3, "failed": 2}
    errors = results(client, batch.error_file_id)
    assert list(errors) == ["mixed-1", "mixed-3"]
    response = errors["mixed-1"]["response"]
    assert 400 <= response["status_code"] < 500 and "error" in response["body"]
    assert list(results(client, batch.output_file_id)) == ["mixed-0", "mixed-2", "mixed-4"]
    stored = client.files.retrieve(batch.output_file_id)
    assert stored.bytes == len(client.files.content(batch.output_file_id).content)


def test_a_file_with_bad_lines_fails_its_batch_listing_each_problem(fleet) -> None:
    _, url, _ = fleet
    client = client_of(url)
    good = embedding_lines(2, "bad")
    lines = [
        good[0],
        good[0],  # duplicate custom_id
        {**good[1], "url": "/v1/completions"},
        {**good[1], "custom_id": "m", "body": {"input": "x", "model": "no-such-model"}},
        {**good[1], "custom_id": "s", "body": {"input": "x", "stream": True}},
    ]
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines) + b"{not json\n"
    file_id = client.files.create(file=("bad.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
    )
    batch = finished(client, batch.id)
    assert batch.status == "failed" and batch.failed_at is not None
    problems = [(e.code, e.line) for e in batch.errors.data]
    assert problems == [
        ("duplicate_custom_id", 2),
        ("mismatched_endpoint", 3),
        ("invalid_model", 4),
        ("invalid_body", 5),
        ("invalid_json_line", 6),
    ]
    assert batch.output_file_id is None and batch.request_counts.total == 0


def test_cancel_stops_the_feed_and_accounts_for_every_line(fleet) -> None:
    _, url, _ = fleet
    client = client_of(url)
    lines = embedding_lines(3000, "cancel")
    batch = answering(client, lines)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    started = time.monotonic()
    batch = finished(client, batch.id, 30)
    assert batch.status == "cancelled" and time.monotonic() - started < 10
    answered = results(client, batch.output_file_id)
    unfinished = results(client, batch.error_file_id)
    assert 0 < len(answered) < len(lines)
    assert set(answered) | set(unfinished) == {line["custom_id"] for line in lines}
    assert not set(answered) & set(unfinished)
    assert {u["error"]["code"] for u in unfinished.values()} == {"batch_cancelled"}
    with pytest.raises(ConflictError, match="cannot be cancelled"):
        client.batches.cancel(batch.id)


def test_a_batch_past_its_window_expires_with_its_unrun_lines_as_errors(
    fleet, redis_server: RedisServer
) -> None:
    _, url, _ = fleet
    client = client_of(url)
    lines = embedding_lines(2000, "expire")
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/embeddings", completion_window="24h"
    )
    # the only window OpenAI's API offers is 24 h: bring this one's end to now instead
    redis.Redis.from_url(redis_server.url).hset(
        f"{PREFIX}:{{{batch.id}}}:batch", "expires_at", str(int(time.time()) + 1)
    )
    batch = finished(client, batch.id, 60)
    assert batch.status == "expired" and batch.expired_at is not None
    unfinished = results(client, batch.error_file_id)
    answered = results(client, batch.output_file_id)
    assert set(answered) | set(unfinished) == {line["custom_id"] for line in lines}
    assert {u["error"]["code"] for u in unfinished.values()} == {"batch_expired"}


# 2,500 lines through the real MiniLM on one gateway, then the rest on another: on a loaded
# 2-core CI host the whole takes up to a minute and more
@pytest.mark.timeout(180)
def test_a_batch_is_resumed_by_another_gateway_when_its_driver_stops(
    fleet, redis_server: RedisServer
) -> None:
    deployment, _, config = fleet
    # it stops within seconds: no client request of its own is in flight to drain
    settings = gateway_settings(config).model_copy(update={"drain_timeout_s": 2})
    spare = deployment.start_gateway(settings)
    client = client_of(spare)
    lines = embedding_lines(1000, "resume")  # more than its driver answers while it drains
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/embeddings", completion_window="24h"
    )
    wait_until(
        lambda: client.batches.retrieve(batch.id).request_counts.completed,
        60,
        "the spare gateway driving it",
        interval_s=0.05,
    )
    lease = redis.Redis.from_url(redis_server.url).get(f"{PREFIX}:{{{batch.id}}}:lease")
    assert lease == settings.gateway_id.encode()  # the gateway that took it drives it
    deployment.stop_gateway(spare)
    assert client_of(config["urls"][0]).batches.retrieve(batch.id).status == "in_progress"
    other = client_of(config["urls"][1])
    batch = finished(other, batch.id, 120)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 1000, "completed": 1000, "failed": 0}
    assert sorted(results(other, batch.output_file_id)) == sorted(x["custom_id"] for x in lines)


def test_files_and_batches_belong_to_the_key_that_made_them(fleet) -> None:
    _, url, _ = fleet
    mine, theirs = client_of(url), client_of(url, OTHER_KEY)
    file_id = upload(mine, embedding_lines(1, "owner"))
    batch = mine.batches.create(
        input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
    )
    for call in (
        lambda: theirs.files.retrieve(file_id),
        lambda: theirs.files.content(file_id),
        lambda: theirs.batches.retrieve(batch.id),
        lambda: theirs.batches.create(
            input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
        ),
    ):
        with pytest.raises(NotFoundError):
            call()
    assert batch.id not in {b.id for b in theirs.batches.list().data}
    assert batch.id in {b.id for b in mine.batches.list().data}
    listed = mine.batches.list(limit=1).model_dump(exclude_none=True)
    assert schema_errors("ListBatchesResponse", listed) == [] and listed["has_more"]
    deleted = mine.files.delete(file_id)
    assert deleted.deleted and schema_errors("DeleteFileResponse", deleted.model_dump()) == []
    with pytest.raises(NotFoundError):
        mine.files.retrieve(file_id)


def test_operators_see_the_fleets_batches_and_the_background_lane(
    fleet, redis_server: RedisServer
) -> None:
    """`microbatch batches` lists an unfinished batch with its counts and driver; the
    gateway's metrics count its lines by outcome and its batches by status."""
    _, url, _ = fleet
    client = client_of(url)
    lines = embedding_lines(3000, "watched")
    batch = answering(client, lines)
    shown = CliRunner().invoke(
        app, ["batches", "--redis-url", redis_server.url, "--prefix", PREFIX, "--json"]
    )
    assert shown.exit_code == 0, shown.output
    mine = next(b for b in json.loads(shown.output) if b["id"] == batch.id)
    assert mine["status"] == "in_progress" and mine["driver"].startswith("gateway-")
    assert mine["request_counts"]["total"] == 3000

    def page() -> str:
        return httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {KEY}"}).text

    text = wait_until(
        page,
        10,
        "the batch in the gauges",
        until=lambda t: sample(t, "microbatch_unfinished_batch_lines", state="pending") > 0,
    )
    assert sample(text, "microbatch_batches", status="in_progress") >= 1
    client.batches.cancel(batch.id)
    finished(client, batch.id, 30)
    # one process holds the whole fleet here, so its counter is every gateway's
    answered = sample(page(), "microbatch_batch_lines_total", outcome="answered")
    assert answered >= client.batches.retrieve(batch.id).request_counts.completed > 0


def test_files_past_the_request_body_limit_are_taken_and_unknown_fields_refused(fleet) -> None:
    """A file is bounded by max_file_bytes, not by the 4 MiB limit of a request body; a form
    field this server does not honour (`expires_after`) is a 400, not ignored."""
    _, url, _ = fleet
    client = client_of(url)
    big = b"".join(orjson.dumps(x) + b"\n" for x in embedding_lines(1, "big")) * 60_000
    assert len(big) > 4 * 1024 * 1024
    stored = client.files.create(file=("big.jsonl", io.BytesIO(big)), purpose="batch")
    assert stored.bytes == len(big)
    assert client.files.content(stored.id).content == big
    client.files.delete(stored.id)
    refused = httpx.post(
        f"{url}/v1/files",
        headers={"authorization": f"Bearer {KEY}"},
        files={"file": ("a.jsonl", b"{}")},
        data={"purpose": "batch", "expires_after[seconds]": "3600"},
    )
    assert refused.status_code == 400 and "expires_after" in refused.json()["error"]["message"]


def test_expired_batches_and_files_leave_their_owners_indexes(
    fleet, redis_server: RedisServer
) -> None:
    _, url, _ = fleet
    client = client_of(url)
    r = redis.Redis.from_url(redis_server.url)
    index = f"{PREFIX}:batches:{owner_of(KEY)}"
    r.zadd(index, {"batch_long_gone": 1})  # created in 1970: long expired
    r.zadd(f"{PREFIX}:files:{owner_of(KEY)}", {"file-longgone": 1})
    client.batches.create(
        input_file_id=upload(client, embedding_lines(1, "prune")),
        endpoint="/v1/embeddings",
        completion_window="24h",
    )
    assert r.zscore(index, "batch_long_gone") is None
    assert "file-longgone" not in {f.id for f in client.files.list().data}
    assert r.zscore(f"{PREFIX}:files:{owner_of(KEY)}", "file-longgone") is None
