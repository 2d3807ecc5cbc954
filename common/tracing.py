"""OpenTelemetry tracing: off unless the standard OTLP endpoint variable is set.

`start(role)` is what a composition root calls (`microbatch serve`, `gateway`, `worker`): it
returns the role's `Tracing` (a tracer, and a `shutdown` that flushes what is buffered) or
None. The tracer is handed down to the parts that trace and every call site tests it for
None, so with tracing off the queue path does no tracing work at all. One provider per role,
so `serve`'s gateway and worker are two services in a trace, as they are in a fleet.

The SDK reads the rest of the standard environment itself: `OTEL_TRACES_SAMPLER(_ARG)`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_SERVICE_NAME`, `OTEL_BSP_*` (export batching) and the
exporter's `OTEL_EXPORTER_OTLP_*` (headers, timeout, certificates). The trace context
crosses the queue inside each entry (`traceparent`, `tracestate`), in W3C's format.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, NamedTuple

from opentelemetry.context import Context
from opentelemetry.trace import (
    Span,
    Status,
    StatusCode,
    Tracer,
    format_span_id,
    format_trace_id,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from common.message_checks import MAX_TRACESTATE

ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
# whether the span current in this task is being recorded: one lookup where asking the OTel
# context takes six calls, asked at every step of every request, sampled or not
_RECORDING: ContextVar[bool] = ContextVar("microbatch_recording", default=False)
SCOPE = "microbatch"
W3C = TraceContextTextMapPropagator()


class TraceContext(NamedTuple):
    """What an entry carries of the request that queued it (W3C); empty when untraced."""

    traceparent: str = ""
    tracestate: str = ""


UNTRACED = TraceContext()


class TracingConfigError(ValueError):
    """The environment asks for an export this build cannot do; refused at start."""


@dataclass(frozen=True)
class Tracing:
    tracer: Tracer
    provider: Any  # the SDK's TracerProvider (imported only when tracing is on)

    def shutdown(self) -> None:
        """Export what is still buffered (bounded by the processor's own timeout)."""
        self.provider.shutdown()


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return any(environ.get(name, "").strip() for name in ENDPOINTS)


def resource(role: str) -> Any:
    """`service.name` microbatch-<role> and a `service.instance.id` of its own, unless the
    environment names them (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`), which wins."""
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    given = OTELResourceDetector().detect().attributes
    ours = {"service.name": f"microbatch-{role}", "service.instance.id": uuid.uuid4().hex}
    return Resource.create({k: v for k, v in ours.items() if k not in given})


def exporter(environ: Mapping[str, str] = os.environ) -> Any:
    """OTLP over HTTP/protobuf (the spec's default), or gRPC when the protocol says so."""
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            raise TracingConfigError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the gRPC exporter: "
                "pip install 'microbatch[otlp-grpc]' (or use http/protobuf)"
            ) from None
        return GrpcExporter()
    raise TracingConfigError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: microbatch exports OTLP as "
        "'http/protobuf' (the default) or 'grpc'"
    )


def start(role: str, environ: Mapping[str, str] = os.environ) -> Tracing | None:
    """The role's tracing as the environment asks for it; None when it is off."""
    if not enabled(environ):
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=resource(role))  # the sampler: OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(exporter(environ)))
    return Tracing(provider.get_tracer(SCOPE), provider)


def span(tracer: Tracer | None, name: str, **attributes: Any) -> AbstractContextManager[Any]:
    """A leaf span under the current one for the `with` block; nothing at all when tracing
    is off or the current span is not sampled (a span under it would be dropped anyway, and
    the SDK's dropped spans still cost microseconds each). A leaf is never made current:
    nothing nests under it, and attaching it would cost as much as the span itself."""
    if tracer is None or not _RECORDING.get():
        return nullcontext()
    return _Leaf(tracer.start_span(name, attributes=attributes or None))


class _Leaf:
    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def __enter__(self) -> Span:
        return self._span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        if exc is not None:  # a refusal (admission's 503) or a failure: its reason, no trace
            self._span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200]))
        self._span.end()


def recording_here() -> Token[bool]:
    """Mark the current task's span as recorded (the server span, once sampled); give the
    token back to `not_recording` when the span stops being current."""
    return _RECORDING.set(True)


def not_recording(token: Token[bool]) -> None:
    _RECORDING.reset(token)


def recording() -> bool:
    return _RECORDING.get()


def carrier() -> TraceContext:
    """The current span's context, as an entry carries it; none for a span not sampled, so
    its entries stay untraced on the wire and on the worker."""
    if not _RECORDING.get():
        return UNTRACED
    out: dict[str, str] = {}
    W3C.inject(out)
    state = out.get("tracestate", "")
    # the SDK keeps up to 32 members of 256 characters; an entry carries at most what W3C
    # asks every hop to pass on, so a longer state is dropped whole, as the spec allows
    return TraceContext(out.get("traceparent", ""), state if len(state) <= MAX_TRACESTATE else "")


def extracted(traceparent: str | None, tracestate: str | None = None) -> Context:
    """The remote parent a W3C header pair names; an empty context when it names none (a
    malformed `traceparent` is ignored, as the spec asks: the trace restarts here)."""
    headers = {"traceparent": traceparent or "", "tracestate": tracestate or ""}
    return W3C.extract(headers)


def log_ids(span: Span | None) -> dict[str, str]:
    """`trace_id` and `span_id` for a log line, when the span is a real one."""
    if span is None:
        return {}
    context = span.get_span_context()
    if not context.is_valid:
        return {}
    return {
        "trace_id": format_trace_id(context.trace_id),
        "span_id": format_span_id(context.span_id),
    }
