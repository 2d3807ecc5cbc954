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
from gateway.request import token_lists
from gateway.routes.answers import Format
from gateway.routes.generation import new_token_limits, serve_generation
from gateway.schemas import CompletionRequest, openapi_body
from gateway.services import Services

ROUTE = "/v1/completions"
SCHEMA = openapi_body(CompletionRequest)
TEXT = Format(ROUTE, "cmpl-", "text_completion", "text_completion", chat=False)


async def completions(request: Request) -> Response:
    return await serve_generation(request, TEXT, CompletionRequest, _prompts)


async def _prompts(
    services: Services, model: ModelEntry, req: CompletionRequest
) -> tuple[list[np.ndarray], list[int]]:
    """Token ids per prompt; the context check comes with the tokens asked for."""
    try:
        prompts = await token_lists(services, model, req.prompt, field="prompt", check=False)
    except InvalidRequest as exc:  # the tokenizer speaks of input[i]; this route of prompt[i]
        param = (exc.param or "prompt").replace("input", "prompt")
        raise type(exc)(exc.message.replace("input", "prompt"), param=param) from None
    return prompts, new_token_limits(prompts, req.max_tokens, model.info.max_tokens)
