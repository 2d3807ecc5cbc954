"""`POST /v1/embeddings`: OpenAI-compatible embeddings, one queue entry per input.

Each input is tokenized here, queued on its model's length-bucket stream, and answered by
whichever worker batches it; the answer's headers say how it was batched.
"""

from __future__ import annotations

import base64

import orjson
from fastapi import Request
from fastapi.responses import Response

from common.errors import InvalidRequest
from common.protocol import EmbeddingResult, RequestEntry, encode, pack_tokens
from gateway.request import Call, api_call, parse_call, priority_of, timeout_ms_of, token_lists
from gateway.schemas import EmbeddingRequest, openapi_body
from gateway.submit import Entries, admit_or_refuse, now_ms, submit

ROUTE = "/v1/embeddings"
SCHEMA = openapi_body(EmbeddingRequest)


async def embeddings(request: Request) -> Response:
    return await api_call(request, ROUTE, lambda call: _embed(request, call))


async def _embed(request: Request, call: Call) -> Response:
    parsed = await parse_call(request, call, EmbeddingRequest, "embedding", "/v1/completions")
    services, req, name, model = parsed.services, parsed.body, parsed.name, parsed.model
    if req.dimensions is not None and req.dimensions != model.info.dim:
        raise InvalidRequest(
            f"dimensions {req.dimensions} is not supported; {name} gives {model.info.dim}",
            param="dimensions",
        )
    request_id = call.request_id or ""
    timeout_ms = timeout_ms_of(request, services.settings.request_timeout_ms)
    inputs = await token_lists(services, model, req.input, truncate=req.truncate)
    priority = priority_of(request)
    admit_or_refuse(services, model, len(inputs), timeout_ms)
    start_ms = now_ms()
    base = services.next_id()
    items, ids = [], []
    for i, tokens in enumerate(inputs):
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
    replies: list[EmbeddingResult] = await submit(services, request, entries)  # type: ignore[assignment]
    body = _body(req, name, replies)
    return Response(body, 200, _tuning_headers(request_id, replies), media_type="application/json")


def _body(req: EmbeddingRequest, model: str, replies: list[EmbeddingResult]) -> bytes:
    data = []
    for i, reply in enumerate(replies):
        value = (
            base64.b64encode(reply.embedding).decode()
            if req.encoding_format == "base64"
            else reply.vector()
        )
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(r.n_tokens for r in replies)
    body = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _tuning_headers(request_id: str, replies: list[EmbeddingResult]) -> dict[str, str]:
    return {
        "X-Request-ID": request_id,
        "X-Microbatch-Batch-Size": str(max(r.batch_size for r in replies)),
        "X-Microbatch-Bucket": str(max(r.bucket for r in replies)),
        "X-Microbatch-Queue-Ms": f"{max(r.queue_ms for r in replies):.2f}",
        "X-Microbatch-Compute-Ms": f"{sum(r.compute_ms for r in replies):.2f}",
        "X-Microbatch-Worker": ",".join(sorted({r.worker for r in replies})),
        "X-Microbatch-Batch-Id": ",".join(dict.fromkeys(r.batch_id for r in replies)),
    }
