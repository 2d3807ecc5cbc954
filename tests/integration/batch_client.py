"""What the Batch API tests do with the official `openai` client: a JSONL file of lines
uploaded, a batch waited for until it ends, its result lines read back by `custom_id`."""

from __future__ import annotations

import io

import orjson
from openai import OpenAI

from gateway.batch_records import TERMINAL
from tests.conftest import wait_until


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def embedding_lines(n: int, tag: str = "line", model: str | None = None) -> list[dict]:
    """`n` embedding lines of varied lengths, for the served default model or `model`."""
    chosen = {} if model is None else {"model": model}
    return [
        {
            "custom_id": f"{tag}-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"input": f"{tag} number {i} " + "word " * (i % 40), **chosen},
        }
        for i in range(n)
    ]


def upload(client: OpenAI, lines: list[dict]) -> str:
    return client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch").id


def finished(client: OpenAI, batch_id: str, timeout_s: float = 120, interval_s: float = 0.2):
    """The batch once it has ended: completed, failed, expired or cancelled."""
    return wait_until(
        lambda: client.batches.retrieve(batch_id),
        timeout_s,
        f"batch {batch_id} finished",
        until=lambda b: b.status in TERMINAL,
        interval_s=interval_s,
    )


def results(client: OpenAI, file_id: str | None) -> dict[str, dict]:
    """One result file's lines by `custom_id`, each id once."""
    if file_id is None:
        return {}
    out = [orjson.loads(line) for line in client.files.content(file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in out}
    assert len(by_id) == len(out), "a custom_id appears twice"
    return by_id


def outputs(client: OpenAI, batch_id: str) -> dict[str, dict]:
    """Every line of a batch's output and error files by `custom_id`, each id once."""
    batch = client.batches.retrieve(batch_id)
    answered, failed = results(client, batch.output_file_id), results(client, batch.error_file_id)
    assert not answered.keys() & failed.keys(), "a custom_id answered twice"
    return answered | failed
