"""Token rows in, one float32 vector per row out: the queue path every encoder route shares.

Embeddings, reranking and classification differ in how they build rows (texts, prompts,
query-document pairs) and shape answers; between the two they are the same: admission, one
queue entry per row on its length bucket's stream, the wait, and the headers that say how
the rows were batched.
"""

from __future__ import annotations

import numpy as np
import orjson
from fastapi import Request
from fastapi.responses import Response

from common.protocol import EmbeddingResult, RequestEntry, encode, pack_tokens
from gateway.request import Call, Parsed, priority_of, timeout_ms_of
from gateway.submit import Entries, admit_or_refuse, now_ms, submit


async def run_rows(
    request: Request, call: Call, parsed: Parsed, rows: list[np.ndarray]
) -> list[EmbeddingResult]:
    """Queue `rows` for `parsed.model` and return each one's answer, in order."""
    services, model = parsed.services, parsed.model
    timeout_ms = timeout_ms_of(request, services.settings.request_timeout_ms)
    priority = priority_of(request)
    admit_or_refuse(services, model, len(rows), timeout_ms)
    start_ms = now_ms()
    base = services.next_id()
    request_id = call.request_id or ""
    items, ids = [], []
    for i, tokens in enumerate(rows):
        entry = RequestEntry(
            id=f"{base}.{i}",
            request_id=request_id,
            model=model.info.name,
            kind="embed",
            tokens=pack_tokens(tokens),
            deadline_ms=start_ms + timeout_ms,
            priority=priority,
            reply_to=services.router.stream,
            enqueued_ms=start_ms,
        )
        items.append((services.request_stream(model.info.name, len(tokens)), encode(entry)))
        ids.append(entry.id)
    entries = Entries(model.info.name, items, ids, start_ms + timeout_ms, timeout_ms)
    return await submit(services, request, entries)  # type: ignore[return-value]


def vectors(replies: list[EmbeddingResult]) -> np.ndarray:
    """The replies' vectors as one (rows, dim) float32 array."""
    return np.stack([r.vector() for r in replies]) if replies else np.zeros((0, 0), np.float32)


def tokens_of(replies: list[EmbeddingResult]) -> int:
    return sum(r.n_tokens for r in replies)


def tuning_headers(call: Call, replies: list[EmbeddingResult]) -> dict[str, str]:
    """How the rows were batched: where each went, with whom, and how long it waited."""
    headers = {"X-Request-ID": call.request_id or ""}
    if not replies:
        return headers
    headers.update(
        {
            "X-Microbatch-Batch-Size": str(max(r.batch_size for r in replies)),
            "X-Microbatch-Bucket": str(max(r.bucket for r in replies)),
            "X-Microbatch-Queue-Ms": f"{max(r.queue_ms for r in replies):.2f}",
            "X-Microbatch-Compute-Ms": f"{sum(r.compute_ms for r in replies):.2f}",
            "X-Microbatch-Worker": ",".join(sorted({r.worker for r in replies})),
            "X-Microbatch-Batch-Id": ",".join(dict.fromkeys(r.batch_id for r in replies)),
        }
    )
    return headers


def json_response(body: object, call: Call, replies: list[EmbeddingResult]) -> Response:
    content = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(content, 200, tuning_headers(call, replies), media_type="application/json")
