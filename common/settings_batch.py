"""The Files and Batch API's settings: a part of `common.settings.Settings`, declared apart.

Nothing builds this class alone: `Settings` inherits it, so one object still holds every
CLI option and `MICROBATCH_<NAME>` variable, validated once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings


class BatchSettings(BaseSettings):
    # Each `description` is the setting's row in docs/settings.md (common/settings_doc.py).

    files_store: Literal["auto", "disk", "redis", "s3"] = Field(
        default="auto",
        description="where uploaded and batch output files live: `disk` (`files_dir`, one "
        "host), `redis` (the queue's Redis: every gateway of a fleet reads every file), `s3` "
        "(the bytes in `files_s3_bucket`, their records in Redis: for large files); "
        "`auto` = `redis` with `redis_url`, else `disk`",
    )
    files_dir: Path = Field(
        default=Path("~/.local/share/microbatch/files"),
        description="the folder `files_store=disk` keeps files in",
    )
    files_s3_bucket: str = Field(
        default="",
        description="the bucket `files_store=s3` keeps files in (credentials: boto3's own "
        "chain, e.g. `AWS_ACCESS_KEY_ID`)",
    )
    files_s3_prefix: str = Field(
        default="microbatch/files",
        description="the key prefix of those objects; expiring ones (batch output) under "
        "`<prefix>/expiring/`, for a lifecycle rule",
    )
    files_s3_endpoint_url: str = Field(
        default="",
        description="an S3-compatible endpoint (MinIO, Ceph, R2); empty = AWS",
    )
    max_file_bytes: int = Field(
        default=100 * 1024 * 1024,
        gt=0,
        description="largest file `POST /v1/files` accepts; 413 above it",
    )
    max_batch_lines: int = Field(
        default=50_000,
        gt=0,
        description="requests one batch input file may hold (OpenAI's limit); more fails "
        "the batch at validation",
    )
    batch_window: int = Field(
        default=128,
        gt=0,
        description="lines of one batch in the queue at once, per gateway driving it: "
        "enough to fill the workers' batches, few enough that online traffic never waits "
        "behind a file's worth; halved while the queue refuses lines, grown back as they "
        "are answered",
    )
    batch_queue_depth: int = Field(
        default=32,
        gt=0,
        description="a batch line enters a model's queue only while it holds fewer entries "
        "than this (waiting or running, all traffic): online traffic that fills it stops "
        "the feed, and an online request never queues behind more lines than this",
    )
    batch_lease_ms: int = Field(
        default=10_000,
        gt=0,
        description="how long a gateway driving a batch may go silent before another one "
        "resumes it where it was",
    )
    idempotency_ttl_s: int = Field(
        default=24 * 3600,
        gt=0,
        description="how long the answer to a request with an `Idempotency-Key` is kept for "
        "its retries (per API key)",
    )
    response_ttl_s: int = Field(
        default=30 * 24 * 3600,
        gt=0,
        description="how long a stored response (`/v1/responses`, `store`) is kept, as OpenAI "
        "keeps them: its conversation can be continued until then",
    )
    response_events_ttl_s: int = Field(
        default=3600,
        gt=0,
        description="how long a background response's stream events are kept after it ends, "
        "for a client that resumes it with `starting_after`",
    )
    max_stored_response_bytes: int = Field(
        default=4 * 1024 * 1024,
        gt=0,
        description="the largest conversation one stored response may hold (its items as "
        "JSON, earlier turns included); a longer one is refused (400)",
    )
    batch_output_ttl_s: int = Field(
        default=30 * 24 * 3600,
        gt=0,
        description="how long a finished batch and its output files are kept",
    )
