"""Reranking with a cross-encoder: Jina's and vLLM's `/v1/rerank`, Cohere's `/v2/rerank`, and
`/rerank` for both Jina's shape (`documents`) and TEI's (`texts`).

Each (query, document) pair is one row on the same queue, buckets and batches as embeddings;
the worker returns the model's logit and the score function is applied here.
"""

from __future__ import annotations

import orjson
from fastapi import Request
from fastapi.responses import Response

from common.errors import InvalidRequest
from common.protocol import ModelKind
from gateway.encoder_schemas import RerankRequest, TeiRerankRequest
from gateway.inputs import check_count
from gateway.request import Parsed, api_call
from gateway.routes.rows import Answered, json_response, run_rows
from gateway.schemas import openapi_body
from gateway.scores import activate, ranking
from gateway.submit import admit_or_refuse

V1 = "/v1/rerank"
V2 = "/v2/rerank"
BOTH = "/rerank"
SCHEMA = openapi_body(RerankRequest)
TEI_SCHEMA = openapi_body(TeiRerankRequest)
ELSEWHERE = "/v1/embeddings or /v1/chat/completions"


async def rerank_v1(request: Request) -> Response:
    return await api_call(request, V1, RerankRequest, ModelKind.CLASSIFIER, _jina, ELSEWHERE)


async def rerank_v2(request: Request) -> Response:
    return await api_call(request, V2, RerankRequest, ModelKind.CLASSIFIER, _cohere, ELSEWHERE)


async def rerank(request: Request) -> Response:
    """A body with `texts` (and no `documents`) is TEI's; any other, Jina's."""
    try:
        raw = orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        raw = None
    if isinstance(raw, dict) and "texts" in raw and "documents" not in raw:
        return await api_call(
            request, BOTH, TeiRerankRequest, ModelKind.CLASSIFIER, _tei, ELSEWHERE
        )
    return await api_call(request, BOTH, RerankRequest, ModelKind.CLASSIFIER, _jina, ELSEWHERE)


async def _jina(parsed: Parsed[RerankRequest]) -> Response:
    req, call = parsed.body, parsed.call
    texts = _documents(parsed, req)
    scores, answered = await _score(
        parsed,
        req.query,
        texts,
        req.truncate,
        req.truncation_direction,
        req.raw_scores,
    )
    results = []
    for i in ranking(scores, req.top_n or None):
        result: dict = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    tokens = answered.tokens
    body = {
        "id": f"rerank-{call.request_id}",
        "model": parsed.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }
    return json_response(body, call, answered)


async def _cohere(parsed: Parsed[RerankRequest]) -> Response:
    """Cohere's v2: documents cut to `max_tokens_per_doc` (4096 unless asked), no documents
    returned, `meta` with the API version."""
    req, call = parsed.body, parsed.call
    texts = _documents(parsed, req)
    admit_or_refuse(parsed.services, parsed.model, len(texts), call.timeout_ms)  # before work
    limit, tokenizer = req.max_tokens_per_doc or 4096, parsed.model.tokenizer
    chars = sum(len(t) for t in texts)  # up to the body limit: on a tokenizer thread
    cut = await parsed.services.tokenize.run(
        chars, lambda: [tokenizer.cut(t, limit) for t in texts]
    )
    scores, answered = await _score(parsed, req.query, cut, True, "right", req.raw_scores)
    results = [
        {"index": i, "relevance_score": scores[i]} for i in ranking(scores, req.top_n or None)
    ]
    body = {
        "id": f"rerank-{call.request_id}",
        "results": results,
        "meta": {
            "api_version": {"version": "2"},
            "billed_units": {"search_units": 1},
            "tokens": {"input_tokens": answered.tokens},
        },
    }
    return json_response(body, call, answered)


async def _tei(parsed: Parsed[TeiRerankRequest]) -> Response:
    req = parsed.body
    _check_count(parsed, req.texts, "texts")
    scores, answered = await _score(
        parsed,
        req.query,
        req.texts,
        bool(req.truncate),
        req.truncation_direction,
        req.raw_scores,
        field="texts",
    )
    body = []
    for i in ranking(scores, None):
        result: dict = {"index": i, "score": scores[i]}
        if req.return_text:
            result["text"] = req.texts[i]
        body.append(result)
    return json_response(body, parsed.call, answered)


def _documents(parsed: Parsed, req: RerankRequest) -> list[str]:
    if req.relevant_spans:
        raise InvalidRequest("relevant_spans is not served", param="relevant_spans")
    texts = req.texts()
    _check_count(parsed, texts, "documents")
    return texts


def _check_count(parsed: Parsed, texts: list[str], field: str) -> None:
    check_count(parsed.services, len(texts), field)
    if len(parsed.model.info.labels) != 1:
        raise InvalidRequest(
            f"model {parsed.name!r} is a classifier over {len(parsed.model.info.labels)} "
            "labels, not a reranker (one relevance score); use /classify",
            param="model",
        )


async def _score(
    parsed: Parsed,
    query: str,
    texts: list[str],
    truncate: bool,
    direction: str,
    raw: bool,
    field: str = "documents",
) -> tuple[list[float], Answered]:
    """Each (query, text) pair's relevance: the model's score function, or its raw logit."""
    tokenizer = parsed.model.tokenizer
    pairs = [(query, t) for t in texts]
    chars = len(query) * len(texts) + sum(len(t) for t in texts)
    rows = await parsed.services.tokenize.run(
        chars, tokenizer.encode_pairs, pairs, truncate, field, direction
    )
    answered = await run_rows(parsed, rows)
    function = "identity" if raw else parsed.model.info.activation
    return activate(answered.vectors, function)[:, 0].tolist(), answered
