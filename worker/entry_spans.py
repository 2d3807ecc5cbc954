"""A worker's spans: each entry from read to publish, each batch linked to its entries.

An entry's context comes from the gateway inside the entry (`traceparent`), so its spans
join the request's trace. At read, two spans start under it: `queue wait`, from the
gateway's enqueue to this read, ended at once (so an attempt that dies computing still
shows in the trace), and `process entry`, ended when its answer is published (or given up
to a peer). A micro-batch serves many requests, so its span is a trace of its own with a
link to every member entry's span, the OpenTelemetry way to show fan-in. What befalls an
entry (redelivered, cancelled, past its deadline, dead-lettered, refused) is an event with
its reason. Built only when tracing is on; every caller tests for None.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from common import tracing
from common.clock import wall_ms
from worker.replies import Entry

NS_PER_MS = 1_000_000


class EntrySpans:
    def __init__(self, tracer: Tracer, worker: str) -> None:
        self._tracer = tracer
        self._worker = worker

    def read(self, entry: Entry, stream: str, deliveries: int) -> Span:
        """The entry's `process entry` span, open; its `queue wait` span, closed."""
        parent = tracing.extracted(entry.traceparent, entry.tracestate)
        now_ms = wall_ms()
        facts: dict[str, AttributeValue] = {
            "microbatch.worker": self._worker,
            "microbatch.stream": stream,
            "microbatch.deliveries": deliveries,
            "microbatch.request_id": entry.request_id,
            "microbatch.entry": entry.id,
        }
        queued = self._tracer.start_span(
            "queue wait",
            context=parent,
            kind=SpanKind.CONSUMER,
            start_time=min(entry.enqueued_ms, now_ms) * NS_PER_MS,
            # the rest is on `process entry`: each attribute costs every span it is on
            attributes={"microbatch.worker": self._worker, "microbatch.deliveries": deliveries},
        )
        queued.end(now_ms * NS_PER_MS)
        rows = len(entry.lengths) // 4 if hasattr(entry, "lengths") else 1
        span = self._tracer.start_span(
            "process entry",
            context=parent,
            kind=SpanKind.CONSUMER,
            start_time=now_ms * NS_PER_MS,
            attributes={
                **facts,
                "microbatch.queue_wait_ms": max(0, now_ms - entry.enqueued_ms),
                "microbatch.rows": rows,
                "microbatch.tokens": entry.n_tokens,
            },
        )
        if deliveries > 1:  # a worker read it before and never answered: it died or hung
            span.add_event("redelivered", {"deliveries": deliveries})
        return span

    def refused(self, entry: Entry, stream: str, deliveries: int, event: str, why: str) -> Span:
        """An entry answered at read without running (refused, past its deadline,
        dead-lettered): its spans, with the reason, ended."""
        span = self.read(entry, stream, deliveries)
        span.add_event(event, {"reason": why})
        span.set_status(Status(StatusCode.ERROR, why))
        span.end()
        return span

    def batch(
        self,
        batch_id: str,
        members: Sequence[Span | None],
        start_ms: int,
        compute_s: float,
        attributes: dict[str, int | str],
    ) -> None:
        """One micro-batch: its own trace, linked to each member entry's span; none for a
        batch of untraced entries (nothing would lead to it)."""
        links = [Link(s.get_span_context()) for s in members if s is not None]
        if not links:
            return
        for member in members:
            if member is not None:
                member.add_event("batch", {"microbatch.batch_id": batch_id})
        span = self._tracer.start_span(
            "batch",
            links=links,
            start_time=start_ms * NS_PER_MS,
            attributes={
                "microbatch.batch_id": batch_id,
                "microbatch.entries": len(links),
                **attributes,
            },
        )
        span.end((start_ms + round(compute_s * 1000)) * NS_PER_MS)


def event(span: Span | None, name: str, **attributes: int | str | float | bool) -> None:
    """An event on an entry's span, if it has one."""
    if span is not None:
        span.add_event(name, attributes)


def ended(spans: Iterable[object], published: bool) -> None:
    """Entry spans whose answers were published, or given up for a peer to redo."""
    for span in spans:
        assert isinstance(span, Span)
        if not published:
            span.set_status(Status(StatusCode.ERROR, "publish failed; left for a peer to redo"))
        span.end()
