"""Sampling options: checked against the model's vocabulary and packed as the entry carries them.

Every option that changes the output is honoured by the worker or refused here with a 400
naming it; none is accepted and ignored.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from common.errors import InvalidRequest
from common.protocol import pack_tokens
from common.response_format import grammar_problem
from gateway.schemas import GenerationParams

MAX_LOGIT_BIAS = 1024
BIAS_LIMIT = 100.0
MAX_SCHEMA_BYTES = 64 * 1024


def sampling_fields(req: GenerationParams, vocab_size: int) -> dict[str, Any]:
    """The `GenerateEntry` fields of the sampling options, validated."""
    bias_ids, biases = _logit_bias(req.logit_bias or {}, vocab_size)
    stop_ids = list(req.stop_token_ids or [])
    for token in stop_ids:
        _in_vocab(token, vocab_size, "stop_token_ids")
    return {
        "presence_penalty": float(req.presence_penalty),
        "frequency_penalty": float(req.frequency_penalty),
        "repetition_penalty": float(req.repetition_penalty),
        "bias_tokens": pack_tokens(bias_ids),
        "bias_values": np.asarray(biases, "<f4").tobytes(),
        "min_tokens": req.min_tokens,
        "stop_token_ids": pack_tokens(stop_ids),
        "ignore_eos": req.ignore_eos,
        "top_k": max(0, req.top_k),  # -1 and 0 both mean every token
        "min_p": float(req.min_p),
        **_structure(req),
    }


def _structure(req: GenerationParams) -> dict[str, str]:
    """The response format as the entry carries it, checked by the grammar library itself."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return {}
    # a forced tool call is generated under its schema: its problems are the tools'
    param = "tools" if getattr(req, "tool_mode", "none") in ("required", "named") else None
    schema = schema_text(req)
    if len(schema) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(
            f"the JSON schema has {len(schema)} bytes; at most {MAX_SCHEMA_BYTES}",
            param=param or "response_format",
        )
    for option, value in (("ignore_eos", req.ignore_eos), ("min_tokens", req.min_tokens)):
        if value:  # the answer ends when its JSON does: neither could be honoured
            raise InvalidRequest(f"{option} cannot be combined with response_format", param=option)
    problem = grammar_problem(fmt.type, schema)  # compiled off the loop first (generation)
    if problem is not None:
        raise InvalidRequest(
            f"{param or 'response_format'}: the schema cannot be enforced: {problem}",
            param=param or "response_format",
        )
    return {"response_format": fmt.type, "json_schema": schema}


def schema_text(req: GenerationParams) -> str:
    """The response format's schema as the entry carries it ("" for a JSON object)."""
    fmt = req.response_format
    return orjson.dumps(fmt.json_schema.schema_).decode() if fmt and fmt.json_schema else ""


def check_min_tokens(req: GenerationParams, new_tokens: list[int]) -> None:
    """min_tokens can be honoured only if each prompt may generate that many."""
    if req.min_tokens and req.min_tokens > min(new_tokens):
        raise InvalidRequest(
            f"min_tokens {req.min_tokens} exceeds the {min(new_tokens)} new tokens allowed",
            param="min_tokens",
        )


def _logit_bias(bias: dict[str, float], vocab_size: int) -> tuple[list[int], list[float]]:
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias"
        )
    ids, values = [], []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):  # "²".isdigit() holds; int() raises
            raise InvalidRequest(f"logit_bias key {key!r} is not a token id", param="logit_bias")
        ids.append(_in_vocab(int(key), vocab_size, "logit_bias"))
        if not -BIAS_LIMIT <= value <= BIAS_LIMIT:
            raise InvalidRequest(
                f"logit_bias for token {key} is {value}; it must be in -100..100",
                param="logit_bias",
            )
        values.append(float(value))
    return ids, values


def _in_vocab(token: int, vocab_size: int, param: str) -> int:
    if vocab_size and token >= vocab_size:
        raise InvalidRequest(
            f"{param}: token {token} is outside the model's vocabulary of {vocab_size}",
            param=param,
        )
    return token
