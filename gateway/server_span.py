"""One API call as a server span: the client's W3C trace context honoured, and returned.

Only `request.api_call` calls it, and only when tracing is on. The span is current for the
whole call, so the steps below it (validation, tokenizing, admission, enqueue, the wait)
are its children through `tracing.span`, and the entries queued carry its context to the
worker. The answer carries a `traceparent` naming this span, so a client that sent none
can still find its trace; a streamed answer's span ends with its stream, not before.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi.responses import Response, StreamingResponse
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from starlette.datastructures import Headers

from common import tracing


async def traced(
    tracer: Tracer, headers: Headers, route: str, call: Callable[[], Awaitable[Response]]
) -> Response:
    traceparent = headers.get("traceparent")
    parent = tracing.extracted(traceparent, headers.get("tracestate")) if traceparent else None
    span = tracer.start_span(
        f"POST {route}",
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"http.request.method": "POST", "http.route": route},
    )
    if not span.is_recording():  # not sampled: nothing below it traces, as none is current
        return await call()
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    marked = tracing.recording_here()
    streaming = False
    try:
        response = await call()
        status = response.status_code
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        traceparent, _ = tracing.carrier()
        response.headers["traceparent"] = traceparent
        if isinstance(response, StreamingResponse):
            response.body_iterator = _ending(response.body_iterator, span)
            streaming = True
        return response
    except BaseException as exc:  # a bug answered 500 above us, or a cancellation
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        tracing.not_recording(marked)
        otel_context.detach(token)
        if not streaming:
            span.end()


T = TypeVar("T")


async def _ending(body: AsyncIterable[T], span: Span) -> AsyncIterator[T]:
    """The stream, then the span's end, however the stream ends."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        span.end()


def describe(request_id: str, model: str, priority: int) -> None:
    """The call's facts on its server span, once known."""
    trace.get_current_span().set_attributes(
        {
            "microbatch.request_id": request_id,
            "microbatch.model": model,
            "microbatch.priority": priority,
        }
    )


def trace_exemplar(tracer: Tracer | None) -> dict[str, str] | None:
    """The current span's ids as a histogram exemplar (shown in the OpenMetrics exposition,
    so a dashboard jumps from a slow bucket to a trace); None untraced or unsampled."""
    if tracer is None or not tracing.recording():
        return None
    return tracing.log_ids(trace.get_current_span())
