"""What a worker answers, as pure functions of what it computed: error and embedding replies.

Each reply is `(reply stream, encoded message)`; the intake publishes them together with the
acks of the entries they answer, so building them needs no I/O and is tested on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from common.errors import openai_type
from common.protocol import EmbeddingResult, ErrorReply, GenerateEntry, RequestEntry, encode
from common.protocol import pack_vector as pack

log = logging.getLogger("microbatch.worker")

Reply = tuple[str, bytes]  # (reply stream, encoded message)
Done = tuple[str, str]  # (request stream, entry id) to ack
Entry = RequestEntry | GenerateEntry


def error_reply(entry: Entry, status: int, code: str, message: str, worker: str) -> Reply:
    """An error for one entry, typed as the gateway will answer it."""
    reply = ErrorReply(
        id=entry.id, status=status, type=openai_type(status), code=code, message=message,
        worker=worker,
    )  # fmt: skip
    return entry.reply_to, encode(reply)


@dataclass(frozen=True, slots=True)
class BatchFacts:
    """What every reply of one embedding batch reports about it."""

    batch_id: str
    bucket: int
    start_ms: int  # wall clock when the batch started computing
    compute_s: float
    worker: str


def embedding_replies(
    entries: Sequence[RequestEntry], results: Sequence[object], facts: BatchFacts
) -> list[Reply]:
    """One reply per entry, in order: its vector, or the error its input caused."""
    replies = []
    for entry, result in zip(entries, results, strict=True):
        if isinstance(result, Exception):
            log.error(
                "input failed: %r",
                result,
                extra={"request_id": entry.request_id, "entry": entry.id},
            )
            message = f"model failed: {result}"
            replies.append(error_reply(entry, 500, "inference_failed", message, facts.worker))
            continue
        reply = EmbeddingResult(
            id=entry.id,
            embedding=pack(result),  # type: ignore[arg-type]
            n_tokens=entry.n_tokens,
            batch_id=facts.batch_id,
            batch_size=len(entries),
            bucket=facts.bucket,
            queue_ms=max(0.0, facts.start_ms - entry.enqueued_ms),
            compute_ms=facts.compute_s * 1000,
            worker=facts.worker,
        )
        replies.append((entry.reply_to, encode(reply)))
    return replies
