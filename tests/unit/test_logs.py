"""JSON log lines carry the context passed as `extra`, request id included."""

from __future__ import annotations

import json
import logging

from common.logs import JsonFormatter


def test_a_json_line_carries_extras_and_the_message() -> None:
    record = logging.LogRecord(
        "microbatch.worker", logging.DEBUG, __file__, 1, "batch %s", ("x",), None
    )
    record.request_id = "req-7"
    record.size = 4
    line = json.loads(JsonFormatter().format(record))
    assert (
        line["msg"] == "batch x"
        and line["level"] == "debug"
        and line["logger"] == "microbatch.worker"
    )
    assert line["request_id"] == "req-7" and line["size"] == 4
    assert line["ts"].endswith("Z")


def test_text_lines_carry_extras_and_auto_chooses_by_terminal() -> None:
    import io

    from common.logs import TextFormatter, resolve_format

    record = logging.LogRecord("microbatch.gateway", logging.INFO, __file__, 1, "ready", (), None)
    record.request_id = "req-9"
    line = TextFormatter().format(record)
    assert "INFO" in line and "microbatch.gateway: ready" in line and "request_id=req-9" in line

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert resolve_format("auto", Terminal()) == "text"
    assert resolve_format("auto", io.StringIO()) == "json"
    assert resolve_format("json", Terminal()) == "json"


def test_a_line_about_a_request_carries_the_trace_current_where_it_is_logged() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import format_span_id, format_trace_id

    from common.logs import TraceIds

    def record(**extra: str) -> logging.LogRecord:
        line = logging.LogRecord("microbatch.gateway", logging.WARNING, __file__, 1, "x", (), None)
        line.__dict__.update(extra)
        TraceIds().filter(line)
        return line

    with TracerProvider().get_tracer("t").start_as_current_span("server") as span:
        about = record(request_id="req-1")
        other = record()  # not about a request: no ids
        own = record(request_id="req-2", trace_id="f" * 32, span_id="e" * 16)  # a worker's
    context = span.get_span_context()
    assert (about.trace_id, about.span_id) == (  # type: ignore[attr-defined]
        format_trace_id(context.trace_id),
        format_span_id(context.span_id),
    )
    assert not hasattr(other, "trace_id") and own.trace_id == "f" * 32  # type: ignore[attr-defined]
    assert not hasattr(record(request_id="req-3"), "trace_id")  # no span current: none
