"""A real OTLP/HTTP trace receiver on loopback, for tests that trace real processes.

It takes what the SDK's OTLP exporter sends (`POST /v1/traces`, protobuf), keeps the bytes,
and decodes them when asked (so a benchmark's exporters are not slowed by it) with the
OpenTelemetry protocol's own generated classes (`opentelemetry-proto`), every span a plain
`Received` record; `tree` renders one trace as text (what docs/operations.md
shows). Nothing here builds a span: what the receiver holds is what the processes exported.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Received:
    name: str
    service: str
    instance: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


class Receiver:
    def __init__(self) -> None:
        self._spans: list[Received] = []
        self._raw: list[bytes] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver.take(body)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def take(self, body: bytes) -> None:
        with self._lock:
            self._raw.append(body)
            self.requests += 1

    @property
    def spans(self) -> list[Received]:
        """Every span received so far (decoded now)."""
        with self._lock:
            raw, self._raw = self._raw, []
            for body in raw:
                self._spans += _decoded(ExportTraceServiceRequest.FromString(body))
            return list(self._spans)

    def trace(self, trace_id: str) -> list[Received]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def named(self, name: str) -> list[Received]:
        return [s for s in self.spans if s.name == name]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _decoded(request: ExportTraceServiceRequest) -> list[Received]:
    out = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(
                    Received(
                        name=span.name,
                        service=resource.get("service.name", ""),
                        instance=resource.get("service.instance.id", ""),
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                        events=[(e.name, _attributes(e.attributes)) for e in span.events],
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                    )
                )
    return out


def tree(spans: list[Received]) -> str:
    """One trace as an indented tree: span, service, offset and duration from the root."""
    by_parent: dict[str, list[Received]] = {}
    ids = {s.span_id for s in spans}
    for span in sorted(spans, key=lambda s: s.start_ns):
        parent = span.parent_id if span.parent_id in ids else ""
        by_parent.setdefault(parent, []).append(span)
    origin = min(s.start_ns for s in spans)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for span in by_parent.get(parent, []):
            start_ms = (span.start_ns - origin) / 1e6
            took_ms = (span.end_ns - span.start_ns) / 1e6
            events = ", ".join(name for name, _ in span.events)
            lines.append(
                f"{'  ' * depth}{span.name}  [{span.service}]  +{start_ms:.1f} ms, "
                f"{took_ms:.1f} ms" + (f"  events: {events}" if events else "")
            )
            walk(span.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)
