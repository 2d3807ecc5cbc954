"""Queue a request's entries and wait for their answers: the one way every route submits work.

Admission first (503 with Retry-After when the queue is too deep to answer in time), then one
future per entry, the entries written in one round trip, and the wait: answers in order, or
the first error an entry got. A client that leaves cancels what is still queued, so no worker
computes answers nobody reads; past its deadline a worker drops an entry by itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from common import metrics, tracing
from common.clock import wall_ms
from common.errors import (
    ClientGone,
    DeadlineExceeded,
    InvalidRequest,
    MicrobatchError,
    Overloaded,
    RateLimited,
    ServiceUnavailable,
    error_from_reply,
)
from common.protocol import EmbeddingResult, ErrorReply, GenerationChunk
from gateway import admission
from gateway.backlog_store import Reservation
from gateway.catalog import ModelEntry
from gateway.quota_store import Charge
from gateway.replies import Choices, ReplyRouter
from gateway.request import Call
from gateway.services import Services
from gateway.waiting import await_replies

Answer = EmbeddingResult | GenerationChunk
BACKLOG_GRACE_MS = 5_000  # a reservation outlives its request's deadline by this, then lapses


def admit_or_refuse(
    services: Services, model: ModelEntry, n_inputs: int, timeout_ms: int, tokens: int = 0
) -> None:
    with tracing.span(services.tracer, "admission", rows=n_inputs):
        _admit_or_refuse(services, model, n_inputs, timeout_ms, tokens)


def _admit_or_refuse(
    services: Services, model: ModelEntry, n_inputs: int, timeout_ms: int, tokens: int
) -> None:
    """Raise Overloaded (503, Retry-After) unless `n_inputs` more rows (and, for a
    generation request, `tokens` more prompt + max_tokens) may be queued;
    ServiceUnavailable when this gateway can no longer receive answers."""
    if not services.alive:
        raise ServiceUnavailable("a gateway background task died; see /healthz", retry_after_s=1.0)
    name, settings = model.info.name, services.settings
    per_entry, rate = services.entry_rows.of(name) or 1.0, model.service_rate_per_s
    ask = None
    if tokens:
        per_row = services.sequence_tokens.observe(name, tokens, max(1, n_inputs))
        assert per_row is not None  # just observed
        ask = admission.TokenAsk(tokens, per_row, settings.max_queued_tokens)
    decision = admission.admit(
        # XLEN is up to a refresh old; this gateway's own waiters are counted live.
        # counted in rows: Redis counts entries, converted at this gateway's rows per entry
        admission.QueueState(
            max(round(model.depth * per_entry), services.router.waiting(name)),
            model.live_workers,
            rate and rate * per_entry,
            model.cold_start_ms if model.cold_start_ms is not None else settings.cold_start_ms,
        ),
        n_inputs,
        settings.max_queue_depth,
        timeout_ms,
        ask,
    )
    if isinstance(decision, admission.Rejected):
        metrics.rejected_total.labels(decision.reason).inc()
        raise Overloaded(decision.message, retry_after_s=decision.retry_after_s, code=decision.code)


async def charge_quota(
    services: Services, call: Call, tokens: int, requests: int = 1
) -> Charge | None:
    """Charge the call's tenant `tokens` (and one request, unless `requests` is 0: a further
    part of a request already charged) against its fleet-wide quotas: 429 over one. The
    first charge's standing goes out on the answer as OpenAI's rate-limit headers."""
    tenant, name = call.terms, call.tenant
    if tenant is None or name is None:
        return None
    if services.tracer is None:  # as every request of a tenant asks: no context to enter
        charge = await services.quotas.charge(name, tenant, tokens, requests)
    else:
        with tracing.span(services.tracer, "quota"):
            charge = await services.quotas.charge(name, tenant, tokens, requests)
    if charge is not None and requests:
        call.headers.extend(charge.headers)
    return charge


async def reserve_backlog(
    services: Services, call: Call, model: ModelEntry, tokens: int
) -> Reservation | None:
    """Hold the request's tokens in its tenant's backlog for the model: 429 when that would
    pass the tenant's `max_queued_tokens`, 400 when this request alone is more. Nothing (no
    Redis call) for a tenant without the cap."""
    tenant = call.terms
    if tenant is None or call.tenant is None or tenant.max_queued_tokens is None:
        return None
    cap = tenant.max_queued_tokens
    if tokens > cap:
        message = (
            f"this request asks for {tokens} tokens (prompts + max_tokens), more than tenant "
            f"{call.tenant!r} may have queued (max_queued_tokens {cap}): it can never queue"
        )
        raise InvalidRequest(message, param="max_tokens", code="request_too_large")
    deadline_ms = wall_ms() + call.timeout_ms + BACKLOG_GRACE_MS
    held, queued = await services.backlogs.reserve(
        call.tenant, model.info.name, call.request_id, deadline_ms, tokens, cap
    )
    if held is not None:
        return held
    refused = admission.tenant_backlog(call.tenant, queued, tokens, cap)
    assert refused is not None  # the script refused it: over the cap, as this says
    metrics.rejected_total.labels(refused.reason).inc()
    metrics.tenant_refusals_total.add((call.tenant, "max_queued_tokens"))
    raise RateLimited(refused.message, retry_after_s=refused.retry_after_s, code=refused.code)


def tenant_used(call: Call, tokens_in: int, tokens_out: int, queue_ms: float) -> None:
    """What an answered call of a tenant used, for its metrics (nothing without a tenant)."""
    if call.tenant is None:
        return
    metrics.tenant_tokens_total.add((call.tenant, "in"), tokens_in)
    if tokens_out:
        metrics.tenant_tokens_total.add((call.tenant, "out"), tokens_out)
    metrics.tenant_queue_wait_seconds.observe((call.tenant,), queue_ms / 1000)


async def lane_of(services: Services, call: Call, model: ModelEntry) -> str | None:
    """The tenant whose lane the call's entries go to (announced to the workers), or None:
    no tenant, or no live worker (a worker scaled from zero is woken by its bucket streams'
    lag, which the autoscaler watches; lanes start once one is live)."""
    tenant = call.terms
    if tenant is None or call.tenant is None or model.live_workers == 0:
        return None
    if services.lanes.due(model.info.name, call.tenant, tenant.weight):
        await services.lanes.announce(model.info.name, call.tenant, tenant.weight)
    return call.tenant


@dataclass(frozen=True, slots=True)
class Entries:
    """One request's queue entries, encoded, each with the stream its length bucket names."""

    model: str
    items: list[tuple[str, bytes]]  # (request stream, encoded entry)
    ids: list[str]  # entry ids, in order
    deadline_ms: int
    timeout_ms: int  # the request's own timeout, for the message when it passes
    rows: list[int] | None = None  # rows each entry carries (encoder entries); None: one each


async def submit(
    services: Services,
    call: Call,
    entries: Entries,
    choices: int = 1,
    more: AsyncIterator[Entries] | None = None,
) -> list[Answer]:
    """Write the entries and return each one's answer, in order; with several `choices` per
    entry (generation's n), each choice's final chunk, in (entry, choice) order. `more`
    yields further entries of the same request as they are made: each is queued at once, so
    workers compute a bulk request's first rows while the rest are still being tokenized; if
    making them fails, what was queued is cancelled."""
    router = services.router
    ids = list(entries.ids)
    if choices == 1:
        futures = _expect(router, entries)
    else:
        collector = Choices(entries.ids, choices)
        for entry_id in entries.ids:
            router.expect_stream(entry_id, collector, entries.model)
        futures = [collector.future]
    try:
        await _enqueue(services, entries)
        if more is not None:
            try:
                async for part in more:
                    ids += part.ids
                    futures += _expect(router, part)
                    await _enqueue(services, part)
            except MicrobatchError:
                services.canceller.cancel(entries.model, ids, entries.deadline_ms)
                raise
        with tracing.span(services.tracer, "wait for replies", entries=len(ids)):
            replies = await await_replies(
                call.disconnected, futures, entries.timeout_ms, entries.deadline_ms
            )
        if choices > 1:
            replies = replies[0]
    except (ClientGone, ServiceUnavailable, DeadlineExceeded):
        # Nobody will read these answers, and a write that failed may still have landed (a
        # timed-out XADD): workers skip cancelled ids, so none is computed for nothing. A
        # cancellation lasts until the deadline; past it, workers drop the entries anyway.
        services.canceller.cancel(entries.model, ids, entries.deadline_ms)
        raise
    finally:
        router.forget(ids)
    return [raise_if_error(r) for r in replies]


async def _enqueue(services: Services, entries: Entries) -> None:
    await enqueue_within(services, entries.items, entries.deadline_ms, entries.timeout_ms)


async def enqueue_within(
    services: Services, items: Sequence[tuple[str, bytes]], deadline_ms: int, timeout_ms: int
) -> None:
    """Write the entries, within the request's deadline: a Redis that stalls (a failover, a
    paused client, retries) answers the client 504 at its deadline, never later. The write
    itself goes on; the caller cancels what it may land."""
    try:
        with tracing.span(services.tracer, "enqueue", entries=len(items)):
            async with asyncio.timeout(max(0.0, (deadline_ms - wall_ms()) / 1000)):
                await services.enqueuer.add(items)
    except TimeoutError:
        raise DeadlineExceeded(
            f"the queue did not take this request within its {timeout_ms} ms deadline"
        ) from None


def _expect(router: ReplyRouter, entries: Entries) -> list[asyncio.Future]:
    rows = entries.rows or [1] * len(entries.ids)
    return [router.expect(i, entries.model, n) for i, n in zip(entries.ids, rows, strict=True)]


def raise_if_error(reply: Answer | ErrorReply) -> Answer:
    if isinstance(reply, ErrorReply):
        raise error_from_reply(reply.status, reply.code, reply.message)
    return reply
