"""The shared path of both generation routes: prompts → entries → whole answer or SSE stream.

Each prompt becomes one `GenerateEntry` on its model's bucket stream (by prompt length). A
whole answer waits for one final chunk per prompt (`submit`); a streamed one is relayed by
`streaming`; `answers` shapes both, as legacy completions or as chat.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from common import tracing
from common.clock import wall_ms
from common.errors import ContextLengthExceeded, InvalidRequest
from common.protocol import (
    MAX_STOP_SEQUENCES,
    GenerateEntry,
    GenerationChunk,
    ModelKind,
    encode,
    pack_tokens,
)
from common.response_format import grammar_problem
from gateway.catalog import ModelEntry
from gateway.request import Parsed, api_call
from gateway.routes.answers import Format, Shape, Submitted, hand_back, whole_body
from gateway.routes.sampling import (
    MAX_SCHEMA_BYTES,
    check_min_tokens,
    sampling_fields,
    schema_text,
)
from gateway.routes.streaming import stream
from gateway.schemas import GenerationParams
from gateway.services import Services
from gateway.submit import (
    Entries,
    admit_or_refuse,
    charge_quota,
    lane_of,
    reserve_backlog,
    submit,
    tenant_used,
)
from gateway.tool_calls import read_by

MAX_STOP_CHARS = 256


@dataclass(frozen=True, slots=True)
class Prompts:
    """What a route makes of its body: token ids and new tokens per prompt, and each prompt's
    text when the answer echoes it."""

    ids: list[np.ndarray]
    new_tokens: list[int]
    texts: list[str] | None = field(default=None)


Prepare = Callable[[Services, ModelEntry, Any], Awaitable[Prompts]]


def new_token_limits(
    prompts: list[np.ndarray],
    asked: int | None,
    context: int,
    param: str = "max_tokens",
) -> list[int]:
    """New tokens per prompt: what was asked (checked against the context together with the
    prompt), or all the context leaves when nothing was asked. 0 (scoring) is the routes'
    to allow."""
    limits = []
    for i, ids in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if len(ids) == 0:
            raise InvalidRequest(f"{where} is empty after tokenization", param=where)
        wanted = context - len(ids) if asked is None else asked
        if (wanted < 1 and asked != 0) or len(ids) + wanted > context:
            raise ContextLengthExceeded(
                f"{where} has {len(ids)} tokens and {param} is {wanted}: "
                f"{len(ids) + wanted} exceeds the model's context of {context} tokens",
                param=param,
            )
        limits.append(wanted)
    return limits


def _stops(req: GenerationParams) -> list[str]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            f"stop has {len(stops)} sequences; at most {MAX_STOP_SEQUENCES}", param="stop"
        )
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"each stop sequence needs 1-{MAX_STOP_CHARS} characters", param="stop"
            )
    return stops


@dataclass(frozen=True, slots=True)
class _Ask:
    """What every entry of one request shares."""

    request_id: str
    priority: int
    timeout_ms: int
    session: str | None = None  # an explicit affinity key
    known: str | None = None  # the worker known to cache the prompt's prefix (a stored turn's)
    trace: tracing.TraceContext = tracing.UNTRACED
    lane: str | None = None  # the tenant whose lane its shared-path entries go to


def _entries(
    services: Services,
    model: ModelEntry,
    req: GenerationParams,
    prompts: list[tuple[np.ndarray, int]],  # (prompt tokens, new tokens)
    ask: _Ask,
    shape: Shape,
    checked: dict[str, Any],  # the stop list and sampling options, validated
    reply_to: str | None = None,
) -> Submitted:
    start_ms, base = wall_ms(), services.next_id()
    deadline_ms = start_ms + ask.timeout_ms
    items, ids, routed, owners = [], [], [], []
    for i, (prompt, n_new) in enumerate(prompts):
        entry = GenerateEntry(
            id=f"{base}.{i}",
            request_id=ask.request_id,
            model=model.info.name,
            tokens=pack_tokens(prompt),
            deadline_ms=deadline_ms,
            priority=ask.priority,
            reply_to=reply_to or services.router.stream,
            enqueued_ms=start_ms,
            max_tokens=n_new,
            temperature=float(req.temperature),
            top_p=float(req.top_p),
            seed=-1 if req.seed is None else req.seed,
            stream=req.stream,
            n=req.candidates,
            logprobs=_scored(req),
            prompt_logprobs=req.prompt_logprobs,
            **ask.trace._asdict(),
            **checked,
        )
        stream, names, worker = _routed(services, model, prompt, ask)
        items.append((stream, encode(entry)))
        ids.append(entry.id)
        routed.append(names)
        owners.append(worker)
    entries = Entries(model.info.name, items, ids, deadline_ms, ask.timeout_ms)
    return Submitted(
        entries,
        [len(p) for p, _ in prompts],
        shape,
        fingerprint=model.info.fingerprint,
        routed=routed,
        owners=owners,
    )


def _routed(
    services: Services, model: ModelEntry, prompt: np.ndarray, ask: _Ask
) -> tuple[str, list[bytes], str | None]:
    """Where one prompt goes: the stream of the worker caching its prefix, else its bucket's
    (in the tenant's lane); the names it is routed by, and that worker."""
    names = services.affinity_names(model.info, prompt.tolist(), ask.session)
    stream, worker = services.generation_stream(
        model.info.name, len(prompt), names, ask.known, ask.lane
    )
    return stream, names, worker


def _scored(req: GenerationParams) -> int:
    """Alternatives per generated token the worker computes: what is shown, or just the
    chosen token's when best_of ranks candidates by their likelihood."""
    shown = req.shown_logprobs
    if shown is not None:
        return shown
    return 0 if req.candidates > req.n else -1


async def serve_generation(
    request: Request, fmt: Format, schema: type, prepare: Prepare
) -> Response:
    """Both generation routes: `prepare` turns the validated body into token ids and new
    tokens per prompt; everything else is the same."""
    return await api_call(
        request,
        fmt.route,
        schema,
        ModelKind.CAUSAL_LM,
        lambda parsed: _generate(parsed, fmt, prepare),
        "/v1/embeddings",
    )


async def _generate(parsed: Parsed, fmt: Format, prepare: Prepare) -> Response:
    services, req, name, model = parsed.services, parsed.body, parsed.name, parsed.model
    request_id = parsed.call.request_id
    sub = await queued(parsed, req, prepare)
    if req.stream:
        return stream(services, fmt, model.info.name, request_id, req, sub)
    finals = await finished(parsed, sub, req.candidates)
    return Response(
        whole_body(fmt, request_id, name, sub, finals),
        200,
        {
            "X-Request-ID": request_id,
            "X-Microbatch-Worker": ",".join({c.worker for c in finals}),
        },
        media_type="application/json",
    )


async def finished(parsed: Parsed, sub: Submitted, choices: int) -> list[GenerationChunk]:
    """Write the entries and wait for their final chunks; each worker that answered is
    learnt as the one caching its prompt's prefix."""
    services, prompt = parsed.services, sum(sub.prompt_tokens)
    used = prompt  # what a failed request is settled at
    try:
        finals: list[GenerationChunk] = await submit(services, parsed.call, sub.entries, choices)  # type: ignore[assignment]
        generated = sum(c.completion_tokens for c in finals)
        used += generated
        tenant_used(parsed.call, prompt, generated, max(c.queue_ms for c in finals))
    finally:
        services.routes_answered(sub.entries.model, sub.owners)
        hand_back(services, sub, used)
    for entry_id, names in zip(sub.ids, sub.routed, strict=True):
        worker = next((c.worker for c in finals if c.id == entry_id), None)
        if worker:
            services.learn_route(names, worker)
    return finals


async def queued(
    parsed: Parsed,
    req: Any,
    prepare: Prepare,
    reply_to: str | None = None,
    known: str | None = None,
) -> Submitted:
    """A generation request's entries, checked, admitted and ready to write: `req` is the
    body as a generation route reads it (the Responses route translates its own); `reply_to`
    a stream of the caller's other than this gateway's (a background response's); `known`
    the worker that answered the conversation's previous turn, which caches its prefix."""
    services, model, call = parsed.services, parsed.model, parsed.call
    with tracing.span(services.tracer, "prompt"):  # rendered and tokenized
        prompts = await prepare(services, model, req)
    tokens = _within_limits(services, req, prompts)
    answer_format, schema = req.response_format, schema_text(req)
    if (
        answer_format is not None
        and answer_format.type != "text"
        and len(schema) <= MAX_SCHEMA_BYTES
    ):
        # a schema's first compile (up to tens of ms) on a tokenizer thread, not the loop;
        # remembered, so sampling_fields below finds it compiled
        await services.tokenize.on_pool(grammar_problem, answer_format.type, schema)
    # the request's own mistakes are 400s before admission can answer it 503
    checked = {"stop": _stops(req), **sampling_fields(req, model.info.vocab_size)}
    admit_or_refuse(services, model, len(prompts.ids) * req.candidates, call.timeout_ms, tokens)
    reserved = await reserve_backlog(services, call, model, tokens)
    try:
        charge = await charge_quota(services, call, tokens)
    except BaseException:
        services.backlogs.release(reserved)
        raise
    session = call.session or req.user
    lane = await lane_of(services, call, model)
    ask = _Ask(
        call.request_id, call.priority, call.timeout_ms, session, known, parsed.entry_trace, lane
    )
    pairs = list(zip(prompts.ids, prompts.new_tokens, strict=True))
    shape = _shape(model, req, prompts, services.settings.tool_call_parser)
    sub = _entries(services, model, req, pairs, ask, shape, checked, reply_to)
    sub.charge, sub.reserved = charge, reserved
    return sub


def _shape(model: ModelEntry, req: Any, prompts: Prompts, parser: str) -> Shape:
    """What the request asked of its answers beyond the text (calls read by `parser`)."""
    return Shape(
        model.tokenizer,
        with_ids=req.return_token_ids,
        logprobs=req.shown_logprobs,
        echo=prompts.texts,
        prompt_ids=prompts.ids,
        n=req.n,
        candidates=req.candidates,
        tools=read_by(getattr(req, "tool_use", None), model.info.chat_template, parser),
    )


def _within_limits(services: Services, req: Any, prompts: Prompts) -> int:
    """Check what one request may ask for; the tokens it asks for (prompts + max_tokens)."""
    check_min_tokens(req, prompts.new_tokens)
    settings = services.settings
    check_sequences(len(prompts.ids), req.candidates, settings.max_sequences_per_request)
    tokens = req.candidates * sum(
        len(ids) + new for ids, new in zip(prompts.ids, prompts.new_tokens, strict=True)
    )
    check_tokens(tokens, settings.max_tokens_per_request)
    if req.prompt_logprobs >= 0:
        check_scored_prompts(prompts.ids, settings.max_scored_prompt_tokens)
    return tokens


def check_scored_prompts(prompts: list[np.ndarray], limit: int) -> None:
    """A prompt scored token by token costs a whole-vocabulary distribution per position,
    computed chunk by chunk on the worker, and a reply of every position's alternatives: its
    length is capped apart from the context."""
    longest = max(len(ids) for ids in prompts)
    if longest > limit:
        raise InvalidRequest(
            f"echo with logprobs scores every prompt token; this prompt has {longest} tokens, "
            f"more than the {limit} that may be scored (max_scored_prompt_tokens)",
            param="echo",
        )


def check_tokens(tokens: int, limit: int) -> None:
    """One request asks for at most `limit` tokens (prompts + `max_tokens`, every sequence):
    `max_tokens` is otherwise bounded only by the context (issue 34)."""
    if tokens > limit:
        raise InvalidRequest(
            f"this request asks for {tokens} tokens (prompt + max_tokens over every sequence); "
            f"one request may ask for at most {limit} (max_tokens_per_request)",
            param="max_tokens",
        )


def check_sequences(prompts: int, per_prompt: int, limit: int) -> None:
    """One request starts at most `limit` sequences: 256 prompts x best_of 16 would hold a
    model's whole queue (issue 34)."""
    if prompts * per_prompt > limit:
        raise InvalidRequest(
            f"{prompts} prompts x {per_prompt} choices each are {prompts * per_prompt} "
            f"sequences; one request may start at most {limit} (max_sequences_per_request)",
            param="n" if per_prompt > 1 else "prompt",
        )
