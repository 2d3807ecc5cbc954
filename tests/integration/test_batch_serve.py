"""The Batch API in `serve` (the embedded store, files on disk): the same flow with nothing
but one process."""

from __future__ import annotations

from openai import OpenAI

from tests.conftest import Processes, wait_ready
from tests.integration.batch_client import finished, jsonl, results, upload


def test_serve_runs_a_batch_with_its_files_on_disk(processes: Processes, tmp_path) -> None:
    folder = tmp_path / "files"
    serve = processes.start("serve", model="noop", files_dir=folder)
    wait_ready(serve)
    with OpenAI(base_url=f"{serve.base_url}/v1", api_key="none", max_retries=0) as client:
        lines = [
            {
                "custom_id": f"s{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"input": "x"},
            }
            for i in range(50)
        ]
        file_id = upload(client, lines)
        assert (folder / file_id).read_bytes() == jsonl(lines)  # the embedded store is memory: disk
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
        )
        batch = finished(client, batch.id, 60)
        assert batch.status == "completed", batch
        assert sorted(results(client, batch.output_file_id)) == sorted(
            line["custom_id"] for line in lines
        )
        assert (folder / batch.output_file_id).exists()
