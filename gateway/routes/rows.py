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
from fastapi.responses import Response

from common.buckets import parts
from common.clock import wall_ms
from common.protocol import EmbeddingResult, RequestEntry, encode, pack_rows, rows_that_fit
from gateway.inputs import RowBlocks
from gateway.request import Call, Parsed
from gateway.submit import (
    Entries,
    admit_or_refuse,
    charge_quota,
    lane_of,
    submit,
    tenant_used,
)


@dataclass(frozen=True, slots=True)
class Answered:
    """A request's rows answered: the vectors in input order, and the replies they came in."""

    vectors: np.ndarray  # float32 [rows, dim]
    tokens: int
    replies: list[EmbeddingResult]


async def run_rows(parsed: Parsed, rows: list[np.ndarray] | RowBlocks) -> Answered:
    """Queue `rows` for `parsed.model` and return their vectors, in order; `RowBlocks` are
    queued block by block, as they are made."""
    services, model, call = parsed.services, parsed.model, parsed.call
    count = rows.count if isinstance(rows, RowBlocks) else len(rows)
    admit_or_refuse(services, model, count, call.timeout_ms)
    parts = _Parts(parsed, await lane_of(services, call, model))
    block = await anext(rows.blocks) if isinstance(rows, RowBlocks) else rows
    await charge_quota(services, call, sum(len(r) for r in block))
    first = parts.of(block)
    more = parts.each(rows.blocks) if isinstance(rows, RowBlocks) else None
    replies: list[EmbeddingResult] = await submit(services, call, first, more=more)  # type: ignore[assignment]
    tokens = sum(r.n_tokens for r in replies)
    tenant_used(call, tokens, 0, max((r.queue_ms for r in replies), default=0.0))
    return Answered(_in_order(replies, parts.groups, count), tokens, replies)


class _Parts:
    """A request's entries, a block of rows at a time: each block's rows grouped by bucket,
    at most `max_entry_rows` to an entry; `groups` keeps each entry's rows' places."""

    def __init__(self, parsed: Parsed, lane: str | None = None) -> None:
        call = parsed.call
        self._services, self._name = parsed.services, parsed.model.info.name
        # an entry's answer must fit one reply: a wide model's entries carry fewer rows
        self._max_rows = min(
            self._services.settings.max_entry_rows, rows_that_fit(parsed.model.info.dim)
        )
        self._request_id, self._trace, self._call = call.request_id, parsed.entry_trace, call
        self._lane = lane  # the tenant whose lane its entries go to
        start_ms = wall_ms()
        self._start_ms, self._deadline_ms = start_ms, start_ms + call.timeout_ms
        self._timeout_ms = call.timeout_ms
        self._base, self._priority = self._services.next_id(), call.priority
        self.groups: list[list[int]] = []
        self._offset = 0

    def of(self, block: list[np.ndarray]) -> Entries:
        services, name, settings = self._services, self._name, self._services.settings
        items, ids, sizes = [], [], []
        for indices in parts([len(r) for r in block], settings.buckets, self._max_rows):
            members = [block[i] for i in indices]
            tokens, lengths = pack_rows(members)
            entry = RequestEntry(
                id=f"{self._base}.{len(self.groups)}",
                request_id=self._request_id,
                model=name,
                tokens=tokens,
                lengths=lengths,
                deadline_ms=self._deadline_ms,
                priority=self._priority,
                reply_to=services.router.stream,
                enqueued_ms=self._start_ms,
                **self._trace._asdict(),
            )
            longest = max(len(r) for r in members)
            items.append((services.request_stream(name, longest, self._lane), encode(entry)))
            ids.append(entry.id)
            sizes.append(len(indices))
            self.groups.append([self._offset + i for i in indices])
        services.entry_rows.observe(name, len(block), len(ids))
        self._offset += len(block)
        return Entries(name, items, ids, self._deadline_ms, self._timeout_ms, sizes)

    async def each(self, blocks: AsyncIterator[list[np.ndarray]]) -> AsyncIterator[Entries]:
        """Each further block, its tokens charged to the tenant as it is made."""
        async for block in blocks:
            await charge_quota(self._services, self._call, sum(len(r) for r in block), 0)
            yield self.of(block)


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
    headers = {"X-Request-ID": call.request_id}
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
