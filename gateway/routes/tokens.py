"""vLLM's `POST /tokenize` and `POST /detokenize`, for every model kind; `/tokenize` with
`inputs` answers in TEI's shape.

Clients count tokens before they send (to fit a context, to price a request) and turn ids
back into text; both use the very tokenizer the gateway queues with, so the counts agree.
"""

from __future__ import annotations

import orjson
from fastapi import Request
from fastapi.responses import Response

from common.errors import InvalidRequest
from gateway.encoder_schemas import TeiTokenizeRequest
from gateway.request import Call, Parsed, api_call
from gateway.routes.chat import render
from gateway.schemas import DetokenizeRequest, TokenizeRequest, openapi_body

TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
TOKENIZE_SCHEMA = openapi_body(TokenizeRequest)
DETOKENIZE_SCHEMA = openapi_body(DetokenizeRequest)


async def tokenize(request: Request) -> Response:
    """A body with `inputs` is TEI's; any other, vLLM's."""
    try:
        raw = orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        raw = None
    if isinstance(raw, dict) and "inputs" in raw:
        return await api_call(request, TOKENIZE, TeiTokenizeRequest, None, _tokenize_tei)
    return await api_call(request, TOKENIZE, TokenizeRequest, None, _tokenize)


async def _tokenize_tei(parsed: Parsed[TeiTokenizeRequest]) -> Response:
    req = parsed.body
    texts = [req.inputs] if isinstance(req.inputs, str) else req.inputs
    prompts = parsed.model.info.prompts
    if req.prompt_name is not None:
        if req.prompt_name not in prompts:
            raise InvalidRequest(
                f"prompt_name {req.prompt_name!r} is not one of {parsed.name}'s prompts",
                param="prompt_name",
            )
        texts = [prompts[req.prompt_name] + t for t in texts]
    tokenizer, pool = parsed.model.tokenizer, parsed.services.tokenize
    chars = sum(len(t) for t in texts)
    body = await pool.run(
        chars, lambda: [tokenizer.spans(t, req.add_special_tokens) for t in texts]
    )
    return _json(body, parsed.call)


async def detokenize(request: Request) -> Response:
    return await api_call(request, DETOKENIZE, DetokenizeRequest, None, _detokenize)


async def _tokenize(parsed: Parsed[TokenizeRequest]) -> Response:
    req, model = parsed.body, parsed.model
    if req.messages is not None:  # the template writes the special tokens itself
        text, special = render(model, req.messages), bool(req.add_special_tokens)
    else:
        text = req.prompt
        special = True if req.add_special_tokens is None else req.add_special_tokens
    pool = parsed.services.tokenize
    ids = await pool.run(len(text), model.tokenizer.encode_text, text, special)
    body = {"count": len(ids), "max_model_len": model.info.max_tokens, "tokens": ids}
    return _json(body, parsed.call)


async def _detokenize(parsed: Parsed[DetokenizeRequest]) -> Response:
    ids = parsed.body.tokens
    text = await parsed.services.tokenize.run(len(ids), parsed.model.tokenizer.decode, ids)
    return _json({"prompt": text}, parsed.call)


def _json(body: dict, call: Call) -> Response:
    headers = {"X-Request-ID": call.request_id}
    return Response(orjson.dumps(body), 200, headers, media_type="application/json")
