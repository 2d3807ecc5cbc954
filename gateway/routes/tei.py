"""Hugging Face text-embeddings-inference's routes for embedding models: `/embed`, `/decode`,
and `POST /`, which TEI answers as `/embed` or `/predict` by the model's kind.

So TEI's clients (Hugging Face's InferenceClient, LangChain's and LlamaIndex's TEI
integrations) work unchanged against microbatch.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from gateway.encoder_schemas import TeiDecodeRequest, TeiEmbedRequest
from gateway.request import Call, api_call, parse_call
from gateway.routes import classify
from gateway.routes.embeddings import embedding_rows, vector_options
from gateway.routes.rows import json_response, run_rows
from gateway.schemas import openapi_body
from gateway.scores import shorten

EMBED = "/embed"
DECODE = "/decode"
ROOT = "/"
EMBED_SCHEMA = openapi_body(TeiEmbedRequest)
DECODE_SCHEMA = openapi_body(TeiDecodeRequest)


async def embed(request: Request) -> Response:
    return await api_call(request, EMBED, lambda call: _embed(request, call))


async def decode(request: Request) -> Response:
    return await api_call(request, DECODE, lambda call: _decode(request, call))


async def root(request: Request) -> Response:
    """TEI's `POST /`: `/predict` when the default model is a classifier, else `/embed`."""
    services = request.app.state.services
    default = services.catalog.models.get(services.settings.served_name)
    if default is not None and default.info.kind == "classifier":
        return await classify.predict(request)
    return await embed(request)


async def _embed(request: Request, call: Call) -> Response:
    parsed = await parse_call(request, call, TeiEmbedRequest, "embedding", "/predict")
    req: TeiEmbedRequest = parsed.body
    dimensions, normalize = vector_options(parsed.model.info, req.dimensions, req.normalize)
    rows = await embedding_rows(
        parsed, req.inputs, req.prompt_name, bool(req.truncate), req.truncation_direction
    )
    answered = await run_rows(request, call, parsed, rows)
    return json_response(shorten(answered.vectors, dimensions, normalize), call, answered)


async def _decode(request: Request, call: Call) -> Response:
    parsed = await parse_call(request, call, TeiDecodeRequest, kind=None)
    req: TeiDecodeRequest = parsed.body
    lists = [req.ids] if req.ids and isinstance(req.ids[0], int) else req.ids
    tokenizer = parsed.model.tokenizer
    texts = []
    for ids in lists:
        tokenizer.check_in_vocab(ids, "ids")  # type: ignore[arg-type]
        texts.append(tokenizer.decode_text(ids, req.skip_special_tokens))  # type: ignore[arg-type]
    return json_response(texts, call, None)
