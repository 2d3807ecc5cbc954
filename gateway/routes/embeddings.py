"""`POST /v1/embeddings`: OpenAI-compatible embeddings.

Each input is tokenized here (after its prompt, if any), queued with the request's other
inputs of its length bucket, and answered by whichever workers batch them; `dimensions` and
`normalize` are applied to the answers here. The answer's headers say how it was batched.
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from common.errors import InvalidRequest
from common.protocol import ModelInfo, ModelKind
from gateway.inputs import RowBlocks, token_rows
from gateway.request import Parsed, api_call
from gateway.routes.rows import json_response, run_rows
from gateway.schemas import EmbeddingRequest, openapi_body
from gateway.scores import shorten

ROUTE = "/v1/embeddings"
SCHEMA = openapi_body(EmbeddingRequest)


async def embeddings(request: Request) -> Response:
    return await api_call(
        request, ROUTE, EmbeddingRequest, ModelKind.EMBEDDING, _embed, elsewhere="/v1/completions"
    )


async def _embed(parsed: Parsed[EmbeddingRequest]) -> Response:
    req, info = parsed.body, parsed.model.info
    dimensions, normalize = vector_options(info, req.dimensions, req.normalize)
    rows = await embedding_rows(
        parsed, req.input, req.prompt_name, req.truncate, req.truncation_direction
    )
    answered = await run_rows(parsed, rows)
    out = shorten(answered.vectors, dimensions, normalize)
    values = base64_rows(out) if req.encoding_format == "base64" else out
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(values)]
    tokens = answered.tokens
    body = {
        "object": "list",
        "data": data,
        "model": parsed.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return json_response(body, parsed.call, answered)


async def embedding_rows(
    parsed: Parsed, data: str | list, prompt_name: str | None, truncate: bool, direction: str
) -> list[np.ndarray] | RowBlocks:
    """Token rows of an `input`, each text after the prompt named (or the model's default);
    more texts than one entry carries are tokenized a block at a time, as they are queued."""
    info = parsed.model.info
    name = prompt_name if prompt_name is not None else info.default_prompt
    if prompt_name is not None and prompt_name not in info.prompts:
        known = ", ".join(sorted(info.prompts)) or "none"
        raise InvalidRequest(
            f"prompt_name {prompt_name!r} is not one of {parsed.name}'s prompts ({known})",
            param="prompt_name",
        )
    texts = [data] if isinstance(data, str) else data
    if name and texts and isinstance(texts[0], str):
        data = [info.prompts[name] + t for t in texts]
    elif prompt_name is not None and texts:
        raise InvalidRequest(
            "prompt_name applies to text inputs, not token ids", param="prompt_name"
        )
    return await token_rows(parsed.services, parsed.model, data, truncate, direction)


def base64_rows(vectors: np.ndarray) -> list[str]:
    """Each row's float32 bytes in base64. A row of a multiple of 3 bytes encodes without
    padding, so one encoding of the whole matrix, cut every row's length, is every row's."""
    rows = np.ascontiguousarray(vectors, "<f4")
    row_bytes = rows.shape[1] * 4 if rows.ndim == 2 else 0
    if row_bytes % 3 or not row_bytes:
        return [base64.b64encode(row.tobytes()).decode() for row in rows]
    whole, width = base64.b64encode(rows.tobytes()).decode(), row_bytes // 3 * 4
    return [whole[i : i + width] for i in range(0, len(whole), width)]


def vector_options(
    info: ModelInfo, dimensions: int | None, normalize: bool | None
) -> tuple[int | None, bool]:
    """(dimensions to keep, whether the gateway must normalize), or a 400 saying why not."""
    if dimensions is not None and dimensions > info.dim:
        raise InvalidRequest(
            f"dimensions {dimensions} is more than {info.name} gives ({info.dim})",
            param="dimensions",
        )
    shorter = dimensions is not None and dimensions < info.dim
    if shorter and not info.matryoshka:
        raise InvalidRequest(
            f"{info.name} does not declare matryoshka training, so its first {dimensions} "
            f"dimensions are not an embedding; it gives {info.dim} (an operator may allow "
            "it with --matryoshka true)",
            param="dimensions",
        )
    if shorter and info.matryoshka_dims and dimensions not in info.matryoshka_dims:
        raise InvalidRequest(
            f"{info.name} was trained for dimensions {info.matryoshka_dims}, not {dimensions}",
            param="dimensions",
        )
    if normalize is False and info.normalized:
        raise InvalidRequest(
            f"{info.name} normalizes its vectors in its own modules; normalize: false "
            "cannot undo that",
            param="normalize",
        )
    wanted = normalize if normalize is not None else (info.normalized or shorter)
    # vectors the model already normalized stay as they are unless cut
    return (dimensions if shorter else None), bool(wanted and (shorter or not info.normalized))
