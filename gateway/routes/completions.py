"""`POST /v1/completions`: OpenAI-compatible text generation, whole or streamed over SSE.

A prompt is a string, strings, a token list or token lists; each becomes one entry. From
there the path is the one both generation routes share (`generation`).
"""

from __future__ import annotations

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from common.errors import InvalidRequest
from gateway.catalog import ModelEntry
from gateway.inputs import token_lists
from gateway.routes.answers import Format
from gateway.routes.generation import Prompts, new_token_limits, serve_generation
from gateway.schemas import CompletionRequest, openapi_body
from gateway.services import Services

ROUTE = "/v1/completions"
SCHEMA = openapi_body(CompletionRequest)
TEXT = Format(ROUTE, "cmpl-", "text_completion", "text_completion", chat=False)


async def completions(request: Request) -> Response:
    return await serve_generation(request, TEXT, CompletionRequest, _prompts)


async def _prompts(services: Services, model: ModelEntry, req: CompletionRequest) -> Prompts:
    """Token ids per prompt; the context check comes with the tokens asked for. An echoed
    prompt is returned as it was sent: its text, or its token ids decoded."""
    try:
        prompts = await token_lists(services, model, req.prompt, field="prompt", check=False)
    except InvalidRequest as exc:  # the tokenizer speaks of input[i]; this route of prompt[i]
        param = (exc.param or "prompt").replace("input", "prompt")
        raise type(exc)(exc.message.replace("input", "prompt"), param=param) from None
    limits = new_token_limits(prompts, req.max_tokens, model.info.max_tokens)
    return Prompts(prompts, limits, _echoed(req, prompts, model) if req.echo else None)


def _echoed(req: CompletionRequest, ids: list[np.ndarray], model: ModelEntry) -> list[str]:
    if isinstance(req.prompt, str):
        return [req.prompt]
    if all(isinstance(p, str) for p in req.prompt):
        return [str(p) for p in req.prompt]
    return [model.tokenizer.decode(p.tolist()) for p in ids]
