"""The Batch API in `serve` (the embedded store, files on disk): the same flow with nothing
but one process."""

from __future__ import annotations

import io

import orjson
from openai import OpenAI

from tests.conftest import Processes, wait_ready, wait_until


def test_serve_runs_a_batch_with_its_files_on_disk(processes: Processes, tmp_path) -> None:
    folder = tmp_path / "files"
    serve = processes.start("serve", model="noop", files_dir=folder)
    wait_ready(serve)
    client = OpenAI(base_url=f"{serve.base_url}/v1", api_key="none", max_retries=0)
    lines = [
        {"custom_id": f"s{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}
        for i in range(50)
    ]
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
    assert (folder / file_id).read_bytes() == data  # the embedded store is memory: disk
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
    )
    batch = wait_until(
        lambda: client.batches.retrieve(batch.id),
        60,
        "the batch completed",
        until=lambda b: b.status == "completed",
        interval_s=0.2,
    )
    output = client.files.content(batch.output_file_id).text.splitlines()
    assert sorted(orjson.loads(x)["custom_id"] for x in output) == sorted(
        line["custom_id"] for line in lines
    )
    assert (folder / batch.output_file_id).exists()
