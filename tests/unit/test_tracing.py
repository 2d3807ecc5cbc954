"""Tracing's switch and identity from the standard OTEL_* environment, and the worker's spans
built with the SDK's in-memory exporter (no Redis, no model)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, format_span_id, format_trace_id

from common import tracing
from common.protocol import RequestEntry, decode, encode, pack_rows
from worker import entry_spans
from worker.entry_spans import EntrySpans
from worker.leases import Leases

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),  # off by default
        (ENDPOINT, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),  # compose's empty default
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, False),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, False),
    ],
)
def test_tracing_is_on_only_where_an_otlp_endpoint_is_set(environ: dict, on: bool) -> None:
    assert tracing.enabled(environ) is on
    assert (tracing.start("gateway", environ) is not None) is on


def test_each_role_is_its_own_service_with_an_instance_id_unless_the_environment_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    gateway, worker = tracing.resource("gateway").attributes, tracing.resource("worker").attributes
    assert gateway["service.name"] == "microbatch-gateway"
    assert worker["service.name"] == "microbatch-worker"
    assert gateway["service.instance.id"] != worker["service.instance.id"]
    assert gateway["deployment.environment"] == "test"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "embedder")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-7")
    named = tracing.resource("worker").attributes
    assert (named["service.name"], named["service.instance.id"]) == ("embedder", "pod-7")


def test_the_sampler_is_the_standard_variable_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.01")
    traced = tracing.start("gateway", ENDPOINT)
    assert traced is not None
    try:
        assert "0.01" in traced.provider.sampler.get_description()
    finally:
        traced.shutdown()


def test_otlp_goes_over_http_protobuf_unless_the_protocol_says_otherwise() -> None:
    assert isinstance(tracing.exporter(ENDPOINT), OTLPSpanExporter)
    with pytest.raises(tracing.TracingConfigError, match="http/protobuf"):
        tracing.exporter({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        with pytest.raises(tracing.TracingConfigError, match=r"microbatch\[otlp-grpc\]"):
            tracing.exporter({**ENDPOINT, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"})


def test_a_client_traceparent_is_the_parent_and_a_malformed_one_restarts_the_trace() -> None:
    provider, _ = _provider()
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("server", context=tracing.extracted(CLIENT)) as span:
        assert tracing.carrier() == tracing.UNTRACED  # not marked recorded: an unsampled call
        marked = tracing.recording_here()  # as the gateway's server span marks itself
        traceparent, _ = tracing.carrier()
        tracing.not_recording(marked)
    context = span.get_span_context()
    assert format_trace_id(context.trace_id) == CLIENT.split("-")[1]
    assert span.parent is not None and format_span_id(span.parent.span_id) == CLIENT.split("-")[2]
    assert traceparent == f"00-{CLIENT.split('-')[1]}-{format_span_id(context.span_id)}-01"
    with tracer.start_as_current_span("s", context=tracing.extracted("00-zz-yy-01")) as fresh:
        assert fresh.parent is None
    assert tracing.carrier() == ("", "")  # nothing current: an untraced entry
    assert tracing.span(None, "x").__enter__() is None  # off: no span at all


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exported = InMemorySpanExporter()
    provider = TracerProvider(resource=tracing.resource("worker"))
    provider.add_span_processor(SimpleSpanProcessor(exported))
    return provider, exported


def _entry(i: int, traceparent: str = CLIENT) -> RequestEntry:
    tokens, lengths = pack_rows([np.array([1, 2, 3]), np.array([4, 5])])
    return RequestEntry(
        id=f"e.{i}", request_id=f"r{i}", model="m", tokens=tokens, lengths=lengths,
        deadline_ms=2_000_000_000_000, priority=1, reply_to="mb:reply:g",
        enqueued_ms=1_700_000_000_000, traceparent=traceparent,
    )  # fmt: skip


def test_an_entry_read_again_is_two_attempts_in_its_request_s_trace() -> None:
    provider, exported = _provider()
    spans = EntrySpans(provider.get_tracer("t"), "w1")
    first = spans.read(_entry(0), "mb:{m}:req:128", deliveries=1)  # this attempt died
    second = spans.read(_entry(0), "mb:{m}:req:128", deliveries=2)
    entry_spans.ended([second], published=True)
    done = exported.get_finished_spans()
    assert [s.name for s in done] == ["queue wait", "queue wait", "process entry"]
    assert {format_trace_id(s.context.trace_id) for s in done} == {CLIENT.split("-")[1]}
    assert all(format_span_id(s.parent.span_id) == CLIENT.split("-")[2] for s in done)  # type: ignore[union-attr]
    assert [s.attributes["microbatch.deliveries"] for s in done] == [1, 2, 2]
    assert [e.name for e in done[2].events] == ["redelivered"]
    assert done[2].kind is SpanKind.CONSUMER and done[2].attributes["microbatch.rows"] == 2
    assert first.is_recording()  # the dead attempt's entry span never ends: only its wait shows


def test_a_batch_span_links_every_member_entry_and_notes_itself_on_each() -> None:
    provider, exported = _provider()
    spans = EntrySpans(provider.get_tracer("t"), "w1")
    members = [spans.read(_entry(i), "s", 1) for i in range(3)]
    spans.batch("w1:7", [*members, None], 1_700_000_000_100, 0.25, {"microbatch.bucket": 128})
    entry_spans.ended(members[:2], published=True)
    entry_spans.ended(members[2:], published=False)
    done = exported.get_finished_spans()
    (batch,) = [s for s in done if s.name == "batch"]
    entries = [s for s in done if s.name == "process entry"]
    assert {link.context.span_id for link in batch.links} == {s.context.span_id for s in entries}
    assert batch.parent is None  # a trace of its own: it serves many requests
    assert (batch.end_time - batch.start_time) == 250_000_000  # type: ignore[operator]
    assert batch.attributes["microbatch.entries"] == 3
    assert all([e.name for e in s.events] == ["batch"] for s in entries)
    assert [s.status.status_code for s in entries] == [
        StatusCode.UNSET,
        StatusCode.UNSET,
        StatusCode.ERROR,  # its publish failed: a peer redoes it
    ]


def test_a_refused_entry_is_one_ended_span_with_its_reason() -> None:
    provider, exported = _provider()
    EntrySpans(provider.get_tracer("t"), "w1").refused(
        _entry(0), "s", 4, "dead_lettered", "delivered 4 times"
    )
    process = [s for s in exported.get_finished_spans() if s.name == "process entry"]
    assert len(process) == 1 and process[0].status.status_code is StatusCode.ERROR
    assert [(e.name, dict(e.attributes or {})) for e in process[0].events] == [
        ("redelivered", {"deliveries": 4}),
        ("dead_lettered", {"reason": "delivered 4 times"}),
    ]


def test_a_lease_gives_back_its_span_once_released() -> None:
    leases = Leases()
    leases.take(("s", "1-0"), "e.0", span="span-a")
    leases.take(("s", "2-0"), "e.1")  # untraced
    assert leases.release([("s", "1-0"), ("s", "2-0"), ("s", "3-0")]) == ["span-a"]
    assert leases.release([("s", "1-0")]) == [] and len(leases) == 0


def test_a_client_tracestate_too_long_for_an_entry_is_dropped_not_the_entry() -> None:
    provider, _ = _provider()
    long_state = ",".join(f"v{i}=" + "x" * 20 for i in range(30))  # 30 members, 750 chars
    parent = tracing.extracted(CLIENT, long_state)
    with provider.get_tracer("t").start_as_current_span("server", context=parent):
        marked = tracing.recording_here()
        carried = tracing.carrier()
        tracing.not_recording(marked)
    assert carried.traceparent and carried.tracestate == ""
    decode(encode(dataclasses.replace(_entry(0), **carried._asdict())))  # a valid entry
