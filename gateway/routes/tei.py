"""Hugging Face text-embeddings-inference's routes for embedding models: `/embed`, `/decode`,
and `POST /`, which TEI answers as `/embed` or `/predict` by the model's kind.

So TEI's clients (Hugging Face's InferenceClient, LangChain's and LlamaIndex's TEI
integrations) work unchanged against microbatch.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from common.protocol import ModelKind
from gateway.encoder_schemas import TeiDecodeRequest, TeiEmbedRequest
from gateway.request import Parsed, api_call
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
    return await api_call(request, EMBED, TeiEmbedRequest, ModelKind.EMBEDDING, _embed, "/predict")


async def decode(request: Request) -> Response:
    return await api_call(request, DECODE, TeiDecodeRequest, None, _decode)


async def root(request: Request) -> Response:
    """TEI's `POST /`: `/predict` when the default model is a classifier, else `/embed`."""
    services = request.app.state.services
    default = services.catalog.models.get(services.settings.served_name)
    if default is not None and default.info.kind == ModelKind.CLASSIFIER:
        return await classify.predict(request)
    return await embed(request)


async def _embed(parsed: Parsed[TeiEmbedRequest]) -> Response:
    req = parsed.body
    dimensions, normalize = vector_options(parsed.model.info, req.dimensions, req.normalize)
    rows = await embedding_rows(
        parsed, req.inputs, req.prompt_name, bool(req.truncate), req.truncation_direction
    )
    answered = await run_rows(parsed, rows)
    vectors = shorten(answered.vectors, dimensions, normalize)
    return json_response(vectors, parsed.call, answered)


async def _decode(parsed: Parsed[TeiDecodeRequest]) -> Response:
    req = parsed.body
    lists = [req.ids] if req.ids and isinstance(req.ids[0], int) else req.ids
    tokenizer = parsed.model.tokenizer
    texts = []
    for ids in lists:
        tokenizer.check_in_vocab(ids, "ids")  # type: ignore[arg-type]
        texts.append(tokenizer.decode_text(ids, req.skip_special_tokens))  # type: ignore[arg-type]
    return json_response(texts, parsed.call, None)
