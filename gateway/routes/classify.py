"""Classification: vLLM's `/classify` and TEI's `/predict` (a text or a [text, text] pair).

Rows go through the same queue and batches as embeddings; the worker returns logits and the
score function (the model's, or the one a request names) is applied here.
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from common.protocol import ModelKind
from gateway.encoder_schemas import ClassifyRequest, PredictRequest
from gateway.inputs import check_count
from gateway.request import Parsed, api_call
from gateway.routes.rows import json_response, run_rows
from gateway.schemas import openapi_body
from gateway.scores import activate

CLASSIFY = "/classify"
PREDICT = "/predict"
CLASSIFY_SCHEMA = openapi_body(ClassifyRequest)
PREDICT_SCHEMA = openapi_body(PredictRequest)
ELSEWHERE = "/v1/embeddings or /v1/chat/completions"
FUNCTIONS = {"sigmoid": "sigmoid", "softmax": "softmax", "none": "identity"}


async def classify(request: Request) -> Response:
    return await api_call(
        request, CLASSIFY, ClassifyRequest, ModelKind.CLASSIFIER, _classify, ELSEWHERE
    )


async def predict(request: Request) -> Response:
    return await api_call(
        request, PREDICT, PredictRequest, ModelKind.CLASSIFIER, _predict, ELSEWHERE
    )


async def _classify(parsed: Parsed[ClassifyRequest]) -> Response:
    req = parsed.body
    texts = [req.input] if isinstance(req.input, str) else req.input
    function = parsed.model.info.activation if req.activation else "identity"
    probs, answered = await _scores(parsed, texts, req.truncate, "right", function)
    labels = parsed.model.info.labels
    data = [
        {
            "index": i,
            "label": labels[int(row.argmax())],
            "probs": row.tolist(),
            "num_classes": len(labels),
        }
        for i, row in enumerate(probs)
    ]
    tokens = answered.tokens
    body = {
        "id": f"classify-{parsed.call.request_id}",
        "object": "list",
        "created": int(time.time()),
        "model": parsed.name,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }
    return json_response(body, parsed.call, answered)


async def _predict(parsed: Parsed[PredictRequest]) -> Response:
    """One input (a text or a pair) answers a list of {score, label}, best first; a list of
    inputs, a list of those. `parameters` are what Hugging Face's InferenceClient sends."""
    req = parsed.body
    single = isinstance(req.inputs, str | tuple)
    items = [req.inputs] if single else list(req.inputs)  # type: ignore[arg-type]
    function = "identity" if req.raw_scores else parsed.model.info.activation
    top_k = None
    if req.parameters is not None:
        if req.parameters.function_to_apply is not None:
            function = FUNCTIONS[req.parameters.function_to_apply]
        top_k = req.parameters.top_k
    scores, answered = await _scores(
        parsed,
        items,
        bool(req.truncate),
        req.truncation_direction,
        function,
        field="inputs",
    )
    labels = parsed.model.info.labels
    answers = []
    for row in scores:
        ranked = sorted(zip(row.tolist(), labels, strict=True), key=lambda p: -p[0])
        answers.append([{"score": s, "label": label} for s, label in ranked[:top_k]])
    return json_response(answers[0] if single else answers, parsed.call, answered)


async def _scores(
    parsed: Parsed,
    items: list,
    truncate: bool,
    direction: str,
    function: str,
    field: str = "input",
):
    check_count(parsed.services, len(items), field)
    chars = sum(len(i) if isinstance(i, str) else len(i[0]) + len(i[1]) for i in items)
    tokenizer = parsed.model.tokenizer
    rows = await parsed.services.tokenize.run(
        chars, tokenizer.encode_pairs, items, truncate, field, direction
    )
    answered = await run_rows(parsed, rows)
    return activate(answered.vectors, function), answered
