"""Token rows in, one float32 vector per row out: the queue path every encoder route shares.

Embeddings, reranking and classification differ in how they build rows (texts, prompts,
query-document pairs) and shape answers; between the two they are the same: admission, the
rows queued in a few entries (one per length bucket and `max_entry_rows`), the wait, and the
headers that say how the rows were batched.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import orjson
from fastapi import Request
from fastapi.responses import Response

from common.buckets import parts
from common.protocol import EmbeddingResult, RequestEntry, encode, pack_rows
from gateway.request import Call, Parsed, priority_of, timeout_ms_of
from gateway.submit import Entries, admit_or_refuse, now_ms, submit


@dataclass(frozen=True, slots=True)
class Answered:
    """A request's rows answered: the vectors in input order, and the replies they came in."""

    vectors: np.ndarray  # float32 [rows, dim]
    tokens: int
    replies: list[EmbeddingResult]


@dataclass(frozen=True, slots=True)
class RowBlocks:
    """A request's rows made a block at a time (tokenized while earlier blocks compute)."""

    count: int
    blocks: AsyncIterator[list[np.ndarray]]


async def run_rows(
    request: Request, call: Call, parsed: Parsed, rows: list[np.ndarray] | RowBlocks
) -> Answered:
    """Queue `rows` for `parsed.model` and return their vectors, in order; `RowBlocks` are
    queued block by block, as they are made."""
    services, model = parsed.services, parsed.model
    timeout_ms = timeout_ms_of(request, services.settings.request_timeout_ms)
    blocks = rows if isinstance(rows, RowBlocks) else RowBlocks(len(rows), _one(rows))
    admit_or_refuse(services, model, blocks.count, timeout_ms)
    groups: list[list[int]] = []  # each entry's rows, as indices into the request's rows
    parts = _entries(request, call, parsed, blocks.blocks, timeout_ms, groups)
    first = await anext(parts)
    replies: list[EmbeddingResult] = await submit(services, request, first, more=parts)  # type: ignore[assignment]
    tokens = sum(r.n_tokens for r in replies)
    return Answered(_in_order(replies, groups, blocks.count), tokens, replies)


async def _one(rows: list[np.ndarray]) -> AsyncIterator[list[np.ndarray]]:
    yield rows


async def _entries(
    request: Request,
    call: Call,
    parsed: Parsed,
    blocks: AsyncIterator[list[np.ndarray]],
    timeout_ms: int,
    groups: list[list[int]],
) -> AsyncIterator[Entries]:
    """Each block's entries: its rows grouped by bucket, at most `max_entry_rows` each."""
    services, settings, name = parsed.services, parsed.services.settings, parsed.model.info.name
    start_ms, base, priority = now_ms(), services.next_id(), priority_of(request)
    offset = 0
    async for block in blocks:
        items, ids, sizes = [], [], []
        for indices in parts([len(r) for r in block], settings.buckets, settings.max_entry_rows):
            members = [block[i] for i in indices]
            tokens, lengths = pack_rows(members)
            entry = RequestEntry(
                id=f"{base}.{len(groups)}",
                request_id=call.request_id or "",
                model=name,
                kind="embed",
                tokens=tokens,
                lengths=lengths,
                deadline_ms=start_ms + timeout_ms,
                priority=priority,
                reply_to=services.router.stream,
                enqueued_ms=start_ms,
            )
            longest = max(len(r) for r in members)
            items.append((services.request_stream(name, longest), encode(entry)))
            ids.append(entry.id)
            sizes.append(len(indices))
            groups.append([offset + i for i in indices])
        services.entry_rows.observe(name, len(block), len(ids))
        offset += len(block)
        yield Entries(name, items, ids, start_ms + timeout_ms, timeout_ms, sizes)


def _in_order(replies: list[EmbeddingResult], groups: list[list[int]], n: int) -> np.ndarray:
    """Each entry's vectors put back at their rows' places in the request."""
    if not replies:
        return np.zeros((0, 0), np.float32)
    first = replies[0].vectors()
    if len(replies) == 1:
        return first
    out = np.empty((n, first.shape[1]), np.float32)
    for reply, indices in zip(replies, groups, strict=True):
        out[indices] = reply.vectors()
    return out


def tuning_headers(call: Call, answered: Answered | None) -> dict[str, str]:
    """How the rows were batched: where each went, with whom, and how long it waited."""
    headers = {"X-Request-ID": call.request_id or ""}
    replies = answered.replies if answered is not None else []
    if not replies:
        return headers
    headers.update(
        {
            "X-Microbatch-Batch-Size": str(max(r.batch_size for r in replies)),
            "X-Microbatch-Bucket": str(max(r.bucket for r in replies)),
            "X-Microbatch-Queue-Ms": f"{max(r.queue_ms for r in replies):.2f}",
            "X-Microbatch-Compute-Ms": f"{sum(r.compute_ms for r in replies):.2f}",
            "X-Microbatch-Worker": ",".join(sorted({r.worker for r in replies})),
            "X-Microbatch-Batch-Id": ",".join(
                dict.fromkeys(b for r in replies for b in r.batch_ids)
            ),
        }
    )
    return headers


def json_response(body: object, call: Call, answered: Answered | None) -> Response:
    content = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(content, 200, tuning_headers(call, answered), media_type="application/json")
